"""Delay messages in the broker: the store's timer (``rocketstore.queues.timer``), seen from the event loop.

The store runs the one timer (layout, state file and guarantees: see that module).  The broker puts a delay
message's timer record through its own put (on the loop under asynchronous flush, in its pool under synchronous
flush) and has it scheduled; the store's timer thread delivers it when due, and the broker wakes the receivers
of its topic.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from ..format.message import Message, PutMessageResult
from ..queues.timer import restore, wrap

__all__ = ["TimerService", "restore"]


class TimerService:
    """The broker's handle on the store's timer: ``submit`` from the loop, receivers woken on delivery."""

    def __init__(self, store: Any, store_host: tuple[bytes, int],
                 put: Callable[[Message], Awaitable[PutMessageResult]], notify: Callable[[str], None]) -> None:
        self.store = store
        self.timer = store.timer  # None when the store runs no services: records wait for an open that does
        self.put = put
        self.notify = notify
        self._loop: asyncio.AbstractEventLoop | None = None
        if self.timer is not None:
            self.timer.store_host = store_host  # the copies carry the broker's address, as its own puts do

    async def submit(self, msg: Message, deliver_at: int) -> PutMessageResult:
        """Store a delay message in the timer topic and schedule it."""
        if self.timer is None:
            return await self.put(wrap(msg, deliver_at))
        floor = self.timer.floor()
        try:
            res = await self.put(wrap(msg, deliver_at))
            self.timer.scheduled(res, deliver_at)  # before the floor goes (see the library's submit)
        finally:
            self.timer.unfloor(floor)
        return res

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.timer is not None:
            self.timer.listeners.append(self._delivered)

    def _delivered(self, topics: set[str]) -> None:
        """In the timer's thread: wake the receivers of these topics on the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for t in topics:
            try:
                loop.call_soon_threadsafe(self.notify, t)
            except RuntimeError:  # the loop closed meanwhile
                return

    async def stop(self) -> None:
        if self.timer is not None and self._delivered in self.timer.listeners:
            self.timer.listeners.remove(self._delivered)

    async def persist(self) -> None:
        if self.timer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.timer.persist)
