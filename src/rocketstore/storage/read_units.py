"""Units that name no record, or the wrong one: a blank unit, a unit below the commitlog minimum, a unit
whose offset was damaged.  Each is judged against the commitlog (the truth) before a read answers."""

from __future__ import annotations

import logging
from itertools import islice
from typing import Any

from ..errors import CorruptRecordError
from ..format import codec
from ..format.codec import MessageExt
from .consume_queue import CQ_STORE_UNIT_SIZE, ConsumeQueue

log = logging.getLogger(__name__)
# How far a get walks the commitlog for the record of a unit whose offset was damaged (see
# UnitChecks._misplaced_unit_record): a few RocketMQ maximum-size messages.
MISPLACED_SEARCH_BYTES = 16 << 20
BLANK_UNIT_SIZE = 0x7FFFFFFF  # the size of a blank consume-queue unit (PRE_BLANK_UNIT): it names no record
BLANK_QUEUE_SCAN = 65536  # blank units at a queue's start settle_queue_min looks through for one naming a record
BLANK_LOOK_BACK = 65536  # units a get looks back over for the last one before a blank unit that names a record


def next_naming_unit(cq: ConsumeQueue, index: int) -> tuple[int, int | None]:
    """(queue offset, commitlog offset) of the first unit after ``index`` that names a record (blank units
    stepped over, at most BLANK_LOOK_BACK of them), or (-1, None)."""
    hi = min(cq.max_offset_in_queue, index + 1 + BLANK_LOOK_BACK)
    for i in range(index + 1, hi):
        try:
            unit = cq.get_unit(i)
        except ValueError:  # a file retention closed meanwhile
            return -1, None
        if unit is None:
            return -1, None
        if unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_SIZE:
            return i, unit[0]
    return -1, None


def lost_unit(cq: ConsumeQueue, cq_file: Any, topic: str, queue_id: int, unit: int, phy: int, size: int,
               why: str) -> CorruptRecordError:
    """The error for a consume-queue unit whose record is not where it says and was not removed by retention."""
    return CorruptRecordError(
        f"consume queue {topic}/{queue_id} offset {unit} ({cq_file.path} position "
        f"{unit * CQ_STORE_UNIT_SIZE % cq.file_size}) says commitlog offset {phy}, {size} bytes, but {why}; the "
        f"message is not returned nor skipped (rocketstore verify --repair rebuilds the queue from the commitlog)",
        path=cq_file.path, offset=phy)


def signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 0x100000000 if v & 0x80000000 else v


class UnitChecks:
    """StoreReader's checks of units against the commitlog (a mixin: the methods use the reader's files)."""

    def _gone_unit_record(self, cq: ConsumeQueue, cq_file: Any, index: int, phy: int, size: int, read_body: bool,
                          topic: str, topic_bytes: bytes, queue_id: int
                          ) -> tuple[MessageExt | None, CorruptRecordError | None]:
        """What a get makes of unit ``index`` when it names no record the store holds: a blank unit (0,
        2147483647), or one pointing below the local commitlog (and not into the tier).  (its record, None)
        when the record is found after all, (None, None) when retention removed it, else (None, the error
        naming the damage).

        Blank units stand for records that are gone: before a queue's first
        message, or written by a rebuild for queue offsets no record was found
        for; a unit pointing below the commitlog's minimum names an expired
        record.  But a unit can be damaged into either shape.  Records are in
        commitlog order, so this unit's record lay between the records of the
        units around it that name one: when the next one's lies below the
        lowest readable offset, it is gone; when the previous one's ends inside
        the store, it must be there; in between it is looked for by a walk of
        the trusted records from the local minimum: the queue's first record
        there tells whether this one lay below it (removed) or not.
        """
        floor = self.min_readable_offset()
        local_min = self.commitlog.min_offset()
        prev_end = 0  # no unit before it names a record: its record lay anywhere from the log's start
        for i in range(index - 1, max(cq.min_offset_in_queue, index - BLANK_LOOK_BACK) - 1, -1):
            unit = cq.get_unit(i)
            if unit is None:
                break
            if unit[0] >= 0 and 0 < unit[1] < BLANK_UNIT_SIZE:
                prev_end = unit[0] + unit[1]
                break
        next_index, next_start = next_naming_unit(cq, index)
        if next_start is not None and prev_end <= next_start <= floor:
            return None, None  # it lay before a record retention removed
        blank = size == BLANK_UNIT_SIZE
        if prev_end >= local_min:  # it lay after a record the store holds: it must be there
            msg = self._misplaced_unit_record(cq, index, phy, size, read_body, topic, topic_bytes, queue_id,
                                              after=prev_end)
            if msg is not None:
                return msg, None
            what = "it is a blank unit" if blank else "that lies below the commitlog's minimum"
            return None, lost_unit(cq, cq_file, topic, queue_id, index, phy, size,
                                    f"{what}, yet its record lay at or after commitlog offset {prev_end}, which the "
                                    f"store still holds (lowest readable offset {floor}): a lost unit, not "
                                    "retention")
        if floor < local_min:  # the tier holds [floor, local_min): its own unit says where the record is
            msg, expired = self._tier_queue_record(topic, topic_bytes, queue_id, index, read_body)
            if msg is not None:
                return msg, None
            if expired:
                return None, None
        verdict, at, first = self.queue_start(topic, queue_id, local_min)
        if verdict == "found" and next_start is not None and (at > next_start or first > next_index):
            verdict = "damaged"  # the queue's "first" record contradicts the next unit: one of them is damaged
        if verdict == "found" and index >= first:  # it lay after the queue's first record the store holds
            if index > first:
                verdict, at, qoff = self._queue_record_from(at, topic_bytes, queue_id, index)
                if verdict == "found" and qoff > index:
                    verdict = "after"
            if verdict == "found":
                msg = self._decode_at(at, read_body, topic, topic_bytes, queue_id, index)
                if msg is not None:
                    return msg, None
                verdict = "damaged"
            elif verdict != "damaged" and verdict != "far":
                verdict = "lost"
        elif verdict in ("found", "end") and floor == local_min:
            return None, None  # the queue's records in the commitlog start past it: it lay below the minimum
        why = {"found": f"the tier does not hold it and the queue's first record from the local minimum {local_min} "
                        f"(at {at}) comes after it",
               "end": f"no record of the queue follows the local minimum {local_min} and the tier does not hold it",
               "lost": f"its record is not among the queue's records after its first one (at {at})",
               "damaged": f"the walk of the commitlog looking for its record met a damaged record at {at}",
               "far": f"its record was not found within {MISPLACED_SEARCH_BYTES} bytes of the walk's start"}[verdict]
        what = "it is a blank unit" if blank else "that lies below the commitlog's minimum"
        return None, lost_unit(cq, cq_file, topic, queue_id, index, phy, size,
                                f"{what} and {why}: a lost unit or damage, not known to be retention")

    def settle_queue_min(self, cq: ConsumeQueue) -> None:
        """Move a queue's minimum past the blank units it rests on whose records retention removed.

        ConsumeQueue.correct_min_offset leaves the minimum on a blank unit it
        cannot judge (no unit before it in the file names an expired record,
        or the one that does ends before the minimum while the next one's
        record is kept): before a queue's first message, or a unit lost or
        damaged whose record may be intact.  The queue's first record in the
        commitlog (:meth:`queue_start`) decides: blank units below its queue
        offset lay below the minimum.  Any doubt (a tier below the local
        segments, a damaged record on the way) keeps the minimum where it is,
        so that reads of those units decide, naming any damage.
        """
        blank = cq.blank_min
        cq.blank_min = None
        if blank is None or self.min_readable_offset() != self.commitlog.min_offset():
            return
        at, naming = blank
        verdict, _phy, first = self.queue_start(cq.topic, cq.queue_id)
        if verdict == "end" and naming is None:
            self._settle_blank_queue(cq, at)
            return
        if verdict != "found" or first <= at or (naming is not None and first > naming):
            return  # (past the next unit naming a record: that record's queue offset is damaged)
        target = first if naming is None or first < naming else naming
        if target * CQ_STORE_UNIT_SIZE > cq.min_logic_offset:
            log.info("%s-%d: units %d..%d are blank and the queue's first record in the commitlog is at queue "
                     "offset %d: its minimum moves to %d", cq.topic, cq.queue_id, at, target - 1, first, target)
            cq.min_logic_offset = target * CQ_STORE_UNIT_SIZE

    def _settle_blank_queue(self, cq: ConsumeQueue, at: int) -> None:
        """(settle_queue_min)  The walk of the whole local log found no record of the queue: when no unit from
        ``at`` to the queue's end names one either, those blank units hold no message (a queue placed at its
        registered offset after its records expired or were lost, whose units a lost log tail then took): the
        queue is empty, its minimum moves to its end."""
        end = cq.max_offset_in_queue
        if end - at > BLANK_QUEUE_SCAN:
            return  # (a long run of blank units: left to the reads, which name what they find)
        for i in range(at, end):
            unit = cq.get_unit(i)
            if unit is None or 0 < unit[1] < BLANK_UNIT_SIZE:
                return
        log.info("%s-%d: units %d..%d are blank and the commitlog holds no record of the queue: it is empty, its "
                 "minimum moves to %d", cq.topic, cq.queue_id, at, end - 1, end)
        cq.min_logic_offset = end * CQ_STORE_UNIT_SIZE

    def queue_start(self, topic: str, queue_id: int, local_min: int | None = None) -> tuple[str, int, int]:
        """(verdict, commitlog offset, queue offset) of the queue's first trusted record at or after the local
        commitlog minimum, from a walk of the records there (see :meth:`_queue_record_from`), kept until the
        minimum moves (or, when none was found, the log grows): the truth a blank unit at a queue's start, or
        one after its last expired unit, is judged by."""
        if local_min is None:
            local_min = self.commitlog.min_offset()
        key = (topic, queue_id)
        stamp = (local_min, None)
        hit = self._queue_starts.get(key)
        if hit is not None and hit[0] in (stamp, (local_min, self.commitlog.max_offset())):
            return hit[1]
        try:
            topic_bytes = topic.encode("utf-8")
        except UnicodeEncodeError:
            return "end", local_min, 0
        found = self._queue_record_from(local_min, topic_bytes, queue_id, 0)
        if found[0] != "found":
            stamp = (local_min, self.commitlog.max_offset())
        self._queue_starts[key] = (stamp, found)
        return found

    def _decode_at(self, phy: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int, index: int
                   ) -> MessageExt | None:
        seg = self.commitlog.queue.find(phy)
        if seg is None or not seg.hold():
            return None
        try:
            pos = phy - seg.file_from_offset
            size = codec.read_total_size(seg.mm, pos)
            if size <= 0 or pos + size > seg.wrote_position:
                return None
            return codec.decode_unit(seg.mm, pos, size, read_body, topic, topic_bytes, queue_id, index)
        finally:
            seg.release()

    def _queue_record_from(self, start: int, topic_bytes: bytes, queue_id: int, index: int
                           ) -> tuple[str, int, int]:
        """Walk the trusted records from commitlog offset ``start`` (where a record or a segment begins) to the
        first of the queue whose queue offset is ``index`` or more.

        ("found", its offset, its queue offset); ("end", the log's end, -1)
        when the log ends first; ("damaged", offset, -1) at a record that fails
        its checks, or zeros inside the written records; ("far", offset, -1)
        past MISPLACED_SEARCH_BYTES.
        """
        cl = self.commitlog
        end, stop, off = cl.max_offset(), start + MISPLACED_SEARCH_BYTES, start
        while off < end:
            if off >= stop:
                return "far", off, -1
            seg = cl.queue.find(off)
            if seg is None or not seg.hold():
                return "damaged", off, -1
            try:
                base, mm = seg.file_from_offset, seg.mm
                nxt = off
                for pos, rsize, parsed, _problem in codec.walk(mm, off - base, seg.wrote_position, check_crc=False,
                                                               parsed=True, base=base):
                    if parsed is None:
                        if rsize == 0:  # the blank record that ends a segment
                            nxt = seg.end_offset
                            break
                        return "damaged", base + pos, -1
                    nxt = base + pos + rsize
                    h, tp, tl, _ = parsed
                    if h[3] == queue_id and h[5] >= index and h[7] & codec.TRANSACTION_MASK in codec.QUEUED_TXN and \
                            mm[tp:tp + tl] == topic_bytes:
                        return "found", base + pos, h[5]
                    if nxt >= stop:
                        return "far", nxt, -1
                else:
                    if nxt < min(seg.end_offset, end):  # zeros inside the written records: cannot see past them
                        return "damaged", nxt, -1
            finally:
                seg.release()
            if nxt <= off:
                return "damaged", off, -1
            off = nxt
        return "end", end, -1

    def _misplaced_unit_record(self, cq: ConsumeQueue, index: int, phy: int, size: int, read_body: bool,
                               topic: str, topic_bytes: bytes, queue_id: int, after: int | None = None
                               ) -> MessageExt | None:
        """The record unit ``index`` means when the record at its offset ``phy`` is not it, or None.

        A bit flip in a unit's size or offset must not cost the intact message
        (a get would stop at it until ``verify --repair``), nor hand out another
        one.  Only a record that names itself as this unit's is taken: its
        topic, queue id and queue offset, a PHYSICALOFFSET equal to its position
        (and its body CRC when bodies are read).  Looked for at ``phy`` by the
        record's own TOTALSIZE (the unit's size damaged), then walking the
        records from the end of the previous unit's record up to the next
        unit's offset, at most ``MISPLACED_SEARCH_BYTES`` (its offset damaged).
        """
        try:
            prev = cq.get_unit(index - 1) if index > 0 else None
            nxt = cq.get_unit(index + 1)
        except ValueError:  # a neighbouring queue file retention closed meanwhile: no bounds to walk between
            prev = nxt = None
        starts = [phy]
        if after is not None:  # where the record of the last unit before it naming one ends
            starts.append(after)
        elif prev is not None and prev[0] >= 0 and 0 < prev[1] < 0x7FFFFFFF:
            starts.append(prev[0] + prev[1])
        hi = nxt[0] if nxt is not None and nxt[0] >= 0 and 0 < nxt[1] < 0x7FFFFFFF else None
        for k, start in enumerate(starts):
            seg = self.commitlog.queue.find(start)
            if seg is None or not seg.hold():
                continue
            try:
                base = seg.file_from_offset
                limit = seg.wrote_position
                stop = limit
                if k:  # the walk between the neighbours' records
                    stop = min(limit, start - base + MISPLACED_SEARCH_BYTES, limit if hi is None else hi - base)
                records = codec.walk(seg.mm, start - base, stop, check_crc=False, parsed=True)
                for pos, rsize, parsed, _ in (records if k else islice(records, 1)):  # k == 0: the one at phy
                    if parsed is None or rsize <= 0:
                        break
                    h = parsed[0]
                    if h[6] == base + pos and h[3] == queue_id and h[5] == index:
                        msg = codec.decode_unit(seg.mm, pos, rsize, read_body, topic, topic_bytes, queue_id, index)
                        if msg is not None:
                            log.warning("%s-%d: unit %d says (%d, %d) but its record is at %d, %d bytes: a damaged "
                                        "unit (verify --repair rebuilds the queue)", topic, queue_id, index, phy,
                                        size, base + pos, rsize)
                            return msg
                        # else another topic's record of the same queue id and offset, or this one damaged
            finally:
                seg.release()
        return None
