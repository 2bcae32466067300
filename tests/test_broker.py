"""End to end: the official rocketmq-python-client (5.1.x) against ``rocketstore serve``, both in subprocesses.

One broker serves most tests (each test uses its own topics and groups);
tests that restart or kill the broker start their own.  Everything is on
127.0.0.1, every client script runs under a hard timeout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("rocketmq")

from rocketstore.broker.harness import BrokerProcess, collect, run_client, start_client  # noqa: E402

FAST_CONF = {
    "transactionTimeOut": 1500,
    "transactionCheckInterval": 1000,
    "messageDelayLevel": "1s 1s 2s",
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
                            "--group", "DlqG:retryMaxTimes=1", "--topic", "Normal1:4:NORMAL"])
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
    prod = start_client(shared.endpoint, f'''
        p = Producer(cfg(), ("Groups1",)); p.startup()
        ids = [p.send(msg("Groups1", f"m{{i}}")).message_id for i in range({n})]
        emit({{"ids": ids}})
        p.shutdown()
    ''', home)
    ids = collect(prod, 60)[0][0]["ids"]
    consumer = '''
        import sys
        group, quiet = sys.argv[1], float(sys.argv[2])
        c = SimpleConsumer(cfg(), group, {"Groups1": FilterExpression()}, await_duration=1); c.startup()
        seen = []; last = time.time()
        while time.time() - last < quiet:
            ms = c.receive(8, 20)
            for m in ms:
                c.ack(m); seen.append(m.message_id)
            if ms: last = time.time()
        emit({"seen": seen}); c.shutdown()
    '''
    procs = [start_client(shared.endpoint, consumer, home, args=["GroupsX", 3]),
             start_client(shared.endpoint, consumer, home, args=["GroupsY", 3]),
             start_client(shared.endpoint, consumer, home, args=["GroupsY", 3])]
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
