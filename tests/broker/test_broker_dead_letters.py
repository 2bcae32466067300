"""The broker's dead letters are moved exactly once: a broker killed right after the DLQ put (before any
state write) finds the copy at restart; the message is neither put again nor delivered to its group again."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

grpc = pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore import MessageStore  # noqa: E402
from rocketstore.bench.broker_harness import BrokerProcess  # noqa: E402
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402

from broker.test_broker_bad_input import md, receive, send_req  # noqa: E402

C = pb.Code

# The broker dies (like SIGKILL: the mapped commitlog's pages survive, nothing else runs) right after the
# store took a put to a DLQ topic: between the dead letter's put and any state write after it.
KILL_AFTER_DLQ_PUT = """
import os, runpy, sys
from rocketstore.store import MessageStore
_put = MessageStore.put
def put(self, msg, *a, **kw):
    res = _put(self, msg, *a, **kw)
    if res.ok and msg.topic.startswith("%DLQ%"):
        os._exit(9)
    return res
MessageStore.put = put
sys.argv = ["rocketstore"] + sys.argv[1:]
runpy.run_module("rocketstore", run_name="__main__")
"""


class KilledAfterDlqPut(BrokerProcess):
    def command(self) -> list[str]:
        cmd = super().command()
        assert cmd[1:3] == ["-m", "rocketstore"]
        return [sys.executable, "-c", KILL_AFTER_DLQ_PUT, *cmd[3:]]


ARGS = ["--no-auto-create-topics", "--topic", "Poison:1:NORMAL", "--group", "G:retryMaxTimes=1"]


def _forward(stub, handle: str) -> None:
    f = svc.ForwardMessageToDeadLetterQueueRequest()
    f.group.name, f.topic.name, f.receipt_handle, f.message_id = "G", "Poison", handle, "X"
    f.delivery_attempt, f.max_delivery_attempts = 1, 2
    stub.ForwardMessageToDeadLetterQueue(f, metadata=md(), timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["retries", "forward"])
def test_a_broker_killed_after_the_dlq_put_settles_it_at_restart_never_put_twice(tmp_path, path):
    store = str(tmp_path / "store")
    first = KilledAfterDlqPut(store, args=ARGS).start()
    try:
        ch = grpc.insecure_channel(first.endpoint)
        stub = svc_grpc.MessagingServiceStub(ch)
        assert stub.SendMessage(send_req(topic="Poison", body=b"poison"), metadata=md(), timeout=5) \
            .entries[0].status.code == C.OK
        got = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = [r.message for r in receive(stub, topic="Poison", group="G", invisible=1)
                   if r.HasField("message")]
        assert [m.body for m in got] == [b"poison"]
        try:
            if path == "forward":
                _forward(stub, got[0].system_properties.receipt_handle)
            else:  # never acked: delivered twice (retryMaxTimes=1), then due for the DLQ
                while time.monotonic() < deadline:
                    receive(stub, topic="Poison", group="G", invisible=1)
        except grpc.RpcError:
            pass  # the broker died under the call
        ch.close()
        first.proc.wait(20)
        assert first.proc.returncode == 9, "the broker was not killed after a DLQ put: " + first.tail_log()
    finally:
        first.kill()

    with BrokerProcess(store, args=ARGS) as again:
        ch = grpc.insecure_channel(again.endpoint)
        stub = svc_grpc.MessagingServiceStub(ch)
        redelivered = []
        end = time.monotonic() + 4  # past the 1 s invisible time of every delivery before the kill
        while time.monotonic() < end:
            redelivered += [r.message.body for r in receive(stub, topic="Poison", group="G", invisible=1)
                            if r.HasField("message")]
        ch.close()
    assert redelivered == [], "a dead-lettered message was delivered to its group again"
    s = MessageStore.open(store, read_only=True)
    try:
        dlq = s.get("%DLQ%G", 0, 0, 32).messages
        assert [m.body for m in dlq] == [b"poison"], "the DLQ must hold the message exactly once"
        assert dlq[0].properties["DLQ_ORIGIN_TOPIC"] == "Poison"
    finally:
        s.close()
