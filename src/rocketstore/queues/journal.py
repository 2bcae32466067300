"""``config/popState.journal``: the pop state's changes since ``popState.json`` was last written.

Rewriting popState.json (temporary file, rename) for every receive and ack costs milliseconds (a rename
over a file makes the filesystem start writing the new one out); appending the changed queues' records
to a journal costs microseconds.  The journal is lines of JSON: a header ``{"base": "<id>"}`` naming the
popState.json it continues (the ``id`` field of that file), then one queue record per line, each the
queue's whole state (the record popState.json holds for it), so replaying is "the last line for a queue
wins" and replaying twice changes nothing.  A line without its newline is a write cut short by a crash:
never confirmed to anyone, ignored, and cut off before the next append.  A journal whose header names
another base (the broker, or a compaction, wrote popState.json since) is stale and ignored.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def journal_path(state_path: str) -> str:
    root, _ = os.path.splitext(state_path)
    return root + ".journal"


def header(base_id: str) -> bytes:
    return json.dumps({"base": base_id}).encode() + b"\n"


_KEY_END = b',"committed":'


def _latest_records(lines: list[bytes]) -> list[dict[str, Any]]:
    """The last intact record for each queue, in journal order: a queue's record replaces its earlier ones, so
    those need not be decoded.  A record starts with its key (``{"group":..,"topic":..,"queueId":..``) and then
    ``,"committed":``, which cannot occur inside a JSON string (a quote in one is escaped); a line without it
    is kept (decoding it says what it is).  A line that does not decode (a power cut lost a page inside it, a
    later page with its newline reached the disk) replaces nothing: the queue keeps its last intact record, as
    an fsync (ackSyncFlush) left it, not the older one popState.json holds."""
    seen: set[bytes] = set()
    out: list[dict[str, Any]] = []
    for ln in reversed(lines):
        cut = ln.find(_KEY_END)
        key = ln[:cut] if cut > 0 else None
        if key is not None and key in seen:
            continue
        try:
            rec = json.loads(ln)
        except ValueError:
            log.warning("popState.journal: skipping a damaged record (%d bytes)", len(ln))
            continue
        if isinstance(rec, dict):
            if key is not None:
                seen.add(key)
            out.append(rec)
    out.reverse()
    return out


def parse(data: bytes, base_id: str, at_start: bool) -> tuple[list[dict[str, Any]], int, bool]:
    """The queue records in ``data`` (journal bytes from the start when ``at_start``), how many bytes the
    complete lines take, and False when the header names another base (the records are then empty).
    Only each queue's last intact record is returned (replaying is "the last line for a queue wins")."""
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    if at_start:
        if not lines:
            return [], end, False  # empty (or a header cut short): the next append writes the header
        try:
            head = json.loads(lines[0])
        except ValueError:
            head = None
        if not isinstance(head, dict) or head.get("base") != base_id:
            return [], end, False
        lines = lines[1:]
    return _latest_records(lines), end, True


def read(state_path: str, base_id: str) -> list[dict[str, Any]]:
    """Every record of the journal continuing popState.json ``base_id`` (none when stale or absent)."""
    try:
        with open(journal_path(state_path), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    records, _, ok = parse(data, base_id, True)
    return records if ok else []


def current_queues(state_path: str, base: Any) -> list[dict[str, Any]]:
    """The queue records of popState.json's parsed ``base`` overlaid with its journal's (the last one wins)."""
    if not isinstance(base, dict):
        base = {}
    return merge(list(base.get("queues") or []) + read(state_path, str(base.get("id", ""))))


def merge(records: list[Any]) -> list[dict[str, Any]]:
    """One record per queue: the last of ``records`` for it."""
    latest: dict[Any, dict[str, Any]] = {}
    for q in records:
        if isinstance(q, dict):
            key = (q.get("group"), q.get("topic"), q.get("queueId"))
            latest.pop(key, None)
            latest[key] = q
    return list(latest.values())
