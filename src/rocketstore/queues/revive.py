"""Moving parked messages to ``%DLQ%<group>``: what RocketMQ's broker does for a message past maxReconsumeTimes.

A receiver that finds a message due for the DLQ parks it in the pop state (``Entry.parked``: never delivered
again); a mover puts it there.  :class:`DeadLetterMoves` is the one protocol, used by the library's
:class:`DeadLetterMover` and by the gRPC broker (``rocketstore.broker.deadletters``), which differ only in how
they write the state and put.  In the library only the writer (the process holding the store open for writing)
can put: a receiver in the writer process moves at once, and :class:`DeadLetterService`, one of the writable
store's services, moves for receivers in read-only processes (they ring its bell, ``REVIVE``; it also looks at
start, so messages parked while no writer ran move when one opens the store, and every ``interval`` seconds
when the pop state changed, in case a ring was lost).

Exactly once: the mover first writes, durably, each parked message's ``dlq_from`` (the DLQ queue's end before
its put), then looks for the copy from there (same DLQ_ORIGIN_MESSAGE_ID, origin topic and born time: a crash
between an earlier put and its state write left it there), puts it if it is not there, and removes the
message from the group's state.  Movers in one process, or after a crash, never put twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..errors import StoreError, StoreLockedError, TierError
from ..format.codec import MessageExt
from ..format.message import Message, PutMessageResult
from ..services.base import ServiceThread
from . import journal
from .dlq import P_DLQ_MSG_ID, P_RETRY_TOPIC, dead_letter
from .doorbell import Doorbell, Waiter
from .pop import PARKED, DeadLetter, PopService
from .retry import dlq_topic
from .state import SharedPopState

log = logging.getLogger(__name__)

REVIVE = "-revive"  # the doorbell channel of the writer's dead-letter service


def ring(root: str) -> None:
    """Tell the writer's dead-letter service that a receiver parked a message."""
    bell = Doorbell(root, REVIVE)
    try:
        bell.ring()
    finally:
        bell.close()


class DeadLetterMover:
    """Puts the parked messages of a store's pop state into their groups' DLQs; thread-safe."""

    def __init__(self, store: Any, config_dir: str) -> None:
        self.store = store
        self.config_dir = config_dir
        self.state_path = os.path.join(config_dir, "popState.json")
        self._lock = threading.Lock()

    def may_have_parked(self) -> bool:
        """Whether popState.json or its journal may hold a parked message (its mark, unparsed): if not, the
        state is neither loaded nor touched (a writable open of a store with queue state writes nothing)."""
        mark = b'"%s",' % PARKED.encode()
        for p in (self.state_path, journal.journal_path(self.state_path)):
            try:
                with open(p, "rb") as fh:
                    if mark in fh.read():
                        return True
            except OSError:
                continue
        return False

    def stamp(self) -> tuple[int, ...]:
        """Changes when the pop state does (its file and journal)."""
        out: tuple[int, ...] = ()
        for p in (self.state_path, journal.journal_path(self.state_path)):
            try:
                st = os.stat(p)
                out += (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                out += (0,)
        return out

    def run(self) -> int:
        """Move every parked message; how many went to a DLQ.  Nothing while a broker owns the pop state."""
        if self.store.read_only or not self.may_have_parked():
            return 0
        with self._lock:
            try:
                state = SharedPopState(self.config_dir, lambda offsets: PopService(
                    self.store, offsets, self.config_dir))
            except StoreLockedError:
                return 0  # a broker serves the store: it dead-letters by itself
            try:
                return self._move(state)
            finally:
                state.close()

    def _move(self, state: SharedPopState) -> int:
        with state.locked(durable=True) as pop:
            retried = DeadLetterMoves(self.store, pop).mark()
        if retried:
            wait = getattr(self.store, "wait_dispatched", None)
            if wait is not None:
                wait(5.0)  # a copy put just before a failure must be in its queue to be found
        moved = 0
        with state.locked(durable=True) as pop:
            moves = DeadLetterMoves(self.store, pop)
            put: list[tuple[DeadLetter, PutMessageResult]] = []
            for d in moves.marked():
                msg = moves.letter(d)
                if msg is not None:
                    res = self.store.put(msg)
                    moves.claim(d, res)
                    put.append((d, res))
            if any(res.ok for _d, res in put) and not self.store.make_puts_durable():
                # not settled: parked with their DLQ ends, a later round finds the copies or puts them again
                raise StoreError(f"{self.store.root}: the commitlog could not be flushed after the puts of "
                                 f"{len(put)} dead letter(s); the messages stay parked")
            for d, res in put:
                moved += moves.placed(d, res)
        return moved


class DeadLetterMoves:
    """One round of moving a pop state's parked messages (the caller serialises rounds on one state).

    The caller: :meth:`mark`, then makes the state durable (no put before that), waits for the store's
    dispatch if :meth:`mark` said so, and for each of :meth:`marked`: puts :meth:`letter` unless it is None and
    hands the result to :meth:`claim` at once; then makes the round's puts durable, once for all of them (under
    asynchronous flush a dead letter could sit in the page cache while the state that forgets the message is
    fsynced: a power cut would lose it from both), and only then hands each result to :meth:`placed`; then
    writes the state (a lost write only makes the next round find the copies).
    """

    def __init__(self, store: Any, pop: PopService, store_host: Any = None) -> None:
        self.store = store
        self.pop = pop
        self.store_host = store_host
        self.matched: set[tuple[str, int]] = set()  # DLQ positions already taken as some message's copy

    def mark(self) -> bool:
        """Record each parked message's DLQ end; True when one had it already: a move cut short, whose copy
        may be in the DLQ (the store's dispatch must have caught up for it to be found)."""
        retried = False
        for d in self.pop.parked():
            if d.entry.dlq_from < 0:
                self.pop.intend_dlq(d, self.store.max_offset_in_queue(dlq_topic(d.group), 0))
            else:
                retried = True
        return retried

    def marked(self) -> list[DeadLetter]:
        """The parked messages whose DLQ end is recorded (parked since :meth:`mark`: the next round)."""
        return [d for d in self.pop.parked() if d.entry.dlq_from >= 0]

    def letter(self, d: DeadLetter) -> Message | None:
        """The dead letter to put for ``d``; None when none is needed (its copy is in the DLQ: a move cut short;
        or the message is damaged or gone: dropped), ``d`` then removed from the state; None too, ``d`` left
        parked, when the message cannot be read for now (TierError, OSError)."""
        if not self.pop.holds(d):
            return None
        try:
            m = self.store.look(d.entry.phy)
        except (TierError, OSError) as e:  # unreadable for now (the bucket, the disk): the next round tries again
            log.warning("%s@%s: message at %d cannot be read now (%s); it stays parked", d.topic, d.group,
                        d.entry.phy, e)
            return None
        except Exception as e:  # noqa: BLE001 - gone or damaged: never delivered again either way
            log.error("%s@%s: message at %d unreadable (%s); dropped instead of dead-lettered", d.topic, d.group,
                      d.entry.phy, e)
            self.pop.settle_dlq(d)
            return None
        dlq = dlq_topic(d.group)
        if self._find_copy(dlq, d, m):
            log.info("message %s of %s was in %s already (a move cut short); settled", m.msg_id, d.topic, dlq)
            self.pop.settle_dlq(d)
            return None
        return dead_letter(m, d.group, d.topic, d.entry.attempts, self.store_host)

    def claim(self, d: DeadLetter, res: PutMessageResult) -> None:
        """Right after the put of ``d``'s letter: its DLQ position is taken, so that :meth:`letter` of another
        message of the round (before :meth:`placed` settles ``d``) never takes that copy for its own."""
        if res.ok:
            self.matched.add((dlq_topic(d.group), res.queue_offset))

    def placed(self, d: DeadLetter, res: PutMessageResult) -> bool:
        """The put of ``d``'s letter returned ``res`` (claimed, and made durable with the round's puts): on
        success ``d`` leaves the state; else it stays parked (with its DLQ end: the next round looks for a copy
        first)."""
        dlq = dlq_topic(d.group)
        if not res.ok:
            log.error("moving the message at %d of %s to %s failed: %s; the next round tries again", d.entry.phy,
                      d.topic, dlq, res.status.value)
            return False
        self.matched.add((dlq, res.queue_offset))
        self.pop.settle_dlq(d)
        log.info("message at %d of %s moved to %s after %d deliveries", d.entry.phy, d.topic, dlq,
                 d.entry.attempts)
        return True

    def _find_copy(self, dlq: str, d: DeadLetter, m: MessageExt) -> bool:
        """Whether ``m``'s dead letter is in the DLQ at or after the recorded end (the move's earlier put)."""
        uniq = m.properties.get("UNIQ_KEY") or m.msg_id
        off = max(d.entry.dlq_from, self.store.min_offset_in_queue(dlq, 0))
        end = self.store.max_offset_in_queue(dlq, 0)
        while off < end:
            res = self.store.get(dlq, 0, off, 32, read_body=False)
            if not res.messages:
                break
            for c in res.messages:
                if (dlq, c.queue_offset) not in self.matched and c.properties.get(P_DLQ_MSG_ID) == uniq and \
                        c.properties.get(P_RETRY_TOPIC) == d.topic and c.born_timestamp == m.born_timestamp:
                    self.matched.add((dlq, c.queue_offset))
                    return True
            if res.next_begin_offset <= off:
                break
            off = res.next_begin_offset
        return False


class DeadLetterService(ServiceThread):
    """The writer's mover for receivers in read-only processes: woken by their ring (REVIVE), at start, and
    every ``interval`` seconds when the pop state changed."""

    name = "DeadLetterService"

    def __init__(self, store: Any, config_dir: str, interval: float = 10.0) -> None:
        super().__init__(interval)
        self.mover = DeadLetterMover(store, config_dir)
        self._root = store.root
        self._waiter: Waiter | None = None
        self._rung = True  # the first round looks: parked while no writer ran
        self._stamp: tuple[int, ...] | None = None
        self._last = 0.0
        self._closing = False

    def start(self) -> None:
        self._waiter = Waiter(self._root, REVIVE)  # bound before the first look: a ring after it wakes us
        super().start()

    def wait_for_running(self, timeout: float) -> None:
        if self._closing:
            super().wait_for_running(timeout)  # until shutdown() stops the loop
            return
        end = time.monotonic() + timeout
        while not self._closing and not self._rung:
            left = end - time.monotonic()
            if left <= 0:
                return
            assert self._waiter is not None
            self._rung = self._waiter.wait(left)

    def run_once(self) -> None:
        rung, self._rung = self._rung, False
        if not rung:
            if time.monotonic() - self._last < self.interval:
                return
            stamp = self.mover.stamp()
            if stamp == self._stamp:
                self._last = time.monotonic()
                return
        self._stamp = self.mover.stamp()
        self._last = time.monotonic()
        self.mover.run()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._closing = True
        if self._waiter is not None:
            self._waiter.wake()
        super().shutdown(timeout)
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
