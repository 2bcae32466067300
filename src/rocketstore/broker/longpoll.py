"""Long polling: ReceiveMessage calls that wait for a message, woken only when one may be theirs.

A stored message can be taken by one receive per consumer group, so a put wakes
the oldest waiter of each group whose queues include the message's queue and
whose tag filter matches it, not every waiter of the topic (with 500 waiting
polls, waking all of them made each send cost ~13 ms of broker CPU).  A put
whose queue is not known (timer, transactions, dead letters) wakes every
waiter of the topic.  A waiter woken but cancelled before it ran passes the
wake-up on to the next waiter of its group.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable, Collection

__all__ = ["LongPolling"]


class _Waiter:
    __slots__ = ("queues", "flt", "future")

    def __init__(self, queues: Collection[int], flt: Any, future: asyncio.Future) -> None:
        self.queues, self.flt, self.future = queues, flt, future

    def wants(self, queue_id: int, tag: str | None) -> bool:
        return queue_id in self.queues and self.flt.match(tag)


class LongPolling:
    """``on_wait`` is called as a receive begins to wait (the broker brings its pending dispatch forward)."""

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self.on_wait = on_wait
        self._waiting: dict[str, dict[str, dict[int, _Waiter]]] = {}  # topic -> group -> waiters, oldest first
        self._ids = itertools.count()
        self.size = 0  # receives waiting now

    def has_waiters(self, topic: str) -> bool:
        return topic in self._waiting

    def notify(self, topic: str, queue_id: int | None = None, tag: str | None = None) -> int:
        """A message for ``topic`` was stored: wake one waiter per group that may take it; how many woke."""
        groups = self._waiting.get(topic)
        if not groups:
            return 0
        woken = 0
        for group in list(groups):
            if queue_id is None:
                woken += self._wake(topic, group, lambda w: True, everyone=True)
            else:
                woken += self._wake(topic, group, lambda w: w.wants(queue_id, tag))
        return woken

    def notify_group(self, topic: str, group: str) -> int:
        """Something of ``group`` became receivable without a put (an unblocked FIFO message, a release)."""
        return self._wake(topic, group, lambda w: True, everyone=True)

    def _wake(self, topic: str, group: str, pick: Any, everyone: bool = False) -> int:
        waiters = self._waiting.get(topic, {}).get(group)
        if not waiters:
            return 0
        woken = 0
        for key, w in list(waiters.items()):
            if pick(w) and not w.future.done():
                del waiters[key]
                w.future.set_result(True)
                woken += 1
                if not everyone:
                    break
        self._prune(topic, group)
        return woken

    def _prune(self, topic: str, group: str) -> None:
        groups = self._waiting.get(topic)
        if groups is not None and not groups.get(group, True):
            del groups[group]
            if not groups:
                del self._waiting[topic]

    async def wait(self, topic: str, group: str, queues: Collection[int], flt: Any, timeout: float) -> bool:
        """Until woken or ``timeout`` seconds pass; True if woken."""
        if timeout <= 0:
            return False
        fut = asyncio.get_running_loop().create_future()
        key = next(self._ids)
        waiters = self._waiting.setdefault(topic, {}).setdefault(group, {})
        waiters[key] = _Waiter(frozenset(queues), flt, fut)
        self.size += 1
        if self.on_wait is not None:
            self.on_wait()
        try:
            await asyncio.wait((fut,), timeout=timeout)
        except asyncio.CancelledError:
            if fut.done():  # woken, but the call is gone: let another waiter of the group look
                self._wake(topic, group, lambda w: True)
            raise
        finally:
            self.size -= 1
            if waiters.pop(key, None) is not None:
                self._prune(topic, group)
            if not fut.done():
                fut.cancel()
        return fut.done() and not fut.cancelled()
