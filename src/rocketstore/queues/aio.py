"""The asyncio twin of :class:`~rocketstore.queues.simple_consumer.SimpleConsumer`.

A blocking receive runs in the loop's default executor (the doorbell wait is a ``select``, the state
operations a few file calls), so the event loop never blocks on it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from .simple_consumer import ReceivedMessage, SimpleConsumer


class AsyncSimpleConsumer:
    """``await receive(...)`` / ``ack`` / ``nack`` / ``change_invisible_duration``; an async context manager."""

    def __init__(self, consumer: SimpleConsumer) -> None:
        self.consumer = consumer

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kw))

    async def receive(self, max_messages: int = 16, wait: float = 0.0) -> list[ReceivedMessage]:
        return await self._run(self.consumer.receive, max_messages, wait)

    async def ack(self, m: ReceivedMessage | str) -> None:
        await self._run(self.consumer.ack, m)

    async def nack(self, m: ReceivedMessage | str) -> None:
        await self._run(self.consumer.nack, m)

    async def change_invisible_duration(self, m: ReceivedMessage | str, seconds: float) -> ReceivedMessage | str:
        return await self._run(self.consumer.change_invisible_duration, m, seconds)

    async def close(self) -> None:
        await self._run(self.consumer.close)

    async def __aenter__(self) -> "AsyncSimpleConsumer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
