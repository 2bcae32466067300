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

Missing is not empty.  ``config/tierStore.json`` keeps, besides the store's
tier id, the highest manifest generation the store published and
``localDeletedEnd``, the offset below which it deleted local segments on the
manifest's word.  A ``tier.json`` that is missing, malformed, of a lower
generation or not reaching ``localDeletedEnd``, and a local copy lost with
its ``.bak``, are a :attr:`TieredStorage.fault`: reads below the local disk
raise it (never OFFSET_TOO_SMALL) and nothing is deleted on such a manifest.
A writable round republishes a lost or stale ``tier.json`` from the local
copy (or rebuilds it from the tier's objects) once the objects check out.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..paths import StorePaths
from ..format import codec
from ..errors import StoreLoadError
from .manifest import GEOMETRY, MANIFEST, TierIndexFile, TierManifest, TierQueueFile, TierSegment
from ..config import TierLocation
from ..errors import TierError
from .objectstore import ObjectStore, require_pyarrow_fs
from .reader import TierReader, index_key, queue_key, segment_key

if TYPE_CHECKING:
    from ..config import StoreConfig

log = logging.getLogger(__name__)

STORE_ID_FILE = "tierStore.json"  # under the store's config/: which tier this store owns, by id
LOCAL_MANIFEST = "tierManifest.json"  # under config/: the last manifest this store published, for opens
UNKNOWN_URI = "<its tier's URI>"  # what an error tells to set when tierStore.json predates its tieredStoreUri
REPUBLISH_RETRY_SECONDS = 600  # a republish that failed on the same damage is tried again after this long
_UNIT = struct.Struct(">qiq")  # a consume-queue unit
_INDEX_HEADER = struct.Struct(">qqqqii")


@dataclass(frozen=True)
class TierState:
    """What ``config/tierStore.json`` says: the store's tier id, the highest manifest generation it published,
    the commitlog offset below which it deleted local segments on the tier's word, and the tier's URI (for the error
    that refuses an open without it; "" in files written before it was recorded)."""

    store_id: str
    generation: int
    deleted_end: int
    uri: str

    @property
    def copied(self) -> bool:
        """Whether the store ever published a manifest (segments in the tier count) or deleted a local segment."""
        return self.generation > 0 or self.deleted_end > 0


def load_tier_state(root: str) -> TierState | None:
    """Read ``config/tierStore.json`` (its ``.bak`` when the file is damaged or caught mid-rename); None when
    neither exists, StoreLoadError naming the file when neither can be read."""
    path = os.path.join(root, "config", STORE_ID_FILE)
    problem = None
    for cand in (path, f"{path}.bak"):
        try:
            with open(cand, encoding="utf-8") as fh:
                d = json.load(fh)
            state = TierState(str(d["storeId"]), int(d.get("generation", 0)), int(d.get("localDeletedEnd", 0)),
                              str(d.get("tieredStoreUri") or ""))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problem = problem or f"{type(e).__name__}: {e}"
            continue
        if cand != path:
            log.warning("%s: %s; using its .bak", path, problem or "missing")
        return state
    if problem is not None:
        raise StoreLoadError(f"{path}: unreadable tier identity: {problem}")
    return None


def refuse_without_tier(root: str, uri: str) -> None:
    """Missing is not empty: a store whose ``config/tierStore.json`` says it copied segments to a tier (and
    retention may since have deleted the local copies) is not opened, repaired, rebuilt or read without that
    tier (``uri``, its config's ``tieredStoreUri``, empty).  Read without it, the records only the tier holds
    would be skipped (reads starting at the local log, OFFSET_TOO_SMALL) and a rebuild would drop their units
    and keys.  StoreLoadError naming the store, the file and what to set; called before anything is touched.
    A store whose tierStore.json says nothing was ever published opens as before."""
    if uri:
        return
    path = os.path.join(root, "config", STORE_ID_FILE)
    copies = [p for p in (os.path.join(root, "config", LOCAL_MANIFEST),
                          os.path.join(root, "config", LOCAL_MANIFEST + ".bak")) if os.path.exists(p)]
    fix = "set tieredStoreUri={} in {} (or --config)".format
    conf = os.path.join(root, "broker.conf")
    try:
        state = load_tier_state(root)
    except StoreLoadError as e:
        raise StoreLoadError(f"{e}, and tieredStoreUri is not set: whether the tier of {root} holds records cannot "
                             f"be told; {fix(UNKNOWN_URI, conf)}; nothing was changed") from None
    if not copies and (state is None or not state.copied):
        return
    if state is not None and state.copied:
        held = f"{path} says generation {state.generation} of its tier's manifest was published" + (
            f" and local segments below commitlog offset {state.deleted_end} were deleted" if state.deleted_end
            else "")
    else:
        held = f"{copies[0]} is the copy of a manifest this store published to its tier ({path})"
    where = state.uri if state is not None and state.uri else UNKNOWN_URI
    raise StoreLoadError(f"{held}, but tieredStoreUri is not set: without its tier the messages only the "
                         f"tier holds would be skipped or dropped; {fix(where, conf)}; nothing was changed")


class TieredStorage:
    def __init__(self, root: str, config: "StoreConfig", *, read_only: bool = False) -> None:
        self.root = root
        self.config = config
        self.read_only = read_only
        require_pyarrow_fs(config.tieredStoreUri)  # one line at open, not a ModuleNotFoundError at the first read
        self.loc = TierLocation.from_options(config.tieredStoreUri, config.to_dict())
        self._objects: ObjectStore | None = None
        self.manifest: TierManifest | None = None
        self.reader: TierReader | None = None
        self.error: str | None = None  # the last failure to reach or trust the tier
        # Why the last upload round stopped before a sealed segment: a damaged record in it (local damage,
        # never sealed into the tier).  Retention keeps that segment and every later one until it is mended.
        self.upload_blocked: str | None = None
        # Why reads of the tier must fail: there is no manifest this store can trust (tier.json missing, older
        # than the store published, malformed, or another store's; the local copy lost).  Reads below the local
        # disk raise it, naming the manifest, rather than answer from an empty or stale list.
        self.fault: str | None = None
        self.republishable = False  # the fault is a lost or stale tier.json that the local copy may replace
        self.local_copy: TierManifest | None = None  # the last manifest this store published (config/)
        self._local_copy_seen = False  # config/tierManifest.json (or its .bak) exists, readable or not
        self._local_copy_bad = False  # it (or its .bak) is damaged: rewritten from the next trusted manifest
        self._republish_failed: tuple[str | None, float, str] | None = None  # (fault, when, why) of the last try
        self.lock = threading.RLock()
        self._state_lock = threading.RLock()  # tierStore.json's writers: publish, and retention's has_segment
        # tierStore.json: the store's tier identity, the highest manifest generation it published, and the
        # commitlog offset below which it may have deleted local segments because the manifest listed them.
        self.store_id: str | None = None
        self.generation = 0
        self.deleted_end = 0
        self._load_state()
        self.last_upload_ms = 0
        self._load_local_copy()

    @property
    def local_manifest_path(self) -> str:
        return os.path.join(self.root, "config", LOCAL_MANIFEST)

    @property
    def published(self) -> bool:
        """Whether this store ever published a manifest: from then on, no manifest is damage, not "empty"."""
        return self.generation > 0 or self.deleted_end > 0 or self.local_copy is not None or self._local_copy_seen

    @property
    def known_generation(self) -> int:
        """The highest generation this store knows it published (its state file, or its local copy)."""
        return max(self.generation, self.local_copy.generation if self.local_copy is not None else 0)

    def _load_local_copy(self) -> None:
        """Start from the last manifest this store published: an open knows the tier's range (queue minimums,
        reads below the local disk) without reaching the bucket, and a bucket that is down then fails reads
        with an error naming the object rather than hiding the messages.  A damaged copy falls back to its
        ``.bak``; a copy older than the generation the store published, or lost with no ``.bak``, is a fault
        (reads fail) until the bucket's manifest is read and trusted."""
        path = self.local_manifest_path
        problems: list[str] = []
        m = None
        for cand in (path, f"{path}.bak"):
            try:
                with open(cand, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                continue
            except OSError as e:
                self._local_copy_seen = True
                problems.append(f"{cand}: {e}")
                continue
            self._local_copy_seen = True
            try:
                got = TierManifest.loads(data, cand)
                self._check_ours(got)
            except StoreLoadError as e:
                problems.append(str(e))
                continue
            if cand != path:
                log.warning("tier: %s is missing or damaged; using %s (generation %d)", path, cand, got.generation)
            m = got
            break
        if m is not None:  # else the fault below says it all, once
            for p in problems:
                log.warning("tier: ignoring the local copy of the manifest: %s", p)
        self._local_copy_bad = bool(problems) or (m is None and self._local_copy_seen)
        self.local_copy = m
        self._set(m)
        if m is None:
            if self.published:
                self._damaged(f"{path}: {'; '.join(problems) or 'missing'} (and no usable .bak), but this store "
                              f"published generation {self.generation} of {self.loc.uri}/{MANIFEST} "
                              f"({self.id_path}): what the tier holds is not known until that manifest is read",
                              republish=False, quiet=True)
                if self.deleted_end > 0:
                    self._set(self._placeholder())
            return
        doubt = self._doubt(m, f"{path}{'' if not problems else '.bak'}")
        if doubt is not None:
            self._damaged(doubt, republish=False, quiet=True)

    def _placeholder(self) -> TierManifest:
        """With no manifest at all: one saying the tier may hold every segment below ``localDeletedEnd`` (from
        offset 0), so queue minimums, ``dump``'s start and ``look`` still lead reads there, where the reader
        raises the fault.  Never published, never a reason to delete (``error`` is set while it stands)."""
        m = TierManifest(store_id=self.store_id or "", geometry={k: int(getattr(self.config, k)) for k in GEOMETRY})
        size = self.config.mappedFileSizeCommitLog
        m.commitlog = [TierSegment(f"{base:020d}", size, 0) for base in range(0, self.deleted_end, size)]
        return m

    def _doubt(self, m: TierManifest, where: str) -> str | None:
        """Why manifest ``m`` cannot be trusted as this store's latest, or None: older than the generation the
        store published, or not listing segments the store deleted locally on the tier's word."""
        if m.generation < self.known_generation:
            return (f"{where}: generation {m.generation}, but this store published generation "
                    f"{self.known_generation} ({self.id_path}): an older manifest (a restored or stale copy)")
        if m.end_offset < self.deleted_end:
            return (f"{where}: lists commitlog segments up to offset {m.end_offset}, but this store deleted its "
                    f"local segments below {self.deleted_end} because the tier held them ({self.id_path})")
        return None

    def _damaged(self, why: str, *, republish: bool, quiet: bool) -> None:
        self.error = why
        if self.published:
            self.fault = why
            self.republishable = republish
        if self.reader is not None:
            self.reader.fault = self.fault
        if not quiet:
            log.error("tier %s: %s", self.loc.uri, why)

    # ------------------------------------------------------------ identity
    @property
    def id_path(self) -> str:
        return os.path.join(self.root, "config", STORE_ID_FILE)

    def _load_state(self) -> None:
        state = load_tier_state(self.root)
        if state is not None:
            self.store_id, self.generation, self.deleted_end = state.store_id, state.generation, state.deleted_end

    def _save_state(self) -> None:
        from ..storage.jsonfile import write_json_atomic
        with self._state_lock:
            # tieredStoreUri: where this store's tier is, for the error that refuses an open without it
            write_json_atomic(self.id_path, {"storeId": self.store_id, "generation": self.generation,
                                             "localDeletedEnd": self.deleted_end, "tieredStoreUri": self.loc.uri})

    def ensure_store_id(self) -> str:
        """This store's tier identity, made (durably) on first use."""
        if self.store_id is None:
            self.store_id = uuid.uuid4().hex
            self._save_state()
        return self.store_id

    # ------------------------------------------------------------ the bucket
    @property
    def objects(self) -> ObjectStore:
        if self._objects is None:
            self._objects = ObjectStore(self.loc)
        self._objects.create_root = not self.published  # a file:// tier's directory is made once, never again
        return self._objects

    def refresh(self, *, quiet: bool = False) -> TierManifest | None:
        """Read ``tier.json`` again; on failure keep the last good manifest and record the error (logged
        unless ``quiet``: an open records it for ``state``/``tier status``, the upload service logs it).

        A bucket that cannot be reached leaves the manifest in hand (reads then fail naming the object they
        need).  A ``tier.json`` that is missing, malformed, older than the generation this store published,
        or that lacks segments the store deleted locally, is a fault: reads below the local disk raise it."""
        where = f"{self.loc.uri}/{MANIFEST}"
        with self.lock:
            try:
                missing = self.objects.root_missing() if self.published else None
                if missing is not None:
                    raise TierError(f"{missing}; this store published generation {self.known_generation} of "
                                    f"{MANIFEST} there")
                data = self.objects.get_bytes(MANIFEST)
            except TierError as e:
                self.error = str(e)
                self.republishable = False  # only a tier just reached and seen damaged is republished
                if not quiet:
                    log.error("tier %s: %s", self.loc.uri, e)
                return self.manifest
            if data is None:
                if not self.published:
                    self._set(None)
                    self.error = self.fault = None
                    return None
                self._damaged(f"{where} is missing, but this store published generation {self.known_generation} "
                              f"of it ({self.id_path}): the tier is not empty, its manifest is lost; a writable open "
                              f"(rocketstore tier upload) republishes it from {self.local_manifest_path} once "
                              "every object it lists is checked", republish=True, quiet=quiet)
                return self.manifest
            try:
                m = TierManifest.loads(data, where)
            except StoreLoadError as e:
                self._damaged(f"{e}; a writable open (rocketstore tier upload) republishes it from "
                              f"{self.local_manifest_path}", republish=True, quiet=quiet)
                return self.manifest
            try:
                self._check_ours(m)
            except StoreLoadError as e:
                self._damaged(str(e), republish=False, quiet=quiet)
                return self.manifest
            doubt = self._doubt(m, where)
            if doubt is not None:
                self._damaged(f"{doubt}; a writable open (rocketstore tier upload) republishes it from "
                              f"{self.local_manifest_path}", republish=True, quiet=quiet)
                return self.manifest
            self._trust(m)
            return self.manifest

    def _trust(self, m: TierManifest) -> None:
        """``m`` is this store's latest manifest: read through it, and keep the local copy and state in step."""
        self._set(m)
        self.error = self.fault = None
        self.republishable = False
        if self.reader is not None:
            self.reader.fault = None
        if self.read_only:
            return
        if self.local_copy is None or self.local_copy.generation < m.generation or self._local_copy_bad:
            from ..storage.jsonfile import write_bytes_atomic
            write_bytes_atomic(self.local_manifest_path, m.dumps())
            self._local_copy_bad = False
        self.local_copy = m
        if m.generation > self.generation:
            self.generation = m.generation
            self._save_state()

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
        if self.reader is not None:
            self.reader.fault = self.fault

    def new_manifest(self) -> TierManifest:
        return TierManifest(store_id=self.ensure_store_id(),
                            geometry={k: int(getattr(self.config, k)) for k in GEOMETRY})

    def publish(self, m: TierManifest) -> None:
        """Write the manifest: from now on the objects it lists count as uploaded.

        Its generation is one more than any this store published.  The local copy and the state file are
        written (durably) before the bucket's ``tier.json``: a crash between leaves the bucket one generation
        behind, which the next round sees as stale and republishes, never a bucket ahead of what the store
        knows."""
        from ..storage.jsonfile import write_bytes_atomic
        with self.lock:
            if not self.published:
                self.objects.make_root()
            m.generation = max(self.known_generation, m.generation) + 1
            m.updated_at = int(time.time() * 1000)
            data = m.dumps()
            write_bytes_atomic(self.local_manifest_path, data)
            self._local_copy_bad = False
            mine = copy.deepcopy(m)  # what readers and retention see: the caller may go on adding to ``m``
            self.local_copy = mine
            self.generation = m.generation
            self._save_state()
            try:
                self.objects.put_bytes(MANIFEST, data)
            except TierError as e:
                self.error = str(e)
                raise
            self._trust(mine)
            self.last_upload_ms = m.updated_at

    def republish(self) -> TierManifest:
        """Replace a lost or stale ``tier.json`` with the local copy, once every object it lists is in the
        tier (see verify_objects); else a TierError naming what is missing.  With the local copy lost too, or
        older than the latest generation (its ``.bak``), the manifest is rebuilt from the tier's objects."""
        with self.lock:
            was = self.fault
            failed = self._republish_failed
            if failed is not None and failed[0] == was and time.time() < failed[1] + REPUBLISH_RETRY_SECONDS:
                raise TierError(failed[2])  # the same damage: not every upload round re-reads the tier
            try:
                src = self.local_copy
                # Only the latest manifest may be put back as it is: an older one (a .bak) lacks the queue and
                # index files later rounds added, whose local copies retention may have deleted since.  Without
                # it, the tier's objects say what it holds.
                if src is None or src.generation < self.known_generation:
                    src, source = self.rebuild_from_objects(), "the tier's objects"
                else:
                    source = self.local_manifest_path
                    if src.end_offset < self.deleted_end:
                        raise TierError(f"{self.fault}; and {source} lists segments only up to {src.end_offset}, "
                                        f"below {self.deleted_end} where this store deleted local segments: not "
                                        "republished (restore the manifest from a backup)")
                    self.verify_objects(src)
            except TierError as e:
                self._republish_failed = (was, time.time(), str(e))
                raise
            self._republish_failed = None
            m = copy.deepcopy(src)
            self.publish(m)
            log.warning("tier %s: republished %s as generation %d from %s after checking its objects (%s)",
                        self.loc.uri, MANIFEST, m.generation, source, was)
            return m

    def rebuild_from_objects(self) -> TierManifest:
        """A manifest made from the objects in the tier, for when ``tier.json`` and the latest local copy are
        both lost.  Segments must be whole and contiguous, and reach where this store deleted
        local segments; one still on local disk must match it by CRC-32.  Queue files and index files are
        described from their own bytes (units, header), as the uploader described them."""
        if self.store_id is None:
            raise TierError(f"{self.fault}; and {self.id_path} is lost: this store cannot claim the tier "
                            f"(restore {MANIFEST} or {self.id_path} from a backup)")
        pafs = require_pyarrow_fs(self.loc.uri)
        obj, root = self.objects, self.loc.key()
        try:
            infos = obj.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        except Exception as e:  # noqa: BLE001
            raise TierError(f"{self.loc.uri}: cannot list the tier to rebuild {MANIFEST}: {e}") from None
        found = {i.path[len(root):].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}
        seg_size = self.config.mappedFileSizeCommitLog
        cq_size = self.config.mappedFileSizeConsumeQueue
        m = self.new_manifest()
        for key in sorted(k for k in found if k.startswith("commitlog/") and k[10:].isdigit() and len(k) == 30):
            name = key[10:]
            if found[key] != seg_size:
                raise TierError(f"{self.loc.uri}: {key} is {found[key]} bytes, not {seg_size}; {MANIFEST} not rebuilt")
            if m.commitlog and int(name) != m.end_offset:
                raise TierError(f"{self.loc.uri}: {key} does not follow {m.commitlog[-1].name}; "
                                f"{MANIFEST} not rebuilt")
            crc = obj.checksum(key)
            local = os.path.join(StorePaths(self.root).commitlog, name)
            if os.path.exists(local):
                with open(local, "rb") as fh:
                    mine = 0
                    while chunk := fh.read(8 * 1024 * 1024):
                        mine = zlib.crc32(chunk, mine)
                if mine != crc:
                    raise TierError(f"{self.loc.uri}: {key} differs from {local} (CRC-32 {crc} vs {mine}); "
                                    f"{MANIFEST} not rebuilt")
            try:
                first_ts = codec.read_store_timestamp(obj.read(key, 0, 128), 0)
            except Exception:  # noqa: BLE001 - a segment that starts with a blank record has no store time
                first_ts = 0
            m.commitlog.append(TierSegment(name, seg_size, crc, max(first_ts, 0)))
        if self.deleted_end > 0 and m.end_offset < self.deleted_end:  # (with nothing deleted, empty is empty)
            raise TierError(f"{self.fault}; and the tier's segments end at {m.end_offset}, below {self.deleted_end} "
                            f"where this store deleted local segments: {MANIFEST} not rebuilt (restore it from a "
                            "backup)")
        for key in sorted(k for k in found if k.startswith("consumequeue/")):
            parts = key.split("/")
            if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit() or found[key] != cq_size:
                log.warning("tier %s: %s is not a whole consume-queue file; left out of the rebuilt %s",
                            self.loc.uri, key, MANIFEST)
                continue
            raw = obj.read(key, 0, cq_size)
            units = [_UNIT.unpack_from(raw, i) for i in range(0, len(raw) - len(raw) % _UNIT.size, _UNIT.size)]
            if len(units) * _UNIT.size != cq_size or any(size <= 0 for _, size, _ in units) or \
                    units[-1][0] + units[-1][1] > m.end_offset:
                log.warning("tier %s: %s has blank units or records past the tier; left out of the rebuilt %s",
                            self.loc.uri, key, MANIFEST)
                continue
            first = next((i for i, (phy, _, _) in enumerate(units) if phy >= m.min_offset), None)
            if first is None:
                continue
            m.consumequeue.setdefault(f"{parts[1]}/{parts[2]}", []).append(
                TierQueueFile(parts[3], int(parts[3]) // _UNIT.size + first, len(units), units[-1][0]))
        for files in m.consumequeue.values():
            files.sort(key=lambda f: int(f.name))
        for key in sorted(k for k in found if k.startswith("index/")):
            name = key[6:]
            head = obj.read(key, 0, _INDEX_HEADER.size)
            if len(head) < _INDEX_HEADER.size:
                continue
            begin_ts, end_ts, begin_phy, end_phy, _, _ = _INDEX_HEADER.unpack_from(head, 0)
            m.index.append(TierIndexFile(name, begin_ts, end_ts, begin_phy, end_phy))
        log.warning("tier %s: rebuilt %s from the tier's objects: %d segments [%d, %d), %d queue files, "
                    "%d index files", self.loc.uri, MANIFEST, len(m.commitlog), m.min_offset, m.end_offset,
                    sum(len(v) for v in m.consumequeue.values()), len(m.index))
        return m

    def verify_objects(self, m: TierManifest) -> None:
        """Every object ``m`` lists is in the tier: by size (each was read back and checked by CRC-32 when
        uploaded), and a segment still on local disk also by CRC-32, since republishing lets retention delete
        that local copy; queue files by size, index files present.  A TierError names the first that is not."""
        obj = self.objects
        cq_size = m.geometry["mappedFileSizeConsumeQueue"]
        for s in m.commitlog:
            key = segment_key(s.name)
            got = obj.size(key)
            if got != s.size:
                raise TierError(f"{self.loc.uri}: {key} is {'missing' if got is None else f'{got} bytes'}, but "
                                f"{self.local_manifest_path} lists it with {s.size}; not republished")
            if not os.path.exists(os.path.join(StorePaths(self.root).commitlog, s.name)):
                continue
            crc = obj.checksum(key)
            if crc != s.crc32:
                raise TierError(f"{self.loc.uri}: {key} has CRC-32 {crc}, but {self.local_manifest_path} lists "
                                f"{s.crc32}; not republished")
        for q, files in m.consumequeue.items():
            topic, _, qid = q.rpartition("/")
            for f in files:
                key = queue_key(topic, int(qid), f.name)
                got = obj.size(key)
                if got != cq_size:
                    raise TierError(f"{self.loc.uri}: {key} is {'missing' if got is None else f'{got} bytes'}, "
                                    f"expected {cq_size}; not republished")
        for i in m.index:
            if obj.size(index_key(i.name)) is None:
                raise TierError(f"{self.loc.uri}: {index_key(i.name)} is missing; not republished")

    # ------------------------------------------------------------ questions from the store
    def _expired_below(self, m: TierManifest, end_offset: int) -> bool:
        """Whether data ending at ``end_offset`` lies below the tier's start: the tier held it and its own
        retention (tieredStoreFileReservedTime) has dropped it (uploads start at the first local segment and
        leave no gap, so nothing below the start was skipped)."""
        return bool(m.commitlog) and end_offset <= m.min_offset

    def has_segment(self, base: int, length: int) -> bool:
        """Whether the local segment [base, base + length) may be deleted: the trusted manifest lists it (or
        it lies below the tier's start).  A yes is first written down (``localDeletedEnd`` in tierStore.json):
        a manifest that later fails to list it is recognised as damage, not read as "nothing there"."""
        m = self.manifest  # no self.lock: an upload round holds it for minutes, retention must not wait
        if m is None or self.error is not None:
            return False
        ok = self._expired_below(m, base + length)
        if not ok:
            s = m.segment_for(base)
            ok = s is not None and s.base == base and s.size >= length
        if ok and not self.read_only and base + length > self.deleted_end:
            with self._state_lock:
                self.deleted_end = max(self.deleted_end, base + length)
                self._save_state()
        return ok

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
        return {"uri": self.loc.uri, "storeId": self.store_id, "error": self.error, "fault": self.fault,
                "uploadBlocked": self.upload_blocked,
                "generation": m.generation if m else None, "publishedGeneration": self.known_generation,
                "localDeletedEnd": self.deleted_end,
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
