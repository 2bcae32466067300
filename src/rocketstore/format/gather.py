"""Cutting many byte ranges out of one buffer at once (numpy and Arrow), for the segment decoder.

:func:`gather` is the workhorse: the ranges are laid out as the elements of
one "interleaved" Arrow binary array over the source buffer (range 0, the gap
after it, range 1, ...), and a ``take`` of the even elements copies every
range once, in C.  The ranges must ascend without overlapping, which holds
for the parts of consecutive records.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def gather(data: pa.Buffer, starts: np.ndarray, lengths: np.ndarray, typ: pa.DataType | None = None) -> pa.Array:
    """Binary array of ``data[starts[i]:starts[i]+lengths[i]]``; ranges must ascend without overlapping."""
    n = len(starts)
    if n == 0:
        return pa.array([], typ or pa.binary())
    large = data.size > 2 ** 31 - 1  # binary offsets are int32; RocketMQ's files stay below 2 GiB
    offs = np.empty(2 * n + 1, dtype=np.int64 if large else np.int32)
    offs[0:2 * n:2] = starts
    offs[1:2 * n:2] = starts + lengths
    offs[2 * n] = offs[2 * n - 1]
    inter = pa.Array.from_buffers(pa.large_binary() if large else pa.binary(), 2 * n,
                                  [None, pa.py_buffer(offs), data])
    out = inter.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    if large:
        out = out.cast(pa.binary())
    return out if typ is None else out.cast(typ)


def fixed(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8 matrix of ``buf[pos[i]:pos[i]+width]`` (positions clipped into the buffer)."""
    idx = pos[:, None] + np.arange(width, dtype=np.int64)
    np.clip(idx, 0, len(buf) - 1, out=idx)
    return buf[idx]


def be16(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    m = fixed(buf, pos, 2).astype(np.int32)
    v = (m[:, 0] << 8) | m[:, 1]
    return np.where(v >= 0x8000, v - 0x10000, v)


def be8(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    v = buf[np.clip(pos, 0, len(buf) - 1)].astype(np.int32)
    return np.where(v >= 0x80, v - 0x100, v)
