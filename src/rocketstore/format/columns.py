"""Commitlog records as Arrow columns, many at once (numpy and pyarrow; no files, no Spark).

:func:`decode` is the vectorised decoder behind ``MessageStore.read_batch`` and the Spark data source
(the Spark executors' segment reader, :mod:`rocketstore.spark.segment`): given a mapped buffer and the
positions of records in it, it decodes every field of every record at once:

* the fixed header (TOTALSIZE .. BODYLENGTH) of every record is gathered into
  one contiguous buffer and viewed through a big-endian numpy structured dtype;
* variable-length parts (body, topic, properties) are cut out of the mapped
  buffer by a single Arrow ``take`` over "interleaved" offsets (start, end of
  record 0, start, end of record 1, ...), which copies each range once in C;
* the properties map is split on the 0x01/0x02 separators with numpy, exactly
  as RocketMQ's ``string2messageProperties`` splits (:mod:`.properties`).

A record whose fields disagree with its size, or whose body (when the body
column is read) fails its BODYCRC, stops the decode with
:class:`RecordFormatError` naming the file and offset; a decode never returns
something ``rocketstore dump`` would not.

The column names and values are those of :meth:`MessageExt.to_json`
(``rocketstore dump``), with the two timestamps as Arrow timestamps.  A buffer
is anything with ``np`` (uint8 view), ``pa`` (Arrow buffer), ``mm`` (the map),
``path`` and ``base`` (its first commitlog offset): :class:`MappedView`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import codec
from .gather import fixed, gather
from .properties import MAP, python_properties, properties_map

log = logging.getLogger(__name__)

TS = pa.timestamp("us", tz="UTC")

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

_MAGIC_TEXT = pa.array([f"0x{codec.MAGIC_V1:08X}", f"0x{codec.MAGIC_V2:08X}"], pa.string())
# Byte value -> its two uppercase hex digits, as one uint16 laid out in memory as (high digit, low digit).
_HEX16 = np.frombuffer(b"".join(f"{i:02X}".encode() for i in range(256)), dtype=np.uint16).copy()
# 16-bit value -> its four uppercase hex digits, as one uint32 laid out in memory in reading order.
_HEX32 = np.stack([_HEX16[np.arange(65536) >> 8], _HEX16[np.arange(65536) & 0xFF]], axis=1).view(np.uint32).ravel()
_HOST_TEXT: dict[int, str] = {}  # formatted IPv4 hosts by their 64-bit header field, kept across batches


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
HEADER_BYTES = _DTYPES[0].itemsize  # the header of the IPv4/IPv4 layout, which most records have


class RecordFormatError(ValueError):
    """A record in the requested range does not decode (the message names file and offset)."""



class MappedView:
    """A mapped buffer as :func:`decode` reads it: ``mm`` (the map), ``np`` and ``pa`` views of it, ``path``
    and ``base`` (the commitlog offset of its first byte) for the errors."""

    def __init__(self, mm: Any, path: str, base: int, size: int | None = None) -> None:
        self.mm = mm
        self.path = path
        self.base = base
        self.size = len(mm) if size is None else size
        self.np = np.frombuffer(mm, dtype=np.uint8)
        self.pa = pa.py_buffer(mm)

# ---------------------------------------------------------------- gathering helpers

def headers(seg: Any, pos: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8 matrix of the bytes at ``pos``.

    The buffer is viewed as one ``width``-byte item starting at every byte (a window, no copy), and a numpy
    fancy index copies the items at ``pos``: about half the CPU of an Arrow gather of the same ranges."""
    n = len(pos)
    buf = seg.np
    if n and int(pos.min()) >= 0 and int(pos.max()) + width <= len(buf):
        win = np.ndarray((len(buf) - width + 1,), np.dtype((np.void, width)), buffer=buf, strides=(1,))
        return win[pos].view(np.uint8).reshape(n, width)
    return fixed(buf, pos, width)


def _host_strings(raw: np.ndarray, v6: bool) -> pa.Array:
    """bornHost/storeHost text from the raw (address, port) bytes, formatted once per distinct host."""
    if not v6:
        keys = raw.view(">u8")  # (address, port) as one number; a strided view of the header fields
        first = int(keys[0])
        if (keys == first).all():  # one host for the whole batch (a store host always, a born host often)
            return repeated(_v4_host_text(first), len(keys))
        enc = pa.array(keys.astype(np.uint64)).dictionary_encode()
        texts = [_v4_host_text(k) for k in enc.dictionary.to_numpy().tolist()]
    else:
        mat = np.frombuffer(raw.tobytes(), dtype=np.uint8).reshape(len(raw), 20)
        blob = [bytes(r) for r in mat]
        enc = pa.array(blob, pa.binary()).dictionary_encode()
        texts = [codec.format_host(b[:16], struct.unpack(">i", b[16:20])[0]) for b in enc.dictionary.to_pylist()]
    return pa.array(texts, pa.string()).take(enc.indices)


def _v4_host_text(key: int) -> str:
    """``address:port`` of an IPv4 host field read as one big-endian 64-bit number (cached across batches)."""
    t = _HOST_TEXT.get(key)
    if t is None:
        if len(_HOST_TEXT) > 100000:
            _HOST_TEXT.clear()
        port = key & 0xFFFFFFFF
        t = _HOST_TEXT[key] = codec.format_host((key >> 32).to_bytes(4, "big"),
                                                port - (1 << 32) if port >> 31 else port)
    return t


def repeated(text: str, n: int) -> pa.Array:
    """A string array of ``n`` times ``text`` (built from one repeated bytes object, no per-row work)."""
    b = text.encode("utf-8")
    offs = np.arange(0, (n + 1) * len(b), len(b), dtype=np.int32) if b else np.zeros(n + 1, np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offs), pa.py_buffer(b * n)])


def _msg_ids(raw: np.ndarray, v6: bool, phy: np.ndarray) -> pa.Array:
    """msgId text: the store host (address, port) and the commitlog offset in uppercase hex, per record.

    Written straight into the string column's buffer, four hex digits per 16-bit piece from one table
    lookup (the host's digits once when the batch has one store host)."""
    n = len(phy)
    hw = (20 if v6 else 8) // 2  # 16-bit pieces of the host field
    out = np.empty((n, hw + 4), np.uint32)
    if not v6 and (raw.view(">u8") == raw.view(">u8")[0]).all():
        out[:, :hw] = _HEX32.take(np.frombuffer(raw[0].tobytes(), ">u2").astype(np.intp))
    else:
        out[:, :hw] = _HEX32.take(np.frombuffer(raw.tobytes(), ">u2").astype(np.intp).reshape(n, hw))
    out[:, hw:] = _HEX32.take(np.ascontiguousarray(phy, ">i8").view(">u2").astype(np.intp).reshape(n, 4))
    width = 4 * (hw + 4)
    offs = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offs), pa.py_buffer(out)])


# Milliseconds an Arrow microsecond timestamp holds (RocketMQ's are any int64: a damaged one may not fit).
TS_MS_RANGE = (-(2 ** 63) // 1000 + 1, (2 ** 63 - 1) // 1000)


def timestamps_fit(ms: np.ndarray) -> np.ndarray:
    """Which millisecond timestamps fit the microsecond timestamp columns (else the column would wrap)."""
    return (ms >= TS_MS_RANGE[0]) & (ms <= TS_MS_RANGE[1])


def _timestamps(ms: np.ndarray) -> pa.Array:
    us = np.ascontiguousarray(ms, dtype=np.int64) * 1000
    return pa.Array.from_buffers(TS, len(us), [None, pa.py_buffer(us)])


def _numeric(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.array(np.ascontiguousarray(values, dtype=typ.to_pandas_dtype()), typ)


# ---------------------------------------------------------------- decoding

def decode(seg: Any, positions: np.ndarray, names: Sequence[str], flt: Any = None,
           limit: int | None = None, skip_damaged: bool = False, check_crc: bool = False,
           head: np.ndarray | None = None) -> pa.RecordBatch | None:
    """Decode the records at ``positions`` (file positions) into a batch of the columns ``names``.

    Rows not passing ``flt`` are dropped before the expensive columns are built.  ``head``: the
    ``HEADER_BYTES`` at ``positions`` when the caller has read them already (:func:`headers`).
    Raises :class:`RecordFormatError` at the first record whose fields disagree with its size, and, when
    the body is read (or ``check_crc``), at the first whose body fails its BODYCRC (``skip_damaged``: such
    rows are dropped and logged instead).
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
        head = None if head is None else head[keep]
    n = len(positions)
    if n == 0:
        return None
    if head is None:
        head = headers(seg, positions, HEADER_BYTES)
    fams = head[:, 36:40].copy().view(">i4").ravel() & 0x30
    if not fams.any():
        groups = [(0, None)]
    else:
        groups = [(f, fams == f) for f in (0x00, 0x10, 0x20, 0x30) if (fams == f).any()]
    cols = _decode_header(seg, positions, groups, head)
    parts = _record_parts(seg, positions, cols, limit)
    _check_times(seg, positions, cols, names)
    keep = None
    if flt is not None and (flt.ts_lo is not None or flt.ts_hi is not None or flt.queue_ids is not None):
        keep = np.ones(n, dtype=bool)
        if flt.ts_lo is not None:
            keep &= cols["store_ts"] * 1000 >= flt.ts_lo
        if flt.ts_hi is not None:
            keep &= cols["store_ts"] * 1000 <= flt.ts_hi
        if flt.queue_ids is not None:
            keep &= np.isin(cols["qid"], np.fromiter(flt.queue_ids, dtype=np.int64))
        if keep.all():
            keep = None
    topic_bin = None
    need_topic = "topic" in names or (flt is not None and flt.topics is not None)
    if need_topic:
        c = cols if keep is None else _subset(cols, keep)
        topic_bin = _part(parts, c["part"])
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
    if keep is not None and not keep.all():
        if not keep.any():
            return None
        positions = positions[keep]
        cols = _subset(cols, keep)
        n = len(positions)
    if check_crc or "body" in names:
        intact = _intact_bodies(seg, positions, cols, skip_damaged)
        if intact is not None:
            if not intact.any():
                return None
            positions = positions[intact]
            cols = _subset(cols, intact)
            n = len(positions)
            if topic_bin is not None:
                topic_bin = topic_bin.filter(pa.array(intact))
    need_props = any(x in names for x in ("properties", "propertiesString", "tags", "keys")) or (
        flt is not None and flt.keys is not None)
    props_bin = _part(parts, cols["part"] + 2) if need_props else None
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


def _decode_header(seg: Any, positions: np.ndarray, groups: list, head: np.ndarray | None = None
                  ) -> dict[str, Any]:
    """The header fields of every record (one structured view per host family), plus part positions."""
    n = len(positions)
    if len(groups) == 1:
        fam = groups[0][0]
        dt = _DTYPES[fam]
        h = (head if fam == 0 and head is not None else headers(seg, positions, dt.itemsize)).view(dt).ravel()
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
            h = headers(seg, positions[mask], dt.itemsize).view(dt).ravel()
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
    cols["body_start"] = positions + cols["hsize"]
    return cols


def _intact_bodies(seg: Any, positions: np.ndarray, cols: dict[str, Any], skip_damaged: bool
                   ) -> np.ndarray | None:
    """None when every body matches its BODYCRC, else the mask of the rows that do (``skip_damaged``);
    without ``skip_damaged`` the first damaged record raises :class:`RecordFormatError`."""
    starts = cols["body_start"]
    lengths = cols["body_len"]
    actual = np.array(codec.crc32_many(seg.np, starts.tolist(), (starts + lengths).tolist()), np.int64)
    bad = np.flatnonzero((lengths > 0) & ((actual & 0x7FFFFFFF) != cols["crc"])).tolist()
    if not bad:
        return None
    for i in bad if skip_damaged else bad[:1]:
        pos = int(positions[i])
        text = f"{seg.path} at offset {seg.base + pos} (file position {pos}): body CRC mismatch"
        if not skip_damaged:
            raise RecordFormatError(f"{text} (set skipDamaged=true to skip damaged records)")
        log.warning("%s; record skipped (skipDamaged)", text)
    intact = np.ones(len(positions), dtype=bool)
    intact[bad] = False
    return intact


def _check_times(seg: Any, positions: np.ndarray, cols: dict[str, Any], names: Sequence[str]) -> None:
    """A timestamp column of a record whose time does not fit it would hold a wrapped, wrong value: refused."""
    for name, key in (("bornTimestamp", "born_ts"), ("storeTimestamp", "store_ts")):
        if name in names:
            fit = timestamps_fit(cols[key])
            if not fit.all():
                pos = int(positions[int(np.argmin(fit))])
                raise RecordFormatError(f"{seg.path} at offset {seg.base + pos} (file position {pos}): {name} "
                                        f"{int(cols[key][int(np.argmin(fit))])} ms is outside the range of the "
                                        "column's timestamp type (a damaged header?)")


def _record_parts(seg: Any, positions: np.ndarray, cols: dict[str, Any], limit: int) -> pa.Array:
    """Check every record's fields against its size (what :func:`codec.parse` checks) and return their
    topics and properties: an Arrow binary array of four elements per record (topic, the properties
    length, properties, the next topic length) over one copy of the records' tails; ``cols["part"]``
    is the index of each record's topic in it (its properties are two further on).

    A record's tail (topic length, topic, properties length, properties) follows its body and ends where
    the record ends, so one gather of the tails is the only read of the mapped file after the headers;
    the fields in them are read from that copy.  Raises :class:`RecordFormatError` at the first record
    whose fields disagree with its size, naming the file and offset.
    """
    n = len(positions)
    end = positions + cols["total"]
    body_len = cols["body_len"]
    body_end = cols["body_start"] + body_len
    bad = (cols["total"] < cols["hsize"]) | (end > limit) | (body_len < 0) | (body_end > end)
    magic = cols["magic"]
    v2 = magic == codec.MAGIC_V2
    every_v2 = bool(v2.all())
    if not every_v2:
        bad |= ~v2 & (magic != codec.MAGIC_V1)
    if bad.any():  # a record already refused gets no bytes (its tail is not where its fields say)
        data, start, stop = _tails(seg, np.where(bad, positions, body_end), np.where(bad, positions, end))
    else:
        data, start, stop = _tails(seg, body_end, end)
    t = np.frombuffer(data, np.uint8) if data is not None and data.size >= 2 else np.zeros(2, np.uint8)
    be16 = np.ndarray((len(t) - 1,), ">i2", buffer=t, strides=(1,))  # the signed 16-bit number at every byte
    last = len(be16) - 1
    # TOPICLENGTH: a signed byte in a V1 record, a signed big-endian short in a V2 one.
    if every_v2:
        topic_len = be16[np.minimum(start, last)]
        topic_start = start + 2
    elif not v2.any():
        topic_len = t.view(np.int8)[np.minimum(start, last)]
        topic_start = start + 1
    else:
        topic_len = np.where(v2, be16[np.minimum(start, last)], t.view(np.int8)[np.minimum(start, last)])
        topic_start = start + np.where(v2, 2, 1).astype(np.int32)
    props_at = topic_start + topic_len  # PROPERTIESLENGTH, then the properties up to the record's end
    props_len = be16[np.clip(props_at, 0, last)]
    bad |= (topic_len < 0) | (props_len < 0) | (props_at + 2 + props_len != stop)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        pos = int(positions[i])
        reason = codec.check(seg.mm, pos, limit, check_crc=False)[2] or "record fields disagree with its size"
        raise RecordFormatError(f"{seg.path} at offset {seg.base + pos} (file position {pos}): {reason}")
    inter = np.empty(4 * n + 1, np.int32)
    inter[0:4 * n:4] = topic_start
    inter[1:4 * n:4] = props_at
    inter[2:4 * n:4] = props_at + 2
    inter[3:4 * n:4] = stop
    inter[4 * n] = stop[-1]
    cols["part"] = np.arange(0, 4 * n, 4, dtype=np.int64)
    return pa.Array.from_buffers(pa.binary(), 4 * n, [None, pa.py_buffer(inter), data])


_WINDOW_TAIL = 256  # the longest tails read as fixed-width items (longer ones: one gather)


def _tails(seg: Any, lo: np.ndarray, hi: np.ndarray) -> tuple[pa.Buffer | None, np.ndarray, np.ndarray]:
    """``seg``'s bytes [lo[i], hi[i]) copied into one buffer: (the buffer, where each range starts and ends in
    it).  Short ranges are read as fixed-width items of the longest one's length (a numpy fancy index, as the
    headers are read), longer ones by one gather when they ascend without overlapping (records in file order),
    else one slice per range."""
    n = len(lo)
    lengths = hi - lo
    width = int(lengths.max()) if n else 0
    buf = seg.np
    if 0 < width <= _WINDOW_TAIL and int(lo.min()) >= 0 and int(lo.max()) + width <= len(buf):
        win = np.ndarray((len(buf) - width + 1,), np.dtype((np.void, width)), buffer=buf, strides=(1,))
        rows = win[lo]
        start = np.arange(0, n * width, width, dtype=np.int32)
        return pa.py_buffer(rows), start, start + lengths.astype(np.int32)
    if n < 2 or (hi[:-1] <= lo[1:]).all():
        tail = gather(seg.pa, lo, lengths)
    else:
        tail = pa.array([bytes(seg.mm[a:b]) for a, b in zip(lo.tolist(), hi.tolist())], pa.binary())
    offs = np.frombuffer(tail.buffers()[1], np.int32, count=n + 1)
    return tail.buffers()[2], offs[:-1], offs[1:]


def _part(parts: pa.Array, index: np.ndarray) -> pa.Array:
    """One field of every record from :func:`_record_parts`'s array (``index``: ``cols["part"]`` plus 0 for the
    topic, 2 for the properties)."""
    return parts.take(pa.array(index))


def _column(name: str, seg: Any, positions: np.ndarray, cols: dict[str, Any], topic_bin, props_str, pmap,
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
            if name == "msgId":
                arrays.append(_msg_ids(raw, v6, cols["phy"] if mask is None else cols["phy"][mask]))
            else:
                arrays.append(_host_strings(raw, v6))
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
        return gather(seg.pa, cols["body_start"], cols["body_len"].astype(np.int64))
    if name == "magicCode":
        v2 = cols["magic"] == codec.MAGIC_V2
        if v2.all() or not v2.any():
            return repeated(f"0x{int(cols['magic'][0]):08X}", n)
        return _MAGIC_TEXT.take(pa.array(v2.astype(np.int8)))
    raise KeyError(name)


def messages_batch(messages: Sequence[Any], names: Sequence[str]) -> pa.RecordBatch:
    """The columns ``names`` of decoded messages (:class:`~rocketstore.format.codec.MessageExt`), with the
    values :func:`decode` gives for the same records: the rows of a read that went record by record."""
    out: list[pa.Array] = []
    for name in names:
        if name in ("bornTimestamp", "storeTimestamp"):
            attr = "born_timestamp" if name == "bornTimestamp" else "store_timestamp"
            out.append(_timestamps(np.array([getattr(m, attr) for m in messages], np.int64)))
        elif name == "properties":
            out.append(python_properties([m.properties_string for m in messages]))
        elif name == "magicCode":
            out.append(pa.array([f"0x{m.magic:08X}" for m in messages], pa.string()))
        else:
            attr = _MESSAGE_ATTRS[name]
            out.append(pa.array([getattr(m, attr) for m in messages], ARROW_TYPES[name]))
    return pa.RecordBatch.from_arrays(out, schema=arrow_schema(names))


_MESSAGE_ATTRS = {"topic": "topic", "queueId": "queue_id", "queueOffset": "queue_offset",
                  "commitLogOffset": "commit_log_offset", "size": "size", "sysFlag": "sys_flag", "flag": "flag",
                  "bodyCrc": "body_crc", "reconsumeTimes": "reconsume_times",
                  "preparedTransactionOffset": "prepared_transaction_offset", "bornHost": "born_host",
                  "storeHost": "store_host", "msgId": "msg_id", "tags": "tags", "keys": "keys",
                  "propertiesString": "properties_string", "body": "body", "bodyLength": "body_length"}
