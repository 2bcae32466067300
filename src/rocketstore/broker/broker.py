"""Broker: one open store plus the state a RocketMQ broker keeps beside it.

It owns the topic and group tables, consumer offsets, the pop state, the
timer (delay messages), transactions and the connected clients, and runs the
periodic work: writing state files, renewing auto-renewed receipts, expiring
clients.  Everything runs on one asyncio loop, ASYNC_FLUSH puts too, and so
does their dispatch into the consume queues and the index, by one call for the
puts of up to DISPATCH_LINGER seconds (at once when a receive waits or looks;
the store's dispatch thread is left what is not quick); in SYNC_FLUSH mode a put
waits for the group commit, so those run in a thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import StoreError
from ..format.message import Message, PutMessageResult, PutMessageStatus
from .clients import ClientRegistry
from .deadletters import BrokerDeadLetters
from .config import BrokerConfig
from .longpoll import LongPolling
from .metrics import BrokerMetrics, count_deliveries
from ..storage.consumer_offsets import ConsumerOffsetManager
from ..queues.pop import PopService
from ..queues.state import claim_pop_state
from .tasks import cancel, every
from .timer import TimerService
from .topics import TRANS_GROUP, TopicManager
from .transaction import TransactionService

log = logging.getLogger(__name__)
PUT_OK = PutMessageStatus.PUT_OK

DISPATCH_WAIT = 0.2  # seconds a long-poll wake-up may wait for the dispatcher
# Seconds the dispatch of ASYNC_FLUSH puts nobody waits for may wait, so that one call serves the puts of many
# loop iterations (a dispatch call costs about three times a put's own share of it).  A receive dispatches
# what is pending before it looks, and a put to a topic a receive waits for is dispatched at once.
DISPATCH_LINGER = 0.01
POP_WRITE_SPACING = 10  # popState.json waits this many times its last write's duration before the next one


class Broker:
    def __init__(self, store: Any, cfg: BrokerConfig, store_host: tuple[bytes, int] = (b"\x7f\x00\x00\x01", 8081)):
        self.store = store
        self.cfg = cfg
        self.store_host = store_host
        self.config_dir = store.paths.config
        os.makedirs(self.config_dir, exist_ok=True)
        self.topics = TopicManager(self.config_dir, auto_create_topics=cfg.auto_create_topics,
                                   default_queues=cfg.defaultTopicQueueNums,
                                   auto_create_groups=cfg.autoCreateSubscriptionGroup,
                                   default_retry_max_times=cfg.defaultRetryMaxTimes,
                                   create_rate=cfg.autoCreateRatePerSecond)
        self.offsets = ConsumerOffsetManager(self.config_dir)
        self.clients = ClientRegistry(cfg.clientExpireTime)
        self.executor = ThreadPoolExecutor(max_workers=cfg.storeThreads, thread_name_prefix="store-put")
        self.io_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self.pop: PopService | None = None
        self.timer: TimerService | None = None
        self.transactions: TransactionService | None = None
        self.dead_letters = BrokerDeadLetters(self)
        self.longpoll = LongPolling(on_wait=self._expedite_dispatch)
        self.metrics = BrokerMetrics()
        self._tasks: list[asyncio.Task] = []
        self._persist_lock: asyncio.Lock | None = None
        self._state_write: asyncio.Task | None = None  # persist's write in progress (see persist)
        self._pop_next_write = 0.0
        self._dispatch_at: asyncio.Handle | None = None  # the scheduled dispatch call of the puts so far
        self._dispatch_soon = False  # ... scheduled for the next loop iteration, not after DISPATCH_LINGER
        self._unnotified: list[tuple[str, int | None, str | None]] = []  # its puts that nobody waited for
        self.started = False
        self._puts_inline = not store.puts_wait_for_flush  # ASYNC_FLUSH: puts run on the loop (see put)
        self._pop_owner = -1  # config/popState.owner, held exclusively while started

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the state (must run on the loop that will serve)."""
        self._persist_lock = asyncio.Lock()
        # The broker keeps the pop state in memory: refused while library receivers share it (and they are
        # refused while the broker holds it), held until stop().
        if self.store.dead_letters is not None:  # the library's mover: the broker dead-letters by itself
            self.store.dead_letters.shutdown()
        self._pop_owner = claim_pop_state(self.config_dir, exclusive=True)
        self.pop = PopService(self.store, self.offsets, self.config_dir, consume_from=self.cfg.consumeFromWhere,
                              auto_renew_ms=self.cfg.popAutoRenewInvisibleTime,
                              renew_ahead_ms=self.cfg.popRenewAheadTime, renew_max_ms=self.cfg.popRenewMaxTime,
                              max_span=self.cfg.popMaxSpan, on_visible=self.longpoll.notify_group,
                              skip_groups=(TRANS_GROUP,))
        count_deliveries(self.pop, self.metrics)
        self.timer = TimerService(self.store, self.store_host, self.put, self.notify)
        self.transactions = TransactionService(self.store, self.offsets, self.cfg, self.store_host, self.put,
                                               self.notify, self.clients.send_to_producer)
        self.timer.start()
        self.transactions.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(every(self.cfg.flushConsumerOffsetInterval / 1000, self.persist,
                                              "persisting consumer state"), name="persist"),
                       loop.create_task(every(1.0, self._housekeeping, "housekeeping"), name="housekeeping")]
        self.store.assist_dispatch(True)  # our ASYNC_FLUSH puts are dispatched on the loop (see put)
        self.started = True
        self.dead_letters.left = bool(self.pop.parked())  # parked before a crash or by library receivers

    async def stop(self) -> None:
        """Stop the services and write every state file (the store stays open)."""
        if not self.started:
            return
        self.started = False
        self.store.assist_dispatch(False)
        if self._dispatch_at is not None:
            self._dispatch_at.cancel()  # the store's dispatch thread takes what is pending
            self._dispatch_at = None
        await cancel(*self._tasks)
        if self.timer:
            await self.timer.stop()
            await self.timer.persist()
        if self.transactions:
            await self.transactions.stop()
        self.clients.close_all()
        await self.persist(final=True)
        self.executor.shutdown(wait=True)
        self.io_executor.shutdown(wait=True)
        if self._pop_owner >= 0:
            os.close(self._pop_owner)
            self._pop_owner = -1

    # ------------------------------------------------------------ store access
    def put_inline(self, msg: Message) -> PutMessageResult | None:
        """ASYNC_FLUSH: store ``msg`` now, on the loop, and give the store's result; None when puts run in the
        pool (SYNC_FLUSH: then :meth:`put`).  The send path calls this first: no coroutine per put."""
        if not self._puts_inline:
            return None
        try:
            res = self.store.put(msg)
            if self._dispatch_at is None:
                self._dispatch_at = asyncio.get_running_loop().call_later(DISPATCH_LINGER, self._dispatch)
        except (StoreError, RuntimeError) as e:
            res = PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=str(e))
        self.metrics.stored(res.status is PUT_OK, len(msg.body))
        return res

    async def put(self, msg: Message) -> PutMessageResult:
        """Store ``msg``; the result is what the store says (a send is answered OK only on PUT_OK).

        ASYNC_FLUSH: the put runs on the loop (:meth:`put_inline`).  It appends to the mapped commitlog and
        hands the record to the dispatcher (tens of microseconds); sending it to a thread cost more than the
        put itself (a pool submit, a thread wake-up and a loop wake-up per send).  The records are dispatched
        on the loop too, asynchronously to the put as ever, by one call for the puts of up to DISPATCH_LINGER
        seconds: waking the store's dispatch thread for them cost more than the dispatch, and so did a call
        per loop iteration (with many producers, an iteration holds about one send).  SYNC_FLUSH: the put
        waits for the group commit's fdatasync, so it runs in the pool, where several wait on one flush; the
        dispatch thread follows the flushed end.
        """
        res = self.put_inline(msg)
        if res is not None:
            return res
        try:
            res = await asyncio.get_running_loop().run_in_executor(self.executor, self.store.put, msg)
        except StoreError as e:
            res = PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=str(e))
        except RuntimeError as e:  # executor shut down
            res = PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=str(e))
        self.metrics.stored(res.status is PUT_OK, len(msg.body))
        return res

    def dispatch_now(self) -> None:
        """Dispatch the puts whose dispatch is pending, in this call: a receive (or an admin reading the
        queues) then sees every message stored before it, as if each put had been dispatched at once."""
        if self._dispatch_at is not None:
            self._dispatch_at.cancel()
            self._dispatch()

    def _expedite_dispatch(self) -> None:
        """A receive waits: the pending puts are dispatched at the next loop iteration, not after the linger."""
        if self._dispatch_at is not None and not self._dispatch_soon:
            self._dispatch_at.cancel()
            self._dispatch_soon = True
            self._dispatch_at = asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_at = None
        self._dispatch_soon = False
        self.store.dispatch_ready()  # what fails here is left to the dispatch thread
        if self._unnotified:
            unnotified, self._unnotified = self._unnotified, []
            for topic, queue_id, tag in unnotified:
                if self.longpoll.has_waiters(topic):  # a receive looked after the put, before this: it waits
                    self.notify(topic, queue_id, tag)

    # ------------------------------------------------------------ long polling
    def notify(self, topic: str, queue_id: int | None = None, tag: str | None = None) -> None:
        """A message was stored in ``topic`` (queue and tag when known): wake the receives that may take it.

        The wake-up waits until the store's dispatcher has put what is written so far into the consume queues
        (at most DISPATCH_WAIT): a receive woken earlier would find nothing and sleep on.  The pending dispatch
        is brought forward to the next loop iteration, and the wake-up is first tried after it (scheduled
        before it), so it is usually not delayed.  A put nobody waits for is remembered until its dispatch,
        which wakes the receives that began to wait in between; they would sleep to their next look.
        """
        if self.longpoll.has_waiters(topic):
            self._expedite_dispatch()
            asyncio.get_running_loop().call_soon(self._wake, topic, queue_id, tag, self.store.max_phy_offset(),
                                                 time.monotonic() + DISPATCH_WAIT)
        elif self._dispatch_at is not None:
            self._unnotified.append((topic, queue_id, tag))

    def _wake(self, topic: str, queue_id: int | None, tag: str | None, end: int, give_up: float) -> None:
        if not self.store.dispatched_to(end) and time.monotonic() < give_up:
            asyncio.get_running_loop().call_later(0.001, self._wake, topic, queue_id, tag, end, give_up)
            return
        self.longpoll.notify(topic, queue_id, tag)

    # ------------------------------------------------------------ state files
    async def persist(self, *, final: bool = False) -> bool:
        """Write the consumer offsets and the pop state when they changed; False when a write failed.

        ``final`` writes popState.json now (at stop, and for an ack with popAckSyncFlush): a caller waiting on
        the lock finds its change written by the write before it, or writes it with every change made since.

        popState.json is written again only after POP_WRITE_SPACING times what its last write took (snapshot
        on the loop plus the write), so that a large in-flight state (60k receipts: ~6 MB) costs a bounded share
        of the broker's time; whatever is not written before a crash is delivered again.
        """
        assert self._persist_lock is not None
        async with self._persist_lock:
            if self._state_write is not None:  # left by a persist cancelled while it wrote: its changes first
                await asyncio.shield(self._state_write)
                self._state_write = None
            started = time.monotonic()
            pop_due = self.pop is not None and (final or started >= self._pop_next_write)
            pop_snap = self.pop.snapshot() if pop_due else None
            off_snap = self.offsets.snapshot()
            if pop_snap is None and off_snap is None:
                return True
            # The snapshots cleared the dirty flags: the write must happen even if this call is cancelled (the
            # periodic task at stop, an ack's RPC cut by the server's grace), or no later persist writes them.
            self._state_write = asyncio.get_running_loop().create_task(self._write_state(pop_snap, off_snap))
            ok = await asyncio.shield(self._state_write)
            self._state_write = None
            if ok and pop_snap is not None:
                took = time.monotonic() - started
                self._pop_next_write = time.monotonic() + POP_WRITE_SPACING * took
                if took > 0.05:
                    log.debug("popState.json: %d queues written in %.0f ms", len(pop_snap), took * 1000)
            return ok

    async def _write_state(self, pop_snap: list[str] | None, off_snap: dict[str, Any] | None) -> bool:
        """Write the snapshots in the state writer's thread; on failure mark them dirty again, False (it raises
        nothing: a persist cancelled meanwhile leaves it to the next persist, which awaits it)."""
        def write() -> None:
            if pop_snap is not None:
                self.pop.write(pop_snap)
            if off_snap is not None:
                self.offsets.write(off_snap)

        try:
            await asyncio.get_running_loop().run_in_executor(self.io_executor, write)
        except Exception as e:  # noqa: BLE001 (OSError mostly: a full or failing disk)
            log.error("writing consumer state failed: %s", e, exc_info=not isinstance(e, OSError))
            if pop_snap is not None:
                self.pop.dirty = True
            if off_snap is not None:
                self.offsets.dirty = True
            return False
        return True

    async def _housekeeping(self) -> None:
        self.pop.renew(self.clients.alive)
        if self.dead_letters.left:
            await self.dead_letters.move()
        for cid in self.clients.expired():
            log.info("client %s expired (no heartbeat, no Telemetry stream)", cid)
            self.clients.remove(cid)
            self.pop.release_client(cid)
