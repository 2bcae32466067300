"""Delayed and scheduled messages in the library (issue 27 point 3): the store's timer service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rocketstore.config import StoreConfig
from rocketstore.format import codec
from rocketstore.format.message import Message, PutMessageStatus
from rocketstore.queues.timer import DELAY_LEVELS_MS, TIMER_TOPIC
from rocketstore.store import MessageStore

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)
PRECISION_MS = 400  # documented: tens of ms on an idle machine; this machine is shared, so a wide bound


def now_ms() -> int:
    return int(time.time() * 1000)


def wait_for(store: MessageStore, topic: str, n: int, timeout: float = 5.0, queue_id: int = 0) -> list:
    end = time.time() + timeout
    while time.time() < end:
        store.wait_dispatched(1)
        got = store.get(topic, queue_id, 0, 32).messages
        if len(got) >= n:
            return got
        time.sleep(0.01)
    return store.get(topic, queue_id, 0, 32).messages


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def test_delivered_not_before_its_time_and_within_precision(root):
    with MessageStore.open(root, SMALL) as s:
        at = now_ms() + 700
        res = s.put(Message("Later", b"hello", queue_id=1, tags="T", deliver_at=at))
        assert res.ok
        s.wait_dispatched(5)
        assert s.max_offset_in_queue("Later", 1) == 0, "not visible in its topic before its time"
        assert s.max_offset_in_queue(TIMER_TOPIC, 0) == 1
        got = wait_for(s, "Later", 1, queue_id=1)
        seen = now_ms()
        assert len(got) == 1 and got[0].body == b"hello" and got[0].tags == "T"
        assert at <= got[0].store_timestamp <= at + PRECISION_MS, (got[0].store_timestamp - at)
        assert seen >= at
        assert "REAL_TOPIC" not in got[0].properties and got[0].properties["TIMER_DELIVER_MS"] == str(at)
        # a time already passed is put straight into the topic
        assert s.put(Message("Now", b"x", deliver_at=now_ms() - 1000)).ok
        assert len(wait_for(s, "Now", 1, timeout=1)) == 1
        assert s.max_offset_in_queue(TIMER_TOPIC, 0) == 1


def test_delay_levels_and_the_delay_property(root):
    with MessageStore.open(root, SMALL) as s:
        t0 = now_ms()
        assert s.put(Message("Lv", b"by-field", delay_level=1)).ok
        assert s.put(Message("Lv", b"by-property", properties={"DELAY": "1"})).ok
        s.wait_dispatched(5)
        recs = s.get(TIMER_TOPIC, 0, 0, 10).messages
        assert len(recs) == 2
        for r in recs:
            deliver = int(r.properties["TIMER_DELIVER_MS"])
            assert t0 + 1000 <= deliver <= now_ms() + 1000
        got = wait_for(s, "Lv", 2)
        assert sorted(m.body for m in got) == [b"by-field", b"by-property"]
        for m in got:
            assert m.store_timestamp >= t0 + 1000
            assert "DELAY" not in m.properties, "the delivered copy loses DELAY, as RocketMQ's schedule service does"
        assert [s.timer.scheduled_times()] == [[]]
        # the 18 levels
        assert DELAY_LEVELS_MS[0] == 1000 and DELAY_LEVELS_MS[3] == 30_000 and DELAY_LEVELS_MS[-1] == 7_200_000
        assert len(DELAY_LEVELS_MS) == 18
        t1 = now_ms()
        assert s.put(Message("Lv2", b"x", delay_level=18)).ok
        assert abs(s.timer.scheduled_times()[0] - (t1 + 7_200_000)) < 1000


@pytest.mark.parametrize("bad", [dict(delay_level=-1), dict(delay_level=19), dict(properties={"DELAY": "x"}),
                                 dict(properties={"DELAY": "40"}), dict(deliver_at=-5),
                                 dict(properties={"TIMER_DELIVER_MS": "soon"})])
def test_bad_delays_are_refused_and_nothing_is_written(root, bad):
    with MessageStore.open(root, SMALL) as s:
        res = s.put(Message("Bad", b"x", **bad))
        assert res.status is PutMessageStatus.MESSAGE_ILLEGAL
        assert res.error and ("delay level" in res.error or "epoch time" in res.error), res.error
        assert s.max_phy_offset() == 0


def test_a_batch_refuses_delay_messages(root):
    with MessageStore.open(root, SMALL) as s:
        res = s.put_batch([Message("B", b"1"), Message("B", b"2", delay_level=1)])
        assert res.status is PutMessageStatus.MESSAGE_ILLEGAL and "delay" in res.error
        assert s.max_phy_offset() == 0


def test_timer_record_is_in_rocketmq_layout_as_the_broker_wrote_it(root):
    """The record the broker wrote before the timer moved here: topic rmq_sys_wheel_timer queue 0, the message's
    properties plus REAL_TOPIC, REAL_QID, TIMER_DELIVER_MS (in that order), body, flag and born time kept."""
    props = {"UNIQ_KEY": "7F0000010001000000000000000A0001", "TAGS": "TagA", "KEYS": "k1 k2", "user": "v"}
    at = now_ms() + 3_600_000
    with MessageStore.open(root, SMALL) as s:
        res = s.put(Message("Real", b"payload", queue_id=3, properties=props, flag=7, born_timestamp=1234,
                            deliver_at=at))
        assert res.ok and res.queue_offset == 0
        rec = s.look(res.commit_log_offset)
        assert (rec.topic, rec.queue_id, rec.body, rec.flag, rec.born_timestamp) == (
            TIMER_TOPIC, 0, b"payload", 7, 1234)
        expected = dict(props, REAL_TOPIC="Real", REAL_QID="3", TIMER_DELIVER_MS=str(at))
        assert rec.properties_string == codec.properties_to_string(expected)
        # a message without a UNIQ_KEY gets one (how a restart recognises a copy put before a crash)
        res2 = s.put(Message("Real", b"p2", deliver_at=at))
        rec2 = s.look(res2.commit_log_offset)
        assert len(rec2.uniq_key or "") == 32
        s.wait_dispatched(5)
        assert s.max_offset_in_queue(TIMER_TOPIC, 0) == 2 and s.max_offset_in_queue("Real", 3) == 0


def test_survives_close_and_reopen_and_is_delivered_once(root):
    with MessageStore.open(root, SMALL) as s:
        at = now_ms() + 600
        assert s.put(Message("R", b"once", deliver_at=at)).ok
        assert s.put(Message("R", b"far", deliver_at=at + 3_600_000)).ok
    time.sleep(max(0.0, (at - now_ms()) / 1000) + 0.3)
    assert not os.path.exists(os.path.join(root, "consumequeue", "R")), "no delivery while closed"
    with MessageStore.open(root, SMALL) as s:
        got = wait_for(s, "R", 1)
        assert [m.body for m in got] == [b"once"]
        time.sleep(0.3)
    with MessageStore.open(root, SMALL) as s:
        time.sleep(0.3)
        assert [m.body for m in s.get("R", 0, 0, 10).messages] == [b"once"]
        assert s.timer.scheduled_times() == [at + 3_600_000]
    state = json.loads(Path(root, "config", "timerState.json").read_text())
    assert state["offset"] == 1 and state.get("delivering") is None


WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    from rocketstore.config import StoreConfig
    from rocketstore.format.message import Message
    from rocketstore.queues import timer
    from rocketstore.store import MessageStore
    if {crash_in_window!r}:
        # SIGKILL after the copies are put and before the state says so: the worst moment
        timer.TimerService._delivered_hook = lambda self: os.kill(os.getpid(), 9)
    cfg = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                      maxIndexNum=400)
    s = MessageStore.open({root!r}, cfg)
    at = int(time.time() * 1000) + {delay_ms}
    for i in range(3):
        assert s.put(Message("K", b"m%d" % i, queue_id=i % 2, deliver_at=at)).ok
    print(at, flush=True)
    time.sleep(60)
""")


def _writer(root: str, delay_ms: int, crash_in_window: bool) -> tuple[subprocess.Popen, int]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = WRITER.format(src=src, root=root, delay_ms=delay_ms, crash_in_window=crash_in_window)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip(), "writer did not start"
    return p, int(line)


def _bodies(s: MessageStore) -> list[bytes]:
    s.wait_dispatched(5)
    return sorted(m.body for q in (0, 1) for m in s.get("K", q, 0, 32).messages)


def test_sigkill_of_the_writer_before_due_then_delivered_once_after_reopen(root):
    p, at = _writer(root, 800, crash_in_window=False)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    time.sleep(max(0.0, (at - now_ms()) / 1000) + 0.2)
    with MessageStore.open(root, SMALL) as s:
        end = time.time() + 5
        while len(_bodies(s)) < 3 and time.time() < end:
            time.sleep(0.02)
        assert _bodies(s) == [b"m0", b"m1", b"m2"]
        time.sleep(0.3)
        assert _bodies(s) == [b"m0", b"m1", b"m2"]
    with MessageStore.open(root, SMALL) as s:
        time.sleep(0.3)
        assert _bodies(s) == [b"m0", b"m1", b"m2"]


def test_sigkill_between_delivery_and_state_write_delivers_once(root):
    """The writer dies right after its timer put the copies and before timerState.json records them: the next
    open finds the copies in their queues (UNIQ_KEY, born time) and does not put them again."""
    p, at = _writer(root, 300, crash_in_window=True)
    assert p.wait(20) == -signal.SIGKILL
    state = json.loads(Path(root, "config", "timerState.json").read_text())
    assert len(state["delivering"]) == 3, "the crash came inside the window"
    with MessageStore.open(root, SMALL) as s:
        assert _bodies(s) == [b"m0", b"m1", b"m2"], "the copies put before the crash are kept"
        time.sleep(0.5)
        assert _bodies(s) == [b"m0", b"m1", b"m2"], "and not put again"
        assert s.timer.scheduled_times() == []
    state = json.loads(Path(root, "config", "timerState.json").read_text())
    assert state["offset"] == 3 and state.get("delivering") is None


def test_read_only_and_serviceless_opens_run_no_timer(root):
    with MessageStore.open(root, SMALL, start_services=False) as s:
        assert s.timer is None
        assert s.put(Message("Q", b"x", deliver_at=now_ms() + 200)).ok  # stored in the timer topic all the same
    time.sleep(0.4)
    with MessageStore.open(root, SMALL, read_only=True) as s:
        assert s.timer is None and s.max_offset_in_queue("Q", 0) == 0
    with MessageStore.open(root, SMALL) as s:
        assert [m.body for m in wait_for(s, "Q", 1)] == [b"x"]


def test_timer_records_of_rocketmq_own_timer_are_not_delivered_again(root):
    """A store RocketMQ's broker ran its timer on (its timercheck file, no timerState.json) holds timer records
    RocketMQ delivered itself: a writable open must not put them into their topics a second time."""
    with MessageStore.open(root, SMALL, start_services=False) as s:
        assert s.put(Message("Old", b"delivered-by-rocketmq", deliver_at=now_ms() + 200)).ok
    Path(root, "config").mkdir(exist_ok=True)
    Path(root, "config", "timercheck").write_bytes(b"\0" * 32)
    time.sleep(0.4)  # due: a timer that took it for its own would put it now
    with MessageStore.open(root, SMALL) as s:
        assert s.timer.scheduled_times() == []
        with MessageStore.open(root, SMALL, read_only=True) as r:
            assert r.max_offset_in_queue("Old", 0) == 0
        at = now_ms() + 200
        assert s.put(Message("New", b"mine", deliver_at=at)).ok  # new ones are delivered as ever
        assert [m.body for m in wait_for(s, "New", 1)] == [b"mine"]
        s.wait_dispatched(5)
        assert s.max_offset_in_queue("Old", 0) == 0


def test_a_delay_put_on_a_closed_or_read_only_store_is_refused_like_any_put(root):
    s = MessageStore.open(root, SMALL)
    s.close()
    with pytest.raises(Exception) as e:
        s.put(Message("C", b"x", delay_level=1))
    assert "closed" in str(e.value)
    with MessageStore.open(root, SMALL, read_only=True) as r:
        with pytest.raises(Exception) as e:
            r.put(Message("C", b"x", delay_level=1))
        assert "read-only" in str(e.value)


def test_a_simple_consumer_receives_a_delay_message_at_its_time(root):
    """End to end with the library's SimpleConsumer (issue 27.1): nothing before the time, the message after."""
    with MessageStore.open(root, SMALL) as s:
        if not hasattr(s, "simple_consumer"):
            pytest.skip("this build has no SimpleConsumer")
        with s.simple_consumer("DelayGroup", "DT", invisible_duration=30) as c:
            at = now_ms() + 600
            assert s.put(Message("DT", b"later", deliver_at=at)).ok
            assert s.put(Message("DT", b"now")).ok
            first = c.receive(16, wait=2.0)
            assert [m.body for m in first] == [b"now"]
            for m in first:
                c.ack(m)
            got = []
            end = time.time() + 5
            while not got and time.time() < end:
                got = c.receive(16, wait=1.0)
            seen = now_ms()
            assert [m.body for m in got] == [b"later"] and seen >= at
            assert seen - at < PRECISION_MS + 1000, seen - at
            c.ack(got[0])
            assert c.receive(16, wait=0.3) == []
