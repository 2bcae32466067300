"""Delivery guarantees across failures: a killed push consumer, resends after a broker restart, durable acks."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:  # not imported here: the client writes to ~/logs on import
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.broker.harness import BrokerProcess, run_client, start_client  # noqa: E402

CONF = {"flushDiskType": "SYNC_FLUSH", "longPollingTimeout": 1000, "flushConsumerOffsetInterval": 200}


def _broker(tmp_path, conf=None, **kw):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    b = BrokerProcess(str(tmp_path / "store"), conf={**CONF, **(conf or {})}, **kw).start()
    b.home = str(home)
    return b


def _client(b, body, timeout=60, **kw):
    try:
        return run_client(b.endpoint, body, b.home, timeout=timeout, **kw)
    except RuntimeError as e:
        raise AssertionError(f"{e}\n--- broker log ---\n{b.tail_log()}") from None


@pytest.mark.timeout(120)
def test_killed_push_consumer_messages_come_back_promptly(tmp_path):
    """SIGKILL of a push consumer holding auto-renewed messages: another member gets them in seconds, not ~61 s."""
    b = _broker(tmp_path, args=["--topic", "DeadP:2:NORMAL"])
    push = None
    try:
        sent = _client(b, '''
            p = Producer(cfg(), ("DeadP",)); p.startup()
            emit([p.send(msg("DeadP", f"d{i}")).message_id for i in range(3)])
            p.shutdown()
        ''')[0]
        push = start_client(b.endpoint, '''
            class Stuck(MessageListener):
                def consume(self, m):
                    emit({"got": m.message_id})
                    time.sleep(3600)  # busy until killed
            c = PushConsumer(cfg(), "DeadPG", Stuck(), {"DeadP": FilterExpression()}); c.startup()
            time.sleep(3600)
        ''', b.home)
        line = push.stdout.readline()
        assert json.loads(line)["got"] in sent, line
        time.sleep(0.5)  # the client has popped what it caches
        push.kill()
        push.wait(10)
        killed = time.time()
        got = _client(b, '''
            c = SimpleConsumer(cfg(), "DeadPG", {"DeadP": FilterExpression()}, await_duration=1); c.startup()
            got, t0 = {}, time.time()
            while len(got) < 3 and time.time() - t0 < 20:
                for m in c.receive(8, 30):
                    got[m.message_id] = time.time(); c.ack(m)
            emit(got)
            c.shutdown()
        ''')[0]
    finally:
        if push is not None and push.poll() is None:
            push.kill()
        b.stop()
    assert sorted(got) == sorted(sent), f"the group lost messages of its dead member: {got} vs {sent}"
    late = max(got.values()) - killed
    assert late < 8, f"the dead push consumer's messages came back after {late:.1f} s"
