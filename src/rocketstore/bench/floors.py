"""The limits every figure is compared with: Python floors and the machine's physical limits.

* bare append: per message one body CRC (the store's own ``codec.crc32``,
  ISA-L's when installed: a floor must not be beaten by a faster CRC alone),
  one ``struct.pack_into`` of a fixed header and one body copy into a fresh
  file mapping (the cheapest a Python store could do per message);
* bare read: per message one ``struct.unpack_from`` and one body copy out of
  the mapping;
* raw sequential write of the same record bytes (large ``write`` calls, and
  ``dd`` with ``conv=fdatasync``), the fdatasync rate of a small append, and
  ``zlib.crc32`` over large chunks.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import time
import zlib

from ..format import codec
from .harness import MiB, Measurement, Results, percentiles_us, rate_measurement, timed

# The fixed part of a RocketMQ V1 record (IPv4 hosts), TOTALSIZE .. BODYLENGTH: 17 fields, 84 bytes.
HEADER = struct.Struct(">iIiiiqqiq4siq4siiqi")
MAGIC = 0xDAA320A7
ADDR = b"\x7f\x00\x00\x01"
FLOOR_FILE_SIZE = 1024 * MiB  # sparse, like a commitlog segment: pages are faulted in as they are written


def make_body(size: int, seed: int = 7) -> bytes:
    """A deterministic body of ``size`` bytes that does not compress to nothing."""
    import random
    return random.Random(seed + size).randbytes(size)


def record_size(body_size: int, topic: str = "BenchTopic", props: str = "") -> int:
    """Bytes a store record takes for a body (what the raw-write limit is converted with)."""
    from rocketstore.format import codec
    return len(codec.encode_bytes(topic, make_body(body_size), properties=props))


class _Mapping:
    """A fresh sparse file mapped read-write (removed on close)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.size = size

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def bare_append(res: Results, workdir: str, body_size: int, seconds: float, *, warm: bool = False) -> Measurement:
    """The floor the targets use writes a fresh sparse 1 GiB mapping, as a new commitlog segment is; the
    ``warm`` variant cycles through 64 MiB of already-faulted pages (Python's cost alone, for diagnosis)."""
    body = make_body(body_size)
    m = _Mapping(os.path.join(workdir, f"floor-append-{body_size}"), 64 * MiB if warm else FLOOR_FILE_SIZE)
    if warm:
        for off in range(0, m.size, MiB):
            m.mm[off:off + MiB] = bytes(MiB)
    try:
        mm, size = m.mm, m.size
        pack_into, crc32 = HEADER.pack_into, codec.crc32
        hs, blen = HEADER.size, len(body)
        total = hs + blen
        ts = int(time.time() * 1000)
        state = [0, 0]  # position, queue offset

        def step() -> int:
            pos, q = state
            for _ in range(1000):
                if pos + total > size:
                    pos = 0
                crc = crc32(body) & 0x7FFFFFFF
                pack_into(mm, pos, total, MAGIC, crc, 0, 0, q, pos, 0, ts, ADDR, 0, ts, ADDR, 10911, 0, 0, blen)
                p = pos + hs
                mm[p:p + blen] = body
                pos += total
                q += 1
            state[0], state[1] = pos, q
            return 1000

        n, elapsed = timed(step, seconds)
    finally:
        m.close()
    if warm:
        return res.add(rate_measurement(f"floor.append.{body_size}.warm", "limit",
                                        f"bare append loop into already-faulted pages, {body_size} B", n, elapsed,
                                        ref=f"floor.append.{body_size}", bytes_per_msg=body_size,
                                        body_size=body_size))
    return res.add(rate_measurement(f"floor.append.{body_size}", "limit", f"bare append floor, {body_size} B",
                                    n, elapsed, bytes_per_msg=body_size, body_size=body_size))


def bare_read(res: Results, workdir: str, body_size: int, seconds: float, records: int = 50000) -> Measurement:
    body = make_body(body_size)
    hs, blen = HEADER.size, len(body)
    total = hs + blen
    m = _Mapping(os.path.join(workdir, f"floor-read-{body_size}"), total * records)
    try:
        mm = m.mm
        pos = 0
        for q in range(records):
            HEADER.pack_into(mm, pos, total, MAGIC, zlib.crc32(body) & 0x7FFFFFFF, 0, 0, q, pos, 0, 0, ADDR, 0, 0,
                             ADDR, 10911, 0, 0, blen)
            mm[pos + hs:pos + total] = body
            pos += total
        end = pos
        unpack_from = HEADER.unpack_from
        state = [0]
        sink: list[bytes] = []

        def step() -> int:
            pos = state[0]
            for _ in range(1000):
                if pos >= end:
                    pos = 0
                f = unpack_from(mm, pos)
                p = pos + hs
                b = mm[p:p + f[16]]
                pos += f[0]
            state[0] = pos
            sink.append(b)
            if len(sink) > 100:
                sink.clear()
            return 1000

        n, elapsed = timed(step, seconds)
    finally:
        m.close()
    return res.add(rate_measurement(f"floor.read.{body_size}", "limit", f"bare read floor, {body_size} B",
                                    n, elapsed, bytes_per_msg=body_size, body_size=body_size))


def raw_write(res: Results, workdir: str, total_bytes: int, seconds: float, rec_size: int) -> Measurement:
    """Large sequential ``write`` calls of record bytes into the page cache (no sync), like an async store."""
    body = make_body(1024)
    rec = HEADER.pack(HEADER.size + len(body), MAGIC, 0, 0, 0, 0, 0, 0, 0, ADDR, 0, 0, ADDR, 0, 0, 0,
                      len(body)) + body
    chunk = (rec * (4 * MiB // len(rec) + 1))[:4 * MiB]
    path = os.path.join(workdir, "floor-write")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    t0 = time.perf_counter()
    try:
        while written < total_bytes:
            written += os.write(fd, chunk)
            if time.perf_counter() - t0 >= max(seconds, 0.05) and written >= 64 * MiB:
                break
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    m = Measurement("floor.write", "limit", "raw sequential write (4 MiB writes, page cache)",
                    written / elapsed / 1e6, "MB/s", n=written, seconds=elapsed,
                    extra={"msg_per_s_at_1KiB_record": written / elapsed / rec_size, "record_bytes": rec_size})
    return res.add(m)


def dd_write(res: Results, workdir: str, total_bytes: int) -> Measurement:
    dd = shutil.which("dd")
    if dd is None:
        return res.skip("floor.dd", "limit", "dd of=file bs=1M conv=fdatasync", "MB/s", "dd not found")
    path = os.path.join(workdir, "floor-dd")
    count = max(1, total_bytes // MiB)
    t0 = time.perf_counter()
    try:
        subprocess.run([dd, "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync",
                        "status=none"], check=True, timeout=300)
        elapsed = time.perf_counter() - t0
    except (OSError, subprocess.SubprocessError) as e:
        return res.skip("floor.dd", "limit", "dd of=file bs=1M conv=fdatasync", "MB/s", f"dd failed: {e}",
                        status="failed")
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return res.add(Measurement("floor.dd", "limit", "dd bs=1M conv=fdatasync (disk, durable)",
                               count * MiB / elapsed / 1e6, "MB/s", n=count * MiB, seconds=elapsed))


def fdatasync_rate(res: Results, workdir: str, seconds: float) -> Measurement:
    """1 KiB written at the next position of a sparse preallocated file (as into a commitlog segment), then
    fdatasync, in a loop: the most durable writes per second one writer gets from this disk."""
    path = os.path.join(workdir, "floor-fsync")
    data = make_body(1024)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, 256 * MiB)
    pos = [0]
    lat: list[float] = []  # each fdatasync alone: what a sync put's latency is shown against
    clock = time.perf_counter
    try:
        def step() -> int:
            p = pos[0]
            for _ in range(10):
                os.pwrite(fd, data, p)
                t = clock()
                os.fdatasync(fd)
                lat.append(clock() - t)
                p += len(data)
            pos[0] = p % (255 * MiB)
            return 10
        n, elapsed = timed(step, seconds, on_start=lat.clear)
    finally:
        os.close(fd)
        os.unlink(path)
    m = rate_measurement("floor.fdatasync", "limit", "write 1 KiB + fdatasync (sparse preallocated file)",
                         n, elapsed, unit="syncs/s")
    m.extra.update(percentiles_us(lat))
    return res.add(m)


def crc32_speed(buf, chunk: int = MiB) -> tuple[float, int]:
    """Seconds and bytes for zlib.crc32 over ``buf`` in ``chunk``-byte slices (memoryview: no copies)."""
    mv = memoryview(buf)
    crc = 0
    t0 = time.perf_counter()
    for off in range(0, len(mv), chunk):
        crc = zlib.crc32(mv[off:off + chunk], crc)
    return time.perf_counter() - t0, len(mv)


def crc32_floor(res: Results, seconds: float) -> Measurement:
    buf = make_body(64 * MiB)
    n = 0
    t = 0.0
    while t < max(seconds, 0.02):
        dt, b = crc32_speed(buf)
        t += dt
        n += b
    return res.add(Measurement("floor.crc32", "limit", "zlib.crc32, 1 MiB chunks", n / t / 1e6, "MB/s", n=n,
                               seconds=t))
