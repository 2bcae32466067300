"""Attack 17: a message moved to ``%DLQ%<group>`` and a power cut (ASYNC_FLUSH).  The mover puts the dead letter,
then removes the message from the group's pop state and fsyncs the state's journal.  If the dead letter was still
only in the page cache, a power cut loses it while the state survives: the message is neither in its topic for
the group nor in the DLQ (lost), though it was durable before the move."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

import pytest

from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.queues import RetryPolicy, SimpleConsumer
from rocketstore.store import MessageStore

SMALL = StoreConfig(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
                    maxIndexNum=400)
DLQ = "%DLQ%G"
POLICY = RetryPolicy(0, (0,))  # one delivery, then the DLQ


def _dead_letters(s: MessageStore) -> list[bytes]:
    s.wait_dispatched(5)
    return [m.body for m in s.get(DLQ, 0, 0, 32).messages]


def test_a_dead_letter_is_durable_before_the_state_lets_its_message_go(tmp_path):
    """A durable message is delivered once, nacked, and moved to the DLQ at the next receive; the power cut is
    taken the moment after (the store's files less the commitlog bytes not fsynced yet).  Opening that image,
    the message must be in the DLQ, or be delivered to the group again: not lost."""
    root = tmp_path / "store"
    with MessageStore.open(str(root), SMALL) as s:
        assert s.put(Message("T", b"poison")).ok
    image = tmp_path / "image"
    with MessageStore.open(str(root), SMALL) as s:
        c = SimpleConsumer(s, "G", "T", retry_policy=POLICY, ack_sync_flush=True)
        got = c.receive(4)
        assert [m.body for m in got] == [b"poison"]
        c.nack(got[0])
        assert c.receive(4) == []
        assert _dead_letters(s) == [b"poison"]
        flushed = s.commitlog.queue.flushed_where
        shutil.copytree(root, image, ignore=shutil.ignore_patterns("lock"))
        c.close()
    with open(image / "commitlog" / "00000000000000000000", "r+b") as fh:
        fh.seek(flushed)
        fh.write(bytes(SMALL.mappedFileSizeCommitLog - flushed))
    with MessageStore.open(str(image), SMALL) as s:
        c = SimpleConsumer(s, "G", "T", retry_policy=POLICY, ack_sync_flush=True)
        again = [m.body for m in c.receive(4)]
        c.close()
        assert again + _dead_letters(s) == [b"poison"], "the message was lost"


# The broker: the power cut comes right after the first pop-state write that follows a dead letter's put (the
# state that lets the message go); the hook records how far the commitlog was fsynced at that moment.
CUT_AFTER_STATE_WRITE = """
import os, runpy, sys
from rocketstore.store import MessageStore
from rocketstore.broker.broker import Broker
_put, _write, moved = MessageStore.put, Broker._write_state, []
def put(self, msg, *a, **kw):
    res = _put(self, msg, *a, **kw)
    if res.ok and msg.topic.startswith("%DLQ%"):
        moved.append(self)
    return res
async def write_state(self, pop_snap, off_snap):
    ok = await _write(self, pop_snap, off_snap)
    if moved and pop_snap is not None and not self.pop.parked():
        with open(os.environ["FLUSHED_AT_CUT"], "w") as fh:
            fh.write(str(moved[0].commitlog.queue.flushed_where))
        os._exit(9)
    return ok
MessageStore.put, Broker._write_state = put, write_state
sys.argv = ["rocketstore"] + sys.argv[1:]
runpy.run_module("rocketstore", run_name="__main__")
"""


@pytest.mark.timeout(120)
def test_a_broker_dead_letter_is_durable_before_the_state_lets_its_message_go(tmp_path, monkeypatch):
    """The broker's mover: a message forwarded to the DLQ by its client, the pop state written, then a power cut
    (the commitlog less what was not fsynced).  After the restart the message is in the DLQ or delivered to the
    group again: not lost."""
    grpc = pytest.importorskip("grpc")
    if importlib.util.find_spec("rocketmq") is None:
        pytest.skip("rocketmq-python-client is not installed")
    from rocketstore.bench.broker_harness import BrokerProcess
    from rocketstore.broker.proto import pb, svc, svc_grpc
    from broker.test_broker_bad_input import md, receive, send_req

    class CutAfterStateWrite(BrokerProcess):
        def command(self) -> list[str]:
            cmd = super().command()
            return [sys.executable, "-c", CUT_AFTER_STATE_WRITE, *cmd[3:]]

    flushed_file = tmp_path / "flushed"
    monkeypatch.setenv("FLUSHED_AT_CUT", str(flushed_file))
    store = str(tmp_path / "store")
    args = ["--no-auto-create-topics", "--topic", "Poison:1:NORMAL", "--group", "G:retryMaxTimes=1"]
    first = CutAfterStateWrite(store, args=args).start()
    try:
        ch = grpc.insecure_channel(first.endpoint)
        stub = svc_grpc.MessagingServiceStub(ch)
        assert stub.SendMessage(send_req(topic="Poison", body=b"poison"), metadata=md(), timeout=5) \
            .entries[0].status.code == pb.Code.OK
        got, deadline = [], time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = [r.message for r in receive(stub, topic="Poison", group="G", invisible=5) if r.HasField("message")]
        assert [m.body for m in got] == [b"poison"]
        f = svc.ForwardMessageToDeadLetterQueueRequest()
        f.group.name, f.topic.name, f.receipt_handle, f.message_id = "G", "Poison", \
            got[0].system_properties.receipt_handle, "X"
        f.delivery_attempt, f.max_delivery_attempts = 1, 2
        try:
            stub.ForwardMessageToDeadLetterQueue(f, metadata=md(), timeout=10)
            first.proc.wait(20)
        except grpc.RpcError:
            pass
        ch.close()
        first.proc.wait(20)
        assert first.proc.returncode == 9, "no state write after the DLQ put: " + first.tail_log()
    finally:
        first.kill()
    flushed = int(flushed_file.read_text())
    seg = Path(store) / "commitlog" / "00000000000000000000"
    with open(seg, "r+b") as fh:  # the power cut: what was not fsynced reads as zeros
        fh.seek(flushed)
        fh.write(bytes(1 << 20))
    with BrokerProcess(store, args=args) as again:
        ch = grpc.insecure_channel(again.endpoint)
        stub = svc_grpc.MessagingServiceStub(ch)
        redelivered, end = [], time.monotonic() + 7  # past the 5 s invisible time of the delivery before the cut
        while time.monotonic() < end and not redelivered:
            redelivered += [r.message.body for r in receive(stub, topic="Poison", group="G", invisible=5)
                            if r.HasField("message")]
        ch.close()
    with MessageStore.open(store, read_only=True) as s:
        dead = [m.body for m in s.get(DLQ, 0, 0, 32).messages]
    assert redelivered + dead == [b"poison"], "the message was lost"
