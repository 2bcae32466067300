"""TierUploadService: copies sealed files to the tier, oldest first, and publishes each in the manifest.

A commitlog segment is sealed when a later segment exists and the flush has
passed its end (a torn, unflushed segment is never uploaded).  Segments go up
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
from typing import TYPE_CHECKING

from ..format import codec
from ..storage.consume_queue import CQ_STORE_UNIT_SIZE
from ..services.base import ServiceThread
from .manifest import TierIndexFile, TierManifest, TierQueueFile, TierSegment
from .objectstore import TierError
from .reader import index_key, queue_key, segment_key
from .retention import expire_round

if TYPE_CHECKING:
    from ..store import MessageStore

log = logging.getLogger(__name__)

_UNIT = struct.Struct(">qiq")


class TierUploadService(ServiceThread):
    name = "TierUploadService"

    def __init__(self, store: "MessageStore") -> None:
        super().__init__(store.config.tieredStoreUploadInterval / 1000.0, initial_delay=0.5)
        self.store = store
        self._last_error: str | None = None

    def run_once(self) -> None:
        try:
            upload_round(self.store)
        except TierError as e:  # the tier is down: local files stay until it is back
            if str(e) != self._last_error:  # once per distinct failure, not every round
                log.error("tier upload: %s", e)
            self._last_error = str(e)
            self.store.tier.error = str(e)
        else:
            self._last_error = None


def upload_round(store: "MessageStore", max_segments: int | None = None) -> dict[str, int]:
    """Upload what is sealed and not yet in the tier; returns counts of objects uploaded by kind."""
    tier = store.tier
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
        done["segments"] = _upload_segments(store, m, max_segments)
        if done["segments"] or not m.updated_at:
            tier.publish(m)
        done["queueFiles"] = _upload_queue_files(store, m)
        done["indexFiles"] = _upload_index_files(store, m)
        if done["queueFiles"] or done["indexFiles"]:
            tier.publish(m)
        done["expiredSegments"] = expire_round(store, int(store.clock() * 1000))
        if any(done.values()):
            log.info("tier %s: uploaded %s", tier.loc.uri, done)
        return done


def _upload_segments(store: "MessageStore", m: TierManifest, max_segments: int | None) -> int:
    tier, cl = store.tier, store.commitlog
    assert tier is not None
    files = list(cl.queue.files)
    flushed = cl.queue.flushed_where
    n = 0
    for f in files[:-1]:
        if f.file_from_offset < m.end_offset:
            continue
        if m.commitlog and f.file_from_offset != m.end_offset:
            tier.error = (f"{tier.loc.uri}: the tier ends at {m.end_offset} but the next local segment is "
                          f"{f.path}; a segment was deleted before it was uploaded, uploads stopped")
            raise TierError(tier.error)
        if flushed < f.end_offset or not f.hold():
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


def _upload_queue_files(store: "MessageStore", m: TierManifest) -> int:
    tier = store.tier
    assert tier is not None
    n = 0
    size = store.config.mappedFileSizeConsumeQueue
    for cq in store.consume_queues():
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
            files = m.consumequeue.setdefault(key, [])
            files.append(TierQueueFile(name, int(name) // CQ_STORE_UNIT_SIZE + min_index, len(units), last_phy))
            files.sort(key=lambda x: int(x.name))
            n += 1
    return n


def _upload_index_files(store: "MessageStore", m: TierManifest) -> int:
    tier, svc = store.tier, store.index_service
    assert tier is not None
    have = {f.name for f in m.index}
    with svc.lock:
        files = list(svc.files[:-1])
    n = 0
    for f in files:
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


def wait_uploaded(store: "MessageStore", offset: int, timeout: float = 30.0) -> bool:
    """Block until the tier holds every segment below ``offset`` (tests and ``tier upload --wait``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        t = store.tier
        if t is not None and t.manifest is not None and t.manifest.end_offset >= offset:
            return True
        time.sleep(0.05)
    return False
