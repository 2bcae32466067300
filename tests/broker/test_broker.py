"""End to end: the official rocketmq-python-client (5.1.x) against ``rocketstore serve``, both in subprocesses.

One broker serves most tests (each test uses its own topics and groups);
tests that restart or kill the broker start their own.  Everything is on
127.0.0.1, every client script runs under a hard timeout.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:  # not imported here: the client writes to ~/logs on import
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.bench.broker_harness import BrokerProcess, collect, run_client, start_client  # noqa: E402

FAST_CONF = {
    "transactionTimeOut": 1500,
    "transactionCheckInterval": 1000,
    "messageDelayLevel": "1s 2s 3s",
    "longPollingTimeout": 3000,
    "flushConsumerOffsetInterval": 200,
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("broker")
    (root / "home").mkdir()
    b = BrokerProcess(str(root / "store"), conf=FAST_CONF,
                      args=["--topic", "Fifo1:4:FIFO", "--group", "FifoG:orderly=true",
                            "--topic", "Txn1:4:TRANSACTION", "--topic", "Delay1:4:DELAY",
                            "--group", "DlqG:retryMaxTimes=1", "--topic", "Normal1:4:NORMAL",
                            "--topic", "FifoP:2:FIFO", "--group", "FifoPG:orderly=true,retryMaxTimes=1"])
    b.start()
    b.home = str(root / "home")
    yield b
    rc = b.stop()
    assert rc == 0, b.tail_log()


def client(b, body, timeout=60, **kw):
    try:
        return run_client(b.endpoint, body, b.home, timeout=timeout, **kw)
    except RuntimeError as e:
        raise AssertionError(f"{e}\n--- broker log ---\n{b.tail_log()}") from None


@pytest.mark.timeout(120)
def test_send_receive_change_ack(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Basic1",)); p.startup()
        r = p.send(msg("Basic1", "hello", tag="tagA", keys=["k1", "k2"], props={"a": "b"}))
        f = p.send_async(msg("Basic1", "async", tag="tagA"))
        r2 = f.result(timeout=10)
        emit({"sent": r.message_id, "offset": r.offset, "async": r2.message_id})
        c = SimpleConsumer(cfg(), "Basic1G", {"Basic1": FilterExpression("tagA")}, await_duration=2); c.startup()
        got = []
        deadline = time.time() + 20
        while len(got) < 2 and time.time() < deadline:
            got += c.receive(16, 15)
        emit({"got": [info(m) for m in got]})
        m = [x for x in got if x.message_id == r.message_id][0]
        old = m.receipt_handle
        c.change_invisible_duration(m, 20)
        emit({"changed": m.receipt_handle != old and bool(m.receipt_handle)})
        try:
            m2 = msg("Basic1", "x"); m2.message_id = m.message_id; m2.topic = "Basic1"
            m.receipt_handle, new = old, m.receipt_handle
            c.ack(m)
            emit({"stale_ack": "accepted"})
        except Exception as e:
            emit({"stale_ack": type(e).__name__, "code": getattr(e, "code", None)})
        m.receipt_handle = new
        for x in got:
            c.ack(x)
        t = time.time(); rest = c.receive(16, 15)
        emit({"after_ack": len(rest), "waited": time.time() - t})
        p.shutdown(); c.shutdown()
    ''')
    sent, got, changed, stale, after = out
    assert len(sent["sent"]) == 34
    assert sent["offset"] >= 0
    byid = {m["id"]: m for m in got["got"]}
    assert set(byid) == {sent["sent"], sent["async"]}
    first = byid[sent["sent"]]
    assert first["body"] == "hello" and first["tag"] == "tagA" and first["keys"] == ["k1", "k2"]
    assert first["props"] == {"a": "b"} and first["attempt"] == 1 and first["topic"] == "Basic1"
    assert changed["changed"] is True
    assert stale["stale_ack"] == "BadRequestException" and stale["code"] == 40013
    assert after["after_ack"] == 0 and 1.5 < after["waited"] < 6


@pytest.mark.timeout(120)
def test_unacked_message_returns_after_invisible_time(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Redeliver1",)); p.startup()
        r = p.send(msg("Redeliver1", "again"))
        c = SimpleConsumer(cfg(), "Redeliver1G", {"Redeliver1": FilterExpression()}, await_duration=2); c.startup()
        first = []
        while not first: first = c.receive(1, 2)
        t0 = time.time()
        early = c.receive(1, 2) if False else []
        second = []
        while not second and time.time() - t0 < 15: second = c.receive(1, 2)
        emit({"first": info(first[0]), "second": info(second[0]), "gap": time.time() - t0,
              "same_handle": first[0].receipt_handle == second[0].receipt_handle})
        c.ack(second[0])
        p.shutdown(); c.shutdown()
    ''')
    (res,) = out
    assert res["first"]["id"] == res["second"]["id"]
    assert res["first"]["attempt"] == 1 and res["second"]["attempt"] == 2
    assert res["same_handle"] is False
    assert 1.0 <= res["gap"] < 6


@pytest.mark.timeout(120)
def test_tag_filters(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Filter1",)); p.startup()
        ids = {}
        for tag in ("TagA", "TagB", "TagC", None):
            ids[str(tag)] = p.send(msg("Filter1", f"body-{tag}", tag=tag)).message_id
        emit(ids)
        def drain(group, expr):
            c = SimpleConsumer(cfg(), group, {"Filter1": FilterExpression(expr)}, await_duration=1); c.startup()
            seen = []
            for _ in range(4):
                ms = c.receive(16, 10)
                for m in ms: c.ack(m); seen.append(m.tag)
            c.shutdown()
            return sorted(str(t) for t in seen)
        emit({"a_or_b": drain("FilterAB", "TagA || TagB"), "star": drain("FilterStar", "*"),
              "only_c": drain("FilterC", "TagC")})
        p.shutdown()
    ''', timeout=90)
    _, res = out
    assert res["a_or_b"] == ["TagA", "TagB"]
    assert res["star"] == ["None", "TagA", "TagB", "TagC"]
    assert res["only_c"] == ["TagC"]


@pytest.mark.timeout(120)
def test_two_groups_and_shared_group_without_duplicates(shared):
    n = 60
    home = shared.home
    consumer = '''
        import sys
        group, quiet = sys.argv[1], float(sys.argv[2])
        c = SimpleConsumer(cfg(), group, {"Groups1": FilterExpression()}, await_duration=1); c.startup()
        emit({"ready": True})
        seen = []; last = None; t0 = time.time()
        while time.time() - t0 < 40 and (last is None or time.time() - last < quiet):
            ms = c.receive(4, 20)
            for m in ms:
                time.sleep(0.02)  # some work per message
                c.ack(m); seen.append(m.message_id)
            if ms: last = time.time()
        emit({"seen": seen}); c.shutdown()
    '''
    procs = [start_client(shared.endpoint, consumer, home, args=["GroupsX", 3]),
             start_client(shared.endpoint, consumer, home, args=["GroupsY", 3]),
             start_client(shared.endpoint, consumer, home, args=["GroupsY", 3])]
    for p in procs:  # every consumer is up before the first message is sent
        assert p.stdout.readline().strip() == b'{"ready": true}'
    prod = start_client(shared.endpoint, f'''
        p = Producer(cfg(), ("Groups1",)); p.startup()
        ids = [p.send(msg("Groups1", f"m{{i}}")).message_id for i in range({n})]
        emit({{"ids": ids}})
        p.shutdown()
    ''', home)
    ids = collect(prod, 60)[0][0]["ids"]
    results = [collect(p, 90)[0][0]["seen"] for p in procs]
    x, y1, y2 = results
    assert sorted(x) == sorted(ids)
    assert len(y1) + len(y2) == n, "members of one group got duplicates or lost messages"
    assert sorted(y1 + y2) == sorted(ids)
    assert y1 and y2, "both members should get a share"


@pytest.mark.timeout(180)
def test_restart_keeps_offsets_and_inflight(tmp_path):
    (tmp_path / "home").mkdir()
    store = str(tmp_path / "store")
    b = BrokerProcess(store, conf=FAST_CONF).start()
    b.home = str(tmp_path / "home")
    try:
        out = client(b, '''
            p = Producer(cfg(), ("Restart1",)); p.startup()
            ids = [p.send(msg("Restart1", f"r{i}")).message_id for i in range(6)]
            c = SimpleConsumer(cfg(), "Restart1G", {"Restart1": FilterExpression()}, await_duration=1); c.startup()
            got = []
            for _ in range(10):
                got += c.receive(16, 10)
                if len(got) >= 6: break
            acked = [m.message_id for m in got[:4]]
            for m in got[:4]: c.ack(m)
            emit({"ids": ids, "acked": acked, "held": [m.message_id for m in got[4:]],
                  "handle": got[4].receipt_handle})
            p.shutdown(); c.shutdown()
        ''')
        state = out[0]
        assert len(state["acked"]) == 4 and len(state["held"]) == 2
        assert b.stop() == 0
        offsets = json.loads((Path(store) / "config" / "consumerOffset.json").read_text())
        table = offsets["offsetTable"]
        assert "Restart1@Restart1G" in table, (offsets, state, b.tail_log())
        assert sum(table["Restart1@Restart1G"].values()) >= 4
        assert (Path(store) / "config" / "topics.json").exists()
        assert not (Path(store) / "abort").exists(), "clean shutdown removes the abort file"
        b.start()
        out = client(b, f'''
            c = SimpleConsumer(cfg(), "Restart1G", {{"Restart1": FilterExpression()}}, await_duration=1); c.startup()
            early = c.receive(16, 10)  # the two held messages are still invisible (10 s): nothing yet
            # a receipt handle from before the restart still acks
            route = c._retrieve_topic_route_data("Restart1")
            m = Message(); m.topic = "Restart1"; m.message_id = {state["held"][0]!r}
            m.receipt_handle = {state["handle"]!r}; m.endpoints = route.message_queues[0].endpoints
            c.ack(m)
            emit({{"early": [x.message_id for x in early]}})
            c.shutdown()
        ''')
        assert out[0]["early"] == []
        # SIGKILL (after the state flush interval): the other held message comes back after its
        # invisible time, the acked ones never
        time.sleep(1.0)
        b.kill()
        b.start()
        out = client(b, '''
            c = SimpleConsumer(cfg(), "Restart1G", {"Restart1": FilterExpression()}, await_duration=1); c.startup()
            got = []
            t0 = time.time()
            while time.time() - t0 < 45 and not got:
                got = c.receive(16, 5)
            emit({"got": [info(x) for x in got]})
            for x in got: c.ack(x)
            c.shutdown()
        ''', timeout=90)
        got = out[0]["got"]
        assert [g["id"] for g in got] == [state["held"][1]]
        assert got[0]["attempt"] == 2
    finally:
        b.stop()


@pytest.mark.timeout(120)
def test_fifo_order_and_withholding(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Fifo1",)); p.startup()
        for i in range(5):
            for g in ("g1", "g2", "g3"):
                p.send(msg("Fifo1", f"{g}-{i}", group=g))
        c = SimpleConsumer(cfg(), "FifoG", {"Fifo1": FilterExpression()}, await_duration=1); c.startup()
        first = []
        for _ in range(5):
            first += c.receive(32, 20)
            if len(first) >= 3: break
        emit({"first": [m.body.decode() for m in first]})
        held = [m for m in first if m.message_group == "g1"]
        for m in first:
            if m.message_group != "g1": c.ack(m)
        second = []
        for _ in range(5):
            second += c.receive(32, 20)
            if len(second) >= 2: break
        emit({"second": [m.body.decode() for m in second]})
        for m in held + second: c.ack(m)
        order = [m.body.decode() for m in first + second]
        idle = 0
        while idle < 3:
            ms = c.receive(32, 20)
            idle = 0 if ms else idle + 1
            for m in ms:
                order.append(m.body.decode()); c.ack(m)
        emit({"order": order})
        p.shutdown(); c.shutdown()
    ''', timeout=90)
    first, second, order = (o[k] for o, k in zip(out, ("first", "second", "order")))
    assert sorted(first) == ["g1-0", "g2-0", "g3-0"], "only the head of each message group is in flight"
    assert sorted(second) == ["g2-1", "g3-1"], "g1-1 waits until g1-0 is acked"
    for g in ("g1", "g2", "g3"):
        seq = [int(b.split("-")[1]) for b in order if b.startswith(g)]
        assert seq == list(range(5)), f"{g} out of order: {seq}"


@pytest.mark.timeout(120)
def test_delay_messages(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Delay1",)); p.startup()
        at = int(time.time()) + 3
        r = p.send(msg("Delay1", "later", deliver_at=at))
        now_msg = p.send(msg("Delay1", "past", deliver_at=int(time.time()) - 5))
        c = SimpleConsumer(cfg(), "Delay1G", {"Delay1": FilterExpression()}, await_duration=1); c.startup()
        seen = {}
        t0 = time.time()
        while len(seen) < 2 and time.time() - t0 < 20:
            for m in c.receive(16, 10):
                seen[m.body.decode()] = {"at": time.time(), "deliver_at": m.delivery_timestamp}
                c.ack(m)
        emit({"at": at, "seen": seen})
        p.shutdown(); c.shutdown()
    ''')
    (res,) = out
    seen = res["seen"]
    assert set(seen) == {"later", "past"}
    assert seen["later"]["at"] >= res["at"] - 0.05, "delivered before its time"
    assert seen["later"]["at"] < res["at"] + 6
    assert seen["later"]["deliver_at"] == res["at"] * 1000


@pytest.mark.timeout(120)
def test_transactions_commit_rollback_and_check(shared):
    out = client(shared, '''
        checks = []
        class Checker(TransactionChecker):
            def check(self, message):
                checks.append(message.body.decode())
                return TransactionResolution.COMMIT if message.body == b"t3" else TransactionResolution.ROLLBACK
        p = Producer(cfg(), ("Txn1",), checker=Checker()); p.startup()
        c = SimpleConsumer(cfg(), "Txn1G", {"Txn1": FilterExpression()}, await_duration=1); c.startup()
        ids = {}
        for body in ("t1", "t2", "t3", "t4"):
            tx = p.begin_transaction()
            r = p.send(msg("Txn1", body), tx)
            ids[body] = r.message_id
            if body == "t1": tx.commit()
            if body == "t2": tx.rollback()
        emit({"ids": ids})
        early = [m.body.decode() for m in c.receive(16, 10)]
        for m in []: pass
        seen = list(early)
        t0 = time.time()
        while time.time() - t0 < 8 and ("t3" not in seen or time.time() - t0 < 4):
            ms = c.receive(16, 10)
            seen += [m.body.decode() for m in ms]
            for m in ms: c.ack(m)
        emit({"early": early, "seen": seen, "checks": checks})
        p.shutdown(); c.shutdown()
    ''', timeout=90)
    ids, res = out[0]["ids"], out[1]
    assert len(set(ids.values())) == 4
    assert res["early"] == ["t1"], "only the committed message is visible at once"
    assert sorted(res["seen"]) == ["t1", "t3"]
    assert "t3" in res["checks"] and "t4" in res["checks"]
    assert "t1" not in res["checks"] and "t2" not in res["checks"]


@pytest.mark.timeout(120)
def test_retries_then_dead_letter_queue(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Dlq1",)); p.startup()
        r = p.send(msg("Dlq1", "poison", tag="bad"))
        c = SimpleConsumer(cfg(), "DlqG", {"Dlq1": FilterExpression()}, await_duration=1); c.startup()
        attempts = []
        t0 = time.time()
        while time.time() - t0 < 10:
            for m in c.receive(16, 1):
                attempts.append(m.delivery_attempt)   # never acked
        d = SimpleConsumer(cfg(), "DlqReader", {"%DLQ%DlqG": FilterExpression()}, await_duration=1); d.startup()
        dead = []
        t0 = time.time()
        while not dead and time.time() - t0 < 10:
            dead = d.receive(16, 10)
        for m in dead: d.ack(m)
        emit({"id": r.message_id, "attempts": attempts, "dead": [info(m) for m in dead]})
        p.shutdown(); c.shutdown(); d.shutdown()
    ''', timeout=90)
    (res,) = out
    assert res["attempts"] == [1, 2], "retryMaxTimes=1: two deliveries, then the DLQ"
    assert len(res["dead"]) == 1
    dead = res["dead"][0]
    assert dead["id"] == res["id"] and dead["body"] == "poison" and dead["tag"] == "bad"
    assert dead["topic"] == "%DLQ%DlqG"


@pytest.mark.timeout(120)
def test_push_consumer_nack_backoff_and_ack(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("Push1",)); p.startup()
        ids = [p.send(msg("Push1", f"p{i}")).message_id for i in range(5)]
        seen = {}
        lock = threading.Lock()
        class L(MessageListener):
            def consume(self, m):
                with lock:
                    seen.setdefault(m.body.decode(), []).append((time.time(), m.delivery_attempt))
                    n = len(seen[m.body.decode()])
                if m.body == b"p0" and n < 3:
                    return ConsumeResult.FAILURE
                return ConsumeResult.SUCCESS
        c = PushConsumer(cfg(), "Push1G", L(), {"Push1": FilterExpression()}); c.startup()
        t0 = time.time()
        while time.time() - t0 < 30:
            with lock:
                if len(seen) == 5 and len(seen["p0"]) >= 3: break
            time.sleep(0.2)
        time.sleep(1.5)
        emit({"seen": seen})
        c.shutdown(); p.shutdown()
    ''', timeout=90)
    seen = out[0]["seen"]
    assert sorted(seen) == [f"p{i}" for i in range(5)]
    for k, v in seen.items():
        if k != "p0":
            assert [a for _, a in v] == [1], f"{k} delivered {v}"
    p0 = seen["p0"]
    assert [a for _, a in p0] == [1, 2, 3]
    gaps = [p0[1][0] - p0[0][0], p0[2][0] - p0[1][0]]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, f"NACK delays should grow (1 s, 2 s): {gaps}"


@pytest.mark.timeout(120)
def test_fifo_push_consumer_order_and_forward_to_dlq(shared):
    out = client(shared, '''
        p = Producer(cfg(), ("FifoP",)); p.startup()
        for i in range(5):
            for g in ("g1", "g2"):
                p.send(msg("FifoP", f"{g}-{i}", group=g))
        seen = []
        lock = threading.Lock()
        class L(MessageListener):
            def consume(self, m):
                with lock: seen.append(m.body.decode())
                return ConsumeResult.FAILURE if m.body == b"g1-1" else ConsumeResult.SUCCESS
        c = PushConsumer(cfg(), "FifoPG", L(), {"FifoP": FilterExpression()}); c.startup()
        t0 = time.time()
        while time.time() - t0 < 30:
            with lock:
                if "g1-4" in seen and "g2-4" in seen: break
            time.sleep(0.2)
        d = SimpleConsumer(cfg(), "FifoPDlqReader", {"%DLQ%FifoPG": FilterExpression()}, await_duration=1)
        d.startup()
        dead = []
        t0 = time.time()
        while not dead and time.time() - t0 < 10:
            dead = d.receive(16, 10)
        for m in dead: d.ack(m)
        emit({"seen": seen, "fifo": c.fifo, "dead": [m.body.decode() for m in dead]})
        c.shutdown(); d.shutdown(); p.shutdown()
    ''', timeout=90)
    res = out[0]
    assert res["fifo"] is True
    seen = res["seen"]
    for g in ("g1", "g2"):
        seq = [b for b in seen if b.startswith(g)]
        firsts = list(dict.fromkeys(seq))
        assert firsts == [f"{g}-{i}" for i in range(5)], seq
    assert seen.count("g1-1") == 2, "two local attempts (retryMaxTimes=1), then the DLQ"
    assert res["dead"] == ["g1-1"]
