"""MessageStore: the embedded store (RocketMQ's DefaultMessageStore), writable or read-only.

Opening reads the directory the way RocketMQ's ``load()`` does: the ``abort``
file says whether the last exit was clean, then the CommitLog, the consume
queues, the checkpoint and the index are loaded and recovered.  A read-only
store does all of that in memory and never writes a byte (no lock, no abort
file, maps opened read-only), so it can read a live or a read-only directory.
"""

from __future__ import annotations

import logging
import os
import time
from time import perf_counter
from typing import Any, Callable, Iterator, Sequence

from .config import SYNC_FLUSH, StoreConfig
from .errors import CommitLogWriteError, ReadOnlyStoreError, StoreClosedError, StoreLoadError
from .format import codec
from .format.codec import MessageExt
from .format.encoder import PLAIN_COLUMNS, RUN_MIN, MessageEncoder
from .format.message import (DEFAULT_STORE_HOST, GetMessageResult, Message, PutMessageResult, PutMessageStatus,
                             QueryMessageResult, batch_bodies, host_tuple, illegal_topic, is_plain)
from .paths import StorePaths
from .queues.aio import AsyncSimpleConsumer
from .queues.doorbell import Doorbell
from .queues.revive import DeadLetterService
from .queues.state import write_clamped_state
from .queues.simple_consumer import SimpleConsumer
from .queues.timer import TIMER_TOPIC, TimerService, deliver_time, wrap as timer_record
from .recovery.load import StoreLoader, boot_id
from .services.clean import CleanService, DiskGuard, DiskGuardService, disk_usage_ratio
from .services.dispatch import ReputMessageService
from .services.flush import CheckpointService, FlushConsumeQueueService, FlushRealTimeService, GroupCommitService
from .services.group_commit import GroupCommit, GroupCommitRequest, PutRefused
from .services.metrics import SAMPLE_EVERY, MetricsService, StoreMetrics, snapshot as metrics_snapshot
from .services.warm_ahead import WarmAheadService
from .storage.consume_queue import LOWER, ConsumeQueue
from .storage.consumer_offsets import lowest_committed_offsets
from .storage.files import InFiles, StoreFiles
from .storage.geometry import STORE_CONF, reserved_bytes, store_config
from .storage.jsonfile import write_file_durably
from .storage.read import StoreReader
from .storage.store_lock import StoreLock
from .tier.upload import TierUploadService

log = logging.getLogger(__name__)


class MessageStore:
    """An open store.  Use :meth:`open`; it is a context manager."""

    # The open files and the tables over them live in self.files (StoreFiles): one copy, given to the services.
    paths, root, config, read_only, clock, sleep = (InFiles() for _ in range(6))
    running_flags, flush_error, commitlog, checkpoint, index_service, tier = (InFiles() for _ in range(6))
    topic_queue_table, queues_to_rebuild, recovery_report, _cq_table, _cq_lock, closed = (InFiles() for _ in range(6))
    last_exit_ok, abort_file_present, process_crash_only, lost_queues = (InFiles() for _ in range(4))

    def __init__(self, root: str, config: StoreConfig, *, read_only: bool = False,
                 clock: Callable[[], float] = time.time, start_services: bool = True,
                 disk_usage: Callable[[str], float] | None = None, sleep: Callable[[float], None] = time.sleep,
                 allow_quarantine: bool = False, repairing: bool = False) -> None:
        self.files = StoreFiles(StorePaths(root), config, read_only=read_only, clock=clock, sleep=sleep)
        self.reader = StoreReader(self.files)
        self.loader = StoreLoader(self.files, self.reader, allow_quarantine)
        self.allow_quarantine = allow_quarantine
        self.closed = False
        self._store_lock: StoreLock | None = None
        self._services: list[Any] = []
        self.reput: ReputMessageService | None = None
        self.group_commit: GroupCommitService | None = None
        # The put path, remade with the services.  Without them (start_services=False) a SYNC_FLUSH put still
        # waits for its fdatasync, led by its own thread: no service would ever flush what it acknowledged.
        self.commit = GroupCommit(self.files, None, sync=config.flushDiskType == SYNC_FLUSH)
        self.timer: TimerService | None = None  # delay messages: runs in the writable store with its services
        # moves messages that receivers in read-only processes parked for the DLQ (rocketstore.queues.revive)
        self.dead_letters: DeadLetterService | None = None
        self.disk_guard = DiskGuard(self.files, disk_usage or disk_usage_ratio)
        self.clean_service = CleanService(self.files, self.disk_guard)
        self.metrics = StoreMetrics()
        self.encoder = MessageEncoder.for_config(config)

        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreLoadError(f"{root}: not a directory (a store is a directory)")
        if not os.path.isdir(root):
            if read_only:
                raise StoreLoadError(f"{root}: no such store directory")
            os.makedirs(root, exist_ok=True)
        elif read_only:
            self._refuse_non_store()
        else:
            self._refuse_foreign_directory()
        if not repairing:
            self._check_repair_marker()
        if not read_only:
            self._acquire_lock()
        try:
            self.loader.load()
            if not read_only and start_services:
                self._start()
        except BaseException:
            self._release_lock()
            self._close_files()
            raise

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str, config: StoreConfig | str | None = None, *, read_only: bool = False,
             allow_quarantine: bool = False, **kw: Any) -> "MessageStore":
        """Open (or, writable, create) the store at ``path``.

        ``config`` is a StoreConfig, a ``broker.conf`` path, or None; it overlays
        ``<path>/broker.conf`` when that exists (``rocketstore init``).  Geometry
        keys neither sets explicitly are measured from the files; one that
        contradicts them refuses the open (ConfigError) before anything is
        touched.  ``allow_quarantine``: let such a key win, and let one open move
        more than one file of a kind to ``quarantine/`` (refused otherwise).
        """
        if isinstance(config, str):
            config = StoreConfig.load(config)
        if not kw.get("repairing") and os.path.exists(StorePaths(path).repair_marker):
            _repair_marker_gate(path, config, read_only)  # before the geometry is measured from half-swapped files
        config = store_config(path, config, allow_quarantine=allow_quarantine)
        return cls(path, config, read_only=read_only, allow_quarantine=allow_quarantine, **kw)

    def __enter__(self) -> "MessageStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _refuse_foreign_directory(self) -> None:
        known = {"commitlog", "consumequeue", "index", "checkpoint", "lock", "abort", "abort.bak", "config",
                 "abort.bootid", "metrics.json", "consumequeue.rebuild", "repair.json", "index.rebuild",
                 "quarantine", "compaction", "timerwheel", "timerlog", "timercheck", "timermetrics"}
        entries = [e for e in os.listdir(self.root) if not e.startswith(".")]
        # A broker.conf alone marks a store made by init; beside other files it may be a RocketMQ conf/ directory.
        if entries and entries != [STORE_CONF] and not any(e in known for e in entries):
            raise StoreLoadError(f"{self.root}: directory holds files that are not a message store "
                                 f"({', '.join(sorted(entries)[:3])}); refusing to write into it")

    def _refuse_non_store(self) -> None:
        """A reader given a directory that holds no store would report it as empty and healthy: refuse."""
        marks = ("commitlog", "consumequeue", "index", "checkpoint")
        if not any(os.path.exists(os.path.join(self.root, m)) for m in marks):
            raise StoreLoadError(f"{self.root}: not a message store (no commitlog/, consumequeue/, index/ "
                                 "or checkpoint)")

    def _acquire_lock(self) -> None:
        self._store_lock = StoreLock(self.root)
        self._store_lock.acquire()

    def _release_lock(self) -> None:
        if self._store_lock is not None:
            self._store_lock.release()
            self._store_lock = None

    def _check_repair_marker(self) -> None:
        if os.path.exists(self.paths.repair_marker):
            _repair_marker_gate(self.root, self.config, self.read_only)

    def _start(self) -> None:
        cfg = self.config
        write_clamped_state(self, self.paths.config)  # before a put (or a timer's copy) reuses lost queue offsets
        if cfg.flushDiskType == SYNC_FLUSH:
            self.group_commit = GroupCommitService(self.files)
            self.files.sync_flush = True
            self._services.append(self.group_commit)
        else:
            self._services.append(FlushRealTimeService(self.files))
        self.reput = ReputMessageService(self.files, self.commitlog.max_offset())
        self.commit = GroupCommit(self.files, self.reput, sync=self.group_commit is not None,
                                  service=self.group_commit)
        if self.group_commit is not None:
            self.group_commit.commit = self.commit
        self.reput.on_dispatched = Doorbell(self.root).ring  # wakes SimpleConsumers waiting in other processes
        self._services += [self.reput, FlushConsumeQueueService(self.files), CheckpointService(self.files)]
        self._services += [self.clean_service, DiskGuardService(self.disk_guard), MetricsService(self.root, self._metrics_snapshot)]
        if self.tier is not None:
            self._services.append(TierUploadService(self.files))
        if cfg.warmAheadBytes > 0:
            self.commitlog.warmer = WarmAheadService(self.commitlog.queue, cfg.warmAheadBytes)
            self._services.append(self.commitlog.warmer)
        if not self.commitlog.queue.files:
            self.commitlog.queue.start_preallocation(0)  # the first segment too is made off the put path
        for s in self._services:
            s.start()
        previous = b""
        if os.path.exists(self.paths.abort):
            with open(self.paths.abort, "rb") as fh:
                previous = fh.read()
        # Durable before the first put is taken: a power cut must not lose the mark that says "recover".
        boot = boot_id()
        if boot is not None:
            write_file_durably(self.paths.abort_boot, boot.encode("ascii"))
        with open(self.paths.abort_bak, "wb") as fh:
            fh.write(previous)
        write_file_durably(self.paths.abort, str(os.getpid()).encode())
        self.timer = TimerService(self, self.paths.config, self._put_direct, clock=self.files.clock,
                                  sync=self.make_puts_durable)
        self.timer.start()
        self.dead_letters = DeadLetterService(self, self.paths.config)
        self.dead_letters.start()

    # ------------------------------------------------------------ queues
    def simple_consumer(self, group: str, topic: str, *, tag_filter: str = "*", invisible_duration: float = 30.0,
                        max_reconsume_times: int | None = None, fifo: bool | None = None,
                        **kw: Any) -> SimpleConsumer:
        """A receiver of ``group`` sharing its work with the group's others, in any process (rocketstore.queues)."""
        return SimpleConsumer(self, group, topic, tag_filter=tag_filter, invisible_duration=invisible_duration,
                              max_reconsume_times=max_reconsume_times, fifo=fifo, **kw)

    def async_simple_consumer(self, group: str, topic: str, **kw: Any) -> AsyncSimpleConsumer:
        """The asyncio twin of :meth:`simple_consumer`."""
        return AsyncSimpleConsumer(self.simple_consumer(group, topic, **kw))

    def find_consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        return self.files.find_consume_queue(topic, queue_id)

    def consume_queues(self) -> list[ConsumeQueue]:
        return self.files.consume_queues()

    def queue_keys(self) -> list[tuple[str, int]]:
        return self.files.queue_keys()

    # ------------------------------------------------------------ offsets
    def min_phy_offset(self) -> int:
        """The first offset of the local segments."""
        return self.files.min_phy_offset()

    def min_readable_offset(self) -> int:
        """The first offset a read can reach: the tier's start when a tier holds older segments."""
        return self.reader.min_readable_offset()

    def max_phy_offset(self) -> int:
        return self.files.max_phy_offset()

    def dispatch_behind_bytes(self) -> int:
        return self.reput.behind() if self.reput else 0

    def _metrics_snapshot(self) -> dict[str, Any]:
        return metrics_snapshot(self.files, self.metrics, self.disk_guard, self.dispatch_behind_bytes())

    def wait_dispatched(self, timeout: float = 30.0) -> bool:
        """Block until the dispatcher has caught up with everything written so far."""
        if self.reput is None:
            return True
        if self.group_commit is not None:
            self.commit.wait_flushed(self.commitlog.max_offset(), timeout)
        return self.reput.wait_dispatched(self.files.confirm_offset(), timeout)

    # The broker's loop puts and dispatches in one thread (ASYNC_FLUSH); these let it without reaching
    # into the services.
    @property
    def puts_wait_for_flush(self) -> bool:
        """True in SYNC_FLUSH: a put blocks on the group commit, so callers run it off their event loop."""
        return self.group_commit is not None

    def assist_dispatch(self, on: bool) -> None:
        """A caller promises (or stops promising) to call :meth:`dispatch_ready` after its puts."""
        if self.reput is not None:
            self.reput.assisted = on and self.group_commit is None

    def dispatch_ready(self) -> None:
        """Dispatch the handed-over puts that are quick to place, in the caller's thread; the rest is left
        to the dispatch thread, which is woken if this fails."""
        if self.reput is None:
            return
        try:
            self.reput.dispatch_ready()
        except Exception:
            log.exception("dispatching in the caller's thread failed; left to the dispatch thread")
            self.reput.wakeup()

    def dispatched_to(self, offset: int) -> bool:
        """True once the consume queues hold every record before commitlog ``offset`` (or nothing dispatches)."""
        return self.reput is None or self.reput.reput_from_offset >= offset

    def min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        return self.reader.min_offset_in_queue(topic, queue_id)

    def max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        return self.reader.max_offset_in_queue(topic, queue_id)

    # ------------------------------------------------------------ writing
    def _check_writable(self) -> str | None:
        if self.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.root}: store was opened read-only")
        return self.running_flags.why_not_writeable()

    def put(self, message: Message) -> PutMessageResult:
        """Append one message; see RocketMQ's putMessage for the statuses.  A delay message (``deliver_at``,
        ``delay_level``, or a ``DELAY``/``TIMER_DELIVER_MS`` property) is kept in the timer topic until due."""
        if not is_plain(message):
            props = message.properties
            if message.deliver_at is not None or message.delay_level or (
                    props and ("DELAY" in props or "TIMER_DELIVER_MS" in props)):
                return self._put_delayed(message)
        return self._put([message], batch=False)

    def make_puts_durable(self) -> bool:
        """Make every put so far durable (fdatasync of the commitlog); False when it could not be.  For a put
        whose record lets a durable state forget another (the timer's copies, dead letters): under
        asynchronous flush the record would otherwise sit in the page cache while the state is fsynced."""
        self.files.flush_commitlog(0, False)
        return self.files.flush_error is None

    def _put_direct(self, message: Message) -> PutMessageResult:
        """A put that does not route delays: the timer's own records and the copies it delivers."""
        return self._put([message], batch=False)

    def _put_delayed(self, message: Message) -> PutMessageResult:
        if message.topic == TIMER_TOPIC or self.closed or self.read_only:  # a timer record already (the
            return self._put([message], batch=False)                       # broker's), or refused as any put
        now = int(self.files.clock() * 1000)
        try:
            at = deliver_time(message, now)
        except ValueError as e:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
        if at is None or at <= now:
            return self._put([message], batch=False)
        why = illegal_topic(message.topic)
        if why:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=why)
        if self.timer is not None:
            return self.timer.submit(message, at)
        return self._put([timer_record(message, at)], batch=False)  # delivered by the next open with services

    def put_batch(self, messages: list[Message]) -> PutMessageResult:
        """Append messages of one topic/queue as one unit (RocketMQ's putMessages with a MessageExtBatch)."""
        bodies = batch_bodies(messages) if len(messages) >= RUN_MIN else None  # (plain: no problem to find)
        why = None if bodies is not None else batch_problem(messages)
        if why:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=why)
        return self._put(messages, batch=True, bodies=bodies)

    def put_encoded(self, topic: str, queue_id: int, records: list[codec.EncodedRecord],
                    dispatch: tuple[list[int] | None, list[list[int] | None] | None] | None,
                    store_timestamp: int | None = None) -> PutMessageResult:
        """Append records a :class:`MessageEncoder` made elsewhere (a Spark append's tasks) as one unit of one
        topic/queue.  ``dispatch`` is what the dispatcher needs of them: their tagsCodes and index key hashes
        (:func:`index.key_hashes`), each None when all are 0 or absent; None when it must decode them from
        the log (the records' properties say more than the writer parsed, as a replay's do).  This re-checks
        what a record must agree on with the store and the put: its topic and queue (a record whose own
        topic bytes are another topic's would sit in this topic's queue), sizes against the store's
        maxMessageSize, one transaction record alone; a writer with other limits cannot slip a record past."""
        files = self.files
        if files.closed or files.read_only or not files.running_flags.is_writeable():
            return PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=self._check_writable())
        if not records:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error="empty batch")
        try:
            head, magic, _ = self.encoder.topic(topic)
        except codec.RecordError as e:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
        limit = self.config.maxMessageSize
        for r in records:
            if r[4] != queue_id or (r[6] & codec.TRANSACTION_MASK and len(records) > 1):
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error="a batch holds one queue and no transaction messages")
            if r[2] != magic or not r[15].startswith(head):
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error=f"a record of the batch is not of topic {topic!r} (or was encoded "
                                              "with another autoMessageVersionOnTopicLen)")
            if len(r[14]) > limit or r[1] > limit + 65536:
                return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL,
                                        error=f"a {r[1]}-byte record is over maxMessageSize {limit}")
        if dispatch is not None and self.reput is not None:
            dispatch = (dispatch[0], None, None, dispatch[1])
        else:
            dispatch = None
        return self._append(topic, queue_id, records, dispatch, store_timestamp, None, None)

    def _put(self, messages: list[Message], batch: bool, bodies: list[bytes] | None = None) -> PutMessageResult:
        files = self.files  # the put path reads StoreFiles directly: no descriptor hop per attribute
        if files.closed or files.read_only or not files.running_flags.is_writeable():
            why = self._check_writable()
            return PutMessageResult(PutMessageStatus.SERVICE_NOT_AVAILABLE, error=why)
        now_ms = int(files.clock() * 1000)
        encoder = self.encoder
        first = messages[0]
        plain = False
        try:
            if batch:  # one pass over the batch: the topic, queue and hosts are settled once
                records, plain = encoder.encode_batch(messages, now_ms, bodies)
            else:
                records = [encoder.encode(first, now_ms)]
        except codec.PropertiesTooLarge as e:
            return PutMessageResult(PutMessageStatus.PROPERTIES_SIZE_EXCEEDED, error=str(e))
        except (codec.RecordError, ValueError) as e:
            return PutMessageResult(PutMessageStatus.MESSAGE_ILLEGAL, error=str(e))
        if self.reput is None:
            dispatch = None
        elif plain and first.topic != codec.SCHEDULE_TOPIC:
            dispatch = PLAIN_COLUMNS  # nothing for the dispatcher to parse in any of them
        else:
            dispatch = encoder.dispatch_columns(messages)
        return self._append(first.topic, first.queue_id, records, dispatch, first.store_timestamp or None,
                            first.store_host, first)

    def _append(self, topic: str, queue_id: int, records: list[codec.EncodedRecord], dispatch: tuple | None,
                store_timestamp: int | None, store_host: Any, first: Message | None) -> PutMessageResult:
        """The put through the group commit: the records are stamped, written and handed to the dispatcher
        with the other producers' waiting at the same time, then flushed with them (a synchronous flush is
        waited for when ``first`` asks to; None: never)."""
        metrics = self.metrics
        n = metrics.puts
        metrics.puts = n + 1
        timed = not n & _UNSAMPLED
        t0 = perf_counter() if timed else 0.0
        sync = self.commit.sync
        wait = sync and first is not None and _wait_store_msg_ok(first)
        req = GroupCommitRequest(topic, queue_id, records, dispatch, store_timestamp, wait)
        try:
            self.commit.submit(req, self.files.config.syncFlushTimeout / 1000)
        except PutRefused as e:
            return PutMessageResult(PutMessageStatus(e.status), error=str(e))
        written = req.written
        if written is None:
            e = req.error
            if isinstance(e, PutRefused):
                return PutMessageResult(PutMessageStatus(e.status), error=str(e))
            raise e if e is not None else CommitLogWriteError(f"{self.root}: a put was neither written nor refused")
        wrote_offset, wrote_bytes, store_ts, offsets = written
        t2 = perf_counter() if timed else 0.0
        # (positional arguments and the shared default host tuple: a quarter fewer instructions for the result)
        result = PutMessageResult(_PUT_OK, wrote_offset, wrote_bytes,
                                  req.queue_offset if req.assigns else 0, "", store_ts, len(records), None,
                                  DEFAULT_STORE_HOST if store_host is None else host_tuple(store_host),
                                  offsets if len(records) > 1 else None)
        if wait:
            if not req.flushed:
                result.status = PutMessageStatus.FLUSH_DISK_TIMEOUT
                result.error = self.flush_error or \
                    f"not flushed within syncFlushTimeout {self.config.syncFlushTimeout} ms"
        elif sync:
            self.commit.request_flush(wrote_offset + wrote_bytes)
        if timed:
            metrics.record_put(t2 - t0, perf_counter() - t0)
        return result

    # ------------------------------------------------------------ retention
    def delete_expired_commit_log(self) -> list[str]:
        """RocketMQ's deleteExpiredCommitLog: request 20 manual rounds and run the first one now."""
        if self.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.root}: store was opened read-only")
        self.clean_service.request_manual_delete()
        deleted = self.clean_service.clean_commitlog()
        self.clean_service.clean_consume_queues()
        return deleted

    # ------------------------------------------------------------ reading
    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
            tag_filter: set[int] | str | None = None, max_total_bytes: int = 128 * 1024 * 1024,
            read_body: bool = True) -> GetMessageResult:
        """See StoreReader.get."""
        return self.reader.get(topic, queue_id, offset, max_msgs, tag_filter, max_total_bytes, read_body)

    def read_batch(self, topic: str, queue_id: int, offset: int, max_messages: int = 1024,
                   columns: Sequence[str] | None = None) -> Any:
        """A queue's messages as one ``pyarrow.RecordBatch``, decoded column-wise (see StoreReader.read_batch)."""
        return self.reader.read_batch(topic, queue_id, offset, max_messages, columns)

    def local_unit_record(self, phy: int, size: int, read_body: bool, topic: str, topic_bytes: bytes, queue_id: int,
                          queue_offset: int) -> MessageExt | None:
        """See StoreReader.local_unit_record."""
        return self.reader.local_unit_record(phy, size, read_body, topic, topic_bytes, queue_id, queue_offset)

    def look(self, commit_log_offset: int, *, read_body: bool = True) -> MessageExt:
        """The message at a commitlog offset (RocketMQ's lookMessageByOffset)."""
        return self.reader.look(commit_log_offset, read_body=read_body)

    def query(self, topic: str, key: str, max_num: int = 32, begin: int = 0, end: int = 2 ** 63 - 1,
              *, read_body: bool = True) -> QueryMessageResult:
        """Messages by key or UNIQ_KEY through the index (RocketMQ's queryMessage): newest hits, ascending."""
        return self.reader.query(topic, key, max_num, begin, end, read_body=read_body)

    def offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str = LOWER) -> int:
        """Queue offset by store time (RocketMQ's getOffsetInQueueByTime)."""
        return self.reader.offset_by_time(topic, queue_id, timestamp, boundary)

    def messages(self, from_offset: int = -1, *, read_body: bool = True, check_crc: bool | None = None,
                 drop_cache: bool = False, skip_damaged: bool = False
                 ) -> Iterator[tuple[int, int, MessageExt | None, str | None]]:
        """Every trusted record in commitlog order (including ones in no consume queue); see CommitLog.scan."""
        return self.reader.messages(from_offset, read_body=read_body, check_crc=check_crc, drop_cache=drop_cache, skip_damaged=skip_damaged)

    def seek_offset(self, topic: str | None = None, from_time: int | None = None) -> int:
        """Where a scan for a topic and/or from a store time can start, found through the consume queues."""
        return self.reader.seek_offset(topic, from_time)

    def consumer_offsets(self, problems: list[str] | None = None) -> dict[tuple[str, int], int]:
        """Lowest committed offset per queue over all groups (see consumer_offsets.lowest_committed_offsets)."""
        return lowest_committed_offsets(self.paths.config, problems)

    def state(self) -> dict[str, Any]:
        queues = []
        for (topic, qid) in self.queue_keys():
            cq = self._cq_table[(topic, qid)]
            lo, hi = self.min_offset_in_queue(topic, qid), cq.max_offset_in_queue  # lo: from the tier, if tiered
            queues.append({"topic": topic, "queueId": qid, "minOffsetInQueue": lo, "maxOffsetInQueue": hi,
                           "messageTotalInQueue": hi - lo})
        d = {"minPhyOffset": self.min_phy_offset(), "maxPhyOffset": self.max_phy_offset(),
             "abortFilePresent": self.abort_file_present, "checkpoint": self.checkpoint.to_dict(),
             "reservedBytes": reserved_bytes(self.root), "queues": queues}
        if self.tier is not None:
            d["tier"] = self.tier.status()
        if not self.read_only:
            d["writeable"] = self.running_flags.why_not_writeable() is None
            d["notWriteableReason"] = self.running_flags.why_not_writeable()
            d["dispatchBehindBytes"] = self.dispatch_behind_bytes()
            d["indexError"] = self.index_service.build_error
            d["indexMissedFrom"] = self.index_service.missed_from
        return d

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop services, flush everything, delete the abort file when clean, release the lock."""
        if self.closed:
            return
        if self.read_only:
            self.closed = True
            self._close_files()
            return
        if self.dead_letters is not None:
            self.dead_letters.shutdown()  # before the puts stop, like the timer
        if self.timer is not None:
            self.timer.shutdown()  # before the puts stop: a round in progress finishes and writes its state
        if self.reput is not None:
            self.wait_dispatched(timeout=30)
        with self.commitlog.put_lock:
            self.closed = True
        for s in reversed(self._services):
            s.shutdown()
        if not self._services:  # no flusher ran: what the puts wrote is made durable before the store says clean
            self.files.flush_commitlog(0, True)
        clean = self.running_flags.why_not_writeable() is None and self.dispatch_behind_bytes() == 0
        if self.index_service.missed_from is not None:  # the abort file stays: the next open re-indexes them
            log.warning("%s: records from commitlog offset %d on are not indexed yet (%s); the next open recovers "
                        "them", self.root, self.index_service.missed_from, self.index_service.build_error)
            clean = False
        try:
            if not self._services:  # no flusher ran: flush the queues, and let the checkpoint say so, here
                FlushConsumeQueueService(self.files).run_once(force=True)
            self.loader.settle_index_flushes()
            self.index_service.flush()
            self.files.flush_checkpoint()
            self.commitlog.queue.discard_preallocated()
            if clean and os.path.exists(self.paths.abort):
                os.unlink(self.paths.abort)
                if os.path.exists(self.paths.abort_boot):
                    os.unlink(self.paths.abort_boot)
        finally:
            self._close_files()
            self._release_lock()

    def _close_files(self) -> None:
        self.files.close()


def _repair_marker_gate(root: str, config: StoreConfig | None, read_only: bool) -> None:
    """A store under repair is half rewritten: a reader refuses it, naming the marker; a writer first finishes
    the repair (or rolls it back, if it was still rewriting segments), so it sees the old state or the new."""
    from .recovery.repair import describe_marker, finish_interrupted_repair, read_marker
    if read_only:
        marker = read_marker(root)
        if marker is not None:
            raise StoreLoadError(f"{describe_marker(root, marker)}; a writable open (rocketstore recover) finishes "
                                 "or rolls it back; nothing was read")
        return
    finish_interrupted_repair(root, config)


def _wait_store_msg_ok(m: Message) -> bool:
    if is_plain(m):
        return True
    v = m.properties.get("WAIT") if m.properties_string is None else codec.parse_properties(
        m.properties_string).get("WAIT")
    return v is None or v.lower() == "true"


_UNSAMPLED = SAMPLE_EVERY - 1
_PUT_OK = PutMessageStatus.PUT_OK  # (read through the Enum class, a member costs a metaclass __getattr__ round)


def batch_problem(messages: list[Message]) -> str | None:
    """Why ``put_batch`` would refuse these messages as one batch, or None."""
    if not messages:
        return "empty batch"
    first = messages[0]
    for m in messages:
        if (m.topic, m.queue_id) != (first.topic, first.queue_id):
            return "a batch must hold one topic and queue"
        if m.sys_flag & codec.TRANSACTION_MASK:
            return "a batch cannot hold transaction messages"
        if m.deliver_at is not None or m.delay_level:
            return "a batch cannot hold delay messages (put them one by one)"
    return None
