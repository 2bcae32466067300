"""Background asyncio tasks of the broker: periodic jobs that survive their own failures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def every(period: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """Await ``step()`` every ``period`` seconds until cancelled; a failure is logged and the next round runs."""
    while True:
        await asyncio.sleep(period)
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed", what)


async def cancel(*tasks: asyncio.Task | None) -> None:
    """Cancel the tasks and wait until they have finished (their errors were logged by ``every``)."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        try:
            await t
        except (asyncio.CancelledError, Exception):
            pass
