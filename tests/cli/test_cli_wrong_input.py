"""What a new user types wrong: a file for a store, a bad value in a config file, a mistyped msgId.

Each is refused with exit status 2 and one line on stderr that names what and where, and touches nothing.
"""

from __future__ import annotations

import pytest

from conftest import golden_expected, golden_store, run_cli

PATH_COMMANDS = [["state"], ["dump"], ["verify"], ["retention"], ["stats"], ["topics"], ["groups"], ["lag"],
                 ["get", "--topic", "T", "--queue-id", "0", "--offset", "0"],
                 ["query", "--topic", "T", "--key", "k"],
                 ["put", "--topic", "T", "--body", "hello"], ["init"], ["recover"], ["tier", "status"]]


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert r.stdout == b""
    return lines[0]


@pytest.mark.parametrize("command", PATH_COMMANDS, ids=lambda c: " ".join(c[:1] if c[0] != "tier" else c[:2]))
def test_a_file_given_as_the_store_is_named_as_not_a_directory(command, tmp_path):
    f = tmp_path / "store.jsonl"
    f.write_bytes(b'{"topic": "T"}\n')
    n = 2 if command[0] == "tier" else 1
    err = _one_error_line(run_cli(*command[:n], f, *command[n:]))
    assert str(f) in err and "not a directory" in err, err
    assert f.read_bytes() == b'{"topic": "T"}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["store.jsonl"]


@pytest.mark.parametrize("line,needle", [("flushDiskType=MAYBE", "flushDiskType=MAYBE: must be"),
                                         ("maxMessageSize=-1", "maxMessageSize=-1: must be positive"),
                                         ("topicRetentionMs=forever", "topicRetentionMs=forever")])
def test_a_refused_config_value_names_the_file_it_is_in(line, needle, tmp_path):
    conf = tmp_path / "my.conf"
    conf.write_text(line + "\n")
    err = _one_error_line(run_cli("state", golden_store("basic"), "--config", conf))
    assert err.endswith(needle) or needle in err, err
    assert str(conf) in err, err
    store = tmp_path / "s"
    err = _one_error_line(run_cli("put", store, "--topic", "T", "--body", "x", "--config", conf))
    assert str(conf) in err and not store.exists(), err


def test_a_msg_id_naming_no_record_start_does_not_claim_damage():
    e = golden_expected("basic")[3]
    offset = e["commitLogOffset"] + 5  # inside the record: no record starts there
    err = _one_error_line(run_cli("msg", golden_store("basic"), "--id", e["msgId"][:-16] + f"{offset:016X}"))
    assert "not the start of one" in err and "holds a damaged record" not in err, err
    assert f"commitlog offset {offset}" in err and "00000000000000000000" in err, err


@pytest.mark.parametrize("command", [["state"], ["topics"], ["groups"], ["lag"], ["dlq", "list"],
                                     ["get", "--topic", "TopicA", "--queue-id", "0", "--offset", "0", "--no-body"],
                                     ["msg", "--id", "7F00000100002A9F0000000000000000", "--no-body"]],
                         ids=lambda c: " ".join(c[:2] if c[0] == "dlq" else c[:1]))
def test_json_is_short_for_format_json_wherever_there_is_a_format(command):
    n = 2 if command[0] == "dlq" else 1
    args = [*command[:n], golden_store("basic"), *command[n:]]
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stdout == run_cli(*args, "--format", "json").stdout and r.stdout.startswith(b"{")


def test_tier_status_before_the_first_upload_and_as_json(tmp_path):
    import json
    store = tmp_path / "s"
    store.mkdir()
    (store / "broker.conf").write_text(f"mappedFileSizeCommitLog=65536\ntieredStoreUri=file://{tmp_path}/tier\n")
    assert run_cli("put", store, "--topic", "T", "--body", "x").returncode == 0
    r = run_cli("tier", "status", store)
    assert r.returncode == 0 and b"offsets none yet" in r.stdout and b"None" not in r.stdout, r.stdout
    doc = json.loads(run_cli("tier", "status", store, "--json").stdout)
    assert doc["minOffset"] is None and doc["uri"] == f"file://{tmp_path}/tier"


def test_import_from_a_directory_is_refused_and_leaves_no_store(tmp_path):
    (tmp_path / "dumps").mkdir()
    store = tmp_path / "new-store"
    err = _one_error_line(run_cli("import", store, "--from", tmp_path / "dumps"))
    assert str(tmp_path / "dumps") in err and "not a dump file" in err, err
    assert not store.exists()


def test_dump_from_an_offset_inside_a_record_says_it_may_not_start_one():
    e = golden_expected("basic")[3]
    err = _one_error_line(run_cli("dump", golden_store("basic"), "--from-offset", str(e["commitLogOffset"] + 5)))
    assert f"commitlog offset {e['commitLogOffset'] + 5}" in err and "may not be the start of a record" in err, err
    nxt = golden_expected("basic")[4]["commitLogOffset"]  # a record's own offset reads as before
    r = run_cli("dump", golden_store("basic"), "--from-offset", str(nxt), "--limit", "1", "--no-body")
    assert r.returncode == 0 and b'"commitLogOffset": %d' % nxt in r.stdout


@pytest.mark.parametrize("job", [["verify"], ["export", "--to", "OUT"], ["stats"], ["rebuild"]], ids=lambda j: j[0])
@pytest.mark.parametrize("what", ["missing", "file", "empty dir"])
def test_spark_jobs_refuse_a_store_that_is_not_one_before_starting_spark(job, what, tmp_path):
    import time
    store = tmp_path / "store"
    if what == "file":
        store.write_text("x")
    elif what == "empty dir":
        store.mkdir()
    args = [a if a != "OUT" else str(tmp_path / "out") for a in job[1:]]
    t0 = time.monotonic()
    err = _one_error_line(run_cli("spark", job[0], store, *args, "--master", "local[1]"))
    assert time.monotonic() - t0 < 5, "a JVM was started"  # (a Spark session takes 10 s and more here)
    assert str(store) in err and ("no such store directory", "not a directory", "not a message store")[
        ["missing", "file", "empty dir"].index(what)] in err, err
    assert not (tmp_path / "out").exists()


def test_spark_package_into_a_file_says_out_is_not_a_directory(tmp_path):
    (tmp_path / "dist").write_text("x")
    err = _one_error_line(run_cli("spark", "package", "--out", tmp_path / "dist"))
    assert str(tmp_path / "dist") in err and "not a directory" in err, err
    assert (tmp_path / "dist").read_text() == "x"


@pytest.mark.parametrize("change,needle", [({"queueId": "x"}, "queueId 'x': expected an integer"),
                                           ({"storeTimestamp": "yesterday"}, "storeTimestamp 'yesterday'"),
                                           ({"topic": 5}, "topic 5: expected a string"),
                                           ({"properties": [1]}, "properties [1]: expected an object"),
                                           ({"flag": 2 ** 40}, "flag 1099511627776"),
                                           ({"storeTimestamp": 2 ** 70}, "store_timestamp"),
                                           (None, "a JSON list, not an object")],
                         ids=["queueId", "storeTimestamp-str", "topic", "properties", "flag", "storeTimestamp-big",
                              "list"])
def test_import_names_a_hand_edited_field_and_imports_nothing(change, needle, tmp_path):
    import json
    lines = [json.loads(line) for line in golden_store("basic").parent.joinpath("expected.jsonl").read_text()
             .splitlines()[:3]]
    lines[1] = [1, 2] if change is None else {**lines[1], **change}
    src = tmp_path / "edited.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in lines))
    err = _one_error_line(run_cli("import", tmp_path / "s", "--from", src))
    assert f"{src}:2:" in err and needle in err and "nothing imported" in err, err
    assert not (tmp_path / "s").exists()


def test_serve_on_a_port_in_use_is_one_line_and_makes_no_store(tmp_path):
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = _one_error_line(run_cli("serve", tmp_path / "s", "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err, err
    assert not (tmp_path / "s").exists()


def test_serve_with_its_admin_port_in_use_is_one_line_and_makes_no_store(tmp_path):
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = _one_error_line(run_cli("serve", tmp_path / "s", "--port", "0", "--admin-port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port} for the admin endpoint" in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("count,ok", [("500", True), ("abc", False), ("0", False)])
def test_demo_takes_any_positive_message_count_and_refuses_others_in_one_line(count, ok, tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "ROCKETSTORE_DEMO_DIR": str(tmp_path / "d"), "ROCKETSTORE_DEMO_MESSAGES": count}
    r = subprocess.run([sys.executable, "-m", "rocketstore.cli.demo"], capture_output=True, env=env, timeout=120)
    if ok:  # under 1,000 messages the key step was 0 (range() raised); the lookups counted 1,000 whatever ran
        assert r.returncode == 0, r.stderr
        assert b"500/500 found" in r.stdout, r.stdout
    else:
        err = _one_error_line(r)
        assert f"ROCKETSTORE_DEMO_MESSAGES='{count}'" in err and not (tmp_path / "d").exists(), err
