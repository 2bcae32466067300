"""Moving bad files aside at open (a rocketstore extension): planned while loading, carried out once checked.

A writable open notes every file it cannot load (a stray name, a wrong size, an
offset that does not follow) and moves them to ``quarantine/`` only after all
of them are known.  Without ``allow_quarantine`` it refuses, before any file has
moved, when more than one file of a kind would go (a wrong config or a damaged
store, not a stray file) or when a commitlog segment that may hold messages
would: moving it would hide them.
"""

from __future__ import annotations

import logging
import os

from .errors import StoreLoadError

log = logging.getLogger(__name__)

KINDS = {"commitlog": 20, "consumequeue": 20, "index": 17}  # data file kinds and the digits of their names


def file_kind(root: str, path: str) -> str | None:
    """"commitlog", "consumequeue" or "index" for a data file of that kind (by its name); None for a stray."""
    kind = os.path.relpath(path, root).split(os.sep, 1)[0]
    name = os.path.basename(path)
    if kind in KINDS and len(name) == KINDS[kind] and name.isdigit():
        return kind
    return None


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
                                        (segments and int(os.path.basename(path)) < segments[-1].file_from_offset)):
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
