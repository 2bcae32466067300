"""Issue 17: the command line as a user meets it (non-stores, pipes, help, version, import, demo, bench --smoke)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from rocketstore import MessageStore, StoreLoadError, __version__
from rocketstore.cli.main import build_parser, main as cli_main
from conftest import GOLDEN, golden_expected, golden_store, run_cli

REPO = Path(__file__).resolve().parents[2]

READ_COMMANDS = [["verify"], ["stats"], ["dump"], ["state"], ["retention"],
                 ["get", "--topic", "T", "--queue-id", "0", "--offset", "0"],
                 ["query", "--topic", "T", "--key", "k"],
                 ["offset-by-time", "--topic", "T", "--queue-id", "0", "--timestamp", "0"]]


# ---------------------------------------------------------------- a directory that is not a store

@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_read_commands_refuse_a_directory_that_is_not_a_store(command, tmp_path):
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    r = run_cli(command[0], tmp_path, *command[1:])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == b""
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "not a message store" in err and str(tmp_path) in err


def test_read_only_open_of_a_non_store_raises_and_writes_nothing(tmp_path):
    with pytest.raises(StoreLoadError, match="not a message store"):
        MessageStore.open(str(tmp_path), read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_read_only_open_still_accepts_a_store_with_any_one_of_its_parts(tmp_path):
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        assert store.max_phy_offset() > 0
    (tmp_path / "consumequeue").mkdir()  # e.g. a store whose commitlog was all cleaned away
    with MessageStore.open(str(tmp_path), read_only=True) as store:
        assert store.max_phy_offset() == 0


# ---------------------------------------------------------------- pipes

def test_dump_into_a_closed_pipe_ends_quietly():
    # golden/basic dumps ~5 MB of JSON: far more than a pipe buffer, so the writer sees the reader go.
    cmd = f"{sys.executable} -m rocketstore dump {golden_store('basic')} | head -1 >/dev/null; " \
          "echo ${PIPESTATUS[0]} >&2"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.stderr == "0\n", r.stderr


# ---------------------------------------------------------------- help, version, -v

def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + (name,), f"command {name}", helps.get(name)
                yield from _walk(sub, path + (name,))
        else:
            yield path, "/".join(action.option_strings) or action.dest, action.help


def test_every_command_and_option_has_help():
    missing = [f"{' '.join(p) or 'rocketstore'}: {what}" for p, what, text in _walk(build_parser()) if not text]
    assert missing == []


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.decode().strip() == f"rocketstore {__version__}"


def test_verbose_is_accepted_after_the_command():
    p = build_parser()
    assert p.parse_args(["state", "S", "-v"]).verbose == 1
    assert p.parse_args(["-v", "state", "S"]).verbose == 1
    assert p.parse_args(["state", "S"]).verbose == 0
    assert p.parse_args(["serve", "S", "-vv"]).verbose == 2


def test_spark_job_has_usage_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "rocketstore.bench.spark_job", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "STORE WORKDIR REPEATS" in r.stdout and "Traceback" not in r.stderr


def test_put_dash_reads_the_body_from_stdin(tmp_path):
    store = tmp_path / "s"
    r = run_cli("put", store, "--topic", "T", "-", input=b"from stdin")
    assert r.returncode == 0, r.stderr
    with MessageStore.open(str(store), read_only=True) as s:
        assert s.get("T", 0, 0, 1).messages[0].body == b"from stdin"


def test_package_ships_type_information_license_and_changelog():
    assert (REPO / "src" / "rocketstore" / "py.typed").exists()
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    assert __version__ in (REPO / "CHANGELOG.md").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'py.typed' in pyproject and "classifiers" in pyproject
    assert "[project.urls]" in pyproject


# ---------------------------------------------------------------- import

def _write_jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_import_a_bad_line_names_file_and_line_and_imports_nothing(tmp_path, golden_conf):
    good = [json.dumps(d) for d in golden_expected("basic")[:20]]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, good[:10] + ['{"topic": "Orders", "body": "not base64!"}'] + good[10:])
    store = tmp_path / "store"
    r = run_cli("import", store, "--from", src, "--config", golden_conf)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert err.count("\n") == 1 and f"{src}:11:" in err and "nothing imported" in err
    assert not store.exists()  # the store the command would have made is not left behind

    # into an existing store: it is left exactly as it was
    r = run_cli("import", store, "--from", GOLDEN / "basic" / "expected.jsonl", "--config", golden_conf)
    assert r.returncode == 0, r.stderr
    before = _contents(store)
    _write_jsonl(src, good[:5] + ["{not json"])
    r = run_cli("import", store, "--from", src)
    assert r.returncode == 2 and f"{src}:6: not a JSON line" in r.stderr.decode()
    assert _contents(store) == before


def _contents(store: Path) -> tuple:
    """Every commitlog and consume-queue byte, and the queues' offsets."""
    files = {str(p.relative_to(store)): p.read_bytes() for sub in ("commitlog", "consumequeue")
             for p in sorted((store / sub).rglob("*")) if p.is_file()}
    state = json.loads(run_cli("state", store).stdout)
    return files, state["maxPhyOffset"], state["queues"]


def test_import_refuses_lines_the_store_would_refuse_before_writing(tmp_path):
    src = tmp_path / "in.jsonl"
    ok = {"topic": "T", "body": base64.b64encode(b"x").decode()}
    _write_jsonl(src, [json.dumps(ok), json.dumps({**ok, "topic": "bad topic"})])
    store = tmp_path / "store"
    r = run_cli("import", store, "--from", src)
    assert r.returncode == 2 and f"{src}:2: topic 'bad topic'" in r.stderr.decode()
    assert not store.exists()


def test_import_continue_on_error_skips_and_names_bad_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    ok = {"topic": "T", "body": base64.b64encode(b"x").decode()}
    _write_jsonl(src, [json.dumps(ok), "[1, 2]", json.dumps(ok), "", json.dumps({"body": ""}), json.dumps(ok)])
    r = run_cli("import", tmp_path / "store", "--from", src, "--continue-on-error")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["imported"], out["skipped"]) == (3, 2)
    err = r.stderr.decode()
    assert f"{src}:2: not a message" in err and f"{src}:5: not a message" in err


def test_import_streams_its_file(tmp_path, golden_conf, capsys):
    """Peak Python memory stays far below the file size (it used to hold every parsed line: ~3.5x the file)."""
    body = base64.b64encode(os.urandom(3000)).decode()
    src = tmp_path / "big.jsonl"
    n = 4000
    with open(src, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"topic": f"T{i % 3}", "queueId": i % 2, "body": body,
                                 "properties": {"KEYS": f"k{i}"}}) + "\n")
    size = src.stat().st_size
    assert size > 12 * 1024 * 1024
    conf = tmp_path / "import.conf"
    conf.write_text(golden_conf.read_text() + "warmAheadBytes=0\n")  # its fixed 4 MiB of buffers aside
    cli_main(["import", str(tmp_path / "warm-up"), "--from", str(GOLDEN / "basic" / "expected.jsonl"),
              "--config", str(conf)])  # modules imported outside the measurement
    capsys.readouterr()
    tracemalloc.start()
    try:
        status = cli_main(["import", str(tmp_path / "store"), "--from", str(src), "--config", str(conf)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 0 and json.loads(capsys.readouterr().out)["imported"] == n
    # The old importer peaked at ~3.5x the file. The store's own 1 s services (metrics, disk guard, cleaner) run
    # inside this window when a loaded machine slows the import (up to 2.5 MB seen in a CI run), and a dispatcher
    # starved of CPU leaves up to HAND_OVER_LIMIT puts' metadata handed over (6.1 MB seen at load 15): bounded,
    # whatever the file's size.
    assert peak < size / 2, (peak, size)


# ---------------------------------------------------------------- demo and bench --smoke

def _demo(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROCKETSTORE_DEMO_DIR": str(path), "ROCKETSTORE_DEMO_MESSAGES": "2000"}
    return subprocess.run([sys.executable, "-m", "rocketstore.cli.demo"], capture_output=True, text=True, env=env,
                          timeout=120)


def test_demo_refuses_to_delete_a_directory_it_did_not_make(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    r = _demo(precious)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "refusing to delete" in r.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"

    made = tmp_path / "demo"
    assert _demo(made).returncode == 0
    assert _demo(made).returncode == 0  # its own store it replaces
    with MessageStore.open(str(made), read_only=True) as store:
        assert sum(q["messageTotalInQueue"] for q in store.state()["queues"]) == 2000


@pytest.mark.timeout(150)
def test_bench_smoke_without_out_leaves_bench_results_alone(tmp_path):
    results = REPO / "bench" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()} if results.exists() else {}
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "rocketstore", "bench", "--smoke", "--no-progress",
                        "--only", "floors"], capture_output=True, text=True, timeout=140, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    after = {p.name: p.stat().st_mtime_ns for p in results.iterdir()} if results.exists() else {}
    assert after == before
    json_line = next(line for line in r.stdout.splitlines() if line.startswith("json: "))
    assert Path(json_line[6:]).is_relative_to(tmp_path) and Path(json_line[6:]).exists()
