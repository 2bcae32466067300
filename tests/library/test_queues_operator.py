"""The operator's view of SimpleConsumer groups (issue 27): queues.inspect.group_stats, `rocketstore groups` /
`lag` columns, and `rocketstore dlq list` / `dlq resend` (dry run by default)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues import RetryPolicy
from rocketstore.queues.inspect import group_stats


def make(root: Path) -> None:
    """G on T: one message dead-lettered, one in flight, one acked; nothing pending for G2."""
    with MessageStore.open(str(root), StoreConfig()) as st:
        for b in (b"dead", b"held", b"done"):
            st.put(Message("T", b, properties={"UNIQ_KEY": f"ID-{b.decode()}"}))
        st.wait_dispatched()
        with st.simple_consumer("G", "T", retry_policy=RetryPolicy(0, (0,)), ack_sync_flush=True) as c:
            got = {m.body: m for m in c.receive(3)}
            assert set(got) == {b"dead", b"held", b"done"}
            c.ack(got[b"done"])
            c.nack(got[b"dead"])  # no redelivery allowed: the next receive moves it to %DLQ%G
            assert c.receive(3) == []
            st.wait_dispatched()
        assert [m.body for m in st.get("%DLQ%G", 0, 0).messages] == [b"dead"]
        stats = group_stats(st.root, st)
    assert [(s["group"], s["topic"], s["inflight"], s["dlq_depth"]) for s in stats] == [("G", "T", 1, 1)]


def test_groups_lag_and_dlq_commands(tmp_path: Path) -> None:
    root = tmp_path / "s"
    make(root)
    r = run_cli("groups", root, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = {(g["group"], g["topic"]): g for g in json.loads(r.stdout)["groups"]}
    assert rows[("G", "T")]["inflight"] == 1 and rows[("G", "T")]["dlq"] == 1 and rows[("G", "T")]["retry"] == 0
    r = run_cli("lag", root, "--group", "G", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert sum(q["inflight"] for q in json.loads(r.stdout)["lag"]) == 1

    r = run_cli("dlq", "list", root, "--format", "json")
    assert r.returncode == 0, r.stderr
    [letter] = json.loads(r.stdout)["deadLetters"]
    assert letter["group"] == "G" and letter["originTopic"] == "T" and letter["msgId"] == "ID-dead"

    before = (root / "commitlog").stat().st_mtime_ns, sorted(p.name for p in (root / "consumequeue").iterdir())
    r = run_cli("dlq", "resend", root, "--group", "G", "--all", "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dryRun"] and [m["resent"] for m in out["messages"]] == [False]
    with MessageStore.open(str(root), read_only=True) as st:
        assert st.max_offset_in_queue("T", 0) == 3  # the dry run sent nothing
    assert sorted(p.name for p in (root / "consumequeue").iterdir()) == before[1]

    r = run_cli("dlq", "resend", root, "--group", "G", "--msg-id", "nope")
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and b"nope" in r.stderr
    r = run_cli("dlq", "resend", root, "--group", "G", "--msg-id", "ID-dead", "--execute", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert [m["resent"] for m in json.loads(r.stdout)["messages"]] == [True]
    with MessageStore.open(str(root), read_only=True) as st:
        [again] = st.get("T", 0, 3).messages
    assert again.body == b"dead" and again.properties["UNIQ_KEY"] == "ID-dead"
    assert "DLQ_ORIGIN_TOPIC" not in again.properties and "RETRY_TOPIC" not in again.properties
