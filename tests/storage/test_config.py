"""Store geometry from the files vs the config: partial configs, contradictions, quarantine limits, init presets."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import copy_store, golden_expected, golden_store, run_cli
from rocketstore import Message, MessageStore, StoreConfig, init_store
from rocketstore.errors import ConfigError, StoreLoadError
from rocketstore.format.message import GetMessageStatus
from rocketstore.storage.geometry import store_config

GOLDEN_TAIL = 3711299  # maxPhyOffset of the basic golden store
WRITERS = {
    "put": ["put", "{store}", "--topic", "Cfg", "--body", "hello"],
    "recover": ["recover", "{store}"],
    "import": ["import", "{store}", "--from", "{lines}"],
    "delete-expired": ["admin", "delete-expired", "{store}"],
}


def _files(root: Path) -> dict[str, str]:
    """Every file's content hash (the lock file left out: opens create it)."""
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if n != "lock":
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _writer_args(cmd: str, store: Path, tmp_path: Path) -> list[str]:
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps({"topic": "Cfg", "queueId": 0, "body": base64.b64encode(b"imported").decode()}) + "\n")
    return [a.format(store=store, lines=lines) for a in WRITERS[cmd]]


def _read_every_golden_message(root: Path) -> None:
    """Every message of the basic golden store comes back through get, in queue order."""
    expected = golden_expected("basic")
    with MessageStore.open(str(root), read_only=True) as store:
        for (topic, qid) in {(e["topic"], e["queueId"]) for e in expected}:
            want = sorted((e for e in expected if (e["topic"], e["queueId"]) == (topic, qid)),
                          key=lambda e: e["queueOffset"])
            got, off = [], 0
            while True:
                r = store.get(topic, qid, off, 32)
                if r.status is not GetMessageStatus.FOUND:
                    break
                got += r.messages
                off = r.next_begin_offset
            assert [(m.commit_log_offset, m.msg_id, m.body) for m in got[:len(want)]] == \
                [(e["commitLogOffset"], e["msgId"], base64.b64decode(e["body"])) for e in want], (topic, qid)


# ---------------------------------------------------------------- a partial config keeps the files' geometry

@pytest.mark.parametrize("cmd", sorted(WRITERS))
def test_a_partial_config_keeps_the_files_geometry_cli(cmd, basic_copy, tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text("flushDiskType=SYNC_FLUSH\nfileReservedTime=1000000\n")
    r = run_cli(*_writer_args(cmd, basic_copy, tmp_path), "--config", conf)
    assert r.returncode == 0, r.stderr
    assert not (basic_copy / "quarantine").exists()
    assert sorted(os.listdir(basic_copy / "commitlog"))[:4] == sorted(os.listdir(golden_store("basic") / "commitlog"))
    if cmd in ("put", "import"):
        with MessageStore.open(str(basic_copy), read_only=True) as store:
            r = store.get("Cfg", 0, 0)
            assert r.messages[0].commit_log_offset == GOLDEN_TAIL  # appended after the golden messages
    _read_every_golden_message(basic_copy)


def _api_writer(cmd: str, store: MessageStore, tmp_path: Path) -> None:
    """What each CLI writer does, through the Python API."""
    if cmd == "put":
        assert store.put(Message("Cfg", b"x")).commit_log_offset == GOLDEN_TAIL
    elif cmd == "import":
        from rocketstore.importer import import_file
        src = tmp_path / "one.jsonl"
        src.write_text('{"topic": "Cfg", "queueId": 0, "body": ""}\n')
        assert import_file(store, str(src)).imported == 1
        store.wait_dispatched()
        assert store.get("Cfg", 0, 0).messages[0].commit_log_offset == GOLDEN_TAIL
    elif cmd == "delete-expired":
        assert store.delete_expired_commit_log() == []


@pytest.mark.parametrize("cmd", sorted(WRITERS))
def test_a_partial_storeconfig_keeps_the_files_geometry_api(cmd, basic_copy, tmp_path):
    cfg = StoreConfig(flushDiskType="SYNC_FLUSH", fileReservedTime=1000000)
    with MessageStore.open(str(basic_copy), cfg, start_services=cmd != "recover") as store:
        assert store.config.mappedFileSizeCommitLog == 1048576 and store.config.maxIndexNum == 4000
        _api_writer(cmd, store, tmp_path)
    assert not (basic_copy / "quarantine").exists()
    _read_every_golden_message(basic_copy)


# ---------------------------------------------------------------- an explicit contradiction refuses

@pytest.mark.parametrize("cmd", sorted(WRITERS))
def test_an_explicit_geometry_that_contradicts_the_files_refuses_cli(cmd, basic_copy, tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text("flushDiskType=SYNC_FLUSH\nmappedFileSizeCommitLog=1073741824\n")  # RocketMQ's default, explicit
    before = _files(basic_copy)
    r = run_cli(*_writer_args(cmd, basic_copy, tmp_path), "--config", conf)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "mappedFileSizeCommitLog=1073741824" in err and str(conf) in err
    assert str(basic_copy / "commitlog" / "00000000000000000000") in err and "1048576 bytes" in err
    assert _files(basic_copy) == before


def test_an_explicit_geometry_that_contradicts_the_files_refuses_api(basic_copy):
    before = _files(basic_copy)
    for cfg in (StoreConfig(mappedFileSizeCommitLog=1 << 30), StoreConfig(mappedFileSizeConsumeQueue=300000 * 20),
                StoreConfig(maxHashSlotNum=5000000, maxIndexNum=20000000)):
        for ro in (False, True):
            with pytest.raises(ConfigError, match="contradicts the files"):
                MessageStore.open(str(basic_copy), cfg, read_only=ro)
    assert _files(basic_copy) == before
    with MessageStore.open(str(basic_copy), StoreConfig(mappedFileSizeCommitLog=1 << 20, maxIndexNum=4000,
                                                        mappedFileSizeConsumeQueue=6000)) as store:
        assert store.max_phy_offset() == GOLDEN_TAIL  # agreeing explicit values open as usual


def test_allow_quarantine_lets_an_explicit_geometry_win(tmp_path):
    store = copy_store(golden_store("basic"), tmp_path / "s")
    with MessageStore.open(str(store), StoreConfig(mappedFileSizeCommitLog=2 << 20), allow_quarantine=True) as s:
        assert s.max_phy_offset() == 0
    assert len(os.listdir(store / "quarantine")) == 4


def test_explicit_keys_are_what_was_given_not_what_differs_from_the_default(tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text("mappedFileSizeCommitLog=1073741824\nflushDiskType=ASYNC_FLUSH\n")
    cfg = StoreConfig.load(str(conf))
    assert cfg.explicit == {"mappedFileSizeCommitLog": str(conf), "flushDiskType": str(conf)}
    assert StoreConfig(maxIndexNum=4000).replace(maxHashSlotNum=1000).explicit.keys() == {"maxIndexNum",
                                                                                          "maxHashSlotNum"}
    assert StoreConfig().explicit == {}


# ---------------------------------------------------------------- more than one file of a kind

def test_more_than_one_file_of_a_kind_refuses_without_the_flag(basic_copy):
    for name in ("TopicA/0/00000000000000000000", "TopicB/1/00000000000000006000"):
        os.truncate(basic_copy / "consumequeue" / name, 3000)
    before = _files(basic_copy)
    with pytest.raises(StoreLoadError, match="2 consumequeue files would go to quarantine/.*allow-quarantine"):
        MessageStore.open(str(basic_copy))
    assert _files(basic_copy) == before
    r = run_cli("recover", basic_copy)
    assert r.returncode == 2 and b"nothing was moved" in r.stderr and r.stderr.count(b"\n") == 1
    assert _files(basic_copy) == before
    r = run_cli("recover", basic_copy, "--allow-quarantine")
    assert r.returncode == 0, r.stderr
    assert len(os.listdir(basic_copy / "quarantine")) == 2
    _read_every_golden_message(basic_copy)


def test_a_commitlog_segment_holding_messages_is_not_quarantined_without_the_flag(basic_copy):
    os.truncate(basic_copy / "commitlog" / "00000000000000000000", 1048575)
    assert store_config(str(basic_copy)).mappedFileSizeCommitLog == 1048576  # the other segments decide
    before = _files(basic_copy)
    with pytest.raises(StoreLoadError, match="00000000000000000000: file is 1048575 bytes.*may hold messages"):
        MessageStore.open(str(basic_copy))
    assert _files(basic_copy) == before


# ---------------------------------------------------------------- one torn consume-queue file

@pytest.mark.parametrize("name", ["TopicA/0/00000000000000000000", "TopicC/0/00000000000000006000"])
def test_one_torn_consume_queue_file_is_quarantined_and_its_queue_refilled(name, basic_copy):
    os.truncate(basic_copy / "consumequeue" / name, 5999)
    assert store_config(str(basic_copy)).mappedFileSizeConsumeQueue == 6000  # majority, not the first file
    with pytest.raises(StoreLoadError, match="file is 5999 bytes, expected 6000.*rocketstore recover"):
        MessageStore.open(str(basic_copy), read_only=True)
    r = run_cli("recover", basic_copy)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["queuesRefilled"] == [name.rsplit("/", 1)[0]]
    assert os.listdir(basic_copy / "quarantine") == ["consumequeue__" + name.replace("/", "__")]
    assert not (basic_copy / "consumequeue.rebuild").exists()
    golden = golden_store("basic") / "consumequeue"
    for d, _dirs, names in os.walk(golden):  # the refilled queue is RocketMQ's, byte for byte
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), golden)
            assert (basic_copy / "consumequeue" / rel).read_bytes() == (golden / rel).read_bytes(), rel
    _read_every_golden_message(basic_copy)


def test_an_unfinished_queue_refill_is_finished_by_the_next_writable_open(basic_copy):
    (basic_copy / "consumequeue.rebuild").write_text("TopicA/0\n")
    for n in os.listdir(basic_copy / "consumequeue" / "TopicA" / "0"):
        if n != "00000000000000000000":
            os.unlink(basic_copy / "consumequeue" / "TopicA" / "0" / n)  # crashed mid-refill: a prefix is left
    with pytest.raises(StoreLoadError, match="has not finished"):
        MessageStore.open(str(basic_copy), read_only=True)
    with MessageStore.open(str(basic_copy)) as store:
        assert store.recovery_report.start_offset < 3145728  # a clean start re-checks only the last segment
    assert not (basic_copy / "consumequeue.rebuild").exists()
    _read_every_golden_message(basic_copy)


# ---------------------------------------------------------------- init and STORE/broker.conf

def test_init_small_preset_is_the_base_config_of_every_open(tmp_path):
    store = tmp_path / "s"
    r = run_cli("init", store, "--preset", "small")
    assert r.returncode == 0, r.stderr
    assert "mappedFileSizeCommitLog=67108864" in (store / "broker.conf").read_text()
    r = run_cli("put", store, "--topic", "Small", "--body", "x")
    assert r.returncode == 0, r.stderr
    reserved = json.loads(r.stdout)["reservedBytes"]
    assert 64 << 20 <= reserved < 70 << 20  # one 64 MiB segment, a 600 KB queue file, a 4.2 MB index file
    assert os.path.getsize(store / "commitlog" / "00000000000000000000") == 64 << 20
    assert os.path.getsize(store / "consumequeue" / "Small" / "0" / "00000000000000000000") == 600000
    assert [os.path.getsize(store / "index" / n) for n in os.listdir(store / "index")] == [4200040]
    state = json.loads(run_cli("state", store).stdout)
    assert state["reservedBytes"]["total"] == reserved
    with MessageStore.open(str(store), StoreConfig(flushDiskType="SYNC_FLUSH")) as s:  # overlays broker.conf
        assert (s.config.mappedFileSizeCommitLog, s.config.flushDiskType) == (64 << 20, "SYNC_FLUSH")
        assert s.config.explicit["mappedFileSizeCommitLog"] == str(store / "broker.conf")
    conf = tmp_path / "c.conf"
    conf.write_text("mappedFileSizeConsumeQueue=6000\n")
    r = run_cli("put", store, "--topic", "Small", "--body", "x", "--config", conf)
    assert r.returncode == 2 and b"mappedFileSizeConsumeQueue" in r.stderr and b"600000" in r.stderr


def test_init_refuses_a_used_directory_and_bad_presets(tmp_path, basic_copy):
    store = tmp_path / "s"
    assert run_cli("init", store, "--preset", "small").returncode == 0
    again = run_cli("init", store, "--preset", "small")
    assert again.returncode == 0 and json.loads(again.stdout)["created"] is False
    for args in (["init", store, "--preset", "default"], ["init", basic_copy], ["init", store, "--preset", "huge"]):
        r = run_cli(*args)
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr, args
    assert not (basic_copy / "broker.conf").exists()
    api = tmp_path / "api"
    assert init_store(str(api), "small") is True and init_store(str(api), "small") is False
    with pytest.raises(ConfigError, match="not empty"):
        init_store(str(api), "default")
    with pytest.raises(ConfigError, match="preset 'huge'"):
        init_store(str(tmp_path / "other"), "huge")
    with MessageStore.open(str(api)) as s:
        assert s.config.mappedFileSizeConsumeQueue == 600000 and s.config.maxIndexNum == 200000



def test_a_conf_directory_is_not_taken_for_a_store(tmp_path):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "broker.conf").write_text("flushDiskType=SYNC_FLUSH\n")
    (conf_dir / "logback_broker.xml").write_text("<configuration/>")
    with pytest.raises(StoreLoadError, match="not a message store"):
        MessageStore.open(str(conf_dir))
    assert sorted(os.listdir(conf_dir)) == ["broker.conf", "logback_broker.xml"]
