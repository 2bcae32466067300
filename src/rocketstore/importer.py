"""Replaying ``dump`` output (or golden expected.jsonl) into a store, keeping every stored field.

Lines that share a batch put result (``putResult.msgNum > 1`` with the same
``wroteOffset``) are put together with ``put_batch`` so that they move to a new
segment as one unit, as RocketMQ's putMessages does.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from .errors import StoreError
from .message import Message, PutMessageResult
from .store import MessageStore


def _groups(lines: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    group: list[dict[str, Any]] = []
    key = None
    for d in lines:
        pr = d.get("putResult") or {}
        k = (pr.get("wroteOffset"), pr.get("msgNum")) if pr.get("msgNum", 1) > 1 else None
        if group and (k is None or k != key):
            yield group
            group = []
        group.append(d)
        key = k
    if group:
        yield group


def import_messages(store: MessageStore, lines: Iterable[dict[str, Any]],
                    progress: Any = None) -> list[PutMessageResult]:
    """Put every line; raise StoreError naming the line if a put is refused."""
    results = []
    n = 0
    for group in _groups(lines):
        try:
            msgs = [Message.from_json(d) for d in group]
        except (KeyError, ValueError, TypeError) as e:
            raise StoreError(f"line {n + 1}: not a message: {e}") from None
        r = store.put(msgs[0]) if len(msgs) == 1 else store.put_batch(msgs)
        if not r.ok:
            raise StoreError(f"line {n + 1}: put refused: {r.status.value}: {r.error}")
        results.append(r)
        n += len(group)
        if progress is not None:
            progress.update(len(group))
    return results
