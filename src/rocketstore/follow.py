"""``dump --follow``: keep printing messages as another process appends them (``tail -f`` for a store).

At the end of the read-only view the follower sleeps ``interval`` and extends
the view's commitlog to the records appended since
(:func:`rocketstore.tail_view.extend_view`, each new record CRC-checked), then
goes on from the same commitlog offset.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from .codec import MessageExt
from .errors import StoreError
from .selection import Selection
from .store import MessageStore
from .tail_view import extend_view


def follow(store: MessageStore, sel: Selection, *, read_body: bool = True,
           interval: float = 0.2) -> Iterator[MessageExt]:
    """The selection's messages, then those appended later, until its limits or ``to_time`` are reached."""
    offset = sel.start(store)
    n = size = 0
    while True:
        for off, rec_size, msg, problem in store.messages(offset, read_body=read_body):
            if msg is None:
                raise StoreError(f"scan stopped at commitlog offset {off}: {problem}")
            offset = off + rec_size
            if sel.to_time is not None and msg.store_timestamp > sel.to_time:
                return
            if (sel.topic is not None and msg.topic != sel.topic) or \
                    (sel.from_time is not None and msg.store_timestamp < sel.from_time):
                continue
            yield msg
            n += 1
            size += msg.size
            if sel.reached(n, size):
                return
        while not extend_view(store, topics=()):
            time.sleep(interval)
