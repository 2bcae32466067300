"""Vectorised decoding of commitlog segments into Arrow record batches.

This is the executors' half of the data source.  It needs numpy and pyarrow
but not Spark, and it never opens a ``MessageStore``: a task maps its own
segment file read-only, finds the record boundaries with one cheap walk over
the TOTALSIZE fields, and then decodes every field of a batch of records at
once:

* the fixed header (TOTALSIZE .. BODYLENGTH) of every record is gathered into
  one contiguous buffer and viewed through a big-endian numpy structured dtype;
* variable-length parts (body, topic, properties) are cut out of the mapped
  file by a single Arrow ``take`` over "interleaved" offsets (start, end of
  record 0, start, end of record 1, ...), which copies each range once in C;
* the properties map is split on the 0x01/0x02 separators with numpy, exactly
  as RocketMQ's ``string2messageProperties`` splits (see
  :func:`rocketstore.codec.parse_properties`); the rare record whose string
  is not plain (duplicate names, invalid UTF-8) goes through the Python
  parser instead, so the result is always the one ``rocketstore dump`` gives.

The column names and values are those of :meth:`MessageExt.to_json`
(``rocketstore dump``), with the two timestamps as Arrow timestamps.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import codec

TS = pa.timestamp("us", tz="UTC")
MAP = pa.map_(pa.string(), pa.string())

# (name, Spark type in DDL, Arrow type): the fields of ``rocketstore dump``, in its order.
COLUMNS: list[tuple[str, str, pa.DataType]] = [
    ("topic", "string", pa.string()),
    ("queueId", "int", pa.int32()),
    ("queueOffset", "bigint", pa.int64()),
    ("commitLogOffset", "bigint", pa.int64()),
    ("size", "int", pa.int32()),
    ("sysFlag", "int", pa.int32()),
    ("flag", "int", pa.int32()),
    ("bodyCrc", "int", pa.int32()),
    ("reconsumeTimes", "int", pa.int32()),
    ("preparedTransactionOffset", "bigint", pa.int64()),
    ("bornTimestamp", "timestamp", TS),
    ("storeTimestamp", "timestamp", TS),
    ("bornHost", "string", pa.string()),
    ("storeHost", "string", pa.string()),
    ("msgId", "string", pa.string()),
    ("tags", "string", pa.string()),
    ("keys", "string", pa.string()),
    ("properties", "map<string,string>", MAP),
    ("propertiesString", "string", pa.string()),
    ("body", "binary", pa.binary()),
    ("bodyLength", "int", pa.int32()),
    ("magicCode", "string", pa.string()),
]
COLUMN_NAMES = [c[0] for c in COLUMNS]
ARROW_TYPES = {c[0]: c[2] for c in COLUMNS}
DDL = ", ".join(f"{n} {t}" for n, t, _ in COLUMNS)

DEFAULT_BATCH_ROWS = 16384
_HEAD8 = struct.Struct(">iI")
_I32 = struct.Struct(">i")
_MAGICS = (codec.MAGIC_V1, codec.MAGIC_V2)
_MAGIC_TEXT = pa.array([f"0x{codec.MAGIC_V1:08X}", f"0x{codec.MAGIC_V2:08X}"], pa.string())
# Byte value -> its two uppercase hex digits, as one uint16 laid out in memory as (high digit, low digit).
_HEX16 = np.frombuffer(b"".join(f"{i:02X}".encode() for i in range(256)), dtype=np.uint16).copy()
_HOST_TEXT: dict[int, str] = {}  # formatted IPv4 hosts, kept across batches


def arrow_schema(names: Sequence[str] | None = None) -> pa.Schema:
    names = COLUMN_NAMES if names is None else list(names)
    return pa.schema([pa.field(n, ARROW_TYPES[n]) for n in names])


def _header_dtype(born6: bool, store6: bool) -> np.dtype:
    return np.dtype([
        ("total", ">i4"), ("magic", ">u4"), ("crc", ">i4"), ("qid", ">i4"), ("flag", ">i4"),
        ("qoff", ">i8"), ("phy", ">i8"), ("sysflag", ">i4"), ("born_ts", ">i8"),
        ("born_host", "V20" if born6 else "V8"), ("store_ts", ">i8"), ("store_host", "V20" if store6 else "V8"),
        ("reconsume", ">i4"), ("prepared", ">i8"), ("body_len", ">i4")])


# sysFlag & 0x30 -> header dtype (its itemsize is the header length).
_DTYPES = {fam: _header_dtype(bool(fam & codec.SYSFLAG_BORNHOST_V6), bool(fam & codec.SYSFLAG_STOREHOST_V6))
           for fam in (0x00, 0x10, 0x20, 0x30)}
assert _DTYPES[0].itemsize == 88 and _DTYPES[0x30].itemsize == 112


class RecordFormatError(ValueError):
    """A record in the requested range does not decode (the message names file and offset)."""


# ---------------------------------------------------------------- filters

@dataclass
class RowFilter:
    """What a scan keeps: bounds are inclusive; None means unbounded."""

    offset_lo: int | None = None  # commitLogOffset
    offset_hi: int | None = None
    ts_lo: int | None = None  # storeTimestamp in microseconds
    ts_hi: int | None = None
    topics: frozenset[str] | None = None
    queue_ids: frozenset[int] | None = None
    keys: frozenset[str] | None = None  # the whole KEYS property (pruned with the index)

    def empty(self) -> bool:
        if self.offset_lo is not None and self.offset_hi is not None and self.offset_lo > self.offset_hi:
            return True
        if self.ts_lo is not None and self.ts_hi is not None and self.ts_lo > self.ts_hi:
            return True
        return any(s is not None and not s for s in (self.topics, self.queue_ids, self.keys))

    def intersect(self, other: "RowFilter") -> "RowFilter":
        def lo(a, b):
            return b if a is None else a if b is None else max(a, b)

        def hi(a, b):
            return b if a is None else a if b is None else min(a, b)

        def both(a, b):
            return b if a is None else a if b is None else a & b
        return RowFilter(lo(self.offset_lo, other.offset_lo), hi(self.offset_hi, other.offset_hi),
                         lo(self.ts_lo, other.ts_lo), hi(self.ts_hi, other.ts_hi),
                         both(self.topics, other.topics), both(self.queue_ids, other.queue_ids),
                         both(self.keys, other.keys))

    def trivial(self) -> bool:
        return self == RowFilter()


# ---------------------------------------------------------------- the mapped file

class Segment:
    """One commitlog file mapped read-only (no store object, no lock: a reader of the files only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.base = int(os.path.basename(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        finally:
            os.close(fd)
        self.np = np.frombuffer(self.mm, dtype=np.uint8) if self.mm is not None else np.zeros(0, np.uint8)
        self.pa = pa.py_buffer(self.mm) if self.mm is not None else pa.py_buffer(b"")

    def close(self) -> None:
        self.np = np.zeros(0, np.uint8)
        self.pa = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # an Arrow array still points into the map; it is unmapped when that goes
                pass
            self.mm = None

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class Walk:
    positions: np.ndarray  # file positions of the records found, ascending
    end: int  # file position after the last record (file size after a blank record)
    blank: bool = False  # stopped at the end-of-file blank record
    problem: str | None = None  # stopped at something that is not a record


MIN_RECORD_SIZE = 88 + 1 + 2  # header, topic length byte, properties length


def walk(mm: Any, pos: int, limit: int, *, zeros_end: bool = False, max_bytes: int | None = None,
         path: str = "") -> Walk:
    """Record boundaries from ``pos`` up to ``limit`` (the readable end), reading only TOTALSIZE and MAGICCODE.

    ``zeros_end``: a zero header is the end of the written data (a live or pre-allocated file), not a problem.
    ``max_bytes``: stop before the record that would take the walk past this many bytes (at least one record).
    The fields of each record are checked when it is decoded (:func:`decode`).
    """
    out = array("q")
    append = out.append
    unpack = _HEAD8.unpack_from
    start = pos
    v1, v2 = codec.MAGIC_V1, codec.MAGIC_V2
    lowest = MIN_RECORD_SIZE
    try:
        if max_bytes is None:
            while pos < limit:
                total, magic = unpack(mm, pos)
                if (magic == v1 or magic == v2) and lowest <= total <= limit - pos:
                    append(pos)
                    pos += total
                else:
                    break
        else:
            while pos < limit:
                total, magic = unpack(mm, pos)
                if not ((magic == v1 or magic == v2) and lowest <= total <= limit - pos):
                    break
                if out and pos + total - start > max_bytes:
                    return Walk(_positions(out), pos)
                append(pos)
                pos += total
    except struct.error:
        pass
    problem = None
    blank = False
    if pos < limit:
        if limit - pos < 8:
            if not (zeros_end and not any(mm[pos:limit])):
                problem = "record header runs past the readable end"
        else:
            total, magic = unpack(mm, pos)
            if magic == codec.BLANK_MAGIC:
                blank = True
            elif not (zeros_end and total == 0 and magic == 0):
                problem = codec.check(mm, pos, limit, check_crc=False)[2] or f"bad record size {total}"
    if problem is not None:
        problem = f"{path} at file position {pos}: {problem}"
    return Walk(_positions(out), pos, blank, problem)


def _positions(out: array) -> np.ndarray:
    return np.frombuffer(out, dtype=np.int64).copy() if out else np.zeros(0, np.int64)


# ---------------------------------------------------------------- gathering helpers

def _gather(data: pa.Buffer, starts: np.ndarray, lengths: np.ndarray, typ: pa.DataType = pa.binary()) -> pa.Array:
    """Binary array of ``data[starts[i]:starts[i]+lengths[i]]``; ranges must ascend without overlapping."""
    n = len(starts)
    if n == 0:
        return pa.array([], typ)
    offs = np.empty(2 * n + 1, dtype=np.int32)
    offs[0:2 * n:2] = starts
    offs[1:2 * n:2] = starts + lengths
    offs[2 * n] = offs[2 * n - 1]
    inter = pa.Array.from_buffers(pa.binary(), 2 * n, [None, pa.py_buffer(offs), data])
    out = inter.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    return out if typ == pa.binary() else out.cast(typ)


def _headers(seg: "Segment", pos: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8 matrix of the bytes at ``pos``: one Arrow gather when the ranges do not overlap."""
    n = len(pos)
    ends = pos + width
    if n and ends[-1] <= len(seg.np) and (n == 1 or (ends[:-1] <= pos[1:]).all()):
        g = _gather(seg.pa, pos, np.full(n, width, np.int64))
        data = g.buffers()[2]
        return np.frombuffer(data, dtype=np.uint8, count=n * width).reshape(n, width)
    return _fixed(seg.np, pos, width)


def _fixed(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8 matrix of ``buf[pos[i]:pos[i]+width]`` (positions clipped into the buffer)."""
    idx = pos[:, None] + np.arange(width, dtype=np.int64)
    np.clip(idx, 0, len(buf) - 1, out=idx)
    return buf[idx]


def _be16(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    m = _fixed(buf, pos, 2).astype(np.int32)
    v = (m[:, 0] << 8) | m[:, 1]
    return np.where(v >= 0x8000, v - 0x10000, v)


def _be8(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    v = buf[np.clip(pos, 0, len(buf) - 1)].astype(np.int32)
    return np.where(v >= 0x80, v - 0x100, v)


def _strings_from_fixed(mat: np.ndarray) -> pa.Array:
    """A string array from an (n, w) uint8 matrix of ASCII."""
    n, w = mat.shape
    data = np.ascontiguousarray(mat).tobytes()
    offs = np.arange(0, (n + 1) * w, w, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offs), pa.py_buffer(data)])


def _host_strings(raw: np.ndarray, v6: bool) -> pa.Array:
    """bornHost/storeHost text from the raw (address, port) bytes, formatted once per distinct host."""
    width = 20 if v6 else 8
    mat = np.frombuffer(raw.tobytes(), dtype=np.uint8).reshape(len(raw), width)
    if not v6:
        keys = mat.view(">u8").ravel().astype(np.uint64)
        enc = pa.array(keys).dictionary_encode()
        texts = []
        cache = _HOST_TEXT
        if len(cache) > 100000:
            cache.clear()
        for k in enc.dictionary.to_numpy().tolist():
            t = cache.get(k)
            if t is None:
                port = k & 0xFFFFFFFF
                t = cache[k] = codec.format_host((k >> 32).to_bytes(4, "big"), port - (1 << 32) if port >> 31 else port)
            texts.append(t)
    else:
        blob = [bytes(r) for r in mat]
        enc = pa.array(blob, pa.binary()).dictionary_encode()
        texts = [codec.format_host(b[:16], struct.unpack(">i", b[16:20])[0]) for b in enc.dictionary.to_pylist()]
    return pa.array(texts, pa.string()).take(enc.indices)


def _timestamps(ms: np.ndarray) -> pa.Array:
    us = np.ascontiguousarray(ms, dtype=np.int64) * 1000
    return pa.Array.from_buffers(TS, len(us), [None, pa.py_buffer(us)])


def _numeric(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.array(np.ascontiguousarray(values, dtype=typ.to_pandas_dtype()), typ)


# ---------------------------------------------------------------- properties

def properties_map(props: pa.BinaryArray, lookups: Sequence[str] = (), valid_utf8: bool = False
                   ) -> tuple[pa.Array, dict[str, pa.Array]]:
    """The properties map (and the values of the names in ``lookups``) from the raw properties strings.

    This is RocketMQ's ``string2messageProperties`` (see :func:`rocketstore.codec.parse_properties`),
    vectorised.  A batch the vectorised paths cannot do exactly (a name twice in one record, invalid
    UTF-8) goes through the Python parser.  ``valid_utf8``: the strings are known to be valid UTF-8.
    """
    n = len(props)
    bufs = props.buffers()
    offs = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=props.offset * 4).astype(np.int64)
    base = int(offs[0])
    offs -= base
    total = int(offs[-1]) if n else 0
    data = np.frombuffer(bufs[2], dtype=np.uint8, count=total, offset=base) if total else np.zeros(0, np.uint8)
    split = _split_simple(data, offs) or _split_general(data, offs)
    ks, ke, ve, map_offs = split
    dbuf = pa.py_buffer(data)
    keys = _gather(dbuf, ks, ke - ks)
    vals = _gather(dbuf, ke + 1, ve - ke - 1)
    counts = np.diff(map_offs)
    rec = np.repeat(np.arange(n, dtype=np.int64), counts)
    enc = keys.dictionary_encode()
    ids = enc.indices.to_numpy()
    if _has_duplicate_names(ids, rec, counts):
        return _python_fallback(props, lookups)
    if valid_utf8:
        # Pieces of valid UTF-8 cut at ASCII separators are valid UTF-8: reinterpret without re-checking.
        keys = pa.Array.from_buffers(pa.string(), len(keys), keys.buffers())
        vals = pa.Array.from_buffers(pa.string(), len(vals), vals.buffers())
    else:
        try:
            keys = keys.cast(pa.string())
            vals = vals.cast(pa.string())
        except pa.ArrowInvalid:
            return _python_fallback(props, lookups)  # invalid UTF-8: decode like the codec (with replacement)
    arr = pa.MapArray.from_arrays(pa.array(map_offs.astype(np.int32)), keys, vals)
    names = enc.dictionary.to_pylist()
    out = {}
    for name in lookups:
        want = name.encode("utf-8")
        idx = np.full(n, -1, np.int64)
        if want in names:
            at = np.flatnonzero(ids == names.index(want))
            idx[rec[at]] = at
        out[name] = vals.take(pa.array(idx, mask=idx < 0))
    return arr, out


def _split_simple(data: np.ndarray, offs: np.ndarray) -> tuple | None:
    """The common shape, ``name\x01value\x02`` pairs only: separators alternate 1, 2 and every string ends
    with 0x02.  Returns None when the batch has any other shape."""
    sep = np.flatnonzero(data < 3)  # the separators (a zero byte sends the batch to the general path)
    if len(sep) % 2:
        return None
    kpos = sep[0::2]
    epos = sep[1::2]
    if not ((data[kpos] == 1).all() and (data[epos] == 2).all()):
        return None
    ends = offs[1:][offs[1:] > offs[:-1]]
    if len(ends) and not (data[ends - 1] == 2).all():
        return None
    ks = np.empty_like(epos)
    if len(epos):
        ks[0] = 0
        ks[1:] = epos[:-1] + 1
    if not ((kpos > ks).all() and (epos > kpos + 1).all()):
        return None  # an empty name or value: RocketMQ skips the pair
    return ks, kpos, epos, np.searchsorted(epos, offs, side="left")


def _split_general(data: np.ndarray, offs: np.ndarray) -> tuple:
    """Any shape: split on 0x02 (and at a string end), cut each piece at its first 0x01, drop pieces with an
    empty name or value."""
    n = len(offs) - 1
    rec_start, rec_end = offs[:-1], offs[1:]
    seps2 = np.flatnonzero(data == 2)
    # A segment ends at each 0x02, and at the end of a record whose string does not end with one.
    nonempty = rec_end > rec_start
    last_byte = data[np.maximum(rec_end - 1, 0)] if len(data) else np.zeros(n, np.uint8)
    tails = np.flatnonzero(nonempty & (last_byte != 2)) if n else np.zeros(0, np.int64)
    sep_rec = np.searchsorted(rec_start, seps2, side="right") - 1
    if len(tails):
        ends = np.concatenate([seps2, rec_end[tails]])
        recs = np.concatenate([sep_rec, tails])
        # A record's open tail ends where the next record starts: it sorts before that record's segments.
        order = np.argsort(ends * 2 + np.concatenate([np.ones(len(seps2), np.int64), np.zeros(len(tails), np.int64)]),
                           kind="stable")
        seg_end, seg_rec = ends[order], recs[order]
    else:
        seg_end, seg_rec = seps2, sep_rec
    same = np.zeros(len(seg_end), dtype=bool)
    if len(seg_end) > 1:
        same[1:] = seg_rec[1:] == seg_rec[:-1]
    prev_end = np.empty_like(seg_end)
    if len(seg_end):
        prev_end[0] = 0
        prev_end[1:] = seg_end[:-1]
    seg_start = np.where(same, prev_end + 1, rec_start[seg_rec]) if len(seg_end) else seg_end
    seps1 = np.flatnonzero(data == 1)
    k_idx = np.searchsorted(seps1, seg_start, side="left")
    has = k_idx < len(seps1)
    k = np.where(has, seps1[np.minimum(k_idx, max(len(seps1) - 1, 0))] if len(seps1) else 0, -1)
    valid = has & (k < seg_end) & (k > seg_start) & (k + 1 < seg_end)
    ks, ke, ve, rec = seg_start[valid], k[valid], seg_end[valid], seg_rec[valid]
    counts = np.bincount(rec, minlength=n) if n else np.zeros(0, np.int64)
    map_offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=map_offs[1:])
    return ks, ke, ve, map_offs


def _has_duplicate_names(ids: np.ndarray, rec: np.ndarray, counts: np.ndarray) -> bool:
    """Whether a property name occurs twice in one record (RocketMQ keeps the last value)."""
    maxc = int(counts.max(initial=0))
    for d in range(1, maxc):
        if ((rec[d:] == rec[:-d]) & (ids[d:] == ids[:-d])).any():
            return True
    return False


def _python_fallback(props: pa.BinaryArray, lookups: Sequence[str]) -> tuple[pa.Array, dict[str, pa.Array]]:
    strings = [b.decode("utf-8", "replace") if b is not None else "" for b in props.to_pylist()]
    arr = _python_properties(strings)
    return arr, {name: pc.map_lookup(arr, name, "last") for name in lookups}


def _python_properties(strings: list[str | None]) -> pa.Array:
    return pa.array([list(codec.parse_properties(s or "").items()) for s in strings], MAP)


# ---------------------------------------------------------------- decoding

def decode(seg: Segment, positions: np.ndarray, names: Sequence[str], flt: RowFilter | None = None,
           limit: int | None = None) -> pa.RecordBatch | None:
    """Decode the records at ``positions`` (file positions) into a batch of the columns ``names``.

    Rows not passing ``flt`` are dropped before the expensive columns are built.
    Raises :class:`RecordFormatError` at the first record whose fields disagree with its size.
    """
    buf = seg.np
    limit = len(buf) if limit is None else limit
    if flt is not None and (flt.offset_lo is not None or flt.offset_hi is not None):
        offs = positions + seg.base
        keep = np.ones(len(positions), dtype=bool)
        if flt.offset_lo is not None:
            keep &= offs >= flt.offset_lo
        if flt.offset_hi is not None:
            keep &= offs <= flt.offset_hi
        positions = positions[keep]
    n = len(positions)
    if n == 0:
        return None
    head = _headers(seg, positions, _DTYPES[0].itemsize)  # the IPv4/IPv4 layout; most records have it
    fams = head[:, 36:40].copy().view(">i4").ravel() & 0x30
    if not fams.any():
        groups = [(0, None)]
    else:
        groups = [(f, fams == f) for f in (0x00, 0x10, 0x20, 0x30) if (fams == f).any()]
    cols = _decode_fixed(seg, positions, groups, head)
    _validate(seg, positions, cols, limit)
    keep = None
    if flt is not None:
        keep = np.ones(n, dtype=bool)
        if flt.ts_lo is not None:
            keep &= cols["store_ts"] * 1000 >= flt.ts_lo
        if flt.ts_hi is not None:
            keep &= cols["store_ts"] * 1000 <= flt.ts_hi
        if flt.queue_ids is not None:
            keep &= np.isin(cols["qid"], np.fromiter(flt.queue_ids, dtype=np.int64))
    topic_bin = None
    need_topic = "topic" in names or (flt is not None and flt.topics is not None)
    if need_topic:
        sel = positions if keep is None else positions[keep]
        c = cols if keep is None else _subset(cols, keep)
        topic_bin = _gather(seg.pa, c["topic_start"], c["topic_len"])
        if flt is not None and flt.topics is not None:
            tk = pc.is_in(topic_bin, value_set=pa.array([t.encode("utf-8") for t in flt.topics], pa.binary()))
            tk = tk.to_numpy(zero_copy_only=False)
            if keep is None:
                keep = tk
            else:
                full = np.zeros(n, dtype=bool)
                full[np.flatnonzero(keep)[tk]] = True
                keep = full
            topic_bin = topic_bin.filter(pa.array(tk))
        del sel
    if keep is not None and not keep.all():
        if not keep.any():
            return None
        positions = positions[keep]
        cols = _subset(cols, keep)
        n = len(positions)
    need_props = any(x in names for x in ("properties", "propertiesString", "tags", "keys")) or (
        flt is not None and flt.keys is not None)
    props_bin = _gather(seg.pa, cols["props_start"], cols["props_len"]) if need_props else None
    props_str = None
    pmap = None
    if need_props:
        try:
            props_str = props_bin.cast(pa.string())
            valid = True
        except pa.ArrowInvalid:
            props_str = pa.array([bytes(b).decode("utf-8", "replace") if b is not None else ""
                                  for b in props_bin.to_pylist()], pa.string())
            valid = False
        if any(x in names for x in ("properties", "tags", "keys")) or (flt is not None and flt.keys is not None):
            pmap, found = properties_map(props_bin, ("TAGS", "KEYS"), valid_utf8=valid)
    tags = keys = None
    if pmap is not None:
        tags, keys = found["TAGS"], found["KEYS"]
        if flt is not None and flt.keys is not None:
            kk = pc.fill_null(pc.is_in(keys, value_set=pa.array(sorted(flt.keys), pa.string())), False)
            if not pc.any(kk).as_py():
                return None
            if not pc.all(kk).as_py():
                kn = kk.to_numpy(zero_copy_only=False)
                positions = positions[kn]
                cols = _subset(cols, kn)
                n = len(positions)
                kka = pa.array(kn)
                pmap, keys, props_str = pmap.filter(kka), keys.filter(kka), props_str.filter(kka)
                if tags is not None:
                    tags = tags.filter(kka)
                if topic_bin is not None:
                    topic_bin = topic_bin.filter(kka)
    out: list[pa.Array] = []
    for name in names:
        out.append(_column(name, seg, positions, cols, topic_bin, props_str, pmap, tags, keys))
    return pa.RecordBatch.from_arrays(out, schema=arrow_schema(names))


def _subset(cols: dict[str, Any], keep: np.ndarray) -> dict[str, Any]:
    """The decoded columns of the rows where ``keep`` is True."""
    out: dict[str, Any] = {}
    for k, v in cols.items():
        if isinstance(v, np.ndarray):
            out[k] = v[keep]
        else:  # host parts: [(family mask or None, raw host bytes of that family, v6)]
            parts = []
            for mask, raw, v6 in v:
                if mask is None:
                    parts.append((None, raw[keep], v6))
                else:
                    sub = keep[mask]
                    if sub.any():
                        parts.append((mask[keep], raw[sub], v6))
            out[k] = parts
    return out


def _decode_fixed(seg: Segment, positions: np.ndarray, groups: list, head: np.ndarray | None = None
                  ) -> dict[str, Any]:
    """The header fields of every record (one structured view per host family), plus part positions."""
    buf = seg.np
    n = len(positions)
    if len(groups) == 1:
        fam = groups[0][0]
        dt = _DTYPES[fam]
        h = (head if fam == 0 and head is not None else _headers(seg, positions, dt.itemsize)).view(dt).ravel()
        cols = {k: h[k] for k in ("total", "magic", "crc", "qid", "flag", "qoff", "phy", "sysflag", "born_ts",
                                 "store_ts", "reconsume", "prepared", "body_len")}
        cols["hsize"] = np.full(n, dt.itemsize, np.int64)
        cols["born_host"] = [(None, h["born_host"], bool(fam & 0x10))]
        cols["store_host"] = [(None, h["store_host"], bool(fam & 0x20))]
    else:
        cols = {}
        cols["born_host"], cols["store_host"] = [], []
        for fam, mask in groups:
            dt = _DTYPES[fam]
            h = _headers(seg, positions[mask], dt.itemsize).view(dt).ravel()
            for k in ("total", "magic", "crc", "qid", "flag", "qoff", "phy", "sysflag", "born_ts", "store_ts",
                      "reconsume", "prepared", "body_len"):
                if k not in cols:
                    cols[k] = np.zeros(n, dtype=h.dtype[k].newbyteorder("="))
                cols[k][mask] = h[k]
            cols.setdefault("hsize", np.zeros(n, np.int64))[mask] = dt.itemsize
            cols["born_host"].append((mask, h["born_host"], bool(fam & 0x10)))
            cols["store_host"].append((mask, h["store_host"], bool(fam & 0x20)))
    for k in ("total", "crc", "qid", "flag", "sysflag", "reconsume", "body_len"):
        cols[k] = cols[k].astype(np.int32, copy=False)
    for k in ("qoff", "phy", "born_ts", "store_ts", "prepared"):
        cols[k] = cols[k].astype(np.int64, copy=False)
    cols["magic"] = cols["magic"].astype(np.uint32, copy=False)
    body_start = positions + cols["hsize"]
    body_len = cols["body_len"].astype(np.int64)
    tl_pos = body_start + np.maximum(body_len, 0)
    v2 = cols["magic"] == codec.MAGIC_V2
    topic_len = np.where(v2, _be16(buf, tl_pos), _be8(buf, tl_pos)).astype(np.int64)
    topic_start = tl_pos + np.where(v2, 2, 1)
    pl_pos = topic_start + np.maximum(topic_len, 0)
    props_len = _be16(buf, pl_pos).astype(np.int64)
    cols.update(body_start=body_start, topic_start=topic_start, topic_len=topic_len, props_start=pl_pos + 2,
                props_len=props_len)
    return cols


def _validate(seg: Segment, positions: np.ndarray, cols: dict[str, Any], limit: int) -> None:
    end = positions + cols["total"]
    bad = (cols["total"] < cols["hsize"]) | (end > limit)
    bad |= (cols["magic"] != codec.MAGIC_V1) & (cols["magic"] != codec.MAGIC_V2)
    bad |= (cols["body_len"] < 0) | (cols["body_start"] + cols["body_len"] > end)
    bad |= (cols["topic_len"] < 0) | (cols["topic_start"] + cols["topic_len"] > end)
    bad |= (cols["props_len"] < 0) | (cols["props_start"] + cols["props_len"] != end)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        pos = int(positions[i])
        reason = codec.check(seg.mm, pos, limit, check_crc=False)[2] or "record fields disagree with its size"
        raise RecordFormatError(f"{seg.path} at offset {seg.base + pos} (file position {pos}): {reason}")


def _column(name: str, seg: Segment, positions: np.ndarray, cols: dict[str, Any], topic_bin, props_str, pmap,
            tags, keys) -> pa.Array:
    n = len(positions)
    if name == "topic":
        try:
            return topic_bin.cast(pa.string())
        except pa.ArrowInvalid:
            return pa.array([bytes(b).decode("utf-8", "replace") for b in topic_bin.to_pylist()], pa.string())
    simple = {"queueId": ("qid", pa.int32()), "queueOffset": ("qoff", pa.int64()),
              "commitLogOffset": ("phy", pa.int64()), "size": ("total", pa.int32()),
              "sysFlag": ("sysflag", pa.int32()), "flag": ("flag", pa.int32()), "bodyCrc": ("crc", pa.int32()),
              "reconsumeTimes": ("reconsume", pa.int32()), "preparedTransactionOffset": ("prepared", pa.int64()),
              "bodyLength": ("body_len", pa.int32())}
    if name in simple:
        key, typ = simple[name]
        return _numeric(cols[key], typ)
    if name == "bornTimestamp":
        return _timestamps(cols["born_ts"])
    if name == "storeTimestamp":
        return _timestamps(cols["store_ts"])
    if name in ("bornHost", "storeHost", "msgId"):
        parts = cols["born_host" if name == "bornHost" else "store_host"]
        arrays, order = [], []
        for mask, raw, v6 in parts:
            sub = raw
            if name == "msgId":
                width = 20 if v6 else 8
                host = np.frombuffer(sub.tobytes(), dtype=np.uint8).reshape(len(sub), width)
                phy = cols["phy"] if mask is None else cols["phy"][mask]
                off = phy.astype(">i8").view(np.uint8).reshape(len(sub), 8)
                mat = np.concatenate([host, off], axis=1)
                arrays.append(_strings_from_fixed(np.take(_HEX16, mat).view(np.uint8)))
            else:
                arrays.append(_host_strings(sub, v6))
            order.append(np.arange(n) if mask is None else np.flatnonzero(mask))
        if len(arrays) == 1:
            return arrays[0]
        perm = np.argsort(np.concatenate(order), kind="stable")
        return pa.concat_arrays(arrays).take(pa.array(perm))
    if name == "tags":
        return tags
    if name == "keys":
        return keys
    if name == "properties":
        return pmap
    if name == "propertiesString":
        return props_str
    if name == "body":
        return _gather(seg.pa, cols["body_start"], cols["body_len"].astype(np.int64))
    if name == "magicCode":
        return _MAGIC_TEXT.take(pa.array((cols["magic"] == codec.MAGIC_V2).astype(np.int8)))
    raise KeyError(name)


# ---------------------------------------------------------------- a whole range

def read_range(path: str, start: int, end: int, names: Sequence[str], flt: RowFilter | None = None,
               batch_rows: int = DEFAULT_BATCH_ROWS, zeros_end: bool = False,
               boundary_known: bool = True) -> Iterator[pa.RecordBatch]:
    """Batches of the records of one segment file between file positions ``start`` and ``end``.

    ``start`` must be a record boundary unless ``boundary_known`` is False, in
    which case the walk starts at the file start and skips what lies before.
    """
    seg = Segment(path)
    try:
        end = min(end, seg.size)
        if not boundary_known and start > 0:
            w = walk(seg.mm, 0, end, zeros_end=zeros_end, path=path)
            w.positions = w.positions[w.positions >= start]
        else:
            w = walk(seg.mm, start, end, zeros_end=zeros_end, path=path)
        if w.problem is not None:
            raise RecordFormatError(w.problem)
        pos = w.positions
        for i in range(0, len(pos), batch_rows):
            b = decode(seg, pos[i:i + batch_rows], names, flt, limit=end)
            if b is not None and b.num_rows:
                yield b
    finally:
        seg.close()


def store_times(seg: Segment, positions: np.ndarray) -> np.ndarray:
    """STORETIMESTAMP (ms) of the records at ``positions`` (its place depends on the born host family)."""
    if not len(positions):
        return np.zeros(0, np.int64)
    sysflag = _fixed(seg.np, positions + 36, 4).view(">i4").ravel()
    at = positions + np.where(sysflag & codec.SYSFLAG_BORNHOST_V6, 68, 56)
    return _fixed(seg.np, at, 8).view(">i8").ravel().astype(np.int64)


def first_store_timestamp(path: str) -> int | None:
    """Store time of a segment's first record (None when the file holds no record)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(128)
    except OSError:
        return None
    if len(head) < 80:
        return None
    magic = struct.unpack_from(">I", head, 4)[0]
    if magic not in _MAGICS:
        return None
    return codec.read_store_timestamp(head, 0)
