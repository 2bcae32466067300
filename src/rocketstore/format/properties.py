"""The properties map of many records at once: RocketMQ's ``string2messageProperties``, vectorised.

A properties string is ``name\\x01value\\x02`` pairs.  RocketMQ splits it on
0x02, cuts each piece at its first 0x01 and keeps the pieces whose name and
value are not empty, a later name winning over an earlier one
(:func:`rocketstore.format.codec.parse_properties`).  Here the separators of a whole
batch are found with numpy; the pieces become the keys and values of one
Arrow map array.  A batch the vectorised paths cannot do exactly (a name twice
in one record, invalid UTF-8) goes through the Python parser.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import codec

MAP = pa.map_(pa.string(), pa.string())


def properties_map(props: pa.BinaryArray, lookups: Sequence[str] = (), valid_utf8: bool = False
                   ) -> tuple[pa.Array, dict[str, pa.Array]]:
    """The properties map (and the values of the names in ``lookups``) from the raw properties strings.

    This is RocketMQ's ``string2messageProperties`` (see :func:`rocketstore.format.codec.parse_properties`),
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
    m = len(ks)
    # The pairs as one Arrow array of four pieces each (name, 0x01, value, the 0x02 up to the next name): its
    # names and values are then copied out by one take each.
    pieces = np.empty(4 * m + 1, np.int32)
    pieces[0:4 * m:4] = ks
    pieces[1:4 * m:4] = ke
    pieces[2:4 * m:4] = ke + 1
    pieces[3:4 * m:4] = ve
    pieces[4 * m] = ve[-1] if m else 0
    inter = pa.Array.from_buffers(pa.binary(), 4 * m, [None, pa.py_buffer(pieces), pa.py_buffer(data)])
    keys = inter.take(pa.array(np.arange(0, 4 * m, 4, dtype=np.int64)))
    vals = inter.take(pa.array(np.arange(2, 4 * m, 4, dtype=np.int64)))
    counts = np.diff(map_offs)
    if int(counts.max(initial=0)) > 1:  # a name twice in one record needs RocketMQ's "the last one wins"
        ids = keys.dictionary_encode().indices.to_numpy()
        if _has_duplicate_names(ids, np.repeat(np.arange(n, dtype=np.int64), counts), counts):
            return _python_fallback(props, lookups)
    if valid_utf8:
        # Pieces of valid UTF-8 cut at ASCII separators are valid UTF-8: reinterpret without re-checking.
        keys_s = pa.Array.from_buffers(pa.string(), len(keys), keys.buffers())
        vals = pa.Array.from_buffers(pa.string(), len(vals), vals.buffers())
    else:
        try:
            keys_s = keys.cast(pa.string())
            vals = vals.cast(pa.string())
        except pa.ArrowInvalid:
            return _python_fallback(props, lookups)  # invalid UTF-8: decode like the codec (with replacement)
    arr = pa.MapArray.from_arrays(pa.array(map_offs.astype(np.int32)), keys_s, vals)
    return arr, {name: _lookup(keys, vals, map_offs, name) for name in lookups}


def _lookup(keys: pa.Array, vals: pa.Array, map_offs: np.ndarray, name: str) -> pa.Array:
    """The value of property ``name`` in each record (null where it has none); no name occurs twice in one
    record here."""
    n = len(map_offs) - 1
    at = np.flatnonzero(pc.equal(keys, pa.scalar(name.encode("utf-8"), pa.binary())).to_numpy(zero_copy_only=False))
    if not len(at):
        return pa.nulls(n, vals.type)
    if len(at) == n:  # every record has it, once: the matches are in record order
        return vals if len(vals) == n else vals.take(pa.array(at))
    idx = np.full(n, -1, np.int64)
    idx[np.searchsorted(map_offs, at, side="right") - 1] = at
    return vals.take(pa.array(idx, mask=idx < 0))


def _split_simple(data: np.ndarray, offs: np.ndarray) -> tuple | None:
    """The common shape, ``name\x01value\x02`` pairs only: separators alternate 1, 2 and every string ends
    with 0x02.  Returns None when the batch has any other shape."""
    sep = np.flatnonzero(data < 3)  # the separators (a zero byte sends the batch to the general path)
    if len(sep) % 2 or not (data[sep].reshape(-1, 2) == _PAIR_SEPARATORS).all():
        return None
    kpos = sep[0::2]
    epos = sep[1::2]
    nonempty = offs[1:] > offs[:-1]
    ends = offs[1:][nonempty]
    if len(ends) and not (data[ends - 1] == 2).all():
        return None
    ks = np.empty_like(epos)
    if len(epos):
        ks[0] = 0
        ks[1:] = epos[:-1] + 1
    if not ((kpos > ks).all() and (epos > kpos + 1).all()):
        return None  # an empty name or value: RocketMQ skips the pair
    return ks, kpos, epos, _pair_offsets(epos, offs, nonempty, ends)


_PAIR_SEPARATORS = np.array([1, 2], np.uint8)


def _pair_offsets(epos: np.ndarray, offs: np.ndarray, nonempty: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Where each record's pairs start among all pairs (``epos``: each pair's 0x02; every non-empty string
    ends with one).  When every non-empty string holds the same number k of pairs (every k-th pair ends a
    string) that is a running count; otherwise a search of each string's start among the pairs."""
    m, strings = len(epos), len(ends)
    if strings and m % strings == 0:
        k = m // strings
        if (epos[k - 1::k] + 1 == ends).all():
            out = np.zeros(len(offs), np.int64)
            np.cumsum(nonempty * k, out=out[1:])
            return out
    return np.searchsorted(epos, offs, side="left")


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
    arr = python_properties(strings)
    return arr, {name: pc.map_lookup(arr, name, "last") for name in lookups}


def python_properties(strings: list[str | None]) -> pa.Array:
    return pa.array([list(codec.parse_properties(s or "").items()) for s in strings], MAP)
