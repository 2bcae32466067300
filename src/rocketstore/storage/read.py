"""StoreReader: the read half of the store (get, look, query, time lookup, walks) over StoreFiles and the tier.

RocketMQ's ``DefaultMessageStore.getMessage`` / ``queryMessage`` / ``lookMessageByOffset``: a unit of a
consume queue is a pointer into the commitlog, checked against the record it names (the trusted-record
check) before a message is returned; a unit whose record is gone from the local disk is read from the tier
(``files.tier``, duck-typed: the tier layer sits above this one).  ``MessageStore`` delegates its reads here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

from ..config import total_memory_bytes
from ..errors import CorruptRecordError, StoreClosedError, StoreError, TierError
from ..format import codec
from ..format.codec import MessageExt
from ..format.message import GetMessageResult, GetMessageStatus, QueryMessageResult, parse_tag_filter
from .consume_queue import CQ_STORE_UNIT_SIZE, LOWER, UPPER, ConsumeQueue
from .files import InFiles, StoreFiles

from .read_batch import BatchReads
from .read_tier import TierReads

from .read_units import BLANK_UNIT_SIZE, UnitChecks, lost_unit, signed32

log = logging.getLogger(__name__)

# (an Enum member read through its class costs a metaclass __getattr__ round of ~1,000 instructions: the two every
# get reads are looked up once here)
_FOUND, _NO_MATCHED = GetMessageStatus.FOUND, GetMessageStatus.NO_MATCHED_MESSAGE


def _damaged_unit(seg: Any, pos: int, size: int, cq: ConsumeQueue, cq_file: Any, topic: str, queue_id: int,
                  unit: int, check_crc: bool) -> CorruptRecordError:
    """The error for a consume-queue unit whose record is damaged or is another queue's (the slow path)."""
    phy = seg.file_from_offset + pos
    where = (f"{seg.path} at offset {phy} (file position {pos}), read through consume queue {topic}/{queue_id} "
             f"offset {unit} ({cq_file.path} position {unit * CQ_STORE_UNIT_SIZE % cq.file_size})")
    try:
        m = codec.decode(seg.mm, pos, pos + size, check_crc=check_crc, read_body=False)
    except codec.RecordError as e:
        return CorruptRecordError(f"{where}: damaged record: {e}", path=seg.path, offset=phy)
    return CorruptRecordError(
        f"{where}: the record there is {m.topic}/{m.queue_id} offset {m.queue_offset}, {m.size} bytes, "
        f"not the unit's {topic}/{queue_id} offset {unit}, {size} bytes", path=seg.path, offset=phy)


def _indexed_record(f: Any, pos: int, read_body: bool) -> MessageExt:
    """The record an index entry points at (position ``pos`` of segment ``f``); its CRC is not checked yet."""
    try:
        return codec.decode(f.mm, pos, f.wrote_position, read_body=read_body)
    except codec.RecordError as e:
        raise CorruptRecordError(f"{f.path} at offset {f.file_from_offset + pos} (file position {pos}): an index "
                                 f"entry points here but no record decodes: {e}", path=f.path,
                                 offset=f.file_from_offset + pos) from None


class StoreReader(TierReads, UnitChecks, BatchReads):
    """Reads over a store's open files; ``MessageStore`` delegates its read methods here."""

    # in StoreFiles (one copy of each open file and table)
    commitlog, config, root, paths, tier, index_service, _cq_table, closed = (InFiles() for _ in range(8))
    lost_queues, clock = InFiles(), InFiles()

    def __init__(self, files: StoreFiles) -> None:
        self.files = files
        self._ram = total_memory_bytes()  # accessMessageInMemoryMaxRatio's base
        # (topic, queue) -> the queue's first record in the commitlog, per local minimum (queue_start)
        self._queue_starts: dict[tuple[str, int], tuple[tuple[int, int | None], tuple[str, int, int]]] = {}
        self._topic_heads: dict[str, tuple[bytes, bytes | None]] = {}  # topic -> (UTF-8, codec.unit_run_head)

    def min_readable_offset(self) -> int:
        """The first offset a read can reach: the tier's start when a tier holds older segments."""
        return self.commitlog.min_offset_with_tier()

    def max_phy_offset(self) -> int:
        return self.files.max_phy_offset()

    def min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        if self.lost_queues and (topic, queue_id) in self.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = self._cq_table.get((topic, queue_id))
        if cq is not None and cq.blank_min is not None:
            self.settle_queue_min(cq)
        lo = cq.min_offset_in_queue if cq else 0
        return self.queue_min_with_tier(topic, queue_id, lo) if self.tier is not None else lo

    def max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        if self.lost_queues and (topic, queue_id) in self.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = self._cq_table.get((topic, queue_id))
        return cq.max_offset_in_queue if cq else 0

    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
            tag_filter: set[int] | str | None = None, max_total_bytes: int = 128 * 1024 * 1024,
            read_body: bool = True) -> GetMessageResult:
        """Read through the consume queue (RocketMQ's getMessage).  ``tag_filter``: tag hash codes, a
        subscription expression (``"TagA"``, ``"TagA || TagB"``, ``"*"``) or None.

        A unit whose record is damaged (does not decode, or its body fails
        BODYCRC when bodies are read) or is not the record the unit claims
        (topic, queue id, queue offset, size) is never returned nor skipped:
        the call returns the messages before it (FOUND, ``next_begin_offset``
        at that unit), and a call starting at it raises
        :class:`CorruptRecordError` naming the segment file and offset.  A unit whose own size or
        offset was damaged still reads its intact record (see :meth:`_misplaced_unit_record`).

        Consumers call this in a loop, so the fixed cost of a call weighs about as
        much as the per-message cost: units are read in blocks of one unpack each,
        ``min``/``max`` are written as comparisons (each builtin call costs more
        than the test), and :func:`codec.decode_unit` builds the messages.
        """
        files = self.files  # (each InFiles attribute is a lookup in it)
        if files.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if isinstance(tag_filter, str):
            tag_filter = parse_tag_filter(tag_filter)
        if files.lost_queues and (topic, queue_id) in files.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        cq = files.cq_table.get((topic, queue_id))
        if cq is None:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, 0, 0)
        if cq.blank_min is not None:
            self.settle_queue_min(cq)
        lo, hi = cq.offset_range()
        if hi == 0:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
        if offset < lo:
            if files.tier is not None:
                return self._get_from_tier(topic, queue_id, offset, max_msgs, tag_filter, read_body, lo, hi)
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        if offset == hi:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_ONE, offset, lo, hi)
        if offset > hi:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_BADLY, hi, lo, hi)
        f = cq.hold_file_at(offset)
        if f is None:
            units_per_file = cq.file_size // CQ_STORE_UNIT_SIZE
            nxt = offset + units_per_file - offset % units_per_file
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, nxt, lo, hi)
        status = _NO_MATCHED
        out: list[MessageExt] = []
        n = total = 0  # messages and bytes in ``out``
        cfg = files.config
        max_pull = (100 if max_total_bytes < 100 else  # clamp to [100, 128 MiB]
                    128 * 1024 * 1024 if max_total_bytes > 128 * 1024 * 1024 else max_total_bytes)
        count_cap, byte_cap = max_msgs, max_pull  # narrowed once the first message says hot or cold
        span = max_msgs * CQ_STORE_UNIT_SIZE  # units looked at: at least maxFilterMessageSize worth
        if span < cfg.maxFilterMessageSize:
            span = cfg.maxFilterMessageSize
        stop_idx = offset + -(-span // CQ_STORE_UNIT_SIZE)
        if stop_idx > hi:
            stop_idx = hi
        skip_file_start = skip_file_end = -1
        seg, seg_start, seg_end, mm = None, 0, -1, None  # the commitlog segment held while reading from it
        decode_unit, decode_run = codec.decode_unit, codec.decode_run
        heads = self._topic_heads.get(topic)
        if heads is None:  # (the topic's UTF-8 and run head are kept: a consumer asks for the same few topics)
            if len(self._topic_heads) >= 4096:
                self._topic_heads.clear()
            tb = topic.encode("utf-8")
            heads = self._topic_heads[topic] = (tb, codec.unit_run_head(tb))
        topic_bytes, run_head = heads
        if tag_filter is not None:
            run_head = None
        misses = 0
        read_units = cq.read_units
        idx = offset  # the next unit; where the next call begins
        want = max_msgs if max_msgs > 1 else 1  # units in the first block: what an unfiltered call takes
        try:
            while idx < stop_idx:
                block = read_units(f, idx, stop_idx - idx if stop_idx - idx < want else want)
                if not block:
                    break
                want = cq.UNITS_PER_READ
                full = False
                j, nb = 0, len(block)
                while j < nb:
                    if run_head is not None:  # the common case: no call per message
                        phy = block[j]
                        if not (seg_start <= phy < seg_end) and phy >= 0:
                            seg, seg_start, seg_end, mm = self._switch_segment(seg, phy)
                        cc, bc = (count_cap, byte_cap) if n else self._transfer_caps(phy, count_cap, byte_cap)
                        j2, k, t = (decode_run(mm, block, j, seg_start, seg.wrote_position, cc - n, bc - total,
                                               read_body, topic, run_head, queue_id, idx, out)
                                    if seg is not None else (j, 0, 0))
                        if k:
                            if not n:
                                count_cap, byte_cap, status = cc, bc, _FOUND
                            j, idx, n, total = j2, idx + k, n + k, total + t
                            if j >= nb or n >= count_cap:
                                break
                        elif misses:  # twice no progress: records of another form (the slow path reads them)
                            run_head = None
                        else:
                            misses = 1
                    phy, size, tags = block[j], block[j + 1], block[j + 2]
                    j += 3
                    if n and (n >= count_cap or total + size > byte_cap and size != BLANK_UNIT_SIZE):
                        full = True
                        break
                    idx += 1
                    if tag_filter is not None and signed32(tags) not in tag_filter and size != BLANK_UNIT_SIZE:
                        if not n:
                            status = _NO_MATCHED
                        continue
                    if skip_file_start <= phy < skip_file_end and size != BLANK_UNIT_SIZE:  # its segment is gone
                        continue
                    if not (seg_start <= phy < seg_end):
                        seg, seg_start, seg_end, mm = self._switch_segment(seg, phy)
                    pos = phy - seg_start
                    if seg is None or pos + size > seg.wrote_position:
                        damage = None
                        if size == BLANK_UNIT_SIZE:  # a unit naming no record: retention's doing, or damage
                            msg, damage = self._gone_unit_record(cq, f, idx - 1, phy, size, read_body, topic,
                                                                 topic_bytes, queue_id)
                            if msg is None and damage is None:
                                if not n:
                                    status = GetMessageStatus.MESSAGE_WAS_REMOVING
                                continue
                            if msg is not None and n and total + msg.size > byte_cap:  # (the cap test above
                                idx -= 1                                                # could not know its size)
                                full = True
                                break
                        elif seg is None and self.commitlog.in_tier(phy):  # uploaded, and gone from local disk
                            msg = self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, idx - 1)
                        elif seg is None and self.tier is not None and self.tier.fault is not None and \
                                phy < self.tier.deleted_end:  # deleted on the tier's word; no manifest to trust
                            if n:
                                idx -= 1
                                full = True
                                break
                            raise TierError(f"{topic}-{queue_id} offset {idx - 1}: its record at commitlog offset "
                                            f"{phy} was moved to the tier, but {self.tier.fault}")
                        elif seg is None and phy < self.commitlog.min_offset():  # expired, unless the unit is damaged
                            msg, damage = self._gone_unit_record(cq, f, idx - 1, phy, size, read_body, topic,
                                                                 topic_bytes, queue_id)
                            if msg is None and damage is None:
                                if not n:
                                    status = GetMessageStatus.MESSAGE_WAS_REMOVING
                                if phy >= 0:
                                    skip_file_start = phy - phy % self.commitlog.file_size
                                    skip_file_end = skip_file_start + self.commitlog.file_size
                                continue
                            if msg is not None and n and total + msg.size > byte_cap:
                                idx -= 1
                                full = True
                                break
                        else:
                            # Not expired, yet no record there: a damaged unit, whose record may still be found.
                            msg = self._misplaced_unit_record(cq, idx - 1, phy, size, read_body, topic, topic_bytes,
                                                              queue_id)
                            if msg is None:
                                damage = lost_unit(cq, f, topic, queue_id, idx - 1, phy, size,
                                                    "its segment is not in the commitlog" if seg is None else
                                                    f"it reaches past the written end of {seg.path}")
                        if damage is not None:
                            if n:  # return what was read; the next call starts at the damaged unit and raises
                                idx -= 1
                                full = True
                                break
                            raise damage
                        if msg is not None:
                            size, phy = msg.size, msg.commit_log_offset
                    else:
                        msg = decode_unit(mm, pos, size, read_body, topic, topic_bytes, queue_id, idx - 1)
                    if msg is None and seg is not None:
                        msg = self._misplaced_unit_record(cq, idx - 1, phy, size, read_body, topic, topic_bytes,
                                                          queue_id)
                        if msg is not None:
                            size, phy = msg.size, msg.commit_log_offset
                    if msg is None:
                        if n:  # return what was read; the next call starts at the damaged unit and raises
                            idx -= 1
                            full = True
                            break
                        if seg is None:
                            raise self._tier_damaged(phy, size, topic, queue_id, idx - 1)
                        raise _damaged_unit(seg, pos, size, cq, f, topic, queue_id, idx - 1, read_body)
                    if not n:
                        count_cap, byte_cap = self._transfer_caps(phy, count_cap, byte_cap)
                        status = _FOUND
                    out.append(msg)
                    n += 1
                    total += size
                if full or (n and n >= count_cap):  # the next unit would stop the call: do not read it
                    break
        finally:
            f.release()
            if seg is not None:
                seg.release()
        return GetMessageResult(status, idx, lo, hi, out)

    def _switch_segment(self, seg: Any, phy: int) -> tuple[Any, int, int, Any]:
        """Release the held segment ``seg`` (or None) and hold the one containing ``phy``: (segment, its first
        offset, its end, its map), or (None, 0, -1, None) when no local segment holds it."""
        if seg is not None:
            seg.release()
        seg = self.commitlog.queue.find(phy)
        if seg is None or not seg.hold():
            return None, 0, -1, None
        return seg, seg.file_from_offset, seg.end_offset, seg.mm

    def _transfer_caps(self, phy: int, count_cap: int, byte_cap: int) -> tuple[int, int]:
        """A get's message and byte caps narrowed by where its first message lies: "in memory" (within 40 % of
        RAM of the log's end) 32 messages / 256 KiB a call, else 8 / 64 KiB (RocketMQ's defaults)."""
        cfg = self.config
        in_mem = self.commitlog.max_offset() - phy <= self._ram * cfg.accessMessageInMemoryMaxRatio // 100
        cap = cfg.maxTransferCountOnMessageInMemory if in_mem else cfg.maxTransferCountOnMessageInDisk
        if cap < count_cap:
            count_cap = cap
        cap = cfg.maxTransferBytesOnMessageInMemory if in_mem else cfg.maxTransferBytesOnMessageInDisk
        if cap < byte_cap:
            byte_cap = cap
        return count_cap, byte_cap

    def _lost_queue_error(self, topic: str, queue_id: int) -> CorruptRecordError:
        d = os.path.join(self.paths.consumequeue, topic, str(queue_id))
        return CorruptRecordError(f"{d}: consume queue {topic}/{queue_id} is in the queue registry but its directory "
                                  "is gone (a lost consume queue, not an empty one); a writable open (rocketstore "
                                  "recover) rebuilds it from the commitlog", path=d)

    def local_unit_record(self, phy: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                          queue_offset: int) -> MessageExt | None:
        """The record a consume-queue unit points at in the local segments, or None when it is not there whole
        or is not the unit's record (codec.decode_unit's check: topic, queue id, queue offset, size)."""
        f = self.commitlog.queue.find(phy)
        if f is None or not f.hold():
            return None
        try:
            pos = phy - f.file_from_offset
            if pos + size > f.wrote_position:
                return None
            return codec.decode_unit(f.mm, pos, size, read_body, topic, topic_bytes, queue_id, queue_offset)
        finally:
            f.release()

    def look(self, commit_log_offset: int, *, read_body: bool = True) -> MessageExt:
        """The message at a commitlog offset (RocketMQ's lookMessageByOffset).

        Raises :class:`CorruptRecordError` (file and offset) when no record
        decodes there or, reading the body, the body fails its BODYCRC.
        """
        if self.files.closed:  # (else the emptied segment list reads as "no segment holds it")
            raise StoreClosedError(f"{self.root}: store is closed")
        return self.commitlog.read_message(commit_log_offset, read_body=read_body, check_crc=read_body)

    def query(self, topic: str, key: str, max_num: int = 32, begin: int = 0, end: int = 2 ** 63 - 1,
              *, read_body: bool = True) -> QueryMessageResult:
        """Messages by key or UNIQ_KEY through the index (RocketMQ's queryMessage): newest hits, ascending.

        The index holds only hashes, so, as RocketMQ's client does after the
        broker answers, a hit is kept only when its topic is ``topic`` and
        ``key`` is one of its KEYS or its UNIQ_KEY (hash collisions and stale
        entries are dropped).  A kept hit whose body fails its BODYCRC, or an
        entry pointing at bytes that are no record, raises
        :class:`CorruptRecordError` naming the file and offset.
        """
        if self.files.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        limit = min(max_num, self.config.maxMsgsNumBatch)
        offsets, last_ts, last_phy = self.index_service.query_offset(topic, key, limit, begin, end)
        if self.tier is not None and self.tier.reader is not None and len(offsets) < limit:
            local = {os.path.basename(f.path) for f in self.index_service.files}
            more = self.tier.reader.select(f"{topic}#{key}", limit - len(offsets), begin, end, local)
            offsets = list(dict.fromkeys(offsets + more))
        offsets.sort()
        msgs, phys = [], []
        for off in offsets:
            f = self.commitlog.queue.find(off)
            if f is None or not f.hold():
                if self.commitlog.in_tier(off):  # uploaded and gone from local disk
                    m = self.commitlog.tier.reader.read_message(off, read_body=read_body, check_crc=read_body)
                    if m.topic == topic and (key == m.uniq_key or key in (m.keys or "").split(" ")):
                        msgs.append(m)
                        phys.append(off)
                continue  # else the segment was deleted (retention): RocketMQ skips such entries too
            try:
                pos = off - f.file_from_offset
                if pos + 4 > f.wrote_position:
                    continue
                m = _indexed_record(f, pos, read_body)
                if m.topic != topic or (key != m.uniq_key and key not in (m.keys or "").split(" ")):
                    log.debug("%s: index hit at offset %d is %s, not %s#%s (hash collision)",
                              self.paths.index, off, m.topic, topic, key)
                    continue
                claim = self.files.queue_claiming(off, m.topic, m.queue_id, m.queue_offset, m.sys_flag)
                if claim is not None:
                    raise CorruptRecordError(
                        f"{f.path} at offset {off} (file position {pos}): damaged record: it says "
                        f"{m.topic}/{m.queue_id} offset {m.queue_offset}, but consume queue {claim[0]}/{claim[1]} "
                        f"offset {claim[2]} points at it (its header changed since; verify --repair restores it); "
                        f"found through the index by {topic}#{key}", path=f.path, offset=off)
                if read_body and m.body and codec.body_crc(m.body) != m.body_crc:
                    raise CorruptRecordError(f"{f.path} at offset {off} (file position {pos}): damaged record: "
                                             f"body CRC mismatch (stored {m.body_crc}, computed "
                                             f"{codec.body_crc(m.body)}); found through the index by "
                                             f"{topic}#{key}", path=f.path, offset=off)
            finally:
                f.release()
            msgs.append(m)
            phys.append(off)
        if not msgs:
            last_ts = last_phy = 0
        return QueryMessageResult(phys, msgs, last_ts, last_phy)

    def offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str = LOWER) -> int:
        """Queue offset by store time (RocketMQ's getOffsetInQueueByTime)."""
        if boundary not in (LOWER, UPPER):  # (any other value searched as UPPER, silently)
            raise StoreError(f"offset_by_time: boundary {boundary!r}: expected {LOWER!r} or {UPPER!r}")
        if self.files.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        cq = self._cq_table.get((topic, queue_id))
        if cq is None:
            return 0
        local = cq.offset_by_time(timestamp, boundary, self.commitlog.pickup_store_timestamp,
                                  self.commitlog.min_offset_with_tier())
        t = self.tier
        rng = t.manifest.queue_range(topic, queue_id) if t is not None and t.reader is not None else None
        lo = cq.min_offset_in_queue
        if rng is None or rng[0] >= lo:
            return local
        first = cq.get_unit(lo)
        if first is not None and timestamp >= self.commitlog.pickup_store_timestamp(first[0], first[1]):
            return local
        return self._tier_offset_by_time(topic, queue_id, timestamp, boundary, rng[0], min(rng[1], lo))

    def messages(self, from_offset: int = -1, *, read_body: bool = True, check_crc: bool | None = None,
                 drop_cache: bool = False, skip_damaged: bool = False
                 ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        """Every trusted record in commitlog order (including ones in no consume queue); see CommitLog.scan.

        Only trusted records are messages (data-safety rule 1): magic, sizes,
        PHYSICALOFFSET equal to the position, and BODYCRC (``check_crc``
        defaults to True, bodies read or not: a walk hands its messages to
        ``import``, which would replay a damaged one).  A damaged record or a
        stale copy of one is yielded once as (offset, size, None, problem naming
        file and position) and ends the walk, unless ``skip_damaged``: then the
        walk resumes at the next trusted record after it (:func:`codec.find_record`).
        """
        check = True if check_crc is None else check_crc
        if not skip_damaged:
            return self.commitlog.scan(from_offset, read_body=read_body, check_crc=check, drop_cache=drop_cache)
        return self._messages_resync(from_offset, read_body, check, drop_cache)

    def _messages_resync(self, offset: int, read_body: bool, check_crc: bool, drop_cache: bool
                         ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        while offset is not None:
            damaged = None
            for item in self.commitlog.scan(offset, read_body=read_body, check_crc=check_crc, drop_cache=drop_cache):
                yield item
                if item[2] is None:
                    damaged = item[0]
            offset = None if damaged is None else self._next_record_after(damaged, check_crc)

    def _next_record_after(self, offset: int, check_crc: bool) -> int | None:
        """The commitlog offset of the first intact record after ``offset``, up to the log's end, or None."""
        queue = self.commitlog.queue
        if self.commitlog.in_tier(offset):  # damage in a segment only the tier holds: resync there
            after = self.tier.reader.next_record_after(offset, check_crc=check_crc)
            if queue.files and after >= self.commitlog.min_offset():
                return self.commitlog.min_offset()
            return after if after < self.tier.manifest.end_offset else None
        f = queue.find(offset)
        pos = offset - f.file_from_offset + 1 if f is not None else 0
        while f is not None and f.hold():
            try:
                found = codec.find_record(f.mm, pos, f.wrote_position, f.file_from_offset, check_crc=check_crc)
            finally:
                f.release()
            if found is not None:
                return f.file_from_offset + found
            f, pos = queue.find(f.end_offset), 0
        return None

    def seek_offset(self, topic: str | None = None, from_time: int | None = None) -> int:
        """Where a scan for a topic and/or from a store time can start, found through the consume queues.

        The lowest commitlog offset among the matching queues' first units at or
        after ``from_time`` (or their first units).  Records in no consume queue
        (PREPARED/ROLLBACK transaction halves) before that point are skipped.
        """
        if topic is None and from_time is None:
            return self.min_readable_offset()
        best = None
        for (t, qid), cq in list(self._cq_table.items()):
            if topic is not None and t != topic:
                continue
            idx = cq.min_offset_in_queue if from_time is None else self.offset_by_time(t, qid, from_time, LOWER)
            unit = cq.get_unit(idx)
            if unit is not None and (best is None or unit[0] < best):
                best = unit[0]
        return self.max_phy_offset() if best is None else max(best, self.min_readable_offset())

    def apply_topic_retention(self) -> dict[tuple[str, int], int]:
        """Per-topic logical retention (topicRetentionMs): advance a queue's minimum past messages older
        than its topic's limit.  Files are untouched; RocketMQ's rules still decide what is deleted."""
        limits = self.config.topic_retention()
        moved: dict[tuple[str, int], int] = {}
        if not limits:
            return moved
        now_ms = int(self.clock() * 1000)
        for (topic, qid), cq in list(self._cq_table.items()):
            ms = limits.get(topic)
            if ms is None:
                continue
            idx = self.offset_by_time(topic, qid, now_ms - ms, LOWER)
            if idx > cq.retention_min_offset:
                cq.retention_min_offset = idx
                moved[(topic, qid)] = idx
        return moved
