"""Tier retention (RocketMQ tieredstore's ``tieredStoreFileReservedTime``): the bucket's oldest segments expire too.

A tier segment expires once every record in it is older than the reserved time, known when the next tier
segment's first record is (so the newest tier segment stays).  The manifest is published without the expired
files before their objects are deleted: a reader sees either the old list with the objects still there, or the
new list; queue minimums move to the first unit whose record the tier still holds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .manifest import TierManifest
from .reader import index_key, queue_key, segment_key

if TYPE_CHECKING:
    from ..storage.files import StoreFiles

log = logging.getLogger(__name__)


def expired_segments(m: TierManifest, now_ms: int, reserved_hours: int) -> int:
    """How many of the tier's oldest segments have expired (0 when ``reserved_hours`` <= 0: kept forever)."""
    if reserved_hours <= 0:
        return 0
    cutoff = now_ms - reserved_hours * 3600 * 1000
    n = 0
    for seg, nxt in zip(m.commitlog, m.commitlog[1:]):
        if nxt.first_store_time <= 0 or nxt.first_store_time > cutoff:
            break
        n += 1
    return n


def expire_round(files: "StoreFiles", now_ms: int) -> int:
    """Drop expired segments (and the queue and index files wholly below them) from the tier; return the count
    of segments dropped.  Called with the tier's lock held, after the manifest was refreshed."""
    tier = files.tier
    assert tier is not None and tier.manifest is not None
    m = tier.manifest
    n = expired_segments(m, now_ms, files.config.tieredStoreFileReservedTime)
    if n == 0:
        return 0
    gone_segments = m.commitlog[:n]
    new_min = m.commitlog[n].base
    kept = TierManifest(m.store_id, dict(m.geometry), m.commitlog[n:], {}, [], m.updated_at, m.generation)
    gone_objects = [segment_key(s.name) for s in gone_segments]
    reader = tier.reader
    for q, segments in m.consumequeue.items():
        topic, _, qid = q.rpartition("/")
        live = []
        for f in segments:
            if f.last_phy < new_min:
                gone_objects.append(queue_key(topic, int(qid), f.name))
            else:
                live.append(f)
        if live:
            first = live[0]
            lo, hi = first.min_index, int(first.name) // 20 + first.units
            while lo < hi:  # the first unit whose record the tier still holds
                mid = (lo + hi) // 2
                unit = reader.units(topic, int(qid), mid, 1)
                if unit and unit[0][0] >= new_min:
                    hi = mid
                else:
                    lo = mid + 1
            live[0] = type(first)(first.name, lo, first.units, first.last_phy)
            kept.consumequeue[q] = live
    for i in m.index:
        if i.end_phy_offset < new_min:
            gone_objects.append(index_key(i.name))
        else:
            kept.index.append(i)
    tier.publish(kept)
    for key in gone_objects:
        tier.objects.delete(key)
    log.info("tier %s: %d segment(s) older than tieredStoreFileReservedTime=%dh deleted; the tier now starts at %d",
             tier.loc.uri, n, files.config.tieredStoreFileReservedTime, new_min)
    return n
