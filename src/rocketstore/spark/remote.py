"""The Spark source's view of a tier (``tieredStoreUri=s3://bucket/prefix``): segments read with ranged GETs.

Driver side, :func:`tier_of` finds a store's tier (the read options, else the
store's ``broker.conf``) and :func:`tier_below` the uploaded segments below the
store's first local segment, so that the tier and the local files form one
continuous commitlog range (a segment both local and uploaded is read locally).
A ``load("s3://bucket/prefix")`` reads a tier alone, from its manifest.

Executor side, :class:`RemoteSegment` stands in for :class:`.segment.Segment`:
an anonymous zero-filled map of the segment's size (pages cost nothing until
written) into which :func:`read_tier_range` fetches one window of the task's
range at a time with parallel ranged reads, decodes it with the same code as a
local file, and gives the window's pages back to the kernel before the next,
so a task holds at most a window (64 MiB) of a 1 GiB segment.  Executors need
no shared disk: only network access to the bucket, and the credentials given
as options (RocketMQ tieredstore's key names) or in the AWS environment.
"""

from __future__ import annotations

import logging
import mmap
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa

from ..format import codec
from ..config import StoreConfig, read_conf_file
from ..errors import StoreError, StoreLoadError
from ..storage.geometry import STORE_CONF
from ..tier.manifest import MANIFEST, TierManifest
from ..config import TierLocation
from ..tier.objectstore import ObjectStore
from ..tier.reader import TierReader
from ..tier.tiered import STORE_ID_FILE, load_tier_state, refuse_without_tier
from .segment import Segment

log = logging.getLogger(__name__)

TIER_KEYS = ("objectStoreEndpoint", "objectStoreRegion", "objectStoreAccessKey", "objectStoreSecretKey")
WINDOW = 64 * 1024 * 1024  # bytes of a segment an executor holds at once
FETCH_CHUNK = 8 * 1024 * 1024  # bytes per ranged GET
FETCH_THREADS = 4  # ranged GETs in flight per task
_PAGE = mmap.PAGESIZE


def is_tier_uri(path: str) -> bool:
    """Whether ``load(path)`` names a tier (``s3://`` or ``s3a://``) rather than a store directory."""
    return urlparse(path).scheme in ("s3", "s3a")


@dataclass(frozen=True)
class TierRef:
    """Where a tier is and how to reach it: plain data, pickled into every scan task."""

    uri: str
    endpoint: str = ""
    region: str = ""
    access_key: str = ""
    secret_key: str = field(default="", repr=False)

    @classmethod
    def from_options(cls, uri: str, options: Mapping[str, Any]) -> "TierRef":
        """From RocketMQ-named options (any case); empty ones fall back to the AWS environment when used."""
        low = {str(k).lower(): v for k, v in options.items()}
        vals = [str(low.get(k.lower()) or "") for k in TIER_KEYS]
        ref = cls(uri.rstrip("/"), *vals)
        ref.location()  # a malformed URI fails on the driver, naming it
        return ref

    def store_config(self) -> StoreConfig:
        """This tier as the keys of a store's config: a store the driver opens beside the read uses the tier
        the read uses (given as read options, it may be missing from the store's broker.conf)."""
        return StoreConfig.from_mapping({"tieredStoreUri": self.uri, **{k: v for k, v in zip(TIER_KEYS, (
            self.endpoint, self.region, self.access_key, self.secret_key)) if v}}, source="read options")

    def location(self) -> TierLocation:
        return TierLocation.parse(self.uri, endpoint=self.endpoint, region=self.region,
                                  access_key=self.access_key, secret_key=self.secret_key)

    def where(self, key: str) -> str:
        """``key``'s full name, for messages: ``s3://bucket/prefix/commitlog/000...``."""
        return posixpath.join(self.uri, key)


_stores: dict[TierRef, ObjectStore] = {}
_stores_lock = threading.Lock()


def objects(ref: TierRef) -> ObjectStore:
    """The process's client for ``ref``: one per tier, so that an executor's tasks share its connections."""
    with _stores_lock:
        o = _stores.get(ref)
        if o is None:
            o = _stores[ref] = ObjectStore(ref.location())
        return o


def manifest(ref: TierRef) -> TierManifest:
    """The tier's ``tier.json``, read now (it grows as the store uploads)."""
    data = objects(ref).get_bytes(MANIFEST)
    if data is None:
        raise StoreLoadError(f"{ref.uri}: no {MANIFEST}: not a rocketstore tier")
    return TierManifest.loads(data, f"{ref.uri}/{MANIFEST}")


def reader(ref: TierRef, m: TierManifest | None = None) -> TierReader:
    return TierReader(objects(ref), m or manifest(ref))


def tier_of(root: str, options: Mapping[str, Any]) -> TierRef | None:
    """The tier of ``load(root)``: ``root`` itself when it is an s3 URI; for a store directory, the
    ``tieredStoreUri`` and ``objectStore*`` read options, else those of ``<root>/broker.conf``; None without."""
    low = {str(k).lower(): v for k, v in options.items() if v is not None}
    if is_tier_uri(root):
        return TierRef.from_options(root, low)
    conf_path = os.path.join(root, STORE_CONF)
    conf = {k.lower(): v for k, v in read_conf_file(conf_path).items()} if os.path.isfile(conf_path) else {}
    uri = low.get("tieredstoreuri") or conf.get("tieredstoreuri")
    if not uri:
        refuse_without_tier(root, "")  # a store that copied segments to a tier is not read as its local part
        return None
    merged = {k.lower(): low.get(k.lower()) or conf.get(k.lower()) or "" for k in TIER_KEYS}
    return TierRef.from_options(str(uri), merged)


@dataclass
class TierPart:
    """The part of a store's commitlog read from its tier: uploaded segments below ``local_min``."""

    ref: TierRef
    manifest: TierManifest
    segments: list  # TierSegment, ascending, continuous, ending at local_min (or the tier's end)

    @property
    def file_size(self) -> int:
        return self.manifest.geometry["mappedFileSizeCommitLog"]

    @property
    def start(self) -> int:
        return self.segments[0].base if self.segments else self.manifest.end_offset

    @property
    def end(self) -> int:
        return self.segments[-1].base + self.file_size if self.segments else self.start


def tier_below(root: str, ref: TierRef | None, local_min: int | None, local_size: int | None) -> TierPart | None:
    """The tier's segments below the first local segment (``local_min``; None when the store has no local
    segment, or ``root`` is a tier), or None when there is no tier or it holds nothing below.

    As the store does (``min_readable_offset``), a tier is used only when it reaches the local segments
    with no gap; otherwise the read starts at the local segments and says why in the log.  A tier
    written by another store, or of another segment size, is refused.
    """
    if ref is None:
        return None
    m = manifest(ref)
    size = m.geometry["mappedFileSizeCommitLog"]
    if not is_tier_uri(root):
        _check_ours(root, ref, m, local_size)
    segs = m.commitlog if local_min is None else [s for s in m.commitlog if s.base < local_min]
    if not segs:
        return None
    if local_min is not None and segs[-1].base + size != local_min:
        log.warning("%s: its tier %s ends at commitlog offset %d but the local segments start at %d; "
                    "reading the local segments only", root, ref.uri, segs[-1].base + size, local_min)
        return None
    return TierPart(ref, m, segs)


def _check_ours(root: str, ref: TierRef, m: TierManifest, local_size: int | None) -> None:
    id_path = os.path.join(root, "config", STORE_ID_FILE)
    state = load_tier_state(root)  # (its .bak when damaged; StoreLoadError when neither can be read)
    store_id = state.store_id if state is not None else None
    if store_id != m.store_id:
        raise StoreLoadError(f"{ref.uri}/{MANIFEST}: the tier belongs to store {m.store_id}, not {root} "
                             f"({store_id or 'no ' + id_path}); refusing to read it as this store's")
    size = m.geometry["mappedFileSizeCommitLog"]
    if local_size is not None and local_size != size:
        raise StoreLoadError(f"{ref.uri}/{MANIFEST}: mappedFileSizeCommitLog={size} in the tier but {root}'s "
                             f"segments are {local_size} bytes; refusing to read it as this store's")


def record_starts_at(ref: TierRef, m: TierManifest, offset: int) -> bool:
    """Whether a whole record starts at ``offset`` in the tier (its PHYSICALOFFSET says so); two GETs."""
    try:
        buf, _ = reader(ref, m).record_bytes(offset)
    except (StoreError, OSError):
        return False
    _size, msg, _ = codec.check(buf, 0, len(buf), check_crc=False)
    return msg is not None and msg.commit_log_offset == offset


def first_at_or_after(ref: TierRef, m: TierManifest, segs: Sequence[Any], ts_ms: int) -> int | None:
    """Commitlog offset of the first record stored at or after ``ts_ms`` in ``segs`` (tier segments), or None.

    Store times ascend in commitlog order, so the search starts at the last segment whose first record is
    older and fetches from there up to the first match (bodies are not decoded)."""
    start_i = 0
    for i, s in enumerate(segs):
        if s.first_store_time and s.first_store_time < ts_ms:
            start_i = i
    if start_i >= len(segs):
        return None
    end = segs[-1].base + m.geometry["mappedFileSizeCommitLog"]
    for offset, _size, msg, problem in reader(ref, m).scan(segs[start_i].base, end, read_body=False):
        if msg is None:
            raise StoreError(problem or f"{ref.uri}: unreadable record at commitlog offset {offset}")
        if msg.store_timestamp >= ts_ms:
            return offset
    return None


# ---------------------------------------------------------------- executors

class RemoteSegment(Segment):
    """A tier segment as :class:`.segment.Segment` presents a local one (``mm``, ``np``, ``pa``, ``base``,
    ``size``, ``path``; closed the same way), filled window by window with ranged reads (:meth:`fetch`)."""

    def __init__(self, ref: TierRef, key: str, base: int, size: int) -> None:  # noqa: super() maps a file
        self.ref = ref
        self.key = key
        self.path = ref.where(key)
        self.base = base
        self.size = size
        self.objects = objects(ref)
        self.mm = mmap.mmap(-1, max(size, 1))  # anonymous: zero pages, no memory until written
        self.np = np.frombuffer(self.mm, dtype=np.uint8, count=size)
        self.pa = pa.py_buffer(self.mm)
        self.fetched = 0  # bytes fetched, for the log

    def fetch(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of the object into the map, ``FETCH_CHUNK`` per ranged GET, in parallel."""
        hi = min(hi, self.size)
        chunks = [(p, min(FETCH_CHUNK, hi - p)) for p in range(lo, hi, FETCH_CHUNK)]

        def one(c: tuple[int, int]) -> None:
            data = self.objects.read(self.key, c[0], c[1])
            if len(data) != c[1]:
                raise StoreError(f"{self.path}: short read at file position {c[0]}: {len(data)} of {c[1]} bytes "
                                 "(the object is smaller than the manifest says)")
            self.np[c[0]:c[0] + c[1]] = np.frombuffer(data, dtype=np.uint8)

        if len(chunks) == 1:
            one(chunks[0])
        elif chunks:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(chunks))) as pool:
                list(pool.map(one, chunks))
        self.fetched += hi - lo

    def release(self, lo: int, hi: int) -> None:
        """Give the pages wholly inside [lo, hi) back to the kernel (they read as zeros afterwards)."""
        a = -(-lo // _PAGE) * _PAGE
        b = hi // _PAGE * _PAGE
        if b > a and self.mm is not None:
            try:
                self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)
            except (OSError, AttributeError, ValueError):
                pass



def read_tier_range(ref: TierRef, key: str, base: int, size: int, start: int, end: int, names: Sequence[str],
                    flt: Any = None, batch_rows: int = 16384, boundary_known: bool = True,
                    skip_damaged: bool = False, window: int = WINDOW) -> Iterator[pa.RecordBatch]:
    """Batches of the records of tier segment ``key`` between file positions ``start`` and ``end``, fetched
    and decoded one window at a time (see :func:`.segment.read_range` for the arguments)."""
    from .segment import RecordFormatError, decode, walk
    seg = RemoteSegment(ref, key, base, size)
    try:
        end = min(end, size)
        pos = start if boundary_known or start == 0 else 0  # an unknown boundary: walk from the file start
        need = window
        while pos < end:
            hi = min(end, pos + need)
            seg.fetch(pos, hi)
            w = walk(seg.mm, pos, hi, path=seg.path)
            if w.problem is not None and not w.blank and hi < end:
                nxt = _crossing(seg, w.end, end)
                if nxt is None:
                    raise RecordFormatError(w.problem)
                if w.end == pos:  # one record longer than the window: widen it to that record
                    if nxt <= need:
                        raise RecordFormatError(w.problem)
                    need = nxt
                    continue
            elif w.problem is not None:
                raise RecordFormatError(w.problem)
            positions = w.positions
            if len(positions) and positions[0] < start:
                positions = positions[positions >= start]
            for i in range(0, len(positions), batch_rows):
                b = decode(seg, positions[i:i + batch_rows], names, flt, limit=w.end, skip_damaged=skip_damaged)
                if b is not None and b.num_rows:
                    yield b
            seg.release(pos, w.end)
            if w.blank or w.end >= end:
                break
            pos, need = w.end, window
        log.debug("%s: fetched %d bytes for [%d, %d)", seg.path, seg.fetched, start, end)
    finally:
        seg.close()


def _crossing(seg: RemoteSegment, pos: int, end: int) -> int | None:
    """The bytes from ``pos`` to fetch for the record there to be whole, when it only crosses the window's end
    (a known magic and a size that fits the range); None when what is there is no record."""
    if pos + 8 > end:
        return None
    seg.fetch(pos, pos + 8)
    total, magic = codec.read_total_size(seg.mm, pos), int.from_bytes(seg.mm[pos + 4:pos + 8], "big")
    if magic not in (codec.MAGIC_V1, codec.MAGIC_V2) or not (0 < total <= end - pos):
        return None
    return total + 8  # and the next header, so a walk can go on past it
