"""Bad input over raw gRPC: the right RocketMQ status codes, and the broker keeps serving."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
import uuid

import pytest

grpc = pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.bench.broker_harness import BrokerProcess  # noqa: E402
# The client's generated modules, loaded without the client itself (no ~/logs side effect).
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402

C = pb.Code
MAX = 65536


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("badinput")
    b = BrokerProcess(str(root / "store"), conf={"maxMessageSize": MAX, "longPollingTimeout": 3000},
                      args=["--no-auto-create-topics", "--topic", "Known:2:NORMAL", "--topic", "Ordered:2:FIFO",
                            "--topic", "Txn:1:TRANSACTION", "--topic", "Later:1:DELAY"])
    b.start()
    yield b
    assert b.stop() == 0, b.tail_log()


@pytest.fixture(scope="module")
def stub(broker):
    ch = grpc.insecure_channel(broker.endpoint, options=[("grpc.max_send_message_length", -1)])
    yield svc_grpc.MessagingServiceStub(ch)
    ch.close()


def md(client_id: str | None = "test@1@1@x"):
    out = [("x-mq-language", "PYTHON"), ("x-mq-protocol", "GRPC_V2")]
    if client_id:
        out.append(("x-mq-client-id", client_id))
    return out


def send_req(topic="Known", body=b"x", **sp):
    req = svc.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = topic
    m.body = body
    m.system_properties.message_id = sp.pop("message_id", uuid.uuid4().hex.upper()[:34])
    m.system_properties.body_encoding = pb.Encoding.IDENTITY
    props = sp.pop("props", {})
    for k, v in props.items():
        m.user_properties[k] = v
    for k, v in sp.items():
        if k == "delivery_ms":
            m.system_properties.delivery_timestamp.seconds = v // 1000
        else:
            setattr(m.system_properties, k, v)
    return req


def receive(stub, topic="Known", group="BadG", timeout=8, **kw):
    req = svc.ReceiveMessageRequest()
    req.group.name = group
    req.message_queue.topic.name = topic
    req.message_queue.id = -1
    req.filter_expression.type = kw.pop("ftype", pb.FilterType.TAG)
    req.filter_expression.expression = kw.pop("expr", "*")
    req.batch_size = kw.pop("batch", 16)
    req.invisible_duration.seconds = kw.pop("invisible", 10)
    req.long_polling_timeout.seconds = kw.pop("poll", 1)
    return list(stub.ReceiveMessage(req, metadata=md(kw.pop("client_id", "test@1@1@x")), timeout=timeout))


def assert_alive(stub):
    r = stub.SendMessage(send_req(body=b"still here"), metadata=md(), timeout=5)
    assert r.status.code == C.OK, r.status


@pytest.mark.timeout(60)
def test_send_validation_codes(stub):
    cases = [
        (send_req(body=b"x" * (MAX + 1)), C.MESSAGE_BODY_TOO_LARGE),
        (send_req(body=b""), C.MESSAGE_BODY_EMPTY),
        (send_req(topic="Nope"), C.TOPIC_NOT_FOUND),
        (send_req(topic="bad topic!"), C.ILLEGAL_TOPIC),
        (send_req(topic="RMQ_SYS_TRANS_HALF_TOPIC"), C.ILLEGAL_TOPIC),
        (send_req(message_id=""), C.ILLEGAL_MESSAGE_ID),
        (send_req(tag="a|b"), C.ILLEGAL_MESSAGE_TAG),
        (send_req(tag=" "), C.ILLEGAL_MESSAGE_TAG),
        (send_req(props={"KEYS": "x"}), C.ILLEGAL_MESSAGE_PROPERTY_KEY),
        (send_req(props={"UNIQ_KEY": "x"}), C.ILLEGAL_MESSAGE_PROPERTY_KEY),
        (send_req(props={"k": "a\x00b"}), C.ILLEGAL_MESSAGE_PROPERTY_KEY),  # the store refuses a zero byte
        (send_req(message_group="g", message_type=pb.MessageType.FIFO), C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (send_req(topic="Ordered", message_type=pb.MessageType.NORMAL), C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (send_req(topic="Ordered", message_type=pb.MessageType.FIFO), C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (send_req(message_type=pb.MessageType.PRIORITY), C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (svc.SendMessageRequest(), C.BAD_REQUEST),
    ]
    for req, code in cases:
        r = stub.SendMessage(req, metadata=md(), timeout=5)
        assert r.status.code == code, (req, r.status)
        assert not req.messages or r.entries[0].status.code == code
    r = stub.SendMessage(send_req(), metadata=md(None), timeout=5)
    assert r.status.code == C.CLIENT_ID_REQUIRED
    far = int(time.time() * 1000) + 2 * 86400 * 1000
    r = stub.SendMessage(send_req(topic="Later", delivery_ms=far, message_type=pb.MessageType.DELAY),
                         metadata=md(), timeout=5)
    assert r.status.code == C.ILLEGAL_DELIVERY_TIME
    r = stub.SendMessage(send_req(topic="Later", message_type=pb.MessageType.DELAY), metadata=md(), timeout=5)
    assert r.status.code == C.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a DELAY message needs its timestamp"
    r = stub.SendMessage(send_req(topic="Ordered", message_group="g", message_type=pb.MessageType.FIFO,
                                  body=b"ok"), metadata=md(), timeout=5)
    assert r.status.code == C.OK and r.entries[0].message_id
    assert_alive(stub)


@pytest.mark.timeout(60)
def test_route_and_consumer_codes(stub):
    q = svc.QueryRouteRequest()
    q.topic.name = "Unknown"
    assert stub.QueryRoute(q, metadata=md(), timeout=5).status.code == C.TOPIC_NOT_FOUND
    q.topic.name = "Known"
    r = stub.QueryRoute(q, metadata=md(), timeout=5)
    assert r.status.code == C.OK and len(r.message_queues) == 2
    assert all(mq.broker.endpoints.addresses[0].host == "127.0.0.1" for mq in r.message_queues)
    assert list(r.message_queues[0].accept_message_types) == [pb.MessageType.NORMAL]

    assert receive(stub, topic="Unknown")[0].status.code == C.TOPIC_NOT_FOUND
    assert receive(stub, group="bad group")[0].status.code == C.ILLEGAL_CONSUMER_GROUP
    assert receive(stub, ftype=pb.FilterType.SQL, expr="a > 1")[0].status.code == C.ILLEGAL_FILTER_EXPRESSION
    assert receive(stub, invisible=0)[0].status.code == C.ILLEGAL_INVISIBLE_TIME
    assert receive(stub, batch=0)[0].status.code == C.BAD_REQUEST
    assert receive(stub, client_id=None)[0].status.code == C.CLIENT_ID_REQUIRED

    for handle in ("garbage", "1_2_3", "", "0_0_deadbeef", "9" * 500):
        a = svc.AckMessageRequest()
        a.group.name, a.topic.name = "BadG", "Known"
        e = a.entries.add()
        e.message_id, e.receipt_handle = "X", handle
        r = stub.AckMessage(a, metadata=md(), timeout=5)
        assert r.status.code == C.INVALID_RECEIPT_HANDLE, handle
        c = svc.ChangeInvisibleDurationRequest()
        c.group.name, c.topic.name, c.receipt_handle, c.message_id = "BadG", "Known", handle, "X"
        c.invisible_duration.seconds = 5
        r = stub.ChangeInvisibleDuration(c, metadata=md(), timeout=5)
        assert r.status.code == C.INVALID_RECEIPT_HANDLE
        assert r.receipt_handle == handle, "the client keeps the handle we answer"
        f = svc.ForwardMessageToDeadLetterQueueRequest()
        f.group.name, f.topic.name, f.receipt_handle, f.message_id = "BadG", "Known", handle, "X"
        assert stub.ForwardMessageToDeadLetterQueue(f, metadata=md(), timeout=5).status.code == \
            C.INVALID_RECEIPT_HANDLE

    for txid in ("", "   ", "zz", "00" * 16):
        t = svc.EndTransactionRequest()
        t.topic.name, t.message_id, t.transaction_id = "Txn", "X", txid
        t.resolution = pb.TransactionResolution.COMMIT
        assert stub.EndTransaction(t, metadata=md(), timeout=5).status.code == C.INVALID_TRANSACTION_ID
    assert_alive(stub)


@pytest.mark.timeout(60)
def test_receive_ack_over_raw_grpc_and_late_ack(stub):
    sent = stub.SendMessage(send_req(topic="Known", body=b"raw", tag="T"), metadata=md(), timeout=5)
    assert sent.status.code == C.OK
    # A new group starts at the queues' beginning: messages earlier tests sent to Known come first, and a batch
    # may end before "raw" (which queue it went to varies). Ack those and receive again until it arrives.
    m = None
    for _ in range(10):
        rs = receive(stub, group="RawG", invisible=2)
        got = [r.message for r in rs if r.HasField("message")]
        for x in got:
            if m is None and x.body == b"raw":
                m = x
                continue
            a = svc.AckMessageRequest()
            a.group.name, a.topic.name = "RawG", "Known"
            a.entries.add(message_id=x.system_properties.message_id, receipt_handle=x.system_properties.receipt_handle)
            stub.AckMessage(a, metadata=md(), timeout=5)
        if m is not None:
            break
    assert m is not None, "the message sent was not received"
    assert rs[0].status.code == C.OK and rs[-1].HasField("delivery_timestamp")
    sp = m.system_properties
    assert sp.body_encoding == pb.Encoding.IDENTITY and sp.delivery_attempt == 1 and sp.receipt_handle
    assert sp.body_digest.type == pb.DigestType.MD5 and sp.tag == "T"
    time.sleep(2.5)  # expired but not redelivered yet: a late ack is still accepted
    a = svc.AckMessageRequest()
    a.group.name, a.topic.name = "RawG", "Known"
    a.entries.add(message_id=sp.message_id, receipt_handle=sp.receipt_handle)
    assert stub.AckMessage(a, metadata=md(), timeout=5).status.code == C.OK
    assert stub.AckMessage(a, metadata=md(), timeout=5).status.code == C.INVALID_RECEIPT_HANDLE


@pytest.mark.timeout(60)
def test_malformed_requests_and_disconnects(broker, stub):
    ch = grpc.insecure_channel(broker.endpoint)
    for method, resp_type in (("SendMessage", svc.SendMessageResponse), ("AckMessage", svc.AckMessageResponse),
                              ("QueryRoute", svc.QueryRouteResponse)):
        raw = ch.unary_unary(f"/apache.rocketmq.v2.MessagingService/{method}",
                             request_serializer=lambda b: b, response_deserializer=resp_type.FromString)
        assert raw(b"\xff\xff\xff\xff\x0f garbage", metadata=md(), timeout=5).status.code == C.BAD_REQUEST
    stream = ch.unary_stream("/apache.rocketmq.v2.MessagingService/ReceiveMessage",
                             request_serializer=lambda b: b,
                             response_deserializer=svc.ReceiveMessageResponse.FromString)
    assert list(stream(b"\x0a\xff\xff", metadata=md(), timeout=5))[0].status.code == C.BAD_REQUEST
    ch.close()

    # a client that gives up in the middle of a long poll
    req = svc.ReceiveMessageRequest()
    req.group.name, req.message_queue.topic.name, req.message_queue.id = "DropG", "Known", -1
    req.batch_size, req.filter_expression.expression = 1, "*"
    req.invisible_duration.seconds, req.long_polling_timeout.seconds = 10, 3
    for _ in range(3):
        call = stub.ReceiveMessage(req, metadata=md(), timeout=10)
        threading.Timer(0.3, call.cancel).start()
        try:
            list(call)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED
    # a Telemetry stream dropped without a word, and a TCP peer that speaks no HTTP/2
    tel = stub.Telemetry(iter([]), metadata=md(), timeout=2)
    try:
        list(tel)
    except grpc.RpcError:
        pass
    host, port = broker.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 100)
        time.sleep(0.2)
    assert_alive(stub)
    # everything DropG's cancelled polls took is still deliverable at once
    sent = stub.SendMessage(send_req(topic="Known", body=b"after"), metadata=md(), timeout=5)
    assert sent.status.code == C.OK
    bodies = []
    t0 = time.time()
    while b"after" not in bodies and time.time() - t0 < 10:
        rs = list(stub.ReceiveMessage(req, metadata=md(), timeout=10))
        bodies += [r.message.body for r in rs if r.HasField("message")]
    assert b"after" in bodies


@pytest.mark.timeout(60)
def test_telemetry_settings_reply(stub):
    cmd = svc.TelemetryCommand()
    s = cmd.settings
    s.client_type = pb.ClientType.PUSH_CONSUMER
    s.subscription.group.name = "TelG"
    e = s.subscription.subscriptions.add()
    e.topic.name, e.expression.type, e.expression.expression = "Ordered", pb.FilterType.TAG, "*"
    p = svc.TelemetryCommand()
    p.settings.client_type = pb.ClientType.PRODUCER
    p.settings.publishing.topics.add().name = "Known"
    empty = svc.TelemetryCommand()
    empty.settings.client_type = pb.ClientType.PRODUCER

    def commands():
        yield cmd
        yield p
        yield empty
        time.sleep(1.0)

    replies = []
    call = stub.Telemetry(commands(), metadata=md("tel@1@1@x"), timeout=5)
    for r in call:
        replies.append(r)
        if len(replies) == 3:
            call.cancel()
            break
    push, prod, bad = replies
    assert push.status.code == C.OK
    assert push.settings.subscription.fifo is True, "a group first seen on a FIFO topic is orderly"
    assert push.settings.subscription.long_polling_timeout.seconds == 3
    assert push.settings.backoff_policy.max_attempts == 17
    assert len(push.settings.backoff_policy.customized_backoff.next) == 18
    assert prod.status.code == C.OK and prod.settings.publishing.max_body_size == MAX
    assert prod.settings.backoff_policy.WhichOneof("strategy") == "exponential_backoff"
    assert bad.status.code == C.BAD_REQUEST
