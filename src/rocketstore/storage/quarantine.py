"""Moving bad files aside at open (a rocketstore extension): planned while loading, carried out once checked.

A writable open notes every file it cannot load (a stray name, a wrong size, an
offset that does not follow) and moves them to ``quarantine/`` only after all
of them are known.  Without ``allow_quarantine`` it refuses, before any file has
moved, when more than one file of a kind would go (a wrong config or a damaged
store, not a stray file) or when a commitlog segment that may hold messages
would: moving it would hide them.  A segment holds messages when it is full
size, lies before the last segment that loaded, or holds a trusted record
(magic, size, PHYSICALOFFSET equal to its position, body CRC).

A last segment shorter than the segment size, in its place (its name follows
the segment before it), that holds or may hold records is a torn file (a copy,
a cut, or a file system that lost its tail), not a stray: a writable open
extends it with zeros to its size (:func:`extend_torn_last_segment`) and
recovery then treats it as any segment with a torn tail: it keeps every intact
record, ends the log at the first torn one, and refuses after a clean stop when
an intact record follows damage.  It may hold records when a record starts in
it (:func:`record_start_in`): a trusted one, a header whose magic, size and
PHYSICALOFFSET name its position (its body damaged or cut off by the file's
end), or, at its start, a header the cut left shorter than its PHYSICALOFFSET
field.  Only a file with none of these (zeros, or bytes that are no record) is
left to the quarantine rules.
"""

from __future__ import annotations

import logging
import mmap
import os

from ..format import codec
from ..errors import StoreLoadError
from .mapped_file import allocate

log = logging.getLogger(__name__)

KINDS = {"commitlog": 20, "consumequeue": 20, "index": 17}  # data file kinds and the digits of their names


def file_kind(root: str, path: str) -> str | None:
    """"commitlog", "consumequeue" or "index" for a data file of that kind (by its name); None for a stray."""
    kind = os.path.relpath(path, root).split(os.sep, 1)[0]
    name = os.path.basename(path)
    if kind in KINDS and len(name) == KINDS[kind] and name.isdigit():
        return kind
    return None


def trusted_record_in(path: str, base: int) -> int | None:
    """Commitlog offset of the first trusted record of the segment file at ``path`` (named ``base``), or None.

    Trusted: magic, size, PHYSICALOFFSET equal to ``base`` plus its position and
    body CRC all hold, so a copy of a record elsewhere in the log never counts.
    """
    try:
        size = os.path.getsize(path)
        if size < 8:
            return None
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            n, parsed, _reason = codec.check(mm, 0, size, check_crc=True, parsed=True)
            if parsed is not None and n > 0 and parsed[0][6] == base:
                return base
            pos = 0
            while (p := codec.find_record(mm, pos, size, base, check_crc=True)) is not None:
                if int.from_bytes(mm[p + 4:p + 8], "big") != codec.BLANK_MAGIC:
                    return base + p
                pos = p + 1
    except (OSError, ValueError):
        return None
    return None


_RECORD_MAGICS = (codec.MAGIC_V1.to_bytes(4, "big"), codec.MAGIC_V2.to_bytes(4, "big"))
_MIN_RECORD = 88  # the fixed part of the smallest record (IPv4 hosts), before its body, topic and properties


def record_start_in(path: str, base: int, file_size: int) -> int | None:
    """Commitlog offset of the first record that starts in the segment file at ``path`` (named ``base``), whole
    or not, or None when nothing in it is a record of this position.

    A trusted record (:func:`trusted_record_in`) counts, and so does a header
    whose magic code is a message's, whose TOTALSIZE fits a segment and whose
    PHYSICALOFFSET is its own position, with a body that fails its CRC or runs
    past the file's end: a record cut or damaged, which recovery or repair must
    see, not a stray's bytes.  At the file's start a header cut before its
    PHYSICALOFFSET field counts when the bytes it kept (TOTALSIZE, then the
    magic code) are a record's.  A record elsewhere in the log (a stale copy)
    names another position and never counts.
    """
    trusted = trusted_record_in(path, base)
    if trusted is not None:
        return trusted
    try:
        size = os.path.getsize(path)
        if size == 0:
            return None
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            found = []
            for magic in _RECORD_MAGICS:
                h = mm.find(magic, 4)
                while h >= 0:
                    p = h - 4
                    if p + 36 <= size and _MIN_RECORD <= int.from_bytes(mm[p:p + 4], "big", signed=True) <= \
                            file_size - p and int.from_bytes(mm[p + 28:p + 36], "big", signed=True) == base + p:
                        found.append(p)
                        break
                    h = mm.find(magic, h + 1)
            if found:
                return base + min(found)
            if size < 36 and _cut_header(mm[:min(size, 8)], file_size):
                return base  # a header cut before its PHYSICALOFFSET field
    except (OSError, ValueError):
        return None
    return None


def _cut_header(head: bytes, file_size: int) -> bool:
    """Whether ``head`` (a file's first bytes, fewer than a header's first 36) can be the start of a record:
    not all zeros (zeros are no record: the quarantine rules stand), a TOTALSIZE that the missing bytes can
    complete to a size that fits a segment, then the first bytes of a message's magic code."""
    if not head.strip(b"\0"):
        return False
    size = head[:4]
    low = int.from_bytes(size.ljust(4, b"\0"), "big", signed=True)
    high = int.from_bytes(size.ljust(4, b"\xff"), "big", signed=True)
    return high >= _MIN_RECORD and 0 <= low <= file_size and \
        any(magic.startswith(head[4:]) for magic in _RECORD_MAGICS)


def torn_last_segment(directory: str, file_size: int) -> tuple[str, int] | None:
    """(path, first record offset) of the last commitlog segment when it is shorter than ``file_size``, in its
    place (its name a multiple of the size, following the segment before it) and holds or may hold records
    (:func:`record_start_in`); None otherwise."""
    try:
        names = sorted(n for n in os.listdir(directory) if len(n) == 20 and n.isdigit())
    except OSError:
        return None
    if not names:
        return None
    path = os.path.join(directory, names[-1])
    base = int(names[-1])
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if not 0 < size < file_size or base % file_size or not os.path.isfile(path) or \
            (len(names) > 1 and int(names[-2]) + file_size != base):
        return None
    first = record_start_in(path, base, file_size)
    if first is not None:
        return path, first
    # In its place, a short last segment of zeros alone is the log's torn end too (a cut through a zero-filled
    # end, or a segment recovery emptied): extended, recovery ends the log at its start; moved aside it would
    # leave verify a "quarantined" file and hide nothing.  Other bytes that start no record stay a stray.
    return (path, base) if _all_zeros(path) else None


def _all_zeros(path: str, chunk: int = 1 << 20) -> bool:
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            if block.count(0) != len(block):
                return False
    return True


def extend_torn_last_segment(directory: str, file_size: int, read_only: bool) -> str | None:
    """Extend a torn last commitlog segment (:func:`torn_last_segment`) with zeros to ``file_size``.

    Moving it to quarantine would hide its messages (or the damage that ended
    them) and hand their queue offsets to the next puts without a word;
    extended, it loads, and recovery keeps every intact record and ends the log
    at the first torn one, as it does for a full-size segment's torn tail.  A
    read-only open refuses with an error that says so.  Returns the path
    extended, or None.
    """
    torn = torn_last_segment(directory, file_size)
    if torn is None:
        return None  # no record in it: an ordinary bad file (quarantine rules apply)
    path, first = torn
    size = os.path.getsize(path)
    if read_only:
        raise StoreLoadError(f"{path}: a torn last segment ({size} of {file_size} bytes) holding records from "
                             f"commitlog offset {first}; a writable open (rocketstore recover) extends it with zeros "
                             "and keeps its intact records")
    base = int(os.path.basename(path))
    fd = os.open(path, os.O_RDWR)
    try:
        allocate(fd, file_size)
        _unmake_cut_record(fd, base, size, file_size, path)
        os.fsync(fd)
    finally:
        os.close(fd)
    log.warning("%s: torn last segment of %d bytes (expected %d) holding records from commitlog offset %d; "
                "extended with zeros, recovery keeps its intact records", path, size, file_size, first)
    return path


def _unmake_cut_record(fd: int, base: int, size: int, file_size: int, path: str) -> None:
    """The record the cut went through (it starts before ``size`` and ends after it) must not read as whole once
    zeros extend it: no CRC covers its topic and properties, so a cut inside them leaves a record every check
    accepts (a power cut tears at page starts, which codec.torn_tail sees; a cut file ends anywhere).  Its
    TOTALSIZE and magic code are zeroed, so every walk ends the log there, as at any torn record."""
    with mmap.mmap(fd, file_size) as mm:
        for magic in _RECORD_MAGICS:
            h = mm.find(magic, 4, size)
            while h >= 0:
                p = h - 4
                total = int.from_bytes(mm[p:p + 4], "big", signed=True)
                if p + 36 <= size < p + total <= file_size and \
                        int.from_bytes(mm[p + 28:p + 36], "big", signed=True) == base + p and \
                        codec.check(mm, p, file_size, check_crc=True, parsed=True, base=base)[1] is not None:
                    os.pwrite(fd, bytes(8), p)  # through the file, so the power-loss model sees the sync
                    os.fsync(fd)
                    log.warning("%s: the record at commitlog offset %d (%d bytes) is cut at %d: its header is "
                                "zeroed so that it never reads as whole", path, base + p, total, base + size)
                    return
                h = mm.find(magic, h + 1, size)


class QuarantinePlan:
    """The files one open moves to ``<root>/quarantine/`` (and the sound ones it deletes to refill a queue)."""

    def __init__(self, root: str, allow: bool) -> None:
        self.root = root
        self.allow = allow
        self.moves: list[tuple[str, str]] = []  # (path, reason)
        self.deletes: list[str] = []

    def check(self, segments: list, segment_size: int) -> None:
        """Refuse what ``allow`` is needed for; ``segments``: the commitlog segments that did load."""
        if self.allow:
            return
        by_kind: dict[str, list[tuple[str, str]]] = {}
        for path, reason in self.moves:
            kind = file_kind(self.root, path)
            if kind == "commitlog" and (os.path.getsize(path) == segment_size or
                                        (segments and int(os.path.basename(path)) < segments[-1].file_from_offset)
                                        or record_start_in(path, int(os.path.basename(path)),
                                                           segment_size) is not None):
                raise StoreLoadError(f"{path}: {reason}; it may hold messages that moving it to quarantine/ would "
                                     "hide; refusing to open, nothing was moved (pass --allow-quarantine to move it)")
            if kind is not None:
                by_kind.setdefault(kind, []).append((path, reason))
        for kind, bad in by_kind.items():
            if len(bad) > 1:
                shown = "; ".join(f"{p}: {r}" for p, r in bad[:2])
                raise StoreLoadError(f"{self.root}: {len(bad)} {kind} files would go to quarantine/ ({shown}"
                                     f"{'; ...' if len(bad) > 2 else ''}); refusing to open, nothing was moved "
                                     "(check the config, or pass --allow-quarantine to move them)")

    def carry_out(self) -> list[str]:
        """Move and delete the planned files; return the paths moved."""
        quarantine = os.path.join(self.root, "quarantine")
        moved = []
        for path, reason in self.moves:
            rel = os.path.relpath(path, self.root)
            dest = os.path.join(quarantine, rel.replace(os.sep, "__"))
            os.makedirs(quarantine, exist_ok=True)
            os.replace(path, dest)
            log.warning("%s: %s; moved to %s", path, reason, dest)
            moved.append(path)
        for path in self.deletes:
            os.unlink(path)
        self.moves, self.deletes = [], []
        return moved
