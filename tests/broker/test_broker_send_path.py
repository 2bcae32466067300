"""The broker's send path without gRPC: where puts run, what a send is answered, how often headers are read;
and the bare reference server of the broker benchmark under the official client."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest

from rocketstore.broker.broker import Broker
from rocketstore.broker.config import BrokerConfig
from rocketstore.broker.proto import pb, svc
from rocketstore.broker.receipts import ReceiptSigner
from rocketstore.broker.service import MessagingService
from rocketstore.config import StoreConfig
from rocketstore.format.message import Message, PutMessageStatus
from rocketstore.store import MessageStore

SMALL = dict(mappedFileSizeCommitLog=1024 * 1024, mappedFileSizeConsumeQueue=6000, maxHashSlotNum=100,
             maxIndexNum=400)


class Context:
    """A gRPC servicer context with a client's headers; counts the passes over its metadata."""

    def __init__(self) -> None:
        self.reads = 0
        self.peers = 0

    def invocation_metadata(self):
        self.reads += 1
        return (("x-mq-client-id", "c1"), ("x-mq-language", "PYTHON"), ("x-mq-request-id", "r1"),
                ("x-mq-namespace", ""), ("x-mq-date-time", "20261125T000000Z"))

    def peer(self) -> str:
        self.peers += 1
        return "ipv4:127.0.0.1:5555"


def _send_request(n: int = 1) -> object:
    req = svc.SendMessageRequest()
    for i in range(n):
        m = req.messages.add()
        m.topic.name = "SendT"
        m.body = b"body-%d" % i
        sp = m.system_properties
        sp.message_id = uuid.uuid4().hex
        sp.tag = "t"
        sp.message_type = pb.MessageType.NORMAL
        sp.born_host = "10.1.2.3"
        sp.born_timestamp.seconds = int(time.time())
    return req


def _run(tmp_path, flush: str, scenario) -> object:
    store = MessageStore.open(str(tmp_path / "store"), StoreConfig(flushDiskType=flush, **SMALL))

    async def main():
        broker = Broker(store, BrokerConfig())
        await broker.start()
        try:
            service = MessagingService(broker, "127.0.0.1", 8081, receipts=ReceiptSigner(b"k" * 32))
            return await scenario(broker, service, store)
        finally:
            await broker.stop()

    try:
        return asyncio.run(main())
    finally:
        store.close()


def _record_put_threads(store) -> list[int]:
    threads: list[int] = []
    real = store.put

    def put(msg):
        threads.append(threading.get_ident())
        return real(msg)
    store.put = put
    return threads


def test_async_flush_put_runs_on_the_loop_and_answers_after_the_store(tmp_path):
    async def scenario(broker, service, store):
        threads = _record_put_threads(store)
        resp = await service.SendMessage(_send_request(3), Context())
        return threads, resp, threading.get_ident()

    threads, resp, loop_thread = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert threads == [loop_thread] * 3  # no hop to the store-put pool
    assert resp.status.code == pb.Code.OK
    assert [e.status.code for e in resp.entries] == [pb.Code.OK] * 3
    assert [e.offset for e in resp.entries] == [0, 0, 0]  # round robin over 8 queues: first of each


def test_sync_flush_put_stays_off_the_loop(tmp_path):
    async def scenario(broker, service, store):
        threads = _record_put_threads(store)
        resp = await service.SendMessage(_send_request(1), Context())
        return threads, resp, threading.get_ident()

    threads, resp, loop_thread = _run(tmp_path, "SYNC_FLUSH", scenario)
    assert resp.status.code == pb.Code.OK
    assert len(threads) == 1 and threads[0] != loop_thread  # it waits for fdatasync: not on the loop


def test_async_flush_sends_nobody_waits_for_are_dispatched_together_on_the_loop(tmp_path):
    """The consume queues are built after the sends are answered, on the loop (not by waking the store's dispatch
    thread, which then waits longer between rounds), and by one call for the sends of DISPATCH_LINGER seconds:
    sends in three loop iterations take one dispatch call (a call per loop iteration was about one per send)."""
    from helpers.workloads import put_units_threads
    from rocketstore.broker.broker import DISPATCH_LINGER

    async def scenario(broker, service, store):
        assert store.reput.assisted
        await service.SendMessage(_send_request(8), Context())  # one per queue: the dispatch thread makes them
        assert await asyncio.to_thread(store.wait_dispatched, 10)
        await asyncio.sleep(DISPATCH_LINGER * 2)  # (the dispatch call of those eight has run)
        calls: list[int] = []
        real = store.dispatch_ready

        def dispatch_ready():
            calls.append(threading.get_ident())
            return real()
        store.dispatch_ready = dispatch_ready
        with put_units_threads() as writers:
            resps = []
            for _ in range(3):
                resps.append(await service.SendMessage(_send_request(1), Context()))
                await asyncio.sleep(0)  # a loop iteration between the sends
            queued_before = sum(store.max_offset_in_queue("SendT", q) for q in range(8))
            await asyncio.sleep(DISPATCH_LINGER * 3)
            queued_after = sum(store.max_offset_in_queue("SendT", q) for q in range(8))
        return resps, queued_before, queued_after, calls, writers, threading.get_ident()

    resps, before, after, calls, writers, loop_thread = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert [r.status.code for r in resps] == [pb.Code.OK] * 3
    assert before == 8  # asynchronous: not in the queues when answered, nor one iteration later
    assert after == 11
    assert calls == [loop_thread]  # one dispatch call for the three sends
    assert writers == [loop_thread] * 3  # three queues


def _receive_request(poll_ms: int) -> object:
    req = svc.ReceiveMessageRequest()
    req.group.name = "g"
    req.message_queue.topic.name = "SendT"
    req.filter_expression.type = pb.FilterType.TAG
    req.filter_expression.expression = "*"
    req.batch_size = 32
    req.invisible_duration.seconds = 30
    req.long_polling_timeout.nanos = poll_ms * 1_000_000
    return req


class _ReceiveContext(Context):
    def time_remaining(self):
        return None


def test_a_receive_finds_the_sends_made_before_it_whose_dispatch_lingers(tmp_path):
    """A receive dispatches the pending sends before it looks: one that does not wait (long polling 0) finds a
    message sent just before it, though the dispatch of sends nobody waits for lingers."""
    async def scenario(broker, service, store):
        await service.SendMessage(_send_request(8), Context())
        assert await asyncio.to_thread(store.wait_dispatched, 10)
        first = [r async for r in service.ReceiveMessage(_receive_request(0), _ReceiveContext())]
        sent = await service.SendMessage(_send_request(1), Context())
        queued = sum(store.max_offset_in_queue("SendT", q) for q in range(8))
        second = [r async for r in service.ReceiveMessage(_receive_request(0), _ReceiveContext())]
        return first, sent, queued, second

    first, sent, queued, second = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert first[0].status.code == pb.Code.OK and len(first) == 8 + 2  # status, 8 messages, delivery time
    assert queued == 8  # the send's dispatch was pending when the receive began
    assert second[0].status.code == pb.Code.OK
    got = [r.message.system_properties.message_id for r in second[1:-1]]
    assert got == [sent.entries[0].message_id]


class _AnyTag:
    @staticmethod
    def match(tag):
        return True


def test_a_send_to_a_waited_for_topic_wakes_the_receive(tmp_path):
    """A receive waits for SendT: the send is dispatched in the next loop iteration (no linger) and the receive
    woken."""
    async def scenario(broker, service, store):
        await service.SendMessage(_send_request(8), Context())  # one per queue: the dispatch thread makes them
        assert await asyncio.to_thread(store.wait_dispatched, 10)
        waiting = asyncio.create_task(broker.longpoll.wait("SendT", "g", range(8), _AnyTag, 5.0))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        resp = await service.SendMessage(_send_request(1), Context())
        await asyncio.sleep(0)
        queued = sum(store.max_offset_in_queue("SendT", q) for q in range(8)) - 8
        woken = await waiting
        return resp, queued, woken, time.monotonic() - t0

    resp, queued, woken, took = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert resp.status.code == pb.Code.OK
    assert queued == 1  # dispatched in the send's own loop iteration
    assert woken and took < 1.0


def test_a_receive_that_starts_waiting_before_the_dispatch_is_woken_by_it(tmp_path):
    """A send nobody waited for is remembered until its dispatch: a receive that looked in between, found
    nothing and began to wait brings the dispatch forward and is woken by it, not left to its next look
    (LONG_POLL_RECHECK, 2 s)."""
    async def scenario(broker, service, store):
        await service.SendMessage(_send_request(8), Context())
        assert await asyncio.to_thread(store.wait_dispatched, 10)
        resp = await service.SendMessage(_send_request(1), Context())
        before = sum(store.max_offset_in_queue("SendT", q) for q in range(8)) - 8
        t0 = time.monotonic()
        woken = await broker.longpoll.wait("SendT", "g", range(8), _AnyTag, 5.0)
        return resp, before, woken, time.monotonic() - t0

    resp, before, woken, took = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert resp.status.code == pb.Code.OK
    assert before == 0  # not dispatched yet when the receive began to wait
    assert woken and took < 1.0


def test_sync_flush_dispatch_stays_with_the_dispatch_thread(tmp_path):
    async def scenario(broker, service, store):
        return store.reput.assisted

    assert _run(tmp_path, "SYNC_FLUSH", scenario) is False


def test_inline_put_failure_is_not_acknowledged(tmp_path):
    async def scenario(broker, service, store):
        store.running_flags.make_not_writeable("disk gone (test)")
        resp = await service.SendMessage(_send_request(1), Context())
        direct = await broker.put(Message(topic="SendT", body=b"x"))
        return resp, direct, store.commitlog.max_offset()

    resp, direct, end = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert direct.status is PutMessageStatus.SERVICE_NOT_AVAILABLE
    assert resp.entries[0].status.code == pb.Code.INTERNAL_SERVER_ERROR
    assert "disk gone" in resp.entries[0].status.message
    assert end == 0


def test_headers_are_read_once_per_send(tmp_path):
    async def scenario(broker, service, store):
        ctx = Context()
        resp = await service.SendMessage(_send_request(2), ctx)
        return ctx.reads, resp

    reads, resp = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert resp.status.code == pb.Code.OK
    assert reads == 1


@pytest.mark.timeout(120)
def test_bare_reference_server_serves_the_official_client(tmp_path):
    pytest.importorskip("rocketmq")
    from rocketstore.bench.broker_client import bench_client_throughput
    d = bench_client_throughput(str(tmp_path / "bare"), 40, producers=1, consumers=1, consumer_threads=1,
                                server="bare", timeout=90)
    assert d["server"] == "bare"
    assert d["produced"] == 40
    assert d["consumed"] >= 40  # and the producer's warm-up message
    assert d["produce_msgs_per_s"] > 0 and d["consume_msgs_per_s"] > 0
    assert d["produce_server_cpu_us_per_msg"] is not None
    assert os.path.exists(str(tmp_path / "bare" / "broker.log"))


def test_request_status_is_the_entries_own_or_multiple_results(tmp_path):
    """The request's status copies its entries' when they agree (code and text), else MULTIPLE_RESULTS."""
    async def scenario(broker, service, store):
        same = _send_request(2)
        for m in same.messages:
            m.body = b""
        mixed = _send_request(2)
        mixed.messages[1].body = b""
        return (await service.SendMessage(same, Context()), await service.SendMessage(mixed, Context()),
                await service.SendMessage(_send_request(3), Context()))

    same, mixed, ok = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert [e.status.code for e in same.entries] == [pb.Code.MESSAGE_BODY_EMPTY] * 2
    assert (same.status.code, same.status.message) == (same.entries[0].status.code, same.entries[0].status.message)
    assert same.status.message == "message body is empty"
    assert [e.status.code for e in mixed.entries] == [pb.Code.OK, pb.Code.MESSAGE_BODY_EMPTY]
    assert mixed.status.code == pb.Code.MULTIPLE_RESULTS
    assert (ok.status.code, ok.status.message) == (pb.Code.OK, "OK")


def test_control_character_check_is_the_regular_expressions():
    import random

    from rocketstore.broker.convert import _CONTROL, _has_control

    rng = random.Random(26)
    samples = ["", " ", "abc", "tab\there", "a\x00b", "\x7f", "x\x1fy", "caf\u00e9", "\u00e9\x01", "\x85",
               "\u2028", "\ud7ff"] + ["".join(chr(rng.randrange(0, 400)) for _ in range(rng.randrange(1, 8)))
                                      for _ in range(5000)]
    for s in samples:
        assert _has_control(s) == (_CONTROL.search(s) is not None), repr(s)


def test_born_host_is_the_same_cached_or_not():
    from rocketstore.broker import convert
    from rocketstore.broker.convert import host_from

    long_text = "10.1.2.3" + " " * 300
    cases = [("10.1.2.3", "ipv4:127.0.0.1:5555"), ("", "ipv4:10.0.0.9:77"), ("not a host", "ipv4:10.0.0.9:77"),
             ("::1", "ipv6:[::1]:9"), ("10.1.2.3:99", "ipv4:127.0.0.1:x"), ("", "unix:/tmp/s"),
             (long_text, "ipv4:10.0.0.9:77"), ("x" * 5000, "ipv4:10.0.0.9:77")]
    first = [host_from(t, p) for t, p in cases]
    assert first == [convert._host_from(t, p) for t, p in cases]
    assert first == [host_from(t, p) for t, p in cases]
    assert first[0] == (b"\x0a\x01\x02\x03", 5555) and first[1] == (b"\x0a\x00\x00\x09", 77)
    assert first[6] == (b"\x0a\x01\x02\x03", 77) and first[7] == (b"\x0a\x00\x00\x09", 77)


def test_long_born_host_texts_are_not_cached():
    """A client's made-up kilobytes of born host are answered but not kept (1,024 of them would be megabytes)."""
    from rocketstore.broker import convert

    convert._cached_host_from.cache_clear()
    convert._packed_ip.cache_clear()
    for i in range(50):
        convert.host_from(f"{i}" + "y" * 10_000, "ipv4:10.0.0.9:77")
    assert convert._cached_host_from.cache_info().currsize == 0
    assert convert._packed_ip.cache_info().currsize == 0
    convert.host_from("10.1.2.3", "ipv4:10.0.0.9:77")
    assert convert._cached_host_from.cache_info().currsize == 1


def _serve_in_process(tmp_path, calls):
    """Run ``rocketstore serve`` on this loop (topic SendT, 8 queues) and ``calls(stub)`` against it."""
    from rocketstore.broker.server import ServeOptions, serve_async
    from rocketstore.broker.topics import TopicConfig

    grpc = pytest.importorskip("grpc")
    from rocketstore.broker.proto import svc_grpc

    async def main():
        ready, stop, port = asyncio.Event(), asyncio.Event(), []

        def up(host, p):
            port.append(p)
            ready.set()

        opts = ServeOptions(store=str(tmp_path / "store"), port=0, store_config=StoreConfig(**SMALL),
                            topics=(TopicConfig("SendT", 8, 8),))
        server = asyncio.create_task(serve_async(opts, ready=up, stop_event=stop))
        await asyncio.wait((server, asyncio.create_task(ready.wait())), return_when=asyncio.FIRST_COMPLETED)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port[0]}") as ch:
                return await calls(svc_grpc.MessagingServiceStub(ch))
        finally:
            stop.set()
            await server

    return asyncio.run(main())


def test_a_metered_send_reads_its_request_without_an_async_generator(tmp_path):
    """Admission reads a unary call's one request with ``context.read()``: iterating gRPC's request stream
    started an async generator per call, left unfinished after the one message, whose finalizer then
    scheduled a task through the loop's self-pipe (a write, a wake-up and a task per send)."""
    import sys

    started: list[str] = []

    async def calls(stub):
        hooks = sys.get_asyncgen_hooks()

        def firstiter(agen):
            started.append(getattr(agen, "__qualname__", "") or getattr(agen, "__name__", ""))
            if hooks.firstiter is not None:
                hooks.firstiter(agen)

        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=hooks.finalizer)
        try:
            meta = (("x-mq-client-id", "c1"), ("x-mq-date-time", "20261125T000000Z"))
            return [await stub.SendMessage(_send_request(1), metadata=meta, timeout=10) for _ in range(20)]
        finally:
            sys.set_asyncgen_hooks(*hooks)

    resps = _serve_in_process(tmp_path, calls)
    assert [r.status.code for r in resps] == [pb.Code.OK] * 20
    assert [r.entries[0].offset for r in resps][:9] == [0] * 8 + [1]  # stored, round robin over 8 queues
    assert not [n for n in started if "receiver" in n.lower()], started


def test_the_metadata_of_the_handler_lookup_reaches_the_handler(tmp_path, monkeypatch):
    """gRPC builds a call's metadata for its handler lookup; admission hands that tuple to the handler, which
    does not build it again (``context.invocation_metadata()``: a named tuple per header, ~17 us a call)."""
    from rocketstore.broker import calls

    seen: list[bool] = []
    real = calls.call_metadata

    def call_metadata(context):
        seen.append(calls._handed.context is context)
        return real(context)
    monkeypatch.setattr(calls, "call_metadata", call_metadata)

    async def run(stub):
        meta = (("x-mq-client-id", "c1"), ("x-mq-date-time", "20261125T000000Z"))
        return [await stub.SendMessage(_send_request(1), metadata=meta, timeout=10) for _ in range(5)]

    resps = _serve_in_process(tmp_path, run)
    assert [r.status.code for r in resps] == [pb.Code.OK] * 5
    assert seen == [True] * 5


def test_handed_metadata_serves_only_its_own_call():
    from rocketstore.broker import calls

    class Ctx:
        def __init__(self, md):
            self.md = md

        def invocation_metadata(self):
            return self.md

    a = Ctx((("x-mq-client-id", "own-a"),))
    b = Ctx((("x-mq-client-id", "own-b"),))
    calls.hand_metadata(a, (("x-mq-client-id", "handed-a"), ("x-mq-client-id", "second")))
    assert calls.caller_headers(b)["x-mq-client-id"] == "own-b"  # another call: its own metadata
    assert calls.caller_headers(a)["x-mq-client-id"] == "handed-a"  # the first of a name wins
    assert calls.caller_headers(a)["x-mq-client-id"] == "own-a"  # taken once
    calls.hand_metadata(a, None)
    assert calls.caller_headers(a)["x-mq-client-id"] == "own-a"


def test_validate_reads_the_stored_properties_in_their_written_order():
    """validate checks an entry and reads what is stored of it in one pass: the properties come in the order
    the record holds them (user properties, TAGS, KEYS, UNIQ_KEY, __SHARDINGKEY, TIMER_DELIVER_MS,
    TRACE_CONTEXT; a transaction's TRAN_MSG, PGROUP, CHECK_IMMUNITY_TIME_IN_SECONDS)."""
    from rocketstore.broker.convert import BadMessage, validate

    m = pb.Message()
    m.topic.name = "T"
    m.body = b"x"
    m.user_properties["b"] = "2"
    m.user_properties["a"] = "1"
    sp = m.system_properties
    sp.message_id = "id-1"
    sp.tag = "tg"
    sp.keys.extend(["k1", "k2"])
    sp.message_group = "g"
    sp.trace_context = "tc"
    sp.born_timestamp.seconds, sp.born_timestamp.nanos = 1700000000, 5_000_000
    mtype, body, props, born, deliver = validate(m, sp, "id-1", 1024)
    assert (mtype, body, born, deliver) == (pb.MessageType.FIFO, b"x", 1700000000005, 0)  # the group implies FIFO
    assert list(props.items()) == [*dict(m.user_properties).items(), ("TAGS", "tg"), ("KEYS", "k1 k2"),
                                   ("UNIQ_KEY", "id-1"), ("__SHARDINGKEY", "g"), ("TRACE_CONTEXT", "tc")]

    d = pb.Message()
    d.topic.name = "T"
    d.body = b"y"
    d.system_properties.delivery_timestamp.seconds = 1800000000
    mtype, _, props, born, deliver = validate(d, d.system_properties, "id-2", 1024)
    assert (mtype, born, deliver) == (pb.MessageType.DELAY, 0, 1800000000000)
    assert props == {"UNIQ_KEY": "id-2", "TIMER_DELIVER_MS": "1800000000000"}

    t = pb.Message()
    t.topic.name = "T"
    t.body = b"z"
    t.system_properties.message_type = pb.MessageType.TRANSACTION
    t.system_properties.orphaned_transaction_recovery_duration.seconds = 0
    mtype, _, props, _, _ = validate(t, t.system_properties, "id-3", 1024)
    assert list(props.items()) == [("UNIQ_KEY", "id-3"), ("TRAN_MSG", "true"), ("PGROUP", "T"),
                                   ("CHECK_IMMUNITY_TIME_IN_SECONDS", "1")]
    t.system_properties.message_group = "g"
    with pytest.raises(BadMessage) as e:
        validate(t, t.system_properties, "id-3", 1024)
    assert e.value.code == pb.Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE


def test_a_decoded_request_knows_its_frame_size_once():
    """Admission keeps a send's frame size reserved while it is handled: the lenient decoder remembers the size
    of the frame it decoded last, for that request only (``ByteSize()`` walked the message, ~1 us a send)."""
    from rocketstore.broker import wire

    decode = wire.lenient("SendMessage", svc.SendMessageRequest.FromString, 1 << 20)
    data, data2 = _send_request(2).SerializeToString(), _send_request(1).SerializeToString()
    req = decode(data)
    other = decode(data2)
    assert wire.frame_size(req) is None  # not the request decoded last
    assert wire.frame_size(other) == len(data2)
    req = decode(data)
    assert wire.frame_size(req) == len(data)
    assert wire.frame_size(req) is None  # taken once
    assert isinstance(decode(b"\xff\xff"), wire.Undecodable) and wire.frame_size(req) is None


def _coroutines_entered(fn) -> list[str]:
    """The coroutine functions entered while ``fn()`` runs (sys.setprofile sees each start or resume)."""
    import inspect
    import sys
    entered: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_flags & inspect.CO_COROUTINE:
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


def test_a_plain_send_to_a_known_topic_enters_no_coroutine_below_the_handler(tmp_path):
    """Every coroutine entered is a frame built and torn down on the path of each send: the steps that may wait
    (topic creation, the store lookup of an earlier send, transactions, delays, the pool put) are entered only
    when needed.  (Old code: eight per send, the handler's wrapper, SendMessage, _send_one, _send_target,
    _topic_for, _already_stored, _route, Broker.put.)"""
    async def scenario(broker, service, store):
        first = await service.SendMessage(_send_request(1), Context())  # creates the topic
        req = _send_request(1)
        out = []
        coro = service.SendMessage(req, Context())

        def step():
            try:
                coro.send(None)
            except StopIteration as e:
                out.append(e.value)
        entered = _coroutines_entered(step)
        return first, out, entered, store.max_phy_offset()

    first, out, entered, end = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert first.status.code == pb.Code.OK
    assert len(out) == 1 and out[0].status.code == pb.Code.OK  # answered without suspending
    assert out[0].entries[0].offset == 0 and end > 0  # stored (queue 1 of 8: its first offset)
    assert entered == ["inner", "SendMessage", "_send_one"], entered  # the guard's, the handler, the message


def test_a_reused_message_id_with_another_body_is_stored_and_a_resend_is_not(tmp_path):
    """The resend check compares bodies by digest: the same id with another body is a new message (stored,
    never dropped); the same id and body as the send before is answered with that send's result."""
    async def scenario(broker, service, store):
        a = _send_request(1)
        b = svc.SendMessageRequest()
        b.CopyFrom(a)
        b.messages[0].body = b"another body"
        out = []
        for r in (a, b, b):
            resp = await service.SendMessage(r, Context())
            out.append((resp.status.code, resp.entries[0].offset, store.commitlog.max_offset()))
        return out

    (ca, oa, end_a), (cb, ob, end_b), (cb2, ob2, end_b2) = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert ca == cb == cb2 == pb.Code.OK
    assert 0 < end_a < end_b == end_b2  # a and b stored, the resend of b wrote nothing
    assert ob2 == ob  # ... and is answered with b's offset


def test_the_resend_digest_is_keyed_unless_the_hash_seed_is_fixed():
    """Python's hash of a body is a keyed SipHash only while its key is random; with PYTHONHASHSEED set anybody
    can compute it, so the resend check falls back to BLAKE2b (a collision would answer a new message as a
    resend of another: an acknowledged message not stored)."""
    import subprocess
    import sys
    code = "from rocketstore.broker import dedup; print(dedup.digest.__name__, dedup.digest(b'x') == dedup.digest(b'x'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = {}
    for seed in (None, "random", "0", "7"):
        e = dict(env) if seed is None else dict(env, PYTHONHASHSEED=seed)
        out[seed] = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                   check=True).stdout.split()
    assert out[None] == out["random"] == ["_keyed_digest", "True"]
    assert out["0"] == out["7"] == ["_fixed_digest", "True"]


def test_the_peer_admission_read_reaches_the_handler(tmp_path):
    """Admission reads the call's peer for its byte caps; the handler takes that string instead of asking gRPC's
    core for another copy, and the same caller's next send is found by its raw header values and peer."""
    from rocketstore.broker import calls

    async def scenario(broker, service, store):
        out = []
        for _ in range(2):
            ctx = Context()
            calls.hand_metadata(ctx, ctx.invocation_metadata(), "ipv4:127.0.0.1:5555")
            ctx.reads = 0
            resp = await service.SendMessage(_send_request(1), ctx)
            out.append((resp.status.code, ctx.peers, ctx.reads))
        ctx = Context()  # nothing handed over: the context's own
        resp = await service.SendMessage(_send_request(1), ctx)
        out.append((resp.status.code, ctx.peers, ctx.reads))
        return out, len(service._callers)

    out, callers = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert out == [(pb.Code.OK, 0, 0), (pb.Code.OK, 0, 0), (pb.Code.OK, 1, 1)]
    assert callers == 1


def test_a_caller_with_an_illegal_namespace_is_refused_every_time(tmp_path):
    """Callers are kept by their raw header values: only legal ones, so a bad namespace is refused each time."""
    class BadNs(Context):
        def invocation_metadata(self):
            return (("x-mq-client-id", "c1"), ("x-mq-namespace", "bad ns!"))

    async def scenario(broker, service, store):
        return [(await service.SendMessage(_send_request(1), BadNs())).status.code for _ in range(2)], \
            len(service._callers)

    codes, callers = _run(tmp_path, "ASYNC_FLUSH", scenario)
    assert codes == [pb.Code.BAD_REQUEST] * 2 and callers == 0
