"""CoalescedWriter: a state file written off the event loop, one write for every change made meanwhile.

Creating topics or groups used to rewrite and fsync their JSON file on the
event loop, once per creation.  Here a change awaits :meth:`CoalescedWriter.flush`:
the document is taken on the loop (a consistent view), written by a thread,
and every change made while a write runs shares the next write.  ``flush``
returns once a write that includes the caller's change is durable (or raises
its error).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable


class CoalescedWriter:
    def __init__(self, snapshot: Callable[[], Any], write: Callable[[Any], None]) -> None:
        self._snapshot = snapshot
        self._write = write
        self._next: asyncio.Future | None = None
        self._task: asyncio.Task | None = None

    async def flush(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
        fut = self._next
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        await asyncio.shield(fut)

    async def _run(self) -> None:
        while self._next is not None:
            fut, self._next = self._next, None
            doc = self._snapshot()
            try:
                await asyncio.to_thread(self._write, doc)
            except Exception as e:  # the callers report it (disk full, permissions)
                fut.set_exception(e)
                fut.exception()  # retrieved: a caller that went away leaves no "never retrieved" warning
            else:
                fut.set_result(None)
