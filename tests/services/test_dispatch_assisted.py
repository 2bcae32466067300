"""Issue 18 item 4: the dispatch of handed-over puts in the putting thread (ReputMessageService.dispatch_ready).

The broker calls it on its event loop after its puts; whatever is not quick (a new queue or file, records to
decode from the log, a busy index lock) stays with the service thread.  The files must be those the service
writes, and nothing may be dispatched twice or skipped.
"""

from __future__ import annotations

import random
import shutil
import threading
import time

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.services import dispatch
from helpers.workloads import mixed_puts, put_units_threads


def _service_paused(store: MessageStore) -> None:
    """Make the service thread's rounds do nothing (only dispatch_ready dispatches from here on)."""
    store.reput.run_once = lambda: None


def _service_resumed(store: MessageStore) -> None:
    del store.reput.run_once


def test_dispatch_ready_dispatches_in_the_calling_thread(tmp_path):
    with MessageStore.open(str(tmp_path / "s")) as store:
        store.reput.assisted = True
        assert store.put(Message("T", b"first", queue_id=0)).ok
        assert store.wait_dispatched(10)  # the service makes the queue and the index file
        _service_paused(store)
        with put_units_threads() as writers:
            results = [store.put(Message("T", b"m%d" % i, queue_id=0, keys=f"k{i}")) for i in range(5)]
            assert store.get("T", 0, 1, 8).messages == []  # not dispatched yet: the put does not dispatch
            assert store.reput.dispatch_ready() is True
        assert writers == [threading.get_ident()]  # one write for the five units, in this thread
        assert store.reput.reput_from_offset == store.commitlog.max_offset()
        assert [m.body for m in store.get("T", 0, 1, 8).messages] == [b"m%d" % i for i in range(5)]
        assert store.query("T", "k4").phy_offsets == [results[4].commit_log_offset]
        assert store.reput.dispatch_ready() is False  # nothing left
        _service_resumed(store)


def test_dispatch_ready_leaves_new_queues_and_full_files_to_the_service(tmp_path):
    cfg = StoreConfig(mappedFileSizeConsumeQueue=60, maxHashSlotNum=16, maxIndexNum=4)  # 3 units, 3 keys a file
    with MessageStore.open(str(tmp_path / "s"), cfg) as store:
        store.reput.assisted = True
        assert store.put(Message("T", b"a", queue_id=0, keys="k0")).ok
        assert store.wait_dispatched(10)
        _service_paused(store)
        start = store.reput.reput_from_offset
        assert store.put(Message("T", b"b", queue_id=1)).ok  # a queue with no file yet
        assert store.reput.dispatch_ready() is False
        assert store.reput.reput_from_offset == start and ("T", 1) not in store._cq_table
        _service_resumed(store)
        assert store.wait_dispatched(10)
        assert store.get("T", 1, 0, 1).messages[0].body == b"b"

        _service_paused(store)  # queue 0's file has room for two more units: the third needs a new file
        results = [store.put(Message("T", b"c%d" % i, queue_id=0)) for i in range(4)]
        assert store.reput.dispatch_ready() is True
        assert store.max_offset_in_queue("T", 0) == 3
        assert store.reput.reput_from_offset == results[2].commit_log_offset
        _service_resumed(store)
        assert store.wait_dispatched(10)
        assert store.max_offset_in_queue("T", 0) == 5
        got = store.get("T", 0, 0, 8).messages + store.get("T", 0, 3, 8).messages  # (one file per get)
        assert [m.body for m in got] == [b"a"] + [b"c%d" % i for i in range(4)]

        _service_paused(store)  # the index file has room for two more keys: the third needs a new file
        results = [store.put(Message("T", b"d%d" % i, queue_id=q, keys=f"d{i}")) for i, q in enumerate((1, 1, 0))]
        assert store.reput.dispatch_ready() is True
        assert store.max_offset_in_queue("T", 1) == 3 and store.max_offset_in_queue("T", 0) == 5
        assert store.reput.reput_from_offset == results[2].commit_log_offset
        assert len(store.index_service.files) == 1
        _service_resumed(store)
        assert store.wait_dispatched(10)
        assert store.max_offset_in_queue("T", 0) == 6
        assert len(store.index_service.files) == 2
        assert all(store.query("T", f"d{i}").phy_offsets == [r.commit_log_offset] for i, r in enumerate(results))
        assert store.query("T", "k0").messages[0].body == b"a"


def test_dispatch_ready_never_waits_for_the_index_lock(tmp_path):
    with MessageStore.open(str(tmp_path / "s")) as store:
        store.reput.assisted = True
        assert store.put(Message("T", b"a", keys="k")).ok
        assert store.wait_dispatched(10)
        held, release = threading.Event(), threading.Event()

        def hold():
            with store.index_service.lock:  # as a flush of the index files does
                held.set()
                release.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(5)
            assert store.put(Message("T", b"b", keys="k2")).ok
            t0 = time.monotonic()
            assert store.reput.dispatch_ready() is False
            assert time.monotonic() - t0 < 0.5
        finally:
            release.set()
            t.join()
        assert store.wait_dispatched(10)  # the service, woken, did it
        assert store.query("T", "k2").messages[0].body == b"b"


def test_assisted_dispatch_writes_what_a_rebuild_from_the_commitlog_writes(tmp_path):
    """Puts of three queues and two topics (batches, keys, tags) with dispatch_ready after most of them and the
    service running meanwhile: the consume queues are byte for byte those recovery rebuilds, every key is found."""
    cfg = StoreConfig(mappedFileSizeCommitLog=256 * 1024, mappedFileSizeConsumeQueue=200, maxIndexNum=120)
    rnd = random.Random(11)
    path = tmp_path / "s"
    with MessageStore.open(str(path), cfg) as store:
        store.reput.assisted = True

        def maybe_dispatch() -> None:
            if rnd.random() < 0.8:
                store.reput.dispatch_ready()
        keyed = mixed_puts(store, rnd, after_each=maybe_dispatch)
        assert store.wait_dispatched(10)
        assert store.reput.reput_from_offset == store.commitlog.max_offset()
        for topic, i, off in keyed:
            assert store.query(topic, f"k{i}").phy_offsets == [off]
            assert store.query(topic, f"j{i}").phy_offsets == [off]
    live = {p.relative_to(path): p.read_bytes() for p in sorted((path / "consumequeue").rglob("*")) if p.is_file()}
    assert len(live) > 60
    shutil.rmtree(path / "consumequeue")
    (path / "abort").write_bytes(b"")  # recovery rebuilds the queues from the commitlog
    with MessageStore.open(str(path), cfg) as store:
        assert store.wait_dispatched(10)
    rebuilt = {p.relative_to(path): p.read_bytes() for p in sorted((path / "consumequeue").rglob("*")) if p.is_file()}
    assert rebuilt == live


def test_an_assisted_service_waits_longer_between_rounds_but_wakes_for_what_is_left(tmp_path, monkeypatch):
    """With an assistant the service no longer wakes every millisecond; records the assistant cannot take (a
    put not handed over: the delay topic's, a verbatim properties string) are dispatched all the same."""
    with MessageStore.open(str(tmp_path / "s")) as store:
        store.reput.assisted = True
        rounds = []
        real = store.reput._run_round

        def counted():
            rounds.append(time.monotonic())
            real()
        store.reput._run_round = counted
        time.sleep(0.5)
        assert len(rounds) <= 0.5 / dispatch.ASSISTED_INTERVAL + 3  # not ~500
        monkeypatch.setattr(dispatch, "ASSISTED_INTERVAL", 60.0)
        time.sleep(0.1)  # the round under way ends; the next waits a minute unless woken
        m = Message("T", b"v")
        m.properties_string = "TAGS\x01a\x02KEYS\x01vk\x02"
        r = store.put(m)
        assert r.ok
        assert store.reput.dispatch_ready() is False  # the record must be decoded from the log: wakes the service
        deadline = time.monotonic() + 10
        while store.reput.reput_from_offset < store.commitlog.max_offset() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.reput.reput_from_offset == store.commitlog.max_offset()  # long before the next round
        assert store.query("T", "vk").phy_offsets == [r.commit_log_offset]


def test_dispatch_ready_without_an_index(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), StoreConfig(messageIndexEnable=False)) as store:
        store.reput.assisted = True
        assert store.put(Message("T", b"a", queue_id=0, keys="k")).ok
        assert store.wait_dispatched(10)
        _service_paused(store)
        assert store.put(Message("T", b"b", queue_id=0, keys="k2")).ok
        assert store.reput.dispatch_ready() is True
        assert [m.body for m in store.get("T", 0, 0, 8).messages] == [b"a", b"b"]
        assert not store.index_service.files
        _service_resumed(store)


def test_hand_over_is_bounded_and_the_rest_is_decoded_from_the_log(tmp_path, monkeypatch):
    """While the dispatcher is stalled, at most HAND_OVER_LIMIT puts wait in memory; the later ones are
    dispatched from the log once it resumes, each exactly once, keys and tags included."""
    import rocketstore.services.group_commit
    monkeypatch.setattr(rocketstore.services.group_commit, "HAND_OVER_LIMIT", 50)  # read by the group commit
    with MessageStore.open(str(tmp_path / "s")) as store:
        assert store.put(Message("T", b"first", queue_id=0)).ok
        assert store.wait_dispatched(10)
        _service_paused(store)
        results = [store.put(Message("T", b"m%d" % i, queue_id=i % 2, tags=f"t{i % 3}", keys=f"k{i}"))
                   for i in range(300)]
        assert all(r.ok for r in results)
        assert len(store.reput.handed_over) == 50
        _service_resumed(store)
        store.reput.wakeup()
        assert store.wait_dispatched(10)
        for q in range(2):
            got, offset = [], 0
            while offset < store.max_offset_in_queue("T", q):
                r = store.get("T", q, offset)
                got += [m.body for m in r.messages]
                offset = r.next_begin_offset
            assert got == ([b"first"] if q == 0 else []) + [b"m%d" % i for i in range(q, 300, 2)]
        assert [m.body for m in store.get("T", 1, 0, 32, tag_filter="t1").messages] == \
            [b"m%d" % i for i in range(1, 300, 2) if i % 3 == 1][:32]
        for i in (0, 49, 50, 51, 299):
            assert store.query("T", f"k{i}").phy_offsets == [results[i].commit_log_offset]


def test_interleaved_queues_get_one_write_each_per_round(tmp_path):
    """Issue 29: sixteen producers on sixteen queues interleave their puts; a round writes each queue's units
    with one put_units, in commitlog order within the queue, whatever the order across queues."""
    with MessageStore.open(str(tmp_path / "s")) as store:
        for q in range(4):
            assert store.put(Message("T", b"first", queue_id=q)).ok
        assert store.wait_dispatched(10)  # every queue has its file
        _service_paused(store)
        with put_units_threads() as writers:
            results = [store.put(Message("T", b"q%d-%d" % (i % 4, i // 4), queue_id=i % 4, tags=f"t{i % 4}"))
                       for i in range(20)]
            _service_resumed(store)
            assert store.wait_dispatched(10)
        assert len(writers) == 4  # one write per queue: before, twenty (each put broke the previous run)
        for q in range(4):
            got = store.get("T", q, 1, 8).messages
            assert [m.body for m in got] == [b"q%d-%d" % (q, n) for n in range(5)]
            assert [m.queue_offset for m in got] == [1, 2, 3, 4, 5]
            assert [m.commit_log_offset for m in got] == [r.commit_log_offset for r in results[q::4]]
            assert store.get("T", q, 1, 8, tag_filter=f"t{q}").messages == got


def test_a_periodic_round_leaves_young_handed_over_puts_to_the_assistant(tmp_path):
    """While assisted, a service round that was not woken takes no handed-over put younger than
    ASSISTED_INTERVAL (the assistant dispatches it within that time; taking it meant a GIL fight and the same
    work in another thread); a woken round, and a periodic round for an older put, take them as before."""
    with MessageStore.open(str(tmp_path / "s")) as store:
        reput = store.reput
        reput.assisted = True
        assert store.put(Message("T", b"first", queue_id=0)).ok
        assert store.wait_dispatched(10)
        _service_paused(store)
        start = reput.reput_from_offset
        assert store.put(Message("T", b"young", queue_id=0)).ok
        reput._periodic = True
        type(reput).run_once(reput)
        assert reput.reput_from_offset == start  # left to the assistant
        reput._periodic = False
        type(reput).run_once(reput)  # a woken round (the assistant left it, or someone waits)
        assert reput.reput_from_offset == store.commitlog.max_offset()

        assert store.put(Message("T", b"old", queue_id=0)).ok
        real = store.files.clock
        store.files.clock = lambda: real() + 2 * dispatch.ASSISTED_INTERVAL
        reput._periodic = True
        type(reput).run_once(reput)  # nobody dispatched it within ASSISTED_INTERVAL: taken
        assert reput.reput_from_offset == store.commitlog.max_offset()
        store.files.clock = real
        assert [m.body for m in store.get("T", 0, 0, 8).messages] == [b"first", b"young", b"old"]
        _service_resumed(store)
