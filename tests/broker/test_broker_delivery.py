"""Delivery guarantees across failures: a killed push consumer, resends after a broker restart, durable acks."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:  # not imported here: the client writes to ~/logs on import
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.bench.broker_harness import BrokerProcess, run_client, start_client  # noqa: E402

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


def _stub(b):
    import grpc
    from rocketstore.broker.proto import svc_grpc
    return svc_grpc.MessagingServiceStub(grpc.insecure_channel(b.endpoint))


MD = [("x-mq-language", "PYTHON"), ("x-mq-protocol", "GRPC_V2"), ("x-mq-client-id", "dedup@1@1@x")]


def _msg_id(seq: int) -> str:
    """A version-1 message id minted now (as the official clients make them)."""
    return f"01AABBCCDDEEFF0001{int(time.time()) - 1609459200:08X}{seq:08X}"


def _send(b, message_id: str, body: bytes) -> tuple[int, int]:
    from rocketstore.broker.proto import pb, svc
    req = svc.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = "Dup"
    m.body = body
    m.system_properties.message_id = message_id
    m.system_properties.body_encoding = pb.Encoding.IDENTITY
    r = _stub(b).SendMessage(req, metadata=MD, timeout=10)
    return r.entries[0].status.code, r.entries[0].offset


def _bodies(b) -> list[str]:
    return _client(b, '''
        c = SimpleConsumer(cfg(), "DupG", {"Dup": FilterExpression()}, await_duration=1); c.startup()
        got, idle = [], 0
        while idle < 2:
            ms = c.receive(32, 30)
            idle = 0 if ms else idle + 1
            for m in ms:
                got.append(m.body.decode()); c.ack(m)
        emit(sorted(got))
        c.shutdown()
    ''')[0]


@pytest.mark.timeout(120)
def test_resend_after_restart_and_sigkill_is_stored_once(tmp_path):
    """A resend of a stored id and body answers the stored result, across a restart and a SIGKILL; a different
    body reusing an id is stored, not dropped."""
    from rocketstore.broker.proto import pb
    ok = pb.Code.OK
    b = _broker(tmp_path, args=["--topic", "Dup:2:NORMAL"])
    try:
        a, c = _msg_id(1), _msg_id(2)
        first = _send(b, a, b"one")
        assert first[0] == ok
        assert _send(b, a, b"one") == first, "a resend in the same run is answered from memory"
        d = _msg_id(3)
        assert _send(b, d, b"four")[0] == ok and _send(b, d, b"five")[0] == ok
        b.stop()
        b.start()
        assert _send(b, a, b"one") == first, "a resend after a restart is found in the store"
        code, _ = _send(b, a, b"two")
        assert code == ok
        crashed = _send(b, c, b"three")
        assert crashed[0] == ok
        b.kill()
        b.start()
        assert _send(b, c, b"three") == crashed, "a resend after a SIGKILL is found in the store"
        assert _send(b, a, b"two")[0] == ok
        bodies = _bodies(b)
    finally:
        b.stop()
    assert bodies == ["five", "four", "one", "three", "two"], f"each message stored exactly once: {bodies}"


@pytest.mark.timeout(120)
def test_acks_with_pop_ack_sync_flush_survive_sigkill(tmp_path):
    """With popAckSyncFlush an answered ack is on disk: a SIGKILL right after brings back only unacked messages
    (the periodic write is a minute away, so without it every message would come back)."""
    b = _broker(tmp_path, conf={"popAckSyncFlush": "true", "flushConsumerOffsetInterval": 60000},
                args=["--topic", "AckD:2:NORMAL"])
    try:
        sent = _client(b, '''
            p = Producer(cfg(), ("AckD",)); p.startup()
            emit([p.send(msg("AckD", f"a{i}")).message_id for i in range(8)])
            p.shutdown()
        ''')[0]
        acked = _client(b, '''
            c = SimpleConsumer(cfg(), "AckDG", {"AckD": FilterExpression()}, await_duration=1); c.startup()
            got, acked, t0 = [], [], time.time()
            while len(got) < 8 and time.time() - t0 < 20:
                got += c.receive(8, 2)
            for m in got[:6]:
                c.ack(m); acked.append(m.message_id)
            emit(acked)
            os._exit(0)
        ''')[0]
        assert len(acked) == 6 and set(acked) <= set(sent)
        b.kill()
        b.start()
        again = _client(b, '''
            c = SimpleConsumer(cfg(), "AckDG", {"AckD": FilterExpression()}, await_duration=1); c.startup()
            got, t0 = [], time.time()
            while time.time() - t0 < 6:
                for m in c.receive(8, 30):
                    got.append(m.message_id); c.ack(m)
            emit(got)
            c.shutdown()
        ''')[0]
    finally:
        b.stop()
    assert not set(again) & set(acked), f"{len(set(again) & set(acked))} acked messages came back after SIGKILL"
    assert sorted(again) == sorted(set(sent) - set(acked)), "the unacked messages come back once"


def test_dedup_looks_up_only_ids_minted_before_the_broker_started():
    """The index lookup is for ids a client may have sent before a restart; later ids cost nothing."""
    from rocketstore.broker.dedup import CLOCK_SKEW_MS, SendDedup, minted_ms

    class Store:
        class config:
            messageIndexEnable = True

        def min_phy_offset(self):
            return 0

        def max_phy_offset(self):
            return 4096  # records stored before this process started

    d = SendDedup(Store())
    old = _msg_id(1)
    assert abs(minted_ms(old) - time.time() * 1000) < 2000
    later = f"01AABBCCDDEEFF0001{(d.started_ms + CLOCK_SKEW_MS) // 1000 - 1609459200 + 5:08X}00000001"
    assert d.needs_lookup("T", old) and not d.needs_lookup("T", later)
    assert minted_ms("not-a-v1-id") is None and d.needs_lookup("T", "not-a-v1-id")
    d.remember("T", old, 7, "", b"d")
    assert not d.needs_lookup("T", old) and d.recent("T", old, b"d") == (7, "") and d.recent("T", old, b"e") is None


def test_dedup_skips_the_lookup_when_no_record_predates_the_broker():
    """A store that held nothing when the broker started (or whose older records are all deleted) cannot hold an
    earlier send of any id: no index lookup (and no thread hop per send), whatever the id's mint time."""
    from rocketstore.broker.dedup import SendDedup

    class Store:
        class config:
            messageIndexEnable = True
        lo, hi = 0, 0

        def min_phy_offset(self):
            return self.lo

        def max_phy_offset(self):
            return self.hi

    empty = Store()
    d = SendDedup(empty)
    old = _msg_id(1)
    empty.hi = 8192  # this process's own sends
    assert not d.needs_lookup("T", old) and not d.needs_lookup("T", "not-a-v1-id")
    held = Store()
    held.hi = 4096
    d = SendDedup(held)
    assert d.needs_lookup("T", old)
    held.lo = 4096  # retention deleted every record older than this process
    assert not d.needs_lookup("T", old)
