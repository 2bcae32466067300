"""TierReader: records, consume-queue units and index entries read from the tier with ranged GETs.

Reads go through a small LRU cache of fixed blocks, so a consumer reading a
queue in order, or a walk over a segment, costs one GET per block rather than
one per record.  Every failure names the tier URI, the object and the offset.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from typing import Iterator

from ..format import codec
from ..format.codec import MessageExt
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..errors import CorruptRecordError
from ..storage.index import ENTRY_SIZE, HEADER_SIZE, SLOT_SIZE, walk_chain
from .manifest import TierManifest, TierSegment
from ..errors import TierError
from .objectstore import ObjectStore

BLOCK = 256 * 1024
CACHE_BLOCKS = 64  # 16 MiB
SCAN_WINDOW = 4 * 1024 * 1024
RESYNC_WINDOW = 32 * 1024 * 1024  # bytes searched at a time for the next trusted record after damage
RESYNC_OVERLAP = 8 * 1024 * 1024  # more than a record's largest size (maxMessageSize 4 MiB): none is cut twice
_UNIT = struct.Struct(">qiq")
_HEADER = struct.Struct(">qqqqii")
_ENTRY = struct.Struct(">iqii")
_SLOT = struct.Struct(">i")


def segment_key(name: str) -> str:
    return f"commitlog/{name}"


def queue_key(topic: str, queue_id: int, name: str) -> str:
    return f"consumequeue/{topic}/{queue_id}/{name}"


def index_key(name: str) -> str:
    return f"index/{name}"


class TierReader:
    def __init__(self, objects: ObjectStore, manifest: TierManifest, *, cache_blocks: int = CACHE_BLOCKS) -> None:
        self.objects = objects
        self.manifest = manifest
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._lock = threading.Lock()
        # Set by TieredStorage when the manifest in hand is not one it can trust (tier.json missing, stale,
        # malformed): every read raises it rather than answer from a list that may be wrong or empty.
        self.fault: str | None = None

    def _check(self) -> None:
        if self.fault is not None:
            raise TierError(self.fault)

    def where(self, key: str) -> str:
        return self.objects.loc.key(key) if self.objects.loc.scheme == "file" else \
            f"s3://{self.objects.loc.key(key)}"

    # ------------------------------------------------------------ bytes
    def _block(self, key: str, n: int) -> bytes:
        with self._lock:
            b = self._cache.get((key, n))
            if b is not None:
                self._cache.move_to_end((key, n))
                return b
        b = self.objects.read(key, n * BLOCK, BLOCK)
        with self._lock:
            self._cache[(key, n)] = b
            while len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
        return b

    def read(self, key: str, pos: int, length: int) -> bytes:
        """``length`` bytes at ``pos`` (fewer at the object's end); large reads bypass the cache."""
        self._check()
        if length >= 4 * BLOCK:
            return self.objects.read(key, pos, length)
        parts = []
        end = pos + length
        while pos < end:
            n, off = divmod(pos, BLOCK)
            b = self._block(key, n)
            part = b[off:off + end - pos]
            if not part:
                break
            parts.append(part)
            pos += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # ------------------------------------------------------------ commitlog
    def _segment(self, offset: int) -> TierSegment:
        self._check()
        seg = self.manifest.segment_for(offset)
        if seg is None:
            raise CorruptRecordError(f"commitlog offset {offset} is not in the tier {self.objects.loc.uri} "
                                     f"(it holds [{self.manifest.min_offset}, {self.manifest.end_offset}))",
                                     offset=offset)
        return seg

    def record_bytes(self, offset: int, size: int | None = None) -> tuple[bytes, str]:
        """The bytes of the record at ``offset`` (``size`` from a consume-queue unit, else its TOTALSIZE)."""
        seg = self._segment(offset)
        key = segment_key(seg.name)
        pos = offset - seg.base
        if size is None:
            head = self.read(key, pos, 4)
            size = codec.read_total_size(head, 0) if len(head) == 4 else 0
            if size <= 0 or pos + size > seg.size:
                raise CorruptRecordError(f"{self.where(key)} at offset {offset} (file position {pos}): "
                                         f"no record there (size field {size})", path=self.where(key), offset=offset)
        return self.read(key, pos, size), key

    def read_message(self, offset: int, *, read_body: bool = True, check_crc: bool = False) -> MessageExt:
        buf, key = self.record_bytes(offset)
        try:
            return codec.decode_at(buf, 0, len(buf), offset, check_crc=check_crc, read_body=read_body)
        except codec.RecordError as e:
            seg = self._segment(offset)
            raise CorruptRecordError(f"{self.where(key)} at offset {offset} (file position {offset - seg.base}): "
                                     f"{e}", path=self.where(key), offset=offset) from None

    def store_timestamp(self, offset: int) -> int:
        buf, _ = self.record_bytes(offset)
        return codec.read_store_timestamp(buf, 0)

    def scan(self, from_offset: int, end: int, *, check_crc: bool = False, read_body: bool = True
             ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        """CommitLog.scan's (offset, size, message, problem) over the tier's segments, ``from_offset`` to ``end``."""
        self._check()
        offset = max(from_offset, self.manifest.min_offset)
        stop = min(end, self.manifest.end_offset)
        file_size = self.manifest.geometry["mappedFileSizeCommitLog"]
        while offset < stop:
            seg = self._segment(offset)
            key = segment_key(seg.name)
            pos = offset - seg.base
            limit = min(seg.size, stop - seg.base)
            window = SCAN_WINDOW
            while pos < limit:
                buf = self.objects.read(key, pos, min(window, seg.size - pos))
                nxt, finished = pos, False
                for p, size, msg, reason in codec.walk(buf, 0, len(buf), check_crc=check_crc, read_body=read_body,
                                                       base=seg.base + pos):
                    if pos + p >= limit or size == 0:  # the range's end, or the blank record that ends a segment
                        finished = True
                        break
                    if msg is None:
                        whole = codec.read_total_size(buf, p) if len(buf) - p >= 4 else 0
                        if pos + len(buf) < seg.size and (len(buf) - p < 4 or p + whole > len(buf)):
                            window = max(window, whole + 8)  # the window cut this record: read again from it
                            break
                        yield seg.base + pos + p, size, None, f"{self.where(key)} at file position {pos + p}: {reason}"
                        return
                    yield seg.base + pos + p, size, msg, None
                    nxt = pos + p + size
                else:
                    if nxt < pos + len(buf) or not buf:  # zeros before the end of a sealed segment
                        yield seg.base + nxt, -1, None, f"{self.where(key)} at file position {nxt}: no record and no blank"
                        return
                if finished:
                    break
                pos = nxt
            offset = seg.base + file_size

    def next_record_after(self, offset: int, *, check_crc: bool = True) -> int:
        """Where a walk resumes after the damage it met at ``offset``: the first trusted record after it in
        the same segment (:func:`codec.find_record`, as the local walk resynchronises), else the next
        segment's start (the manifest's end after the last), which the walk then checks in turn.

        The damaged record is named by the walk; what follows it is still the tier's to give, so a walk
        that stopped there would lose every intact message after one bad record."""
        seg = self._segment(offset)
        key = segment_key(seg.name)
        pos = offset - seg.base + 1
        while pos < seg.size:
            n = min(RESYNC_WINDOW, seg.size - pos)
            buf = self.read(key, pos, n)
            if not buf:
                break
            # (a blank record counts only where it ends the segment, that is, where ``buf`` reaches the end)
            found = codec.find_record(buf, 0, len(buf), seg.base + pos, check_crc=check_crc)
            if found is not None:
                return seg.base + pos + found
            if pos + len(buf) >= seg.size:
                break
            pos += max(len(buf) - RESYNC_OVERLAP, 1)  # a record the window cut is found in the next one
        return seg.base + seg.size

    # ------------------------------------------------------------ consume queues
    def units(self, topic: str, queue_id: int, index: int, count: int) -> list[tuple[int, int, int]]:
        """Up to ``count`` (commitlog offset, size, tags code) units from queue offset ``index`` (one file)."""
        self._check()
        files = self.manifest.queue_files(topic, queue_id)
        size = self.manifest.geometry["mappedFileSizeConsumeQueue"]
        per_file = size // CQ_STORE_UNIT_SIZE
        base = index * CQ_STORE_UNIT_SIZE - (index * CQ_STORE_UNIT_SIZE) % size
        for f in files:
            if int(f.name) == base:
                first = index - base // CQ_STORE_UNIT_SIZE
                n = min(count, f.units - first, per_file - first)
                if n <= 0:
                    return []
                raw = self.read(queue_key(topic, queue_id, f.name), first * CQ_STORE_UNIT_SIZE,
                                n * CQ_STORE_UNIT_SIZE)
                return [_UNIT.unpack_from(raw, i * CQ_STORE_UNIT_SIZE)
                        for i in range(len(raw) // CQ_STORE_UNIT_SIZE)]
        return []

    # ------------------------------------------------------------ index
    def select(self, full_key: str, max_num: int, begin: int, end: int, skip: set[str]) -> list[int]:
        """Offsets of index entries for ``topic#key`` in the tier's index files (newest first), as
        IndexFile.select walks a local file; files named in ``skip`` (present locally) are not read."""
        self._check()
        slots = self.manifest.geometry["maxHashSlotNum"]
        h = codec.index_key_hash(full_key)
        out: list[int] = []
        for f in reversed(self.manifest.index):
            if f.name in skip:
                continue
            fb, fe = f.begin_timestamp, f.end_timestamp
            if not ((begin < fb and end > fe) or fb <= begin <= fe or fb <= end <= fe):
                if fb < begin:
                    break
                continue
            key = index_key(f.name)
            count = _HEADER.unpack_from(self.read(key, 0, HEADER_SIZE), 0)[5]
            cur = _SLOT.unpack_from(self.read(key, HEADER_SIZE + (h % slots) * SLOT_SIZE, SLOT_SIZE), 0)[0]
            base = HEADER_SIZE + SLOT_SIZE * slots
            walk_chain(lambda n, key=key: _ENTRY.unpack_from(self.read(key, base + n * ENTRY_SIZE, ENTRY_SIZE), 0),
                       cur, count, h, fb, out, max_num, begin, end)
            if fb < begin or len(out) >= max_num:
                break
        return out
