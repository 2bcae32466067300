"""Recovery's fast path: the run of records that the consume queues vouch for, checked column by column.

After a crash the consume queues usually point at every record of a
CommitLog segment up to where the dispatcher got.  Their units say where the
records start, so the checks of :func:`codec.scan_records` can run as numpy
passes over all those records at once instead of a Python loop step per
record; only the body CRC still takes one ``zlib.crc32`` call per record.

The units are a hint, never trusted: a record is accepted only if the records
before it were, it starts where the one before it ends, and it passes every
test ``scan_records`` makes (magic, PHYSICALOFFSET equal to its position,
lengths that add up to TOTALSIZE, body CRC).  Beyond that it must be what
``scan_records`` would not hand back for dispatch: a record whose own topic and
queue id are those of the queue pointing at it, which holds it (its end is at
or below the queue's max physical offset), and that lies below where the
index must resume (then ``scan_records`` wants it for neither, whatever its
transaction type).  The run ends at the first record failing any of this, and
``scan_records`` goes on from there, so recovery decides every record exactly
as the plain walk would.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from ..format import codec
from .consume_queue import CQ_STORE_UNIT_SIZE

UNIT_DTYPE = np.dtype([("off", ">i8"), ("size", ">i4"), ("tags", ">i8")])  # a consume-queue unit
_HEAD = 88  # the fixed header of a record with IPv4 hosts, up to BODYLENGTH: 22 big-endian int32 words
_V1, _V2 = (np.array([codec.MAGIC_V1, codec.MAGIC_V2], np.uint32).view(np.int32)).tolist()
_HOST_EXTRA = np.array([0, 12, 12, 24], np.int64)  # bytes the IPv6 born/store hosts add, by (SYSFLAG >> 4) & 3
BLOCK = 1 << 13  # records checked per pass
_MAX = (1 << 63) - 1

QueueUnits = dict[tuple[str, int], np.ndarray]


def units_by_queue(store: Any, lo: int = 0, hi: int = 1 << 62) -> QueueUnits:
    """(topic, queue id) -> the (commitlog offset, size) units of that consume queue pointing into [lo, hi).

    Padding units (before a queue's first real unit) and units below the
    CommitLog's minimum offset are left out.  Queue files whose units all lie
    outside the range are not read.
    """
    out: QueueUnits = {}
    lo = max(lo, store.min_phy_offset())
    for cq in store.consume_queues():
        parts = []
        for f in list(cq.queue.files):
            start = max(0, cq.min_logic_offset - f.file_from_offset)
            count = (f.wrote_position - start) // CQ_STORE_UNIT_SIZE
            if count <= 0:
                continue
            units = np.frombuffer(f.mm, dtype=UNIT_DTYPE, count=count, offset=start)
            off = units["off"]
            if off[-1] < lo or off[0] >= hi:
                continue
            u = np.stack([off.astype(np.int64), units["size"].astype(np.int64)], axis=1)
            parts.append(u[(u[:, 0] >= lo) & (u[:, 0] < hi) & (u[:, 1] > 0)])
        if parts:
            u = np.concatenate(parts)
            if len(u):
                out[(cq.topic, cq.queue_id)] = u
    return out


def checked_prefix(buf: Any, pos: int, limit: int, *, base: int, units: QueueUnits, check_crc: bool,
                   held: Mapping[tuple[bytes, int], int] | None = None, index_from: int = codec.NO_INDEX,
                   progress: Callable[[int], None] | None = None) -> tuple[int, int, int]:
    """Accept the records from file position ``pos`` that the queue ``units`` point at, in vectorised passes.

    ``held`` and ``index_from`` mean what they mean to :func:`codec.scan_records`
    (``held=None``: no record is wanted for a queue); the accepted records are
    exactly those ``scan_records`` would accept from ``pos`` without handing any
    back.  ``progress`` gets the file position reached after each block.
    Returns (position after the last accepted record, position of that record
    or -1, records accepted).
    """
    claims = _claims(units, base, pos, limit, held)
    if claims is None:
        return pos, -1, 0
    at_all, queue_no, queues = claims
    a = np.frombuffer(buf, np.uint8)
    n, last = 0, -1
    # Blocks keep the temporary arrays small and reused (fresh memory costs more to touch than the checks).
    for lo in range(0, len(at_all), BLOCK):
        at = at_all[lo:lo + BLOCK]
        ok, end, body, blen, crc = _check(a, at, pos, limit, base, queue_no[lo:lo + BLOCK], queues,
                                          held is not None, min(index_from, _MAX))
        _not_torn(buf, ok, at, end, body, blen, base)
        bad = np.flatnonzero(~ok)
        k = int(bad[0]) if len(bad) else len(at)
        if check_crc and k:
            k = _crc_prefix(buf, body[:k], blen[:k], crc[:k])
        if k:
            n += k
            last, pos = int(at[k - 1]), int(end[k - 1])
            if progress is not None:
                progress(pos)
        if k < len(at):
            break
    return pos, last, n


def _check(a: np.ndarray, at: np.ndarray, pos: int, limit: int, base: int, queue_no: np.ndarray,
           queues: "_Queues", own_queue: bool, index_from: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every test but the CRC on the records at ``at`` (the first expected at ``pos``).

    Returns (passes, record end, body start, body length, stored body CRC); a
    record passes only if it starts where the one before it ends, so the
    accepted run is the leading run of passes.
    """
    size = len(a)
    ok = at + _HEAD <= limit
    words = _at_every_byte(a, f"V{_HEAD}")[np.where(ok, at, 0)].view(">i4").reshape(len(at), _HEAD // 4)
    total, sysflag = _col(words, 0), _col(words, 9)
    magic, crc = words[:, 1], _col(words, 2)
    phy = (_col(words, 7) << 32) | (_col(words, 8) & 0xFFFFFFFF)
    end = at + total
    extra = _HOST_EXTRA[(sysflag >> 4) & 3]
    body = at + 88 + extra
    blen = _col(words, 21)
    v6 = np.flatnonzero(extra)
    if len(v6):
        blen[v6] = _int32(a, np.clip(body[v6] - 4, 0, size - 4))
    p = body + blen  # the topic length
    v1 = magic == _V1
    ok &= (v1 | (magic == _V2)) & (phy == base + at) & (end <= limit) & (body <= p) & (p < end) & (phy < index_from)
    if own_queue:
        ok &= (words[:, 3] == queues.qid[queue_no]) & (base + end <= queues.held_end[queue_no])
    p = np.where(ok, p, 0)
    if v1.all():
        tl, t = a[p].astype(np.int64), p + 1
        ok &= tl <= 127
    else:
        tl = np.where(v1, a[p], _int16(a, np.minimum(p, size - 2)))
        t = p + np.where(v1, 1, 2)
        ok &= np.where(v1, tl <= 127, tl >= 0)
    q = np.where(ok, t + tl, 0)
    ok &= q + 2 <= end
    plen = _int16(a, np.minimum(q, size - 2))
    ok &= (plen >= 0) & (q + 2 + plen == end)
    ok[0] &= at[0] == pos
    ok[1:] &= at[1:] == end[:-1]
    if own_queue:  # the record's own topic is its queue's
        topic_no = queues.topic_no[queue_no]
        for k, name in enumerate(queues.topics):
            mine = np.flatnonzero(ok & (topic_no == k))
            if len(mine):
                same = tl[mine] == len(name)
                if name:  # fixed-width byte strings of the topic's length compare exactly
                    same &= _at_every_byte(a, f"S{len(name)}")[np.minimum(t[mine], size - len(name))] == name
                ok[mine] = same
    return ok, end, body, blen, crc


def _not_torn(buf: Any, ok: np.ndarray, at: np.ndarray, end: np.ndarray, body: np.ndarray, blen: np.ndarray,
              base: int) -> None:
    """Clear ``ok`` for records torn by a power cut (:func:`codec.torn_tail`); only the few whose last page
    starts after their body are looked at."""
    page = (base + end - 1) // codec.PAGE_SIZE * codec.PAGE_SIZE - base
    for i in np.flatnonzero(ok & (page >= body + blen) & (page > at)).tolist():
        if codec.torn_tail(buf, int(at[i]), int(end[i]), base) is not None:
            ok[i] = False


class _Queues(NamedTuple):
    """What each queue pointing into the segment claims of its records, by queue number."""

    qid: np.ndarray
    held_end: np.ndarray  # the queue's max physical offset
    topic_no: np.ndarray
    topics: list[bytes]  # UTF-8 names, by topic number


def _claims(units: QueueUnits, base: int, pos: int, limit: int, held: Mapping[tuple[bytes, int], int] | None
            ) -> tuple[np.ndarray, np.ndarray, _Queues] | None:
    """The file positions in [pos, limit) that the units point at, ascending, with the number of the queue
    whose unit points there; None when there is none."""
    lo, hi = base + pos, base + limit
    parts, numbers, qids, ends, topic_nos = [], [], [], [], []
    topic_numbers: dict[bytes, int] = {}
    for (topic, qid), u in units.items():
        off = u[:, 0]
        if len(off) and not (lo <= off.min() and off.max() < hi):  # recovery passes the units of [pos, limit)
            off = off[(off >= lo) & (off < hi)]
        if not len(off):
            continue
        name, end = b"", _MAX
        if held is not None:
            try:
                name = topic.encode("utf-8")
                end = min(held.get((name, qid), -1), _MAX)
            except UnicodeEncodeError:  # a name no record's topic decodes to: the queue vouches for nothing
                end = -1
        topic_nos.append(topic_numbers.setdefault(name, len(topic_numbers)))
        qids.append(qid)
        ends.append(end)
        numbers.append(np.full(len(off), len(parts), np.int32))
        parts.append(off - base)
    if not parts:
        return None
    queues = _Queues(np.array(qids, np.int64), np.array(ends, np.int64), np.array(topic_nos, np.int64),
                     list(topic_numbers))
    at = np.concatenate(parts)
    order = np.argsort(at, kind="stable")
    return at[order], np.concatenate(numbers)[order], queues


def _at_every_byte(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` seen as items of ``dtype`` starting at every byte: indexing it with positions gathers the items."""
    width = np.dtype(dtype).itemsize
    return np.ndarray(shape=(len(a) - width + 1,), dtype=dtype, buffer=a, strides=(1,))


def _col(words: np.ndarray, k: int) -> np.ndarray:
    return words[:, k].astype(np.int64)


def _int32(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    return _at_every_byte(a, ">i4")[at].astype(np.int64)


def _int16(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    return _at_every_byte(a, ">i2")[at].astype(np.int64)


def _crc_prefix(buf: Any, body: np.ndarray, blen: np.ndarray, crc: np.ndarray) -> int:
    """How many of the records, in order, have a body CRC that matches (an empty body always does)."""
    mv = memoryview(buf)
    try:
        got = np.fromiter(map(zlib.crc32, map(mv.__getitem__, map(slice, body.tolist(), (body + blen).tolist()))),
                          np.int64, len(body))
    finally:
        mv.release()
    bad = np.flatnonzero(((got & 0x7FFFFFFF) != crc) & (blen != 0))
    return int(bad[0]) if len(bad) else len(body)
