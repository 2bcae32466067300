"""Issue 17 (10): a read-only view follows a writer (tail_view.extend_view) without ever skipping a message:
a half-written consume-queue unit or record waits for the next look instead of being read wrong."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore
from rocketstore.config import golden_config
from rocketstore.consumer import Consumer
from rocketstore.tail_view import extend_view


def _patch(path: Path, pos: int, data: bytes) -> bytes:
    """Overwrite bytes through the file (the writer's shared mapping sees them); return what was there."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, len(data), pos)
        os.pwrite(fd, data, pos)
    finally:
        os.close(fd)
    return old


def test_view_grows_over_new_segments_queues_and_consume_queue_files(tmp_path):
    root = str(tmp_path / "s")
    with MessageStore.open(root, golden_config()) as w:
        w.put(Message("T", b"first"))
        w.wait_dispatched()
        with MessageStore.open(root, read_only=True) as r:
            assert extend_view(r) is False  # nothing new
            for i in range(350):  # past a 300-unit consume-queue file, into a new queue too
                assert w.put(Message("T", bytes(4000) + b"%d" % i, queue_id=0 if i < 340 else 1)).ok
            w.wait_dispatched()
            assert len(os.listdir(os.path.join(root, "commitlog"))) >= 2
            assert r.max_offset_in_queue("T", 0) == 1
            assert extend_view(r) is True
            assert r.state()["queues"] == w.state()["queues"]
            assert r.max_phy_offset() == w.max_phy_offset()
            got = []
            while (res := r.get("T", 0, len(got), 64)).messages:
                got += res.messages
            assert [m.body for m in got] == [b"first"] + [bytes(4000) + b"%d" % i for i in range(340)]


def test_half_written_unit_or_record_is_not_taken_and_nothing_is_skipped(tmp_path):
    root = str(tmp_path / "s")
    with MessageStore.open(root, golden_config()) as w:
        for i in range(2):
            w.put(Message("T", b"m%d" % i, tags="TagA"))
        w.wait_dispatched()
        with MessageStore.open(root, read_only=True) as r:
            c = Consumer(r, "G", "T", tag_filter="TagA", poll_interval=0.01)
            assert [m.body for m in c.poll(0)] == [b"m0", b"m1"]
            res = w.put(Message("T", b"m2", tags="TagA"))
            w.wait_dispatched()
            cq = Path(root, "consumequeue", "T", "0", "0" * 20)
            # the unit's tagsCode not yet copied (a torn read): the filter would wrongly drop m2
            saved = _patch(cq, 2 * 20 + 12, bytes(8))
            assert c.poll(0.05) == [] and c.position() == {0: 2}  # waits, does not skip
            _patch(cq, 2 * 20 + 12, saved)
            assert [m.body for m in c.poll(1)] == [b"m2"]
            # a record whose body is still being copied fails its CRC: not in the view yet
            res = w.put(Message("T", b"m3", tags="TagA"))
            w.wait_dispatched()
            seg = Path(root, "commitlog", "0" * 20)
            body_at = res.commit_log_offset + res.wrote_bytes - 2 - len("TAGS\x01TagA\x02") - 1 - 1 - 2  # "m3"
            saved = _patch(seg, body_at, b"M")
            assert saved == b"m"
            assert c.poll(0.05) == [] and extend_view(r) is False
            _patch(seg, body_at, saved)
            assert [m.body for m in c.poll(1)] == [b"m3"]


def test_extend_view_refuses_a_writable_store(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as w:
        with pytest.raises(ValueError, match="read-only"):
            extend_view(w)


def test_a_record_finished_between_two_looks_is_not_reported_as_damage(tmp_path, monkeypatch, caplog):
    """The view's first look at a record the writer is still copying can see its TOTALSIZE but not yet its magic
    ("bad magic code 0x00000000"); the view stops there, and a later look, or a search for the next trusted record
    that finds that very record whole, takes it: the writer was only mid-copy, no damage is logged or remembered."""
    import logging

    from rocketstore import tail_view
    from rocketstore.format import codec

    root = str(tmp_path / "s")
    with MessageStore.open(root, golden_config()) as w:
        w.put(Message("T", b"m0"))
        w.wait_dispatched()
        with MessageStore.open(root, read_only=True) as r:
            res = w.put(Message("T", b"m1"))
            w.wait_dispatched()
            real, torn = codec.check, {res.commit_log_offset}

            def check_mid_copy(buf, pos, limit, **kw):
                if kw.get("base", 0) + pos in torn:
                    torn.clear()  # the first look only
                    return 0x7F, None, "bad magic code 0x00000000"
                return real(buf, pos, limit, **kw)

            monkeypatch.setattr(tail_view.codec, "check", check_mid_copy)
            with caplog.at_level(logging.WARNING, logger="rocketstore.tail_view"):
                assert extend_view(r) is False  # the first look: the view waits at the record being copied
                assert extend_view(r) is True
            assert not torn  # the torn first look happened
            assert "the view goes on" not in caplog.text
            assert r.max_phy_offset() == w.max_phy_offset()
            assert [m.body for m in r.get("T", 0, 0, 8).messages] == [b"m0", b"m1"]


def test_a_view_looking_while_the_writer_copies_does_not_search_the_segment(tmp_path, monkeypatch):
    """A follower of a busy writer often looks while a put is being copied.  Searching the rest of the segment
    for a trusted record after it (a GiB of unused bytes in a default store) each time took half the CPU of the
    queue bench's receivers; the search runs only once the view has stood at the same bytes DAMAGE_AFTER."""
    from rocketstore import tail_view
    from rocketstore.format import codec

    searches = []
    real_find = codec.find_record

    def counting_find(*a, **kw):
        searches.append(a[1])
        return real_find(*a, **kw)

    monkeypatch.setattr(tail_view.codec, "find_record", counting_find)
    root = str(tmp_path / "s")
    with MessageStore.open(root, golden_config()) as w:
        w.put(Message("T", b"m0"))
        w.wait_dispatched()
        with MessageStore.open(root, read_only=True) as r:
            seg = Path(root, "commitlog", "0" * 20)
            for i in range(5):  # each look comes while the next put's body is still being copied
                res = w.put(Message("T", b"body%d" % i))
                w.wait_dispatched()
                body_at = res.commit_log_offset + res.wrote_bytes - 10
                saved = _patch(seg, body_at, b"\xff")
                assert extend_view(r) is (i > 0)  # the records before it are taken
                _patch(seg, body_at, saved)
            assert searches == []
            assert extend_view(r) is True and r.max_phy_offset() == w.max_phy_offset()
            # bytes that stay no whole record, with a trusted record after them: damage, gone past after a while
            bad = w.put(Message("T", b"damaged"))
            w.put(Message("T", b"after"))
            w.wait_dispatched()
            _patch(seg, bad.commit_log_offset + bad.wrote_bytes - 10, b"\xff")
            assert extend_view(r) is False and searches == []
            time.sleep(tail_view.DAMAGE_AFTER)
            assert extend_view(r) is True and searches == [bad.commit_log_offset]
            assert r.max_phy_offset() == w.max_phy_offset()
            assert [m.body for m in r.get("T", 0, 7, 8).messages] == [b"after"]
