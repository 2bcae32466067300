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
from .gather import fixed, gather, strings_from_fixed
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
    """(n, width) uint8 matrix of the bytes at ``pos``: one Arrow gather when the ranges do not overlap."""
    n = len(pos)
    ends = pos + width
    if n and ends[-1] <= len(seg.np) and (n == 1 or (ends[:-1] <= pos[1:]).all()):
        g = gather(seg.pa, pos, np.full(n, width, np.int64))
        data = g.buffers()[2]
        return np.frombuffer(data, dtype=np.uint8, count=n * width).reshape(n, width)
    return fixed(seg.np, pos, width)


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
    _validate(seg, positions, cols, limit)
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
        topic_bin = gather(seg.pa, c["topic_start"], c["topic_len"])
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
    props_bin = gather(seg.pa, cols["props_start"], cols["props_len"]) if need_props else None
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
    body_start = positions + cols["hsize"]
    body_len = cols["body_len"].astype(np.int64)
    tl_pos = body_start + np.maximum(body_len, 0)
    v2 = cols["magic"] == codec.MAGIC_V2
    tl = fixed(seg.np, tl_pos, 2).astype(np.int64)  # TOPICLENGTH: 1 byte (V1) or 2 (V2), signed
    byte1 = np.where(tl[:, 0] >= 0x80, tl[:, 0] - 0x100, tl[:, 0])
    short = (tl[:, 0] << 8) | tl[:, 1]
    topic_len = np.where(v2, np.where(short >= 0x8000, short - 0x10000, short), byte1)
    topic_start = tl_pos + np.where(v2, 2, 1)
    pl_pos = topic_start + np.maximum(topic_len, 0)
    pl = fixed(seg.np, pl_pos, 2).astype(np.int64)
    props_len = (pl[:, 0] << 8) | pl[:, 1]
    props_len = np.where(props_len >= 0x8000, props_len - 0x10000, props_len)
    cols.update(body_start=body_start, topic_start=topic_start, topic_len=topic_len, props_start=pl_pos + 2,
                props_len=props_len)
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


def _validate(seg: Any, positions: np.ndarray, cols: dict[str, Any], limit: int) -> None:
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
            sub = raw
            if name == "msgId":
                width = 20 if v6 else 8
                host = np.frombuffer(sub.tobytes(), dtype=np.uint8).reshape(len(sub), width)
                phy = cols["phy"] if mask is None else cols["phy"][mask]
                off = phy.astype(">i8").view(np.uint8).reshape(len(sub), 8)
                mat = np.concatenate([host, off], axis=1)
                arrays.append(strings_from_fixed(np.take(_HEX16, mat).view(np.uint8)))
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
        return gather(seg.pa, cols["body_start"], cols["body_len"].astype(np.int64))
    if name == "magicCode":
        return _MAGIC_TEXT.take(pa.array((cols["magic"] == codec.MAGIC_V2).astype(np.int8)))
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
