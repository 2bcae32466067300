"""The reads that reach the tier (files.tier, duck-typed: the tier layer sits above this one): a unit whose
record left the local disk, a queue's minimum and a time lookup below the local consume queue."""

from __future__ import annotations



from ..errors import CorruptRecordError, StoreError, TierError
from ..format import codec
from ..format.codec import MessageExt
from ..format.message import GetMessageResult, GetMessageStatus
from .consume_queue import LOWER
from .read_units import BLANK_UNIT_SIZE, signed32


class TierReads:
    """StoreReader's tier half (a mixin: the methods use the reader's files)."""

    def _tier_queue_record(self, topic: str, topic_bytes: bytes, queue_id: int, index: int, read_body: bool
                           ) -> tuple[MessageExt | None, bool]:
        """(the record the tier's own unit ``index`` of the queue names, or None; whether the tier's queue
        starts past ``index``, so that the record was removed from the tier too)."""
        t = self.tier
        if t is None or t.fault is not None or t.reader is None or t.manifest is None:
            return None, False
        rng = t.manifest.queue_range(topic, queue_id)
        if rng is None:
            return None, False
        if index < rng[0]:
            return None, True
        if index >= rng[1]:
            return None, False
        try:
            units = t.reader.units(topic, queue_id, index, 1)
            if not units or not 0 < units[0][1] < BLANK_UNIT_SIZE:
                return None, False
            phy, size, _ = units[0]
            if self.commitlog.in_tier(phy):
                return self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, index), False
            return self.local_unit_record(phy, size, read_body, topic, topic_bytes, queue_id, index), False
        except StoreError:
            return None, False

    def _tier_unit(self, phy: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                   queue_offset: int) -> MessageExt | None:
        """The record of a unit whose segment is only in the tier (None when it is not the unit's record)."""
        buf, _ = self.tier.reader.record_bytes(phy, size)
        if len(buf) < size:
            return None
        return codec.decode_unit(buf, 0, size, read_body, topic, topic_bytes, queue_id, queue_offset)

    def _tier_damaged(self, phy: int, size: int, topic: str, queue_id: int, queue_offset: int) -> CorruptRecordError:
        reader = self.tier.reader
        seg = reader.manifest.segment_for(phy)
        where = reader.where(f"commitlog/{seg.name}") if seg else self.tier.loc.uri
        return CorruptRecordError(f"{where} at offset {phy}: the record is not the one {topic}-{queue_id} unit "
                                  f"{queue_offset} points at ({size} bytes), or its body fails BODYCRC",
                                  path=where, offset=phy)

    def queue_min_with_tier(self, topic: str, queue_id: int, local_min: int) -> int:
        """A queue's lowest readable offset: where its consume-queue files in the tier begin, when lower.

        With no manifest to trust (see TieredStorage.fault) after the store deleted local segments on the
        tier's word, the tier may hold any of the queue's older messages: 0, where a read then raises the
        fault, rather than a local minimum that would have a consumer skip them unawares."""
        t = self.tier
        if t is None:
            return local_min
        if t.fault is not None and t.deleted_end > 0:
            return 0
        rng = t.manifest.queue_range(topic, queue_id) if t.manifest is not None else None
        return rng[0] if rng is not None and rng[0] < local_min else local_min

    def _get_from_tier(self, topic: str, queue_id: int, offset: int, max_msgs: int, tag_filter: set[int] | None,
                       read_body: bool, lo: int, hi: int) -> GetMessageResult:
        """get() below the local consume queue: units from the tier's queue files, records from wherever they are.

        Cold reads take RocketMQ's on-disk caps (maxTransferCountOnMessageInDisk / ...BytesOnMessageInDisk).
        A tier whose manifest cannot be trusted (missing, stale, lost locally) raises, naming the manifest:
        below the local disk is where the tier's messages are, not "too small".
        """
        t = self.tier
        if t.fault is not None:
            raise TierError(f"{topic}-{queue_id} offset {offset} lies below the local consume queue (from {lo}) and "
                            f"is read from the tier, but {t.fault}")
        reader = t.reader
        if reader is None:  # this store never published a manifest: nothing was moved to the tier
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        rng = reader.manifest.queue_range(topic, queue_id)
        tier_lo = rng[0] if rng is not None and rng[0] < lo else lo
        if offset < tier_lo:
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, tier_lo, tier_lo, hi)
        if rng is None or offset >= rng[1]:  # between the tier's last file and the local first: none there
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, lo, tier_lo, hi)
        cfg = self.config
        count_cap = min(max_msgs, cfg.maxTransferCountOnMessageInDisk) or 1
        byte_cap = cfg.maxTransferBytesOnMessageInDisk
        topic_bytes = topic.encode("utf-8")
        out: list[MessageExt] = []
        total = 0
        idx = offset
        status = GetMessageStatus.NO_MATCHED_MESSAGE
        stop = min(rng[1], lo if lo > offset else rng[1])
        while idx < stop and len(out) < count_cap:
            units = reader.units(topic, queue_id, idx, min(stop - idx, max(max_msgs, 32)))
            if not units:
                break
            for phy, size, tags in units:
                if out and (len(out) >= count_cap or total + size > byte_cap):
                    return GetMessageResult(GetMessageStatus.FOUND, idx, tier_lo, hi, out)
                if tag_filter is not None and signed32(tags) not in tag_filter:
                    idx += 1
                    continue
                if self.commitlog.in_tier(phy):
                    msg = self._tier_unit(phy, size, read_body, topic, topic_bytes, queue_id, idx)
                else:
                    msg = self.local_unit_record(phy, size, read_body, topic, topic_bytes, queue_id, idx)
                if msg is None:
                    if out:
                        return GetMessageResult(GetMessageStatus.FOUND, idx, tier_lo, hi, out)
                    raise self._tier_damaged(phy, size, topic, queue_id, idx)
                out.append(msg)
                total += size
                status = GetMessageStatus.FOUND
                idx += 1
        return GetMessageResult(status, idx, tier_lo, hi, out)

    def _tier_offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str, lo: int,
                             hi: int) -> int:
        """offset_by_time over queue offsets [lo, hi) held by the tier: a binary search on store times."""
        reader = self.tier.reader

        def time_at(i: int) -> int:
            unit = reader.units(topic, queue_id, i, 1)
            return self.commitlog.pickup_store_timestamp(unit[0][0], unit[0][1]) if unit else -1

        if boundary == LOWER:  # the first offset stored at or after ``timestamp``
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                if time_at(mid) >= timestamp:
                    b = mid
                else:
                    a = mid + 1
            return a
        a, b = lo, hi  # UPPER: the last offset stored at or before ``timestamp``
        while a < b:
            mid = (a + b) // 2
            if time_at(mid) <= timestamp:
                a = mid + 1
            else:
                b = mid
        return max(lo, a - 1)
