"""Replaying ``dump`` output (or golden expected.jsonl) into a store, keeping every stored field.

Lines that share a batch put result (``putResult.msgNum > 1`` with the same
``wroteOffset``) are put together with ``put_batch`` so that they move to a new
segment as one unit, as RocketMQ's putMessages does.

The file is streamed, never held in memory.  A commitlog append cannot be taken
back, so by default a first streaming pass checks every line (JSON, message
fields, and the store's own encoding checks) and nothing is written unless all of
them pass; ``continue_on_error`` instead skips bad lines in a single pass.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from typing import Any, Iterator, NamedTuple

from .format import codec
from .errors import StoreError
from .format.message import Message
from .store import MessageStore, batch_problem

log = logging.getLogger(__name__)


class Line(NamedTuple):
    """One non-blank line: its number, its length in bytes, and the message or why it is not one."""
    number: int
    size: int
    message: Message | None
    problem: str | None
    batch: tuple[Any, Any] | None  # (wroteOffset, msgNum) of a recorded batch put, else None


class ImportResult(NamedTuple):
    imported: int
    skipped: int


def read_lines(path: str) -> Iterator[Line]:
    """Parse ``path`` line by line (a bad line is reported, not raised)."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                d = json.loads(raw)
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                yield Line(number, len(raw), None, f"not a JSON line: {e}", None)
                continue
            if not isinstance(d, dict):
                yield Line(number, len(raw), None, f"not a message: a JSON {type(d).__name__}, not an object", None)
                continue
            try:
                msg = Message.from_json(d)
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                yield Line(number, len(raw), None, f"not a message: {type(e).__name__}: {e}", None)
                continue
            why = body_problem(d, msg.body)
            if why:
                yield Line(number, len(raw), None, why, None)
                continue
            pr = d.get("putResult") or {}
            batch = (pr.get("wroteOffset"), pr.get("msgNum")) if isinstance(pr, dict) and \
                isinstance(pr.get("msgNum"), int) and pr["msgNum"] > 1 else None
            yield Line(number, len(raw), msg, None, batch)


def body_problem(d: dict[str, Any], body: bytes) -> str | None:
    """Why the line's body is not the body the dumped record held, else None.

    A dump line carries the record's ``bodyLength`` and ``bodyCrc``; the body
    put must match both.  Without this a ``dump --no-body`` line (no ``body``)
    would be imported as an empty message, and an edited body as if it were
    the stored one.  A hand-written line without those fields is taken as it is.
    """
    length, crc = d.get("bodyLength"), d.get("bodyCrc")
    if "body" not in d and isinstance(length, int) and length > 0:
        return (f"no body, but the record's bodyLength is {length} (a dump --no-body line?); "
                "import needs dump output with bodies")
    if length is not None and length != len(body):
        return f"body is {len(body)} bytes, but the line's bodyLength says {length}"
    if crc is not None and length != 0 and crc != codec.body_crc(body):
        return f"body CRC is {codec.body_crc(body)}, but the line's bodyCrc says {crc} (body edited or damaged)"
    return None


def _groups(lines: Iterator[Line]) -> Iterator[list[Line]]:
    """Consecutive lines of one recorded batch together; every other line alone."""
    group: list[Line] = []
    for line in lines:
        if group and (line.batch is None or line.batch != group[-1].batch):
            yield group
            group = []
        group.append(line)
    if group:
        yield group


def _group_problem(store: MessageStore, group: list[Line], now_ms: int) -> tuple[int, str] | None:
    """(line number, reason) of the first line the store would refuse, else None; writes nothing."""
    for line in group:
        if line.problem:
            return line.number, line.problem
        try:
            store.encoder.encode(line.message, now_ms)  # the put path's own checks (topic, sizes, hosts, properties)
        except (ValueError, struct.error) as e:  # (struct.error: a number the record's field cannot hold)
            return line.number, str(e)
    if len(group) > 1:
        why = batch_problem([line.message for line in group])
        if why:
            return group[0].number, why
    return None


def validate_file(store: MessageStore, path: str, progress: Any = None) -> int:
    """Check every line as a put would, without writing; raise StoreError naming the first bad line."""
    now_ms = int(time.time() * 1000)
    n = 0
    for group in _groups(read_lines(path)):
        bad = _group_problem(store, group, now_ms)
        if bad:
            raise StoreError(f"{path}:{bad[0]}: {bad[1]}; nothing imported")
        n += len(group)
        if progress is not None:
            progress.update(sum(line.size for line in group))
    return n


def import_file(store: MessageStore, path: str, continue_on_error: bool = False,
                progress: Any = None) -> ImportResult:
    """Replay ``path`` into ``store``.

    Without ``continue_on_error`` the whole file is validated first and a bad line
    raises StoreError (file and line named) before anything is written; with it,
    bad lines are logged and skipped.  ``progress`` counts bytes, once per pass.
    """
    if not continue_on_error:
        validate_file(store, path, progress)
    imported = skipped = 0
    now_ms = int(time.time() * 1000)
    for group in _groups(read_lines(path)):
        if continue_on_error:
            bad = _group_problem(store, group, now_ms)
            if bad:
                log.warning("%s:%d: %s; skipped %d line(s)", path, bad[0], bad[1], len(group))
                skipped += len(group)
                continue
        msgs = [line.message for line in group]
        r = store.put(msgs[0]) if len(msgs) == 1 else store.put_batch(msgs)
        if not r.ok:
            # Every line passed the checks above: this is the store refusing (disk full, read-only).
            raise StoreError(f"{path}:{group[0].number}: put refused: {r.status.value}: {r.error} "
                             f"({imported} message(s) before this line were imported)")
        imported += r.msg_num
        if progress is not None:
            progress.update(sum(line.size for line in group))
    return ImportResult(imported, skipped)
