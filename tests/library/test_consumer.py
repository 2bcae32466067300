"""Issue 17 (10): the embedded consumer: committed group offsets in RocketMQ's layout, blocking polls,
iteration, asyncio, a writer in another process, concurrent committers; get() with a tag expression."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, parse_tag_filter
from rocketstore.config import golden_config
from rocketstore.consumer import AsyncConsumer, Consumer
from conftest import golden_store


def _offsets_file(root: Path) -> dict:
    return json.loads((root / "config" / "consumerOffset.json").read_text())["offsetTable"]


def _put(store: MessageStore, n: int, topic: str = "T", queues: int = 2, start: int = 0) -> None:
    for i in range(start, start + n):
        r = store.put(Message(topic, f"m{i}".encode(), queue_id=i % queues, tags="A" if i % 2 else "B"))
        assert r.ok
    store.wait_dispatched()


def test_get_accepts_a_subscription_expression_string():
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        for expr in ("TagA", "TagA || TagB", " TagC||TagE ", "*"):
            got = store.get("TopicA", 0, 0, 32, expr)
            want = store.get("TopicA", 0, 0, 32, parse_tag_filter(expr))
            assert got.status == want.status and got.next_begin_offset == want.next_begin_offset
            assert [m.commit_log_offset for m in got.messages] == [m.commit_log_offset for m in want.messages]
            allowed = None if expr == "*" else {t.strip() for t in expr.split("||")}
            assert got.messages and all(allowed is None or m.tags in allowed for m in got.messages)


def test_poll_commit_and_resume_in_rocketmq_layout(tmp_path):
    root = tmp_path / "s"
    with MessageStore.open(str(root), golden_config()) as store:
        _put(store, 10)
        c = Consumer(store, "G", "T", max_messages=3)
        got = []
        while batch := c.poll(0):
            got += batch
        assert sorted(m.body for m in got) == sorted(f"m{i}".encode() for i in range(10))
        for q in (0, 1):  # per queue, in queue order
            assert [m.queue_offset for m in got if m.queue_id == q] == list(range(5))
        assert c.commit() == {0: 5, 1: 5}
        assert _offsets_file(root) == {"T@G": {"0": 5, "1": 5}}
        assert c.commit() == {}  # nothing moved: nothing written
        _put(store, 4, start=10)
        again = Consumer(store, "G", "T")  # resumes at the committed offsets
        assert sorted(m.body for m in again.poll(0) + again.poll(0)) == [b"m10", b"m11", b"m12", b"m13"]
        fresh = Consumer(store, "Other", "T", start="latest")
        assert fresh.poll(0) == [] and fresh.position() == {0: 7, 1: 7}
        store.put(Message("T", b"new-queue", queue_id=5))  # a queue that appears later: read from its start
        store.put(Message("T", b"old-queue", queue_id=0))
        store.wait_dispatched()
        assert sorted(m.body for m in fresh.poll(0) + fresh.poll(0)) == [b"new-queue", b"old-queue"]


def test_tag_filter_skips_and_commits_past_filtered_units(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        _put(store, 10, queues=1)
        c = Consumer(store, "G", "T", tag_filter="A")
        assert [m.body for m in c.poll(0)] == [b"m1", b"m3", b"m5", b"m7", b"m9"]
        assert c.poll(0) == [] and c.commit() == {0: 10}


def test_poll_blocks_until_a_message_is_dispatched(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        c = Consumer(store, "G", "T", queues=[0])
        t0 = time.monotonic()
        assert c.poll(0.2) == [] and 0.19 < time.monotonic() - t0 < 2
        timer = threading.Timer(0.3, lambda: store.put(Message("T", b"late")))
        timer.start()
        t0 = time.monotonic()
        got = c.poll(10)
        waited = time.monotonic() - t0
        timer.join()
        assert [m.body for m in got] == [b"late"]
        assert 0.25 < waited < 1.5  # woken by the dispatcher, not by the 10 s timeout


def test_iterator_counts_only_what_the_loop_finished(tmp_path):
    root = tmp_path / "s"
    with MessageStore.open(str(root), golden_config()) as store:
        _put(store, 6, queues=1)
        c = Consumer(store, "G", "T", auto_commit=True)
        seen = []
        for m in c:
            seen.append(m.body)
            if len(seen) == 3:
                break  # the third message was not finished
        assert seen == [b"m0", b"m1", b"m2"]
        assert c.position() == {0: 2}
        c.close()  # auto_commit commits on close
        assert _offsets_file(root) == {"T@G": {"0": 2}}
        stop = threading.Timer(0.5, Consumer.close, args=(c2 := Consumer(store, "G", "T", auto_commit=True),))
        stop.start()
        assert [m.body for m in c2] == [b"m2", b"m3", b"m4", b"m5"]  # ends when closed from another thread
        stop.join()
        assert _offsets_file(root) == {"T@G": {"0": 6}}


def test_async_consumer(tmp_path):
    root = tmp_path / "s"

    async def main(store: MessageStore) -> list[bytes]:
        async with AsyncConsumer(store, "G", "T", auto_commit=True) as c:
            assert await c.poll(0.05) == []
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, lambda: store.put(Message("T", b"a", queue_id=0)))
            first = await c.poll(5)
            store.put(Message("T", b"b", queue_id=1))
            out = [m.body for m in first]
            async for m in c:
                out.append(m.body)
                break
            return out

    with MessageStore.open(str(root), golden_config()) as store:
        assert asyncio.run(asyncio.wait_for(main(store), 20)) == [b"a", b"b"]
    assert _offsets_file(root) == {"T@G": {"0": 1, "1": 0}}


_FOLLOWER = textwrap.dedent("""
    import json, sys
    from rocketstore.consumer import Consumer
    c = Consumer(sys.argv[1], "G", "T", queues=[0, 1], poll_interval=0.02)
    print("ready", flush=True)
    got = []
    while len(got) < int(sys.argv[2]):
        batch = c.poll(20)
        if not batch:
            break
        got += [m.body.decode() for m in batch]
    c.commit()
    c.close()
    print(json.dumps(got), flush=True)
""")


def test_consumer_in_another_process_follows_the_writer(tmp_path):
    """The writer has the store open; a consumer process given the directory sees new messages and commits."""
    root = tmp_path / "s"
    with MessageStore.open(str(root), golden_config()) as store:
        _put(store, 4)
        p = subprocess.Popen([sys.executable, "-c", _FOLLOWER, str(root), "12"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            for k in range(2):
                time.sleep(0.3)
                _put(store, 4, start=4 + 4 * k)
            line = p.stdout.readline()  # (readline only: communicate() would lose what it buffered)
            assert p.wait(60) == 0, p.stderr.read()
        finally:
            p.kill()
        got = json.loads(line)
        assert sorted(got, key=lambda b: int(b[1:])) == [f"m{i}" for i in range(12)]
    assert _offsets_file(root) == {"T@G": {"0": 6, "1": 6}}


_COMMITTER = textwrap.dedent("""
    import sys
    from rocketstore.storage.group_offsets import commit_offsets
    for i in range(1, 41):
        commit_offsets(sys.argv[1], "T", sys.argv[2], {0: i, 1: 2 * i})
""")


def test_two_processes_committing_keep_each_others_offsets(tmp_path):
    root = tmp_path / "s"
    os.makedirs(root)
    procs = [subprocess.Popen([sys.executable, "-c", _COMMITTER, str(root), g], stderr=subprocess.PIPE)
             for g in ("G1", "G2")]
    for p in procs:
        assert p.wait(60) == 0, p.stderr.read()
    assert _offsets_file(root) == {"T@G1": {"0": 40, "1": 80}, "T@G2": {"0": 40, "1": 80}}


def test_bad_arguments():
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        with pytest.raises(ValueError, match="group"):
            Consumer(store, "a@b", "TopicA")
        with pytest.raises(ValueError, match="start"):
            Consumer(store, "G", "TopicA", start="middle")
        c = Consumer(store, "G", "TopicA", queues=[2])
        assert c.queues() == [2] and c.poll(0)[0].queue_id == 2


def test_commit_over_a_corrupt_file_keeps_the_good_backup(tmp_path):
    cfg = tmp_path / "s" / "config"
    cfg.mkdir(parents=True)
    good = {"offsetTable": {"T@Old": {"0": 4}}}
    (cfg / "consumerOffset.json.bak").write_text(json.dumps(good))
    (cfg / "consumerOffset.json").write_bytes(b'{"offsetTable": {"T@Ol')  # torn
    from rocketstore.storage.group_offsets import commit_offsets
    commit_offsets(str(tmp_path / "s"), "T", "New", {0: 9})
    assert _offsets_file(tmp_path / "s") == {"T@Old": {"0": 4}, "T@New": {"0": 9}}
    assert json.loads((cfg / "consumerOffset.json.bak").read_text()) == good
