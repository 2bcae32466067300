"""A record torn by a power cut after its body (found by the model-based test, not listed in issue 24).

RocketMQ's BODYCRC covers the body alone; the topic and the properties follow it.  A power cut that keeps the
pages holding a record's header and body but loses its last page leaves zeros for (part of) its properties: every
other check passes, and ``get`` returned tags ``'TagB\\x00'``.  Such a record is the torn tail, not a message.
"""

from __future__ import annotations

import glob
import mmap
import os
from pathlib import Path

import pytest

from conftest import GOLDEN_NAMES, golden_store
from helpers.powerloss import rebooted
from rocketstore.format import codec
from rocketstore.config import StoreConfig
from rocketstore.format.message import Message
from rocketstore.store import MessageStore

PAGE = codec.PAGE_SIZE


def _config() -> StoreConfig:
    return StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=20 * 100, maxHashSlotNum=64,
                       maxIndexNum=256, warmAheadBytes=0)


def _store_with_a_record_across_a_page(tmp_path: Path) -> tuple[Path, list, dict]:
    """Messages whose properties are long enough that one record's last page starts after its body."""
    path = tmp_path / "s"
    with MessageStore.open(str(path), _config()) as store:
        for i in range(60):
            store.put(Message("Busy", b"b%03d" % i, tags="TagB", keys=[f"k{i}"], queue_id=0,
                              properties={"pad": "x" * (150 + i % 7)}))
        assert store.wait_dispatched()
        msgs = store.get("Busy", 0, 0, 32).messages + store.get("Busy", 0, 32, 32).messages
    data = (path / "commitlog" / f"{0:020d}").read_bytes()
    for m in msgs:
        end = m.commit_log_offset + m.size
        page = (end - 1) // PAGE * PAGE
        _h, tp, tl, plen = codec.parse(data, m.commit_log_offset, len(data))
        if tp + tl + 2 <= page < end - 20:  # the page starts inside its properties
            return path, msgs, {"msg": m, "page": page, "end": end}
    pytest.fail("no record crosses a page boundary inside its properties")


def _tear(path: Path, page: int) -> None:
    """The power cut lost the page at ``page`` and everything after it (zeros)."""
    seg = path / "commitlog" / f"{0:020d}"
    with open(seg, "r+b") as fh:
        fh.seek(page)
        fh.write(bytes(64 * 1024 - page))


def test_a_record_whose_last_page_was_lost_is_the_torn_tail_not_a_message(tmp_path):
    path, msgs, torn = _store_with_a_record_across_a_page(tmp_path)
    m = torn["msg"]
    _tear(path, torn["page"])
    rebooted(path)
    with MessageStore.open(str(path), _config()) as store:
        before = [x for x in msgs if x.commit_log_offset < m.commit_log_offset]
        got = store.get("Busy", 0, 0, 32).messages + store.get("Busy", 0, 32, 32).messages
        assert [(x.queue_offset, x.body) for x in got] == [(x.queue_offset, x.body) for x in before]
        assert all(x.tags == "TagB" for x in got)
        assert store.max_phy_offset() == m.commit_log_offset  # the log ends before the torn record
        r = store.put(Message("Busy", b"next", tags="TagB", queue_id=0))
        assert r.queue_offset == m.queue_offset  # the torn record was never acknowledged durable: its slot is reused
    with MessageStore.open(str(path), _config(), read_only=True) as store:
        [nxt] = store.get("Busy", 0, m.queue_offset, 1).messages
        assert nxt.body == b"next" and nxt.tags == "TagB"


def test_the_trusted_record_check_names_a_torn_record(tmp_path):
    path, _msgs, torn = _store_with_a_record_across_a_page(tmp_path)
    m = torn["msg"]
    _tear(path, torn["page"])
    with open(path / "commitlog" / f"{0:020d}", "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, base=0)
        assert msg is None and "torn record" in reason and str(torn["page"]) in reason
        # Without the trusted-record check (no base) the bytes still decode: that is what got through before.
        size, msg, reason = codec.check(mm, m.commit_log_offset, len(mm), check_crc=True, read_body=True)
        assert msg is not None and msg.body == m.body and msg.tags != "TagB"
    with MessageStore.open(str(path), _config(), read_only=True) as store:  # a reader's log ends before it
        assert store.max_phy_offset() == m.commit_log_offset
        assert [x.commit_log_offset for _o, _s, x, _p in store.messages(0, read_body=False, skip_damaged=True)
                if x is not None][-1] < m.commit_log_offset


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_no_golden_record_looks_torn(name):
    """Every record RocketMQ wrote passes: the rule matches only the torn-page shape."""
    checked = 0
    for seg in sorted(glob.glob(os.path.join(golden_store(name), "commitlog", "*"))):
        base = int(os.path.basename(seg))
        with open(seg, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for pos, size, msg, reason in codec.walk(mm, 0, len(mm), check_crc=True, base=base):
                if size == 0:
                    break
                assert msg is not None, f"{seg}@{pos}: {reason}"
                assert codec.torn_tail(mm, pos, pos + size, base) is None
                checked += 1
    assert checked > 0
