"""Abuse over raw gRPC (issue 18): bounded work and memory per request, system topics, bad fields.

Each test sends what a hostile or broken client could send and checks the broker answers with a RocketMQ
status code in the body, quickly, and keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import time
import uuid
import zlib

import pytest

grpc = pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.bench.broker_harness import BrokerProcess  # noqa: E402
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402

C = pb.Code
MAX = 65536


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    b = BrokerProcess(str(root / "store"), conf={"maxMessageSize": MAX, "longPollingTimeout": 3000},
                      args=["--topic", "Known:2:NORMAL", "--topic", "Later:1:DELAY", "--topic", "%DLQ%Dead:1",
                            "--topic", "Hot:4:NORMAL"])
    b.start()
    yield b
    assert b.stop() == 0, b.tail_log()


@pytest.fixture(scope="module")
def stub(broker):
    ch = grpc.insecure_channel(broker.endpoint, options=[("grpc.max_send_message_length", -1)])
    yield svc_grpc.MessagingServiceStub(ch)
    ch.close()


def md(client_id: str = "abuse@1@1@x"):
    return [("x-mq-language", "PYTHON"), ("x-mq-protocol", "GRPC_V2"), ("x-mq-client-id", client_id)]


def send_req(topic="Known", body=b"x", encoding=pb.Encoding.IDENTITY, **sp):
    req = svc.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = topic
    m.body = body
    m.system_properties.message_id = uuid.uuid4().hex.upper()[:34]
    m.system_properties.body_encoding = encoding
    for k, v in sp.items():
        setattr(m.system_properties, k, v)
    return req


def send(stub, req):
    return stub.SendMessage(req, metadata=md(), timeout=10)


def assert_alive(stub):
    r = send(stub, send_req(body=b"still here"))
    assert r.status.code == C.OK, r.status


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def gzip_bomb(size: int) -> bytes:
    """A gzip member of ``size`` zero bytes, built without holding them."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [c.compress(chunk) for _ in range(size >> 20)]
    return b"".join(parts) + c.flush()


@pytest.mark.timeout(60)
def test_gzip_bomb_is_refused_with_bounded_memory(broker, stub):
    assert send(stub, send_req(body=zlib.compress(b"hello"), encoding=pb.Encoding.GZIP)).status.code == C.OK
    bomb = gzip_bomb(256 << 20)
    assert len(bomb) < 512 * 1024
    before = peak_rss_kb(broker.proc.pid)
    t0 = time.monotonic()
    r = send(stub, send_req(body=bomb, encoding=pb.Encoding.GZIP))
    took = time.monotonic() - t0
    assert r.status.code == C.MESSAGE_BODY_TOO_LARGE, r.status
    assert str(MAX) in r.status.message
    grown_mb = (peak_rss_kb(broker.proc.pid) - before) / 1024
    assert grown_mb < 32, f"peak RSS grew by {grown_mb:.0f} MB for a refused 256 MiB bomb"
    assert took < 2.0, f"refusing the bomb took {took:.2f}s"
    # exactly at the limit is accepted; truncated or trailing garbage is corrupt
    assert send(stub, send_req(body=zlib.compress(bytes(MAX)),
                               encoding=pb.Encoding.GZIP)).status.code == C.OK
    assert send(stub, send_req(body=zlib.compress(bytes(MAX + 1)),
                               encoding=pb.Encoding.GZIP)).status.code == C.MESSAGE_BODY_TOO_LARGE
    good = zlib.compress(b"abc" * 100)
    assert send(stub, send_req(body=good[:-6], encoding=pb.Encoding.GZIP)).status.code == C.MESSAGE_CORRUPTED
    assert send(stub, send_req(body=good + b"junk", encoding=pb.Encoding.GZIP)).status.code == C.MESSAGE_CORRUPTED
    assert send(stub, send_req(body=b"\x1f\x8bnot gzip", encoding=pb.Encoding.GZIP)).status.code == \
        C.MESSAGE_CORRUPTED
    assert_alive(stub)


def route(stub, topic, namespace=""):
    q = svc.QueryRouteRequest()
    q.topic.name, q.topic.resource_namespace = topic, namespace
    return stub.QueryRoute(q, metadata=md(), timeout=5)


def receive(stub, topic="Known", group="AbuseG", poll=0):
    req = svc.ReceiveMessageRequest()
    req.group.name = group
    req.message_queue.topic.name = topic
    req.message_queue.id = -1
    req.filter_expression.type = pb.FilterType.TAG
    req.filter_expression.expression = "*"
    req.batch_size = 16
    req.invisible_duration.seconds = 10
    req.long_polling_timeout.seconds = poll
    return list(stub.ReceiveMessage(req, metadata=md(), timeout=10))


SYSTEM = ["TBW102", "SCHEDULE_TOPIC_XXXX", "BenchmarkTest", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRACE_TOPIC",
          "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT",
          "rmq_sys_wheel_timer", "rmq_sys_anything", "RMQ_SYS_ANYTHING"]


@pytest.mark.timeout(60)
def test_system_and_broker_topics_are_not_for_clients(stub):
    for name in SYSTEM:
        assert send(stub, send_req(topic=name)).status.code == C.ILLEGAL_TOPIC, name
        assert route(stub, name).status.code == C.ILLEGAL_TOPIC, name
        assert receive(stub, topic=name)[0].status.code == C.ILLEGAL_TOPIC, name
    # retry and dead letter topics: readable when they exist, never written by clients, never auto-created
    assert route(stub, "%DLQ%Dead").status.code == C.OK
    for name in ("%DLQ%Dead", "%RETRY%Dead", "%DLQ%Fresh", "%RETRY%Fresh"):
        r = send(stub, send_req(topic=name))
        assert r.status.code == C.ILLEGAL_TOPIC, (name, r.status)
    for name in ("%DLQ%Fresh", "%RETRY%Fresh"):
        assert route(stub, name).status.code == C.TOPIC_NOT_FOUND, name
    assert_alive(stub)


@pytest.mark.timeout(60)
def test_trailing_newline_names_are_illegal(stub):
    for name in ("Known\n", "Fresh\n", "Known\r", "\nKnown"):
        assert send(stub, send_req(topic=name)).status.code == C.ILLEGAL_TOPIC, repr(name)
        assert route(stub, name).status.code == C.ILLEGAL_TOPIC, repr(name)
    assert route(stub, "Fresh").status.code == C.OK  # auto-created, without the newline
    assert receive(stub, group="G\n")[0].status.code == C.ILLEGAL_CONSUMER_GROUP
    assert route(stub, "Known", namespace="ns\n").status.code == C.BAD_REQUEST
    assert_alive(stub)


def raw_call(broker, method, payload, stream=False):
    ch = grpc.insecure_channel(broker.endpoint, options=[("grpc.max_send_message_length", -1)])
    try:
        path = f"/apache.rocketmq.v2.MessagingService/{method}"
        if stream:
            call = ch.unary_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            return list(call(payload, metadata=md(), timeout=10))
        call = ch.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return call(payload, metadata=md(), timeout=10)
    finally:
        ch.close()


def no_python_text(status):
    for word in ("Traceback", "Error:", "Exception", "object has no attribute", "line "):
        assert word not in status.message, status


@pytest.mark.timeout(60)
def test_undecodable_requests_get_bad_request(broker, stub):
    garbage = b"\xff\xff\xff\xff\x0f garbage"
    for method, resp_type in (("SendMessage", svc.SendMessageResponse), ("AckMessage", svc.AckMessageResponse),
                              ("QueryRoute", svc.QueryRouteResponse), ("Heartbeat", svc.HeartbeatResponse),
                              ("EndTransaction", svc.EndTransactionResponse),
                              ("ChangeInvisibleDuration", svc.ChangeInvisibleDurationResponse)):
        r = resp_type.FromString(raw_call(broker, method, garbage))
        assert r.status.code == C.BAD_REQUEST, (method, r.status)
        assert "not a valid protobuf" in r.status.message
    first = svc.ReceiveMessageResponse.FromString(raw_call(broker, "ReceiveMessage", b"\x0a\xff\xff", True)[0])
    assert first.status.code == C.BAD_REQUEST
    # a Telemetry stream that carries garbage is answered, not dropped
    ch = grpc.insecure_channel(broker.endpoint)
    tel = ch.stream_stream("/apache.rocketmq.v2.MessagingService/Telemetry",
                           request_serializer=lambda b: b, response_deserializer=svc.TelemetryCommand.FromString)
    call = tel(iter([garbage]), metadata=md(), timeout=5)
    reply = next(call)
    call.cancel()
    ch.close()
    assert reply.status.code == C.BAD_REQUEST
    assert_alive(stub)


@pytest.mark.timeout(60)
def test_oversize_frames(broker, stub):
    big = svc.AckMessageRequest()
    big.group.name, big.topic.name = "AbuseG", "Known"
    for i in range(20000):
        big.entries.add(message_id="X" * 34, receipt_handle=f"0_{i}_" + "a" * 120)
    assert big.ByteSize() > 2 * 1024 * 1024
    r = stub.AckMessage(big, metadata=md(), timeout=10)
    assert r.status.code == C.BAD_REQUEST and "exceeds the limit" in r.status.message, r.status
    # a SendMessage frame above the soft limit is not parsed: MESSAGE_BODY_TOO_LARGE
    r = send(stub, send_req(body=b"x" * (MAX + 2 * 1024 * 1024)))
    assert r.status.code == C.MESSAGE_BODY_TOO_LARGE
    # above gRPC's own limit the frame never reaches the broker's code
    with pytest.raises(grpc.RpcError) as e:
        send(stub, send_req(body=b"x" * (9 * 1024 * 1024)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_alive(stub)


@pytest.mark.timeout(60)
def test_unknown_enums_and_out_of_range_times(broker, stub):
    def check(r, code):
        assert r.status.code == code, r.status
        no_python_text(r.status)

    check(send(stub, send_req(message_type=99)), C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE)
    check(send(stub, send_req(encoding=7)), C.BAD_REQUEST)
    hb = svc.HeartbeatRequest(client_type=42)
    check(stub.Heartbeat(hb, metadata=md(), timeout=5), C.UNRECOGNIZED_CLIENT_TYPE)
    req = svc.ReceiveMessageRequest()
    req.group.name, req.message_queue.topic.name, req.message_queue.id = "AbuseG", "Known", -1
    req.batch_size, req.invisible_duration.seconds = 1, 10
    req.filter_expression.type, req.filter_expression.expression = 9, "*"
    check(list(stub.ReceiveMessage(req, metadata=md(), timeout=10))[0], C.ILLEGAL_FILTER_EXPRESSION)
    req.filter_expression.type = pb.FilterType.TAG
    req.long_polling_timeout.seconds = -5
    check(list(stub.ReceiveMessage(req, metadata=md(), timeout=10))[0], C.ILLEGAL_POLLING_TIME)
    t = svc.EndTransactionRequest()
    t.topic.name, t.message_id, t.transaction_id, t.resolution = "Known", "X", "00" * 16, 77
    check(stub.EndTransaction(t, metadata=md(), timeout=5), C.BAD_REQUEST)

    def timed(field, seconds, nanos=0, **kw):
        req = send_req(**kw)
        ts = getattr(req.messages[0].system_properties, field)
        ts.seconds, ts.nanos = seconds, nanos
        return send(stub, req)

    for seconds, nanos in ((-5, 0), (1 << 62, 0), (10, -1), (10, 2_000_000_000)):
        check(timed("delivery_timestamp", seconds, nanos, topic="Later", message_type=pb.MessageType.DELAY),
              C.ILLEGAL_DELIVERY_TIME)
        check(timed("born_timestamp", seconds, nanos), C.BAD_REQUEST)
    # a delivery time already past is delivered at once, as RocketMQ's proxy does
    check(timed("delivery_timestamp", int(time.time()) - 3600, topic="Later", message_type=pb.MessageType.DELAY),
          C.OK)
    assert_alive(stub)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(120)
def test_waiting_long_polls_are_woken_only_for_their_messages(broker):
    """300 idle long polls of one group cost little CPU; each send is still received at once, by every group."""
    def poll_req(group, expr="*", inv=60):
        r = svc.ReceiveMessageRequest()
        r.group.name, r.message_queue.topic.name, r.message_queue.id = group, "Hot", -1
        r.filter_expression.type, r.filter_expression.expression = pb.FilterType.TAG, expr
        r.batch_size, r.invisible_duration.seconds, r.long_polling_timeout.seconds = 32, inv, 20
        return r

    async def run():
        ch = grpc.aio.insecure_channel(broker.endpoint)
        stub = svc_grpc.MessagingServiceStub(ch)
        got: dict[str, list] = {"PollG": [], "OtherG": [], "TagG": []}
        stop = False

        async def poller(group, expr="*"):
            while not stop:
                try:
                    async for r in stub.ReceiveMessage(poll_req(group, expr), metadata=md(), timeout=30):
                        if r.HasField("message"):
                            got[group].append((time.monotonic(), r.message))
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)

        pid = broker.proc.pid

        async def cpu_share(seconds):
            c0, t0 = cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(seconds)
            return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)

        quiet = await cpu_share(3.0)
        tasks = [asyncio.create_task(poller("PollG")) for _ in range(300)]
        tasks.append(asyncio.create_task(poller("OtherG")))
        tasks.append(asyncio.create_task(poller("TagG", "never")))
        await asyncio.sleep(2.0)
        idle = await cpu_share(3.0) - quiet
        sent = []
        for i in range(20):
            req = send_req(topic="Hot", body=f"hot-{i}".encode(), tag="T")
            r = await stub.SendMessage(req, metadata=md(), timeout=10)
            assert r.status.code == C.OK
            sent.append((time.monotonic(), req.messages[0].system_properties.message_id))
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 10
        while (len(got["PollG"]) < 20 or len(got["OtherG"]) < 20) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ch.close()
        return idle, sent, got

    idle, sent, got = asyncio.run(run())
    assert idle < 0.04, f"300 waiting long polls use {idle:.1%} more of a core while nothing happens"
    ids = [mid for _, mid in sent]
    for group in ("PollG", "OtherG"):
        received = {m.system_properties.message_id: t for t, m in got[group]}
        assert sorted(received) == sorted(ids), group
        lag = max(received[mid] - t for t, mid in sent)
        assert lag < 1.0, f"{group}: a waiting poll got a message {lag:.2f}s after it was stored"
    assert got["TagG"] == []


@pytest.mark.timeout(60)
def test_ack_entries_are_capped(stub):
    a = svc.AckMessageRequest()
    a.group.name, a.topic.name = "AbuseG", "Known"
    for i in range(1025):
        a.entries.add(message_id="X", receipt_handle=f"0_{i}_x")
    r = stub.AckMessage(a, metadata=md(), timeout=10)
    assert r.status.code == C.BAD_REQUEST and "1024" in r.status.message, r.status
    assert len(r.entries) == 0
    del a.entries[1024:]
    r = stub.AckMessage(a, metadata=md(), timeout=10)
    assert r.status.code == C.INVALID_RECEIPT_HANDLE and len(r.entries) == 1024


def test_pop_state_is_written_incrementally_and_spaced(tmp_path):
    """popState.json: unchanged queues are not encoded again, and big states are not rewritten every second."""
    from rocketstore.broker.broker import Broker
    from rocketstore.broker.config import BrokerConfig
    from rocketstore.storage.consumer_offsets import ConsumerOffsetManager
    from rocketstore.queues.pop import PopService, TagFilter
    from rocketstore.config import StoreConfig
    from rocketstore.format.message import Message
    from rocketstore.store import MessageStore

    store = MessageStore.open(str(tmp_path / "store"), StoreConfig(mappedFileSizeCommitLog=4 << 20,
                                                                    mappedFileSizeConsumeQueue=60000))
    try:
        for i in range(4000):
            assert store.put(Message(topic="T", body=b"x", queue_id=i % 2, properties={"UNIQ_KEY": f"U{i}"})).ok
        assert store.wait_dispatched(10)

        async def run():
            b = Broker(store, BrokerConfig(flushConsumerOffsetInterval=3_600_000))
            await b.start()
            pop = b.pop
            got = []
            while True:
                d, _ = pop.receive("G", "T", [0, 1], 32, 600_000, TagFilter("*"), fifo=False, max_attempts=17,
                                   client="c", auto_renew=False)
                if not d:
                    break
                got += d
            assert len(got) == 4000
            await b.persist()
            path = pop.path
            first = os.stat(path).st_ino
            texts = pop.snapshot() if pop.dirty else None
            assert texts is None  # nothing changed since the write
            q0 = next(d for d in got if d.queue_id == 0)
            assert pop.ack("G", "T", q0.handle)
            cached = {k: qs.text for k, qs in pop.queues.items()}
            assert cached[("G", "T", 0)] is None and cached[("G", "T", 1)] is not None
            await b.persist()  # right after a write: not written again yet
            assert os.stat(path).st_ino == first and pop.dirty
            await asyncio.sleep(max(0.0, b._pop_next_write - time.monotonic()) + 0.01)
            await b.persist()
            assert os.stat(path).st_ino != first and not pop.dirty
            assert pop.queues[("G", "T", 1)].text is cached[("G", "T", 1)], "an unchanged queue was encoded again"
            q1 = next(d for d in got if d.queue_id == 1)
            assert pop.ack("G", "T", q1.handle)
            await b.stop()  # the last state is written whatever the spacing
            return q0, q1

        q0, q1 = asyncio.run(run())
        again = PopService(store, ConsumerOffsetManager(store.paths.config), store.paths.config)
        assert len(again.queues[("G", "T", 0)].entries) == 1999 and q0.entry.offset not in \
            again.queues[("G", "T", 0)].entries
        assert len(again.queues[("G", "T", 1)].entries) == 1999
        assert again.ack("G", "T", PopService.handle_of(0, again.queues[("G", "T", 0)].entries[1]))
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_acl_turns_auto_creation_off_and_creation_is_rate_limited(tmp_path):
    import json
    from datetime import datetime, timezone

    from rocketstore.broker.acl import sign
    from rocketstore.broker.config import BrokerConfig

    assert BrokerConfig().auto_create_topics and not BrokerConfig(authorizationEnabled=True).auto_create_topics
    assert BrokerConfig(authorizationEnabled=True, autoCreateTopicEnable=True).auto_create_topics
    acl = {"users": [{"username": "mallory", "password": "msecret"}],
           "acls": [{"subject": "User:mallory", "policies": [
               {"resource": ["Topic:*", "Group:*"], "actions": ["Pub", "Sub"], "decision": "Allow"}]}]}
    (tmp_path / "acl.json").write_text(json.dumps(acl))

    def signed():
        dt = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return md("mallory@1@1@x") + [("x-mq-date-time", dt), (
            "authorization", f"MQv2-HMAC-SHA1 Credential=mallory, SignedHeaders=x-mq-date-time, "
                             f"Signature={sign('msecret', dt)}")]

    with BrokerProcess(str(tmp_path / "store"), args=["--acl", "--topic", "Known:1:NORMAL"],
                       conf={"authConfigPath": str(tmp_path / "acl.json"), "autoCreateRatePerSecond": 3}) as b:
        ch = grpc.insecure_channel(b.endpoint)
        s = svc_grpc.MessagingServiceStub(ch)
        q = svc.QueryRouteRequest()
        q.topic.name = "Known"
        assert s.QueryRoute(q, metadata=signed(), timeout=5).status.code == C.OK
        q.topic.name = "Invented"
        assert s.QueryRoute(q, metadata=signed(), timeout=5).status.code == C.TOPIC_NOT_FOUND
        r = send_req(topic="Invented")
        assert s.SendMessage(r, metadata=signed(), timeout=5).status.code == C.TOPIC_NOT_FOUND

        def new_group(name):
            req = svc.ReceiveMessageRequest()
            req.group.name, req.message_queue.topic.name, req.message_queue.id = name, "Known", -1
            req.filter_expression.expression, req.batch_size = "*", 1
            req.invisible_duration.seconds, req.long_polling_timeout.seconds = 10, 0
            return list(s.ReceiveMessage(req, metadata=signed(), timeout=10))[0].status.code

        codes = [new_group(f"Flood{i}") for i in range(12)]
        assert codes.count(C.MESSAGE_NOT_FOUND) in (3, 4) and codes.count(C.TOO_MANY_REQUESTS) >= 8, codes
        created = [f"Flood{i}" for i, c in enumerate(codes) if c == C.MESSAGE_NOT_FOUND]
        time.sleep(1.2)
        assert new_group("Later") == C.MESSAGE_NOT_FOUND
        assert new_group(created[0]) == C.MESSAGE_NOT_FOUND  # an existing group costs no token
        ch.close()
    groups = json.loads((tmp_path / "store" / "config" / "subscriptionGroup.json").read_text())
    assert sorted(groups["subscriptionGroupTable"]) == sorted(created + ["Later"])


def test_topic_creation_is_written_off_the_loop_in_batches(tmp_path):
    import json
    import threading

    from rocketstore.broker.topics import TopicManager

    tm = TopicManager(str(tmp_path), auto_create_topics=True, default_queues=2, auto_create_groups=True,
                      default_retry_max_times=16, create_rate=1000)
    threads = []
    real = tm._topic_writer._write

    def counting(doc):
        threads.append(threading.current_thread())
        real(doc)
    tm._topic_writer._write = counting

    async def run():
        loop_thread = threading.current_thread()
        made = await asyncio.gather(*(tm.ensure_topic(f"T{i}") for i in range(50)),
                                    *(tm.ensure_topic("T0") for _ in range(5)))
        return loop_thread, made

    loop_thread, made = asyncio.run(run())
    assert all(t is not None for t in made) and len({id(t) for t in made}) == 50
    assert 1 <= len(threads) <= 3, f"{len(threads)} writes for 50 creations"
    assert all(t is not loop_thread for t in threads)
    doc = json.loads((tmp_path / "topics.json").read_text())
    assert {f"T{i}" for i in range(50)} <= set(doc["topicConfigTable"])


def test_a_cancelled_request_does_not_undo_a_creation(tmp_path):
    import json

    from rocketstore.broker.topics import TopicManager

    tm = TopicManager(str(tmp_path), auto_create_topics=True, default_queues=2, auto_create_groups=True,
                      default_retry_max_times=16)

    async def run():
        first = asyncio.create_task(tm.ensure_topic("Gone"))
        await asyncio.sleep(0)  # it is now waiting for the write
        first.cancel()
        for _ in range(100):  # the write goes on
            await asyncio.sleep(0.01)
            if (tmp_path / "topics.json").exists():
                break
        await asyncio.sleep(0.05)
        on_disk = set(json.loads((tmp_path / "topics.json").read_text())["topicConfigTable"])
        assert "Gone" in on_disk and "Gone" in tm.topics, "the broker's table and topics.json disagree"
        again = await tm.ensure_topic("Gone")
        return again

    t = asyncio.run(run())
    assert t is not None and tm.topics["Gone"] is t


@pytest.mark.timeout(60)
def test_many_small_bombs_in_one_request_share_one_budget(stub):
    """A request may not inflate to more than it could carry plain (8 MiB here), however many messages it has."""
    bomb = zlib.compress(bytes(MAX))  # ~70 bytes each, MAX bytes inflated: allowed one by one
    req = svc.SendMessageRequest()
    for i in range(300):
        m = req.messages.add()
        m.topic.name, m.body = "Known", bomb
        m.system_properties.message_id = f"BOMB{i:04d}{uuid.uuid4().hex[:20]}"
        m.system_properties.body_encoding = pb.Encoding.GZIP
    r = stub.SendMessage(req, metadata=md(), timeout=30)
    codes = [e.status.code for e in r.entries]
    ok = codes.count(C.OK)
    assert ok == (8 << 20) // MAX, codes  # 128 of 64 KiB
    assert codes[ok:] == [C.MESSAGE_BODY_TOO_LARGE] * (300 - ok)
    assert r.status.code == C.MULTIPLE_RESULTS
    assert "in total" in r.entries[-1].status.message
    # refused bombs count too: the inflating was done
    req = svc.SendMessageRequest()
    for i in range(200):
        m = req.messages.add()
        m.topic.name, m.body = "Known", zlib.compress(bytes(MAX + 1))
        m.system_properties.message_id = f"OVER{i:04d}{uuid.uuid4().hex[:20]}"
        m.system_properties.body_encoding = pb.Encoding.GZIP
    last = req.messages.add()
    last.topic.name, last.body = "Known", zlib.compress(b"small and fine")
    last.system_properties.message_id = uuid.uuid4().hex.upper()
    last.system_properties.body_encoding = pb.Encoding.GZIP
    r = stub.SendMessage(req, metadata=md(), timeout=30)
    assert [e.status.code for e in r.entries] == [C.MESSAGE_BODY_TOO_LARGE] * 201
    assert "in total" in r.entries[-1].status.message


@pytest.mark.timeout(60)
def test_stored_compressed_bodies_go_out_as_stored(tmp_path):
    """A record RocketMQ stored compressed (sysFlag bit 0) is sent GZIP-encoded as the proxy does, never inflated
    by the broker: a stored bomb costs the broker nothing."""
    from rocketstore.format.message import Message
    from rocketstore.store import MessageStore

    bomb = zlib.compress(bytes(64 << 20), 9)  # zlib data, as RocketMQ's remoting clients compress
    small = zlib.compress(b"hello compressed")
    store = MessageStore.open(str(tmp_path / "store"))
    try:
        for body, flag in ((small, 0x1), (bomb, 0x1 | (0x3 << 8))):
            assert store.put(Message(topic="Old", body=body, queue_id=0, sys_flag=flag,
                                     properties={"UNIQ_KEY": uuid.uuid4().hex.upper()})).ok
        assert store.wait_dispatched(10)
    finally:
        store.close()
    with BrokerProcess(str(tmp_path / "store"), args=["--topic", "Old:1:NORMAL"]) as b:
        ch = grpc.insecure_channel(b.endpoint)
        s = svc_grpc.MessagingServiceStub(ch)
        before = peak_rss_kb(b.proc.pid)
        req = svc.ReceiveMessageRequest()
        req.group.name, req.message_queue.topic.name, req.message_queue.id = "OldG", "Old", -1
        req.filter_expression.expression, req.batch_size = "*", 8
        req.invisible_duration.seconds, req.long_polling_timeout.seconds = 30, 1
        got = [r.message for r in s.ReceiveMessage(req, metadata=md(), timeout=10) if r.HasField("message")]
        grown_mb = (peak_rss_kb(b.proc.pid) - before) / 1024
        ch.close()
    assert [m.body for m in got] == [small, bomb]
    assert all(m.system_properties.body_encoding == pb.Encoding.GZIP for m in got)
    assert all(m.system_properties.body_digest.checksum == hashlib.md5(m.body).hexdigest().upper() for m in got)
    assert zlib.decompress(got[0].body) == b"hello compressed"
    assert grown_mb < 32, f"peak RSS grew by {grown_mb:.0f} MB delivering a stored bomb"


def test_made_up_method_names_are_not_remembered(broker):
    from types import SimpleNamespace

    from rocketstore.broker import wire

    cap = wire._Capture()
    svc_grpc.add_MessagingServiceServicer_to_server(svc_grpc.MessagingServiceServicer(), cap)
    h = wire.LenientHandler(cap.handlers, {})
    for i in range(1000):
        assert h.service(SimpleNamespace(method=f"/apache.rocketmq.v2.MessagingService/X{i}",
                                         invocation_metadata=())) is None
    assert h.service(SimpleNamespace(method="/apache.rocketmq.v2.MessagingService/SendMessage",
                                     invocation_metadata=())) is not None
    assert len(h._cache) == 1
    ch = grpc.insecure_channel(broker.endpoint)
    call = ch.unary_unary("/apache.rocketmq.v2.MessagingService/Nope", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        call(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    ch.close()


@pytest.mark.timeout(60)
def test_waiting_receives_are_capped(tmp_path):
    with BrokerProcess(str(tmp_path / "store"), conf={"maxPopPollingSize": 5},
                       args=["--topic", "Quiet:1:NORMAL"]) as b:
        def req(poll):
            r = svc.ReceiveMessageRequest()
            r.group.name, r.message_queue.topic.name, r.message_queue.id = "CapG", "Quiet", -1
            r.filter_expression.expression, r.batch_size = "*", 1
            r.invisible_duration.seconds, r.long_polling_timeout.seconds = 10, poll
            return r

        async def run():
            ch = grpc.aio.insecure_channel(b.endpoint)
            stub = svc_grpc.MessagingServiceStub(ch)

            async def first_code(poll):
                async for r in stub.ReceiveMessage(req(poll), metadata=md(), timeout=10):
                    return r.status.code, time.monotonic()

            waiting = [asyncio.create_task(first_code(3)) for _ in range(5)]
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            code, at = await first_code(3)
            done = [await w for w in waiting]
            after, _ = await first_code(0)
            await ch.close()
            return code, at - t0, done, after

        code, took, done, after = asyncio.run(run())
    assert code == C.TOO_MANY_REQUESTS and took < 1.0, (code, took)
    assert [c for c, _ in done] == [C.MESSAGE_NOT_FOUND] * 5
    assert after == C.MESSAGE_NOT_FOUND
