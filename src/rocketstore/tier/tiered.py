"""TieredStorage: one store's view of its tier (RocketMQ 5's tieredstore, Kafka's KIP-405 in spirit).

Sealed commitlog segments, and the consume-queue and index files that point
into them, are copied to a bucket (``tieredStoreUri``) by
:class:`~rocketstore.tier.upload.TierUploadService`.  This class answers the
two questions the rest of the store asks:

* may retention delete this local file?  Only when the tier's manifest,
  written by this store, lists it (never on a guess: a tier that cannot be
  reached keeps every local file);
* where is an old offset?  Reads below the local minimum go to
  :class:`~rocketstore.tier.reader.TierReader`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from ..errors import StoreLoadError
from .manifest import GEOMETRY, MANIFEST, TierManifest
from .objectstore import ObjectStore, TierError, TierLocation
from .reader import TierReader

if TYPE_CHECKING:
    from ..config import StoreConfig

log = logging.getLogger(__name__)

STORE_ID_FILE = "tierStore.json"  # under the store's config/: which tier this store owns, by id
LOCAL_MANIFEST = "tierManifest.json"  # under config/: the last manifest this store published, for opens


class TieredStorage:
    def __init__(self, root: str, config: "StoreConfig", *, read_only: bool = False) -> None:
        self.root = root
        self.config = config
        self.read_only = read_only
        self.loc = TierLocation.from_options(config.tieredStoreUri, config.to_dict())
        self._objects: ObjectStore | None = None
        self.manifest: TierManifest | None = None
        self.reader: TierReader | None = None
        self.error: str | None = None  # the last failure to reach or trust the tier
        self.lock = threading.RLock()
        self.store_id = self._local_store_id()
        self.last_upload_ms = 0
        self._load_local_copy()

    def _load_local_copy(self) -> None:
        """Start from the last manifest this store published: an open knows the tier's range (queue minimums,
        reads below the local disk) without reaching the bucket, and a bucket that is down then fails reads
        with an error naming the object rather than hiding the messages."""
        path = os.path.join(self.root, "config", LOCAL_MANIFEST)
        try:
            with open(path, "rb") as fh:
                m = TierManifest.loads(fh.read(), path)
            self._check_ours(m)
        except FileNotFoundError:
            return
        except (OSError, StoreLoadError) as e:
            log.warning("tier: ignoring the local copy of the manifest: %s", e)
            return
        self._set(m)
    # ------------------------------------------------------------ identity
    @property
    def id_path(self) -> str:
        return os.path.join(self.root, "config", STORE_ID_FILE)

    def _local_store_id(self) -> str | None:
        try:
            with open(self.id_path, encoding="utf-8") as fh:
                return str(json.load(fh)["storeId"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreLoadError(f"{self.id_path}: unreadable tier identity: {e}") from None

    def ensure_store_id(self) -> str:
        """This store's tier identity, made (durably) on first use."""
        if self.store_id is None:
            from ..jsonfile import write_json_atomic
            sid = uuid.uuid4().hex
            write_json_atomic(self.id_path, {"storeId": sid})
            self.store_id = sid
        return self.store_id

    # ------------------------------------------------------------ the bucket
    @property
    def objects(self) -> ObjectStore:
        if self._objects is None:
            self._objects = ObjectStore(self.loc)
        return self._objects

    def refresh(self, *, quiet: bool = False) -> TierManifest | None:
        """Read ``tier.json`` again; on failure keep the last good manifest and record the error (logged
        unless ``quiet``: an open records it for ``state``/``tier status``, the upload service logs it)."""
        with self.lock:
            try:
                data = self.objects.get_bytes(MANIFEST)
                m = None if data is None else TierManifest.loads(data, f"{self.loc.uri}/{MANIFEST}")
                if m is not None:
                    self._check_ours(m)
                self._set(m)
                self.error = None
            except (TierError, StoreLoadError) as e:
                self.error = str(e)
                if not quiet:
                    log.error("tier %s: %s", self.loc.uri, e)
            return self.manifest

    def _check_ours(self, m: TierManifest) -> None:
        for k in GEOMETRY:
            if m.geometry.get(k) != getattr(self.config, k):
                raise StoreLoadError(f"{self.loc.uri}/{MANIFEST}: {k}={m.geometry.get(k)} in the tier but "
                                     f"{getattr(self.config, k)} in this store; refusing to use the tier")
        if self.store_id is not None and m.store_id != self.store_id:
            raise StoreLoadError(f"{self.loc.uri}/{MANIFEST}: the tier belongs to store {m.store_id}, not this "
                                 f"store ({self.store_id} in {self.id_path}); refusing to use the tier")
        if self.store_id is None and not self.read_only:
            raise StoreLoadError(f"{self.loc.uri}/{MANIFEST}: the tier belongs to store {m.store_id} and this "
                                 f"store has no {self.id_path}; refusing to upload into another store's tier")

    def _set(self, m: TierManifest | None) -> None:
        self.manifest = m
        if m is None:
            self.reader = None
        elif self.reader is None:
            self.reader = TierReader(self.objects, m)
        else:
            self.reader.manifest = m

    def new_manifest(self) -> TierManifest:
        return TierManifest(store_id=self.ensure_store_id(),
                            geometry={k: int(getattr(self.config, k)) for k in GEOMETRY})

    def publish(self, m: TierManifest) -> None:
        """Write the manifest: from now on the objects it lists count as uploaded."""
        m.updated_at = int(time.time() * 1000)
        data = m.dumps()
        self.objects.put_bytes(MANIFEST, data)
        from ..jsonfile import write_bytes_atomic
        write_bytes_atomic(os.path.join(self.root, "config", LOCAL_MANIFEST), data)
        with self.lock:
            self._set(m)
            self.last_upload_ms = m.updated_at

    # ------------------------------------------------------------ questions from the store
    def _expired_below(self, m: TierManifest, end_offset: int) -> bool:
        """Whether data ending at ``end_offset`` lies below the tier's start: the tier held it and its own
        retention (tieredStoreFileReservedTime) has dropped it (uploads start at the first local segment and
        leave no gap, so nothing below the start was skipped)."""
        return bool(m.commitlog) and end_offset <= m.min_offset

    def has_segment(self, base: int, length: int) -> bool:
        m = self.manifest
        if m is None or self.error is not None:
            return False
        if self._expired_below(m, base + length):
            return True
        s = m.segment_for(base)
        return s is not None and s.base == base and s.size >= length

    def has_queue_file(self, topic: str, queue_id: int, name: str, last_phy: int | None = None) -> bool:
        m = self.manifest
        if m is None or self.error is not None:
            return False
        if last_phy is not None and self._expired_below(m, last_phy + 1):
            return True
        return any(f.name == name for f in m.queue_files(topic, queue_id))

    def has_index_file(self, name: str, end_phy: int | None = None) -> bool:
        m = self.manifest
        if m is None or self.error is not None:
            return False
        if end_phy is not None and self._expired_below(m, end_phy + 1):
            return True
        return any(f.name == name for f in m.index)

    def holds(self, offset: int) -> bool:
        m = self.manifest
        return m is not None and m.min_offset <= offset < m.end_offset

    def status(self) -> dict[str, Any]:
        m = self.manifest
        return {"uri": self.loc.uri, "storeId": self.store_id, "error": self.error,
                "minOffset": m.min_offset if m else None, "endOffset": m.end_offset if m else None,
                "segments": len(m.commitlog) if m else 0,
                "queueFiles": sum(len(v) for v in m.consumequeue.values()) if m else 0,
                "indexFiles": len(m.index) if m else 0, "updatedAt": m.updated_at if m else None}


def open_tier_reader(uri: str, options: dict[str, Any]) -> TierReader:
    """A reader of a tier on its own (no local store): Spark executors, ``rocketstore dump s3://...``."""
    loc = TierLocation.from_options(uri, options)
    objects = ObjectStore(loc)
    data = objects.get_bytes(MANIFEST)
    if data is None:
        raise StoreLoadError(f"{uri}: no {MANIFEST}: not a rocketstore tier")
    return TierReader(objects, TierManifest.loads(data, f"{uri}/{MANIFEST}"))
