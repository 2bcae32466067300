"""RecordRun: a put_batch's records encoded column by column instead of one tuple each.

A batch of plain messages (a topic, a body and a queue each, one topic and
queue for all: the common ``put_batch``, see ``message.batch_bodies``) shares
every header field but TOTALSIZE, BODYCRC, BODYLENGTH and the three fields stamped
under the put lock (QUEUEOFFSET, PHYSICALOFFSET, STORETIMESTAMP).  The run
keeps the first record as :class:`~rocketstore.format.codec.MessageEncoder`
made it (every check a single put gets has been made on it) and the bodies as
a column; its bytes are the records ``codec.batch_parts`` writes for the same
messages one by one.

Bodies of one length (the usual batch) are laid out in one numpy record array
outside the lock: one ``join`` puts the bodies between copies of the shared
header and tail, and the CRCs are filled in with one call; under the lock three
column assignments stamp the offsets and the time, and the batch goes to the
file as one buffer.  Other runs pack their headers with one ``struct`` call per record
through ``map`` (no Python frame per record) and are written gathered.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Iterator

import numpy as np

from .codec import EncodedRecord, crc32

# Uniform runs with bodies up to this size are copied into one buffer (the copy is cheaper than the kernel's
# per-buffer cost of a gathered write); larger bodies go to the file straight from the caller's objects.
CONTIGUOUS_MAX_BODY = 16384

_CRC_MASK = np.uint32(0x7FFFFFFF)
_layouts: dict[tuple[int, int, int, int], np.dtype] = {}


def _layout(header_size: int, born_addr_len: int, body_len: int, tail_len: int) -> np.dtype:
    """The fields of a record a run sets per record, at their offsets in RocketMQ's layout (big-endian)."""
    key = (header_size, born_addr_len, body_len, tail_len)
    dt = _layouts.get(key)
    if dt is None:
        if len(_layouts) > 256:
            _layouts.clear()
        dt = _layouts[key] = np.dtype({
            "names": ["crc", "qoff", "phys", "ts"],
            "formats": [">u4", ">i8", ">i8", ">i8"],
            # BODYCRC at 8, QUEUEOFFSET 20, PHYSICALOFFSET 28, STORETIMESTAMP after the born host and port
            "offsets": [8, 20, 28, 48 + born_addr_len + 4],
            "itemsize": header_size + body_len + tail_len})
    return dt


class RecordRun:
    """The records of one batch whose messages differ only in their bodies (see the module doc); the
    layout takes any shared header fields, the first record's.

    Behaves as the list of :data:`~rocketstore.format.codec.EncodedRecord` it
    stands for (``len``, indexing, iteration; ``run[0][6]`` is the sysFlag)
    for code that looks at a record; ``codec.batch_parts`` /
    ``codec.records_size`` / ``codec.record_sizes`` take the columns instead.
    """

    __slots__ = ("first", "bodies", "sizes", "size", "crcs", "_array", "_buf")

    def __init__(self, first: EncodedRecord, bodies: list[bytes], lens: list[int]) -> None:
        self.first = first  # the first message's record, from MessageEncoder.encode (all checks made)
        self.bodies = bodies
        n = len(bodies)
        crcs = np.fromiter(map(crc32, bodies), np.uint32, n)
        crcs &= _CRC_MASK
        self.crcs = crcs
        total, blen = first[1], lens[0]
        self._array: np.ndarray | None = None
        self._buf: memoryview | None = None  # the array's bytes
        if lens.count(blen) == n:
            self.sizes = [total] * n
            self.size = total * n
            if blen <= CONTIGUOUS_MAX_BODY:
                self._array = self._lay_out(blen)
        else:
            fixed = total - blen
            self.sizes = list(map(fixed.__add__, lens))
            self.size = sum(self.sizes)

    def _lay_out(self, blen: int) -> np.ndarray:
        """Every record but the fields stamped under the lock, in one array.

        One ``join`` copies the bodies in between copies of (tail, header): joined over ("", bodies..., "")
        that is the records one after another, with one spare tail before them and one spare header after
        (cheaper than broadcasting a template and assigning the bodies as a numpy column, which converts each
        body on its own)."""
        (header, total, magic, _, queue_id, flag, sys_flag, born_ts, born_addr, born_port, store_addr,
         store_port, reconsume, prepared, _, tail) = self.first
        head = header.pack(total, magic, 0, queue_id, flag, 0, 0, sys_flag, born_ts, born_addr, born_port, 0,
                           store_addr, store_port, reconsume, prepared, blen)
        n = len(self.bodies)
        buf = bytearray(tail + head).join([b"", *self.bodies, b""])
        self._buf = memoryview(buf)[len(tail):len(tail) + n * total]  # the records
        arr = np.frombuffer(buf, _layout(header.size, len(born_addr), blen, len(tail)), n, len(tail))
        arr["crc"] = self.crcs
        return arr

    def parts(self, queue_offset: int, step: int, physical_offset: int, store_ts: int) -> tuple[list[Any],
                                                                                               list[int]]:
        """What ``codec.batch_parts`` returns for these records: the buffers to write, each record's offset."""
        n = len(self.bodies)
        arr = self._array
        if arr is not None:
            total = self.first[1]
            arr["qoff"] = np.arange(queue_offset, queue_offset + n) if step else queue_offset
            arr["phys"] = np.arange(physical_offset, physical_offset + n * total, total)
            arr["ts"] = store_ts
            # (bytes: the writer counts what pwritev must write by len(), and finishes a short write)
            return [self._buf], list(range(physical_offset, physical_offset + n * total, total))
        (header, _, magic, _, queue_id, flag, sys_flag, born_ts, born_addr, born_port, store_addr, store_port,
         reconsume, prepared, _, tail) = self.first
        sizes = self.sizes
        starts = np.zeros(n, np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        offsets = (starts + physical_offset).tolist()
        qoffs = range(queue_offset, queue_offset + n) if step else repeat(queue_offset, n)
        headers = map(header.pack, sizes, repeat(magic), self.crcs.tolist(), repeat(queue_id), repeat(flag), qoffs,
                      offsets, repeat(sys_flag), repeat(born_ts), repeat(born_addr), repeat(born_port),
                      repeat(store_ts), repeat(store_addr), repeat(store_port), repeat(reconsume), repeat(prepared),
                      map(len, self.bodies))
        iov: list[Any] = [None] * (3 * n)
        iov[0::3] = headers
        iov[1::3] = self.bodies
        iov[2::3] = repeat(tail, n)
        return iov, offsets

    # ------------------------------------------------------------ as the list of records it stands for
    def __len__(self) -> int:
        return len(self.bodies)

    def __getitem__(self, i: int) -> EncodedRecord:
        body = self.bodies[i]  # (raises IndexError as a list would)
        f = self.first
        if i == 0:  # the first message's own record (the put path looks at ``run[0]`` twice)
            return f
        return (f[0], self.sizes[i], f[2], int(self.crcs[i]), *f[4:14], body, f[15])

    def __iter__(self) -> Iterator[EncodedRecord]:
        return map(self.__getitem__, range(len(self.bodies)))
