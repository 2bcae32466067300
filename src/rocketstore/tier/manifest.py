"""TierManifest: ``tier.json`` at the tier's root, the one record of what the bucket holds.

An object counts as uploaded only once the manifest lists it: the uploader
writes the object, checks its size, and only then rewrites the manifest (a
whole-object PUT, so a reader sees the old or the new list, never half).
Local retention deletes a file only when the manifest lists it.

Every publish carries a ``generation`` one higher than the last this store
published (the store keeps that number in ``config/tierStore.json``): a
manifest that is missing, or older than what the store knows it published,
is damage (an unmounted tier, a lost or restored ``tier.json``), never an
empty tier.

The manifest also pins the tier to one store (``storeId``) and one file
geometry: a second store pointed at the same prefix, or a store whose
segment size differs, is refused rather than mixed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreLoadError

MANIFEST = "tier.json"
FORMAT = "rocketstore-tier"
VERSION = 1
GEOMETRY = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")


@dataclass
class TierSegment:
    name: str  # the commitlog file name: its first offset, 20 digits
    size: int  # bytes uploaded (the whole sealed file)
    crc32: int
    first_store_time: int = 0  # store time (ms) of its first record, for time-range pruning

    @property
    def base(self) -> int:
        return int(self.name)


@dataclass
class TierQueueFile:
    name: str  # the consume-queue file name: its first unit's byte position, 20 digits
    min_index: int  # first unit whose record the tier holds (earlier ones point below the tier's start)
    units: int  # units in the file
    last_phy: int = 0  # commitlog offset of its last unit's record: tier retention drops the file below it


@dataclass
class TierIndexFile:
    name: str
    begin_timestamp: int
    end_timestamp: int
    begin_phy_offset: int
    end_phy_offset: int


@dataclass
class TierManifest:
    store_id: str
    geometry: dict[str, int]
    commitlog: list[TierSegment] = field(default_factory=list)
    consumequeue: dict[str, list[TierQueueFile]] = field(default_factory=dict)  # "topic/queueId" -> files
    index: list[TierIndexFile] = field(default_factory=list)
    updated_at: int = 0
    generation: int = 0  # grows by one with every publish; 0 in manifests written before it existed

    # ------------------------------------------------------------ ranges
    @property
    def min_offset(self) -> int:
        return self.commitlog[0].base if self.commitlog else 0

    @property
    def end_offset(self) -> int:
        """Commitlog offset just past the last uploaded segment (0 when none)."""
        if not self.commitlog:
            return 0
        return self.commitlog[-1].base + self.geometry["mappedFileSizeCommitLog"]

    def segment_for(self, offset: int) -> TierSegment | None:
        size = self.geometry["mappedFileSizeCommitLog"]
        if not self.commitlog or not (self.min_offset <= offset < self.end_offset):
            return None
        return self.commitlog[(offset - self.min_offset) // size]

    def queue_files(self, topic: str, queue_id: int) -> list[TierQueueFile]:
        return self.consumequeue.get(f"{topic}/{queue_id}", [])

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int] | None:
        """(min, end) queue offsets the tier holds for a queue, or None."""
        files = self.queue_files(topic, queue_id)
        if not files:
            return None
        unit = 20
        last = files[-1]
        return files[0].min_index, int(last.name) // unit + last.units

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "storeId": self.store_id, **self.geometry,
            "updatedAt": self.updated_at, "generation": self.generation,
            "commitlog": [{"name": s.name, "size": s.size, "crc32": s.crc32, "firstStoreTime": s.first_store_time}
                          for s in self.commitlog],
            "consumequeue": {q: [{"name": f.name, "minIndex": f.min_index, "units": f.units, "lastPhy": f.last_phy}
                                 for f in files]
                             for q, files in sorted(self.consumequeue.items())},
            "index": [{"name": i.name, "beginTimestamp": i.begin_timestamp, "endTimestamp": i.end_timestamp,
                       "beginPhyOffset": i.begin_phy_offset, "endPhyOffset": i.end_phy_offset} for i in self.index],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def loads(cls, data: bytes, where: str) -> "TierManifest":
        """Parse ``tier.json``; anything of the wrong shape is a StoreLoadError naming ``where`` and the field."""
        try:
            d = json.loads(data.decode("utf-8"))
            if d.get("format") != FORMAT or d.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} v{VERSION} manifest (format={d.get('format')!r}, "
                                 f"version={d.get('version')!r})")
            m = cls(store_id=str(d["storeId"]), geometry={k: int(d[k]) for k in GEOMETRY},
                    updated_at=int(d.get("updatedAt", 0)), generation=int(d.get("generation", 0)))
            m.commitlog = [TierSegment(str(s["name"]), int(s["size"]), int(s["crc32"]), int(s.get("firstStoreTime", 0)))
                           for s in d["commitlog"]]
            m.consumequeue = {str(q): [TierQueueFile(str(f["name"]), int(f["minIndex"]), int(f["units"]),
                                                     int(f.get("lastPhy", 0)))
                                       for f in files] for q, files in d["consumequeue"].items()}
            m.index = [TierIndexFile(str(i["name"]), int(i["beginTimestamp"]), int(i["endTimestamp"]),
                                     int(i["beginPhyOffset"]), int(i["endPhyOffset"])) for i in d["index"]]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise StoreLoadError(f"{where}: bad tier manifest: {type(e).__name__}: {e}") from None
        size = m.geometry["mappedFileSizeCommitLog"]
        for a, b in zip(m.commitlog, m.commitlog[1:]):
            if b.base != a.base + size:
                raise StoreLoadError(f"{where}: tier manifest has a gap or overlap between segments "
                                     f"{a.name} and {b.name}")
        return m
