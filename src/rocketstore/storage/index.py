"""IndexFile and IndexService: the hash index from ``topic#key`` to commitlog offsets.

File layout (``S`` = maxHashSlotNum, ``N`` = maxIndexNum)::

    header (40 bytes)
    +----------------+--------------+----------------+--------------+-----------+------------+
    | beginTimestamp | endTimestamp | beginPhyOffset | endPhyOffset | slotCount | indexCount |
    |     int64      |    int64     |     int64      |    int64     |   int32   |   int32    |
    +----------------+--------------+----------------+--------------+-----------+------------+
    S slots of int32 (0 = empty), then N entries of 20 bytes (entry 0 never used):
    +-----------------+--------------------+-----------------+---------------------+
    | keyHash (int32) | phyOffset (int64)  | timeDiff s (int32) | prevIndex (int32) |
    +-----------------+--------------------+-----------------+---------------------+

A key is matched by hash only (collisions are returned, as in RocketMQ).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
import time
from typing import Callable, Sequence

from ..format.codec import index_key_hash
from ..errors import StoreLoadError
from .jsonfile import fsync_dir
from .mapped_file import allocate

log = logging.getLogger(__name__)

HEADER_SIZE = 40
SLOT_SIZE = 4
ENTRY_SIZE = 20
_HEADER = struct.Struct(">qqqqii")
_ENTRY = struct.Struct(">iqii")
_SLOT = struct.Struct(">i")
INT_MAX = 2 ** 31 - 1
_ENTRY_DTYPE = [("hash", ">i4"), ("phy", ">i8"), ("diff", ">i4"), ("prev", ">i4")]  # _ENTRY as numpy's
VECTOR_MIN_KEYS = 64  # fewer keys in a put are written one by one (numpy's fixed cost is tens of microseconds)
_ZERO_ENTRY = bytes(ENTRY_SIZE)


def index_file_size(slots: int, entries: int) -> int:
    return HEADER_SIZE + SLOT_SIZE * slots + ENTRY_SIZE * entries


def index_file_name(now_ms: int) -> str:
    """yyyyMMddHHmmssSSS in local time, as RocketMQ names index files."""
    t = time.localtime(now_ms // 1000)
    return time.strftime("%Y%m%d%H%M%S", t) + f"{now_ms % 1000:03d}"


def walk_chain(entry: Callable[[int], tuple[int, int, int, int]], cur: int, count: int, h: int, begin_ts: int,
               out: list[int], max_num: int, begin: int, end: int) -> None:
    """Follow a hash slot's chain from entry ``cur`` (newest first), adding to ``out`` the offsets of entries
    of hash ``h`` stored in [begin, end]; ``entry(n)`` reads entry n as (hash, offset, time diff, previous).
    A chain stops at a bad link (outside 1..count, or a loop to itself) or once it is older than ``begin``."""
    if cur <= 0 or cur > count or count <= 1:
        return
    while len(out) < max_num:
        eh, off, diff, prev = entry(cur)
        if diff < 0:
            break
        t = begin_ts + diff * 1000
        if eh == h and begin <= t <= end:
            out.append(off)
        if prev <= 0 or prev > count or prev == cur or t < begin:
            break
        cur = prev


def index_keys(topic: str, uniq_key: str | None, keys: str | None) -> list[str]:
    """The index keys of one message: ``topic#UNIQ_KEY``, then ``topic#key`` for each of the space-separated
    KEYS (RocketMQ's buildKey), in the order entries are written."""
    out = [f"{topic}#{uniq_key}"] if uniq_key else []
    if keys:
        out += [f"{topic}#{k}" for k in keys.split(" ") if k]
    return out


def key_hashes(topic: str, uniq_key: str | None, keys: str | None) -> list[int]:
    """The hashes of a message's :func:`index_keys`, as its index entries hold them."""
    return [index_key_hash(k) for k in index_keys(topic, uniq_key, keys)]


def key_hashes_many(messages: Sequence[tuple[str, str | None, str | None]]) -> list[list[int] | None]:
    """:func:`key_hashes` of many (topic, UNIQ_KEY, KEYS) at once, None for a message without keys.

    A Spark append's task hashes its rows' keys here: the ASCII keys go through
    Java's polynomial hash together, one numpy step per character position,
    about ten times cheaper per key than one call each.
    """
    import numpy as np
    full: list[str] = []
    counts: list[int] = []
    for topic, uniq, keys in messages:
        n = len(full)
        full += index_keys(topic, uniq, keys)
        counts.append(len(full) - n)
    hashes: list[int] = [0] * len(full)
    fast: list[int] = []  # short ASCII keys, hashed together below; the others one by one here
    for i, k in enumerate(full):
        if len(k) <= 256 and k.isascii():
            fast.append(i)
        else:
            hashes[i] = index_key_hash(k)
    if fast:
        sel = [full[i] for i in fast]
        lens = np.fromiter(map(len, sel), np.int64, len(sel))
        width = int(lens.max())
        chars = np.frombuffer("".join(sel).encode("ascii"), np.uint8)
        # each key right-aligned in a row of ``width`` (leading zeros do not change the hash)
        starts = np.cumsum(lens) - lens
        at = np.repeat(np.arange(len(sel), dtype=np.int64) * width + (width - lens) - starts, lens) + \
            np.arange(len(chars), dtype=np.int64)
        grid = np.zeros(len(sel) * width, np.uint32)
        grid[at] = chars
        grid = grid.reshape(len(sel), width)
        h = np.zeros(len(sel), np.uint32)
        for c in range(width):
            h = h * np.uint32(31) + grid[:, c]  # wraps modulo 2**32, as Java's int arithmetic does
        v = np.abs(h.view(np.int32).astype(np.int64))
        v[v == 0x80000000] = 0  # abs(Integer.MIN_VALUE) stays negative in Java; RocketMQ maps it to 0
        for i, x in zip(fast, v.tolist()):
            hashes[i] = x
    out: list[list[int] | None] = []
    at_key = 0
    for n in counts:
        out.append(hashes[at_key:at_key + n] if n else None)
        at_key += n
    return out


def _header_damage(count: int, entries: int, begin_phy: int, end_phy: int) -> str | None:
    """Why an index file's header cannot be believed, or None.  The entry count says which entries a query
    walks: a count out of range would hide every key of the file, or walk entries never written."""
    if count < 0 or count > entries:
        return f"indexCount {count} outside 0..{entries} (maxIndexNum)"
    if begin_phy < 0 or end_phy < begin_phy:
        return f"beginPhyOffset {begin_phy} and endPhyOffset {end_phy} out of order"
    return None


class IndexFile:
    def __init__(self, path: str, slots: int, entries: int, *, read_only: bool = False, create: bool = False,
                 prev_end: tuple[int, int] = (0, 0)) -> None:
        self.path = path
        self.slots = slots
        self.entries = entries
        size = index_file_size(slots, entries)
        flags = os.O_RDONLY if read_only else os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            if create:
                allocate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise StoreLoadError(f"{path}: index file is {os.fstat(fd).st_size} bytes, expected {size} "
                                     f"(maxHashSlotNum={slots}, maxIndexNum={entries})")
            self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
        self.read_only = read_only
        self.entries_base = HEADER_SIZE + SLOT_SIZE * slots
        if create:
            self.begin_timestamp = self.end_timestamp = prev_end[1]
            self.begin_phy_offset = self.end_phy_offset = prev_end[0]
            self.hash_slot_count, self.index_count = 0, 1
            self._write_header()
        else:
            (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
             self.hash_slot_count, self.index_count) = _HEADER.unpack_from(self.mm, 0)
            why = _header_damage(self.index_count, entries, self.begin_phy_offset, self.end_phy_offset)
            if why is not None:
                raise StoreLoadError(f"{path}: damaged header: {why}")
            if self.index_count == 0:  # a zero header (never synced): no entry
                self.index_count = 1

    def _write_header(self) -> None:
        _HEADER.pack_into(self.mm, 0, self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
                          self.end_phy_offset, self.hash_slot_count, self.index_count)

    def is_full(self) -> bool:
        return self.index_count >= self.entries

    def put_keys(self, entries: Sequence[tuple[int, int]], start: int, store_ts: int) -> int:
        """Add the (key hash, commitlog offset) ``entries`` from ``start`` on, all stored at ``store_ts``, until
        the file is full; return where it stopped (``len(entries)`` when all went in).

        Many entries at once (a Spark append's put of hundreds of messages) are
        written with numpy (:meth:`_put_keys_vectorised`); the bytes are those
        the one-by-one loop writes.
        """
        n = self.index_count
        stop = min(len(entries), start + self.entries - n)
        if stop <= start:
            return start
        begin_ts = self.begin_timestamp
        # Every entry of the call has the same time offset: the file's first entry starts the file's clock.
        diff = min(max((store_ts - begin_ts) // 1000, 0), INT_MAX) if begin_ts > 0 else 0
        if n <= 1:
            self.begin_phy_offset = entries[start][1]
            self.begin_timestamp = store_ts
        if stop - start >= VECTOR_MIN_KEYS:
            self.hash_slot_count += self._put_keys_vectorised(entries[start:stop], n, diff)
        else:
            mm, slots, base = self.mm, self.slots, self.entries_base
            slot_at, slot_put, entry_put = _SLOT.unpack_from, _SLOT.pack_into, _ENTRY.pack_into
            new_slots = 0
            cur = n
            for i in range(start, stop):
                h, phy = entries[i]
                slot_pos = HEADER_SIZE + (h % slots) * SLOT_SIZE
                head = slot_at(mm, slot_pos)[0]
                if head <= 0 or head > cur:  # empty, or left by a crash past the entry count
                    head = 0
                    new_slots += 1
                entry_put(mm, base + cur * ENTRY_SIZE, h, phy, diff, head)
                slot_put(mm, slot_pos, cur)
                cur += 1
            self.hash_slot_count += new_slots
        self.index_count = n + stop - start
        self.end_phy_offset = entries[stop - 1][1]
        self.end_timestamp = store_ts
        return stop

    def _put_keys_vectorised(self, entries: Sequence[tuple[int, int]], n: int, diff: int) -> int:
        """Write ``entries`` as entries ``n``, ``n + 1``, ... with their hash chains; return how many started a
        chain (found their slot empty).  Each entry's previous one is the last earlier entry of the call in
        its slot, else the slot's head if that is a valid entry below it (as the one-by-one loop reads it)."""
        import numpy as np
        k = len(entries)
        pairs = np.array(entries, dtype=np.int64).reshape(k, 2)
        hashes, phys = pairs[:, 0], pairs[:, 1]
        idx = np.arange(n, n + k, dtype=np.int64)
        slot = hashes % self.slots
        order = np.argsort(slot, kind="stable")
        by_slot = slot[order]
        follows = np.zeros(k, dtype=bool)
        follows[1:] = by_slot[1:] == by_slot[:-1]  # an earlier entry of this call has the same slot
        slots_view = np.frombuffer(self.mm, dtype=">i4", count=self.slots, offset=HEADER_SIZE)
        prev = np.empty(k, dtype=np.int64)
        prev_sorted = slots_view[by_slot].astype(np.int64)
        prev_sorted[follows] = idx[order][:-1][follows[1:]]
        prev[order] = prev_sorted
        stale = ~((prev > 0) & (prev <= idx))
        prev[stale] = 0
        out = np.frombuffer(self.mm, dtype=_ENTRY_DTYPE, count=k, offset=self.entries_base + n * ENTRY_SIZE)
        out["hash"] = hashes
        out["phy"] = phys
        out["diff"] = diff
        out["prev"] = prev
        last = np.ones(k, dtype=bool)
        last[:-1] = by_slot[1:] != by_slot[:-1]  # the last entry of the call in each slot becomes its head
        slots_view[by_slot[last]] = idx[order][last]
        del slots_view, out
        return int(stale.sum())

    def time_matched(self, begin: int, end: int) -> bool:
        fb, fe = self.begin_timestamp, self.end_timestamp
        return (begin < fb and end > fe) or fb <= begin <= fe or fb <= end <= fe

    def select(self, out: list[int], key: str, max_num: int, begin: int, end: int) -> None:
        h = index_key_hash(key)
        cur = _SLOT.unpack_from(self.mm, HEADER_SIZE + (h % self.slots) * SLOT_SIZE)[0]
        base, mm = self.entries_base, self.mm
        walk_chain(lambda n: _ENTRY.unpack_from(mm, base + n * ENTRY_SIZE), cur, self.index_count, h,
                   self.begin_timestamp, out, max_num, begin, end)

    def holds(self, h: int, phy_offset: int) -> bool:
        """Whether an entry of the key hash ``h`` points at ``phy_offset`` (its hash chain is walked back to
        older offsets)."""
        cur = _SLOT.unpack_from(self.mm, HEADER_SIZE + (h % self.slots) * SLOT_SIZE)[0]
        count = self.index_count
        while 0 < cur < count:
            eh, off, _diff, prev = self.entry(cur)
            if off < phy_offset:
                return False
            if eh == h and off == phy_offset:
                return True
            if prev >= cur:
                return False
            cur = prev
        return False

    def entries_iter(self):
        """Every used entry as (keyHash, phyOffset, timeDiff, prev): for verify."""
        base = self.entries_base
        for i in range(1, self.index_count):
            yield _ENTRY.unpack_from(self.mm, base + i * ENTRY_SIZE)

    def first_blank_entry(self) -> int | None:
        """The first entry below the entry count that is all zeros (a page that never reached the disk), or
        None; found with ``find`` in C, as no used entry is zeros (a key hashing to 0 at offset 0 aside)."""
        base, at = self.entries_base, self.entries_base + ENTRY_SIZE
        stop = base + self.index_count * ENTRY_SIZE
        while (hit := self.mm.find(_ZERO_ENTRY, at, stop)) >= 0:
            n = (hit - base + ENTRY_SIZE - 1) // ENTRY_SIZE  # the first entry starting at or after the hit
            at = base + n * ENTRY_SIZE
            if at + ENTRY_SIZE <= stop and self.mm[at:at + ENTRY_SIZE] == _ZERO_ENTRY:
                return n
            if at >= stop:
                break
        return None

    def entry(self, n: int) -> tuple[int, int, int, int]:
        """Entry ``n`` as (keyHash, phyOffset, timeDiff, prevIndex)."""
        return _ENTRY.unpack_from(self.mm, self.entries_base + n * ENTRY_SIZE)

    def first_entry_at_or_past(self, phy: int) -> int:
        """The first used entry whose offset is at or past ``phy`` (``index_count`` if none).

        Entries are added in commitlog order (``build_index`` refuses an offset
        below the file's end), so a binary search finds it.
        """
        lo, hi = 1, self.index_count
        while lo < hi:
            mid = (lo + hi) // 2
            if self.entry(mid)[1] >= phy:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def truncate(self, keep: int, store_time: Callable[[int], int]) -> int:
        """Remove the entries from ``keep`` on, and those a crash left past ``index_count``; return how many.

        A crash between writing a message's entries and the header leaves
        entries past the count whose slots already point at them; the next
        entry for that slot would link to itself and lose the older chain.
        Going from the newest entry down, each slot that points at a removed
        entry is given back that entry's predecessor, then the entry is zeroed;
        the header comes last (a crash half-way leaves a state this repeats).
        ``store_time`` gives the store time of the record at an offset, for the
        new end timestamp.
        """
        top = self.index_count
        while top < self.entries and self.mm[self.entries_base + top * ENTRY_SIZE:
                                             self.entries_base + (top + 1) * ENTRY_SIZE] != _ZERO_ENTRY:
            top += 1
        keep = max(1, min(keep, self.index_count))
        if top <= keep:
            return 0
        for n in range(top - 1, keep - 1, -1):
            h, _off, _diff, prev = self.entry(n)
            slot_pos = HEADER_SIZE + (h % self.slots) * SLOT_SIZE
            if _SLOT.unpack_from(self.mm, slot_pos)[0] == n:
                prev = prev if 0 < prev < n else 0
                _SLOT.pack_into(self.mm, slot_pos, prev)
                if prev == 0 and n < self.index_count:
                    self.hash_slot_count = max(0, self.hash_slot_count - 1)
            at = self.entries_base + n * ENTRY_SIZE
            self.mm[at:at + ENTRY_SIZE] = _ZERO_ENTRY
        if keep < self.index_count:
            self.index_count = keep
            if keep > 1:
                self.end_phy_offset = self.entry(keep - 1)[1]
                ts = store_time(self.end_phy_offset)
                self.end_timestamp = ts if ts > 0 else self.begin_timestamp + self.entry(keep - 1)[2] * 1000
            else:
                self.end_phy_offset, self.end_timestamp = self.begin_phy_offset, self.begin_timestamp
        self._write_header()
        self.mm.flush()
        return top - keep

    def flush(self) -> None:
        if not self.read_only:
            self.mm.flush()

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass

    def destroy(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class IndexService:
    """The rolling list of index files; keys are ``topic#UNIQ_KEY`` and ``topic#each KEYS token``."""

    def __init__(self, directory: str, slots: int, entries: int, *, read_only: bool = False,
                 clock: Callable[[], float] = time.time,
                 on_file_full: Callable[[IndexFile], None] | None = None) -> None:
        self.directory = directory
        self.slots = slots
        self.entries = entries
        self.read_only = read_only
        self.files: list[IndexFile] = []
        self.clock = clock
        self.on_file_full = on_file_full
        self.lock = threading.RLock()
        # Set by dispatch when a new index file cannot be made (full disk): why, and the first record (commitlog
        # offset, store time) left unindexed since; dispatch retries and indexes the records it missed.
        self.build_error: str | None = None
        self.missed_from: int | None = None
        self.missed_ts = 0
        # Set by load when a file was damaged (moved to quarantine) and the files after it dropped: their
        # records are indexed again from where the files kept end (MessageStore._reindex_lost_entries).
        # (A read-only open keeps the files after it and notes the damage: a query then raises, naming it.)
        self.damaged: dict[str, str] = {}  # path -> why

    def load(self, last_exit_ok: bool, index_msg_timestamp: int,
             on_bad_file: Callable[[str, str], None] | None = None) -> list[str]:
        """Open the files in name order; after an unclean exit drop those newer than the checkpoint."""
        dropped: list[str] = []
        if not os.path.isdir(self.directory):
            return dropped
        damaged_from: str | None = None  # the name of the first damaged file: it and the files after it go
        dropped_newer = False  # a file newer than the checkpoint was dropped: the files after it go too
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp") and len(name) == 21 and name[:17].isdigit():
                # an index file whose creation never finished (crash or full disk): it holds nothing
                log.warning("%s: unfinished index file creation%s", path, "" if self.read_only else "; removed")
                if not self.read_only:
                    with contextlib.suppress(OSError):
                        os.remove(path)
                continue
            try:
                if not (len(name) == 17 and name.isdigit()) or not os.path.isfile(path):
                    raise StoreLoadError(f"{path}: not an index file (expected a yyyyMMddHHmmssSSS name)")
                f = IndexFile(path, self.slots, self.entries, read_only=self.read_only)
            except StoreLoadError as e:
                if on_bad_file is None:
                    raise
                why = str(e).split(": ", 1)[-1]
                on_bad_file(path, why)
                if len(name) == 17 and name.isdigit():  # a damaged index file, not a stray: its keys are lost
                    self.damaged[path] = why
                    damaged_from = damaged_from or name
                continue
            if damaged_from is not None and not self.read_only:  # dropped, indexed again after the files before
                log.warning("%s: after the damaged %s; dropped, its records are indexed again", path,
                            damaged_from)
                dropped.append(path)
                f.destroy()
                continue
            # After an unclean exit a file newer than the checkpoint goes, and every file after it: entries go in
            # commitlog order and the rebuild resumes at the last kept entry.  Store times are not monotonic (an
            # imported record keeps its own), so a later file may end "older" than the checkpoint while an
            # earlier one does not: kept alone, it would make the rebuild resume past the dropped file's records
            # (their keys never found again: store model seed 42025, imported records).
            if not last_exit_ok and (dropped_newer or f.end_timestamp > index_msg_timestamp):
                dropped_newer = True
                dropped.append(path)
                if self.read_only:
                    f.close()
                else:
                    f.destroy()
                continue
            self.files.append(f)
        self._mend_empty_files(last_exit_ok, dropped)
        self._mend_lowered_count()
        return dropped

    def _mend_lowered_count(self) -> None:
        """The last file's entry count lowered (a damaged header): its last counted entry points below the
        header's end offset, which every write keeps equal to the last entry's record.  The entries past
        the count are lost to queries; left so, the index would resume at that end offset and never index
        those records again.  A writable open ends the file at its last counted entry and has the records
        after it indexed again (:attr:`damaged` names the file; nothing moves to quarantine)."""
        if self.read_only or not self.files:
            return
        f = self.files[-1]
        count = f.index_count
        if count <= 1:
            return
        h, phy, diff, _prev = f.entry(count - 1)
        if (h, phy, diff) == (0, 0, 0) or phy >= f.end_phy_offset:
            return
        why = (f"header says endPhyOffset {f.end_phy_offset}, but its last counted entry ({count - 1}) points at "
               f"{phy}: its indexCount was damaged")
        log.warning("%s: %s; the records after it are indexed again", f.path, why)
        f.end_phy_offset = phy
        f.end_timestamp = f.begin_timestamp + diff * 1000
        f._write_header()
        self.damaged[f.path] = why

    def _mend_empty_files(self, last_exit_ok: bool, dropped: list[str]) -> None:
        """Files a power loss left without entries, or torn, as never-synced pages read back (zeros).

        A file with no entry (zeros, header included) or, after an unclean exit,
        with a zero entry below its entry count (the header's page reached the
        disk, an entry page did not): before another file, or torn, its keys are
        lost, so after an unclean exit it and every file after it are dropped
        and recovery re-indexes from where the files before it end.  The last
        file with no entry continues where the file before ends, as when it was
        created; left with a zero header, the index would resume at commitlog
        offset 0 and add every key again.
        """
        for i, f in enumerate(self.files):
            torn = not last_exit_ok and f.first_blank_entry() is not None
            if f.index_count > 1 and not torn:
                continue
            if torn or i + 1 < len(self.files):
                if last_exit_ok:
                    continue
                why = "a zero entry below its entry count" if torn else "no entry"
                for g in self.files[i:]:
                    log.warning("%s: %s", g.path, f"{why} (not synced before a power loss?); dropped with the "
                                "files after it, recovery re-indexes their records" if g is f else
                                f"dropped after {f.path}, which has {why}")
                    dropped.append(g.path)
                    if self.read_only:
                        g.close()
                    else:
                        g.destroy()
                del self.files[i:]
                return
            prev = self.files[i - 1] if i else None
            if prev is not None and f.end_phy_offset < prev.end_phy_offset:
                f.begin_phy_offset = f.end_phy_offset = prev.end_phy_offset
                f.begin_timestamp = f.end_timestamp = prev.end_timestamp
                if not self.read_only:
                    f._write_header()

    # ------------------------------------------------------------ recovery
    def resume_offset(self) -> int:
        """Where re-indexing starts: the record of the index's last entry (0 for an empty index).

        That record is offered again because a crash may have cut it short (its
        keys not all written, or a file filled part-way through them);
        :meth:`build_index` adds only the keys it does not hold yet.  RocketMQ
        adds them all again, so every crash left a duplicate entry.
        """
        with self.lock:
            return self.files[-1].end_phy_offset if self.files else 0

    def _holds(self, h: int, phy_offset: int) -> bool:
        """Whether the last two files (the record of the last entry may span a roll-over) hold the key hash
        ``h`` at ``phy_offset``."""
        return any(f.holds(h, phy_offset) for f in self.files[-2:])

    def truncate(self, phy: int, store_time: Callable[[int], int]) -> int:
        """Drop every entry for a record at or past commitlog offset ``phy`` (recovery cut the commitlog
        there), and what a crash left past the last file's entry count; return how many entries went.

        Files with no entry left below ``phy`` are deleted; the one the cut
        falls in is truncated, so its end offset lies below ``phy`` again and
        new records past it are indexed.
        """
        removed = 0
        with self.lock:
            while self.files:
                f = self.files[-1]
                keep = f.first_entry_at_or_past(phy)
                if keep > 1 or (f.index_count <= 1 and f.end_phy_offset < phy):
                    removed += f.truncate(keep, store_time)
                    break
                removed += f.truncate(1, store_time)
                log.warning("%s: every entry points at or past commitlog offset %d; deleted", f.path, phy)
                f.destroy()
                self.files.pop()
        return removed

    # ------------------------------------------------------------ building
    def _writable_file(self) -> IndexFile:
        last = self.files[-1] if self.files else None
        if last is not None and not last.is_full():
            return last
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            fsync_dir(os.path.dirname(os.path.abspath(self.directory)))  # index/ itself survives a power cut
        now = int(self.clock() * 1000)
        name = index_file_name(now)
        while any(os.path.basename(f.path) == name for f in self.files) or os.path.exists(
                os.path.join(self.directory, name)):
            now += 1
            name = index_file_name(now)
        prev = (last.end_phy_offset, last.end_timestamp) if last else (0, 0)
        path = os.path.join(self.directory, name)
        tmp = path + ".tmp"
        try:
            IndexFile(tmp, self.slots, self.entries, create=True, prev_end=prev).close()
            os.replace(tmp, path)  # a crash never leaves a half-created index file under a real name
            fsync_dir(self.directory)  # and a power cut never loses the name of one the checkpoint counts on
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)  # a full disk must not leave a file the next open stumbles on
            raise
        f = IndexFile(path, self.slots, self.entries)
        self.files.append(f)
        if last is not None and self.on_file_full is not None:
            self.on_file_full(last)
        return f

    def build_index(self, topic: str, phy_offset: int, store_ts: int, sys_flag_txn: int,
                    uniq_key: str | None, keys: str | None) -> None:
        """Index one dispatched message (ROLLBACK messages are not indexed)."""
        self.build_index_hashes((phy_offset,), store_ts, sys_flag_txn,
                                (key_hashes(topic, uniq_key, keys),) if uniq_key or keys else None)

    def build_index_hashes(self, offsets: Sequence[int], store_ts: int, sys_flag_txn: int,
                           hashes: Sequence[Sequence[int]] | None) -> None:
        """Index the messages of one put: ``hashes[i]`` are the key hashes of the message at ``offsets[i]``
        (:func:`key_hashes`; a Spark task computes them, so the driver's dispatcher only writes entries).
        ``hashes`` None: no message has keys.

        The header is written once per put rather than once per key: the
        bytes on disk after the call are the same, and queries use the header
        fields held in memory.
        """
        if hashes is None and self.files and not self.files[-1].is_full():
            return  # nothing to index; RocketMQ still makes a file when there is none, hence the test
        with self.lock:
            f = self._writable_file()
            if sys_flag_txn == 0xC or hashes is None:
                return
            end = f.end_phy_offset
            entries: list[tuple[int, int]] = []
            for phy_offset, hs in zip(offsets, hashes):
                if not hs or phy_offset < end:
                    continue
                if phy_offset == end:  # the record of the last entry, offered again by recovery: the keys it lacks
                    hs = [h for h in hs if not self._holds(h, phy_offset)]
                entries += [(h, phy_offset) for h in hs]
            at = f.put_keys(entries, 0, store_ts)
            while at < len(entries):
                f._write_header()
                f = self._writable_file()
                at = f.put_keys(entries, at, store_ts)
            f._write_header()

    # ------------------------------------------------------------ querying
    def query_offset(self, topic: str, key: str, max_num: int, begin: int, end: int) -> tuple[list[int], int, int]:
        """Raw index walk, newest file first: (offsets, lastUpdateTimestamp, lastUpdatePhyOffset)."""
        if self.damaged:  # its keys cannot be found: an empty or short answer would be a wrong one
            path, why = next(iter(self.damaged.items()))
            raise StoreLoadError(f"{path}: {why}; the keys indexed there cannot be found until a writable open "
                                 "(rocketstore recover) rebuilds the index from the commitlog")
        out: list[int] = []
        last_ts = last_phy = 0
        full_key = f"{topic}#{key}"
        with self.lock:
            files = list(self.files)
        for i in range(len(files) - 1, -1, -1):
            f = files[i]
            if i == len(files) - 1:
                last_ts, last_phy = f.end_timestamp, f.end_phy_offset
            if f.time_matched(begin, end):
                f.select(out, full_key, max_num, begin, end)
            if f.begin_timestamp < begin or len(out) >= max_num:
                break
        return out, last_ts, last_phy

    # ------------------------------------------------------------ maintenance
    def delete_expired_file(self, min_offset: int, may_delete: Callable[[str, int], bool] | None = None) -> int:
        """Delete files (never the last) whose end offset is below the commitlog minimum (and, with a tier,
        that ``may_delete(name, end offset)`` says the tier holds)."""
        with self.lock:
            if not self.files or self.files[0].end_phy_offset >= min_offset:
                return 0
            victims = []
            for f in self.files[:-1]:
                if f.end_phy_offset < min_offset and (may_delete is None or may_delete(os.path.basename(f.path), f.end_phy_offset)):
                    victims.append(f)
                else:
                    break
            for f in victims:
                f.destroy()
                self.files.remove(f)
            return len(victims)

    def flush(self) -> None:
        with self.lock:
            for f in self.files:
                f.flush()

    def close(self) -> None:
        with self.lock:
            for f in self.files:
                f.close()
            self.files = []
