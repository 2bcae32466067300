"""TierUploadService: copies sealed files to the tier, oldest first, and publishes each in the manifest.

A commitlog segment is sealed when a later segment exists and the flush has
passed its end (a torn, unflushed segment is never uploaded), and it passes
a trusted walk: damage sealed into the tier could not be repaired there, so a
segment with a damaged record stays local (and blocks the ones after it)
until ``verify --repair`` mends it.  Segments go up
in offset order with no gap, so the tier is one continuous offset range.  A
consume-queue file goes up when it is full and its last unit's record is in
the tier; an index file when it is no longer the one being written and its
last entry's record is in the tier.  Each object is uploaded (fsynced on a
``file://`` tier), read back and its CRC-32 compared with the local bytes,
then the manifest rewritten: an interrupted round leaves at worst an
object the manifest does not list, which the next round uploads again.
"""

from __future__ import annotations

import copy
import logging
import os
import struct
import time
from typing import TYPE_CHECKING, Any

from ..format import codec
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..services.base import ServiceThread
from .manifest import TierIndexFile, TierManifest, TierQueueFile, TierSegment
from ..errors import TierError
from .reader import index_key, queue_key, segment_key
from .retention import expire_round

if TYPE_CHECKING:
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)

_UNIT = struct.Struct(">qiq")


class TierUploadService(ServiceThread):
    name = "TierUploadService"

    def __init__(self, files: "StoreFiles") -> None:
        super().__init__(files.config.tieredStoreUploadInterval / 1000.0, initial_delay=0.5)
        self.files = files
        self._last_error: str | None = None
        self._last_blocked: str | None = None

    def run_once(self) -> None:
        try:
            upload_round(self.files)
        except TierError as e:  # the tier is down: local files stay until it is back
            if str(e) != self._last_error:  # once per distinct failure, not every round
                log.error("tier upload: %s", e)
            self._last_error = str(e)
            self.files.tier.error = str(e)
        else:
            self._last_error = None
        blocked = self.files.tier.upload_blocked
        if blocked is not None and blocked != self._last_blocked:  # once, not every round
            log.error("tier upload: %s", blocked)
        self._last_blocked = blocked


def upload_round(files: "StoreFiles", max_segments: int | None = None) -> dict[str, int]:
    """Upload what is sealed and not yet in the tier; returns counts of objects uploaded by kind."""
    tier = files.tier
    assert tier is not None
    with tier.lock:
        m = tier.refresh(quiet=True)
        if tier.error is not None:
            if tier.fault is None or not tier.republishable:
                raise TierError(tier.error)
            m = tier.republish()  # tier.json lost or stale: put the local copy back once its objects check out
        # A copy: segments are added to it before it is published, and readers must not see them until then.
        m = tier.new_manifest() if m is None else copy.deepcopy(m)
        done = {"segments": 0, "queueFiles": 0, "indexFiles": 0, "expiredSegments": 0}
        done["segments"] = _upload_segments(files, m, max_segments)
        if done["segments"] or not m.updated_at:
            tier.publish(m)
        done["queueFiles"] = _upload_queue_files(files, m)
        done["indexFiles"] = _upload_index_files(files, m)
        if done["queueFiles"] or done["indexFiles"]:
            tier.publish(m)
        done["expiredSegments"] = expire_round(files, int(files.clock() * 1000))
        if any(done.values()):
            log.info("tier %s: uploaded %s", tier.loc.uri, done)
        return done


def _upload_segments(files: "StoreFiles", m: TierManifest, max_segments: int | None) -> int:
    tier, cl = files.tier, files.commitlog
    assert tier is not None
    segments = list(cl.queue.files)
    flushed = cl.queue.flushed_where
    tier.upload_blocked = None
    n = 0
    for f in segments[:-1]:
        if f.file_from_offset < m.end_offset:
            continue
        if m.commitlog and f.file_from_offset != m.end_offset:
            tier.error = (f"{tier.loc.uri}: the tier ends at {m.end_offset} but the next local segment is "
                          f"{f.path}; a segment was deleted before it was uploaded, uploads stopped")
            raise TierError(tier.error)
        if flushed < f.end_offset:
            break
        why = upload_blocker(f)
        if why is not None:  # (the upload service logs it, the CLI raises it)
            tier.upload_blocked = why
            break
        if not f.hold():
            break
        try:
            first_ts = codec.read_store_timestamp(f.mm, 0) if f.wrote_position >= codec.PREFIX_SIZE + 8 else 0
        except Exception:  # noqa: BLE001 - a segment that starts with a blank record has no store time
            first_ts = 0
        finally:
            f.release()
        name = os.path.basename(f.path)
        crc = tier.objects.put_file(f.path, segment_key(name), f.file_size)
        m.commitlog.append(TierSegment(name, f.file_size, crc, first_ts))
        tier.publish(m)  # each segment counts as soon as it is up: retention may free it
        n += 1
        if max_segments is not None and n >= max_segments:
            break
    return n


def upload_blocker(f: Any) -> str | None:
    """Why sealed segment ``f`` (a MappedFile) must not go to the tier, or None: a damaged record in it."""
    if not f.hold():
        return None
    try:
        damage = segment_damage(f.mm, f.file_size, f.file_from_offset)
    finally:
        f.release()
    if damage is None:
        return None
    return (f"{f.path} at file position {damage[0]} (commitlog offset {f.file_from_offset + damage[0]}): "
            f"{damage[1]}; the segment is not uploaded, nor any after it (the tier has no gaps), until rocketstore "
            "verify --repair mends it: damage sealed into the tier could not be repaired there")


def segment_damage(buf: Any, size: int, base: int) -> tuple[int, str] | None:
    """The first damage in a sealed segment that has intact records after it, as (file position, reason), or
    None.  A trusted walk (data-safety rule 1: magic, sizes, PHYSICALOFFSET, BODYCRC) of ``buf[:size]``; it
    ends well at the blank record that closes the segment, or at zeros with no trusted record after them."""
    pos = 0
    while pos < size:
        pos = codec.scan_records(buf, pos, size, size, base=base, check_crc=True)[0]
        if pos >= size:
            return None
        n, msg, reason = codec.check(buf, pos, size, check_crc=True, base=base)
        if n == 0:
            return None  # the blank record: the segment's end
        if msg is not None:  # accepted by the full check (the fast loop is stricter on a few shapes): go on
            pos += n
            continue
        if buf[pos:pos + 8] == bytes(8):
            after = codec.find_record(buf, pos, size, base, check_crc=True)
            if after is None:
                return None  # zeros to the end: no record lost
            return pos, f"zeros where a record should be, with a record at file position {after} after them"
        return pos, reason or "not a record"
    return None


def _upload_queue_files(files: "StoreFiles", m: TierManifest) -> int:
    tier = files.tier
    assert tier is not None
    n = 0
    size = files.config.mappedFileSizeConsumeQueue
    for cq in files.consume_queues():
        key = f"{cq.topic}/{cq.queue_id}"
        have = {f.name for f in m.consumequeue.get(key, [])}
        for f in list(cq.queue.files)[:-1]:
            name = os.path.basename(f.path)
            if name in have or not f.hold():
                continue
            try:
                # The last unit decides first: a file whose records are not all in the tier yet is looked at
                # again every round, and unpacking all its units (300,000 by default) each time is waste.
                last_phy, last_size, _ = _UNIT.unpack_from(f.mm, size - CQ_STORE_UNIT_SIZE)
                if last_size <= 0 or last_phy + last_size > m.end_offset:
                    break  # not yet all in the tier (or not full): later
                units = [_UNIT.unpack_from(f.mm, i) for i in range(0, size, CQ_STORE_UNIT_SIZE)]
            finally:
                f.release()
            if any(s <= 0 for _, s, _ in units):
                log.warning("tier: %s has blank units; not uploaded", f.path)
                break
            min_index = next((i for i, (phy, _, _) in enumerate(units) if phy >= m.min_offset), None)
            if min_index is None:
                continue  # every record it points at was gone before the tier began
            tier.objects.put_file(f.path, queue_key(cq.topic, cq.queue_id, name), size)
            segments = m.consumequeue.setdefault(key, [])
            segments.append(TierQueueFile(name, int(name) // CQ_STORE_UNIT_SIZE + min_index, len(units), last_phy))
            segments.sort(key=lambda x: int(x.name))
            n += 1
    return n


def _upload_index_files(files: "StoreFiles", m: TierManifest) -> int:
    tier, svc = files.tier, files.index_service
    assert tier is not None
    have = {f.name for f in m.index}
    with svc.lock:
        segments = list(svc.files[:-1])
    n = 0
    for f in segments:
        name = os.path.basename(f.path)
        if name in have:
            continue
        if f.end_phy_offset >= m.end_offset or f.end_phy_offset < m.min_offset:
            if f.end_phy_offset >= m.end_offset:
                break
            continue
        f.flush()
        tier.objects.put_file(f.path, index_key(name), len(f.mm))
        m.index.append(TierIndexFile(name, f.begin_timestamp, f.end_timestamp, f.begin_phy_offset,
                                     f.end_phy_offset))
        m.index.sort(key=lambda x: x.name)
        n += 1
    return n


def wait_uploaded(files: "StoreFiles", offset: int, timeout: float = 30.0) -> bool:
    """Block until the tier holds every segment below ``offset`` (tests and ``tier upload --wait``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        t = files.tier
        if t is not None and t.manifest is not None and t.manifest.end_offset >= offset:
            return True
        time.sleep(0.05)
    return False
