"""The broker's dead letters: parked messages moved to ``%DLQ%<group>`` by the library's exactly-once protocol.

A receive that finds a message past its group's maxReconsumeTimes, and a client's
ForwardMessageToDeadLetterQueue, park it in the pop state (never delivered again).  A round here runs
:class:`~rocketstore.queues.revive.DeadLetterMoves` on the broker's in-memory state: the DLQ ends are written
to popState.json (fsync) before any put, so a crash between a put and the next state write is settled at the
next round (the copy is found, not put again).  Rounds run one at a time: when something was parked, at
start (parked before a crash, or by library receivers before the broker took the state), and every
housekeeping second while a round left work behind (a failed put or state write).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..queues.pop import DeadLetter
from ..queues.retry import dlq_topic
from ..queues.revive import DeadLetterMoves

log = logging.getLogger(__name__)


class BrokerDeadLetters:
    """Moves a broker's parked messages into their groups' DLQs (on the broker's loop)."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self._lock = asyncio.Lock()
        self.left = False  # the last round left parked messages behind: housekeeping runs another

    async def move(self) -> int:
        """One round: how many messages were put into a DLQ."""
        async with self._lock:
            moved = await self._round()
            self.left = bool(self.broker.pop.parked())
            return moved

    async def forward(self, d: DeadLetter) -> bool:
        """A client's forward of the parked ``d``: True once it left the group (in the DLQ, or unreadable)."""
        await self.move()
        return not self.broker.pop.holds(d)

    async def _round(self) -> int:
        broker = self.broker
        pop, store = broker.pop, broker.store
        parked = pop.parked()
        if not parked:
            return 0
        try:
            for group in sorted({d.group for d in parked}):
                await broker.topics.ensure_dlq_topic(group)
        except OSError as e:
            log.error("cannot create a dead letter topic: %s; the messages stay parked", e)
            return 0
        moves = DeadLetterMoves(store, pop, broker.store_host)
        retried = moves.mark()
        if not await broker.persist(final=True):  # the DLQ ends must be on disk before any put
            return 0
        if retried:  # a copy put just before a crash must be in its queue to be found
            await asyncio.get_running_loop().run_in_executor(None, store.wait_dispatched, 5.0)
        put = []
        for d in moves.marked():
            msg = moves.letter(d)
            if msg is None:
                continue
            res = await broker.put(msg)
            moves.claim(d, res)
            put.append((d, res))
        # one flush serves the round's puts; no message leaves the state before its dead letter is durable
        if any(res.ok for _d, res in put) and \
                not await asyncio.get_running_loop().run_in_executor(None, store.make_puts_durable):
            # not settled: parked with their DLQ ends, the next round finds the copies or puts them again
            log.error("the commitlog could not be flushed after the puts of %d dead letter(s); the messages stay "
                      "parked", len(put))
            return 0
        moved = 0
        for d, res in put:
            if moves.placed(d, res):
                moved += 1
                broker.notify(dlq_topic(d.group))
        return moved
