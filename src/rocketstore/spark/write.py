"""Appending a DataFrame to a store: executors encode the records, the driver stamps and writes them under the
store's lock.

``df.write.format("rocketstore").mode("append").save(path)`` runs in two steps:

1. every task normalises its rows and encodes each with the put path's own
   :class:`MessageEncoder` (which refuses what the store would: an illegal
   topic, a body or properties over RocketMQ's limits, a record that does not
   fit a segment), hashes the index keys, and writes the records with what the
   dispatcher needs as an Arrow IPC file under ``<store>/.spark-staging/<job>/``;
   a bad row fails the task, so the job aborts and the store is never touched;
2. the driver's commit opens the store writable, which takes its ``lock`` (one
   writer at a time; it waits up to ``lockTimeoutMs`` for another writer to
   finish), puts the staged records in partition order with
   :meth:`MessageStore.put_encoded` (only the queue offset, commitlog offset
   and store time are left to stamp), waits for dispatch and closes the store
   cleanly.  If a put is refused half-way, the error names how many messages
   were written and their commitlog offsets; the store stays readable and
   consistent (every appended message is a complete record).

Encoding in the tasks matters because the commit is one thread: it used to
spend most of its time serialising properties and hashing keys, work that
spreads over the executors.

``replay=true`` keeps every stored field (store time and host, sysFlag, the
exact properties string) and appends in ``commitLogOffset`` order when that
column is present, as ``rocketstore import`` does: exporting a store and
replaying the export into an empty store of the same geometry reproduces its
commitlog byte for byte.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..format import codec
from ..config import StoreConfig
from ..errors import StoreError, StoreLockedError
from ..format.encoder import MessageEncoder
from ..storage.index import key_hashes_many
from ..format.message import Message
from ..store import MessageStore

log = logging.getLogger(__name__)

STAGING = ".spark-staging"

# Columns a message is built from; the dump columns below that are store-assigned are accepted and ignored.
CONTENT = ["topic", "body", "queueId", "tags", "keys", "properties", "flag", "bornTimestamp", "bornHost",
           "reconsumeTimes"]
REPLAY = ["storeTimestamp", "storeHost", "sysFlag", "preparedTransactionOffset", "propertiesString",
          "commitLogOffset"]
IGNORED = {"queueOffset", "commitLogOffset", "size", "bodyCrc", "msgId", "bodyLength", "magicCode",
           "storeTimestamp", "storeHost", "sysFlag", "preparedTransactionOffset", "propertiesString", "date",
           "hour", "store"}

NORMALIZED_SCHEMA = pa.schema([
    ("topic", pa.string()), ("body", pa.binary()), ("queueId", pa.int32()), ("tags", pa.string()),
    ("keys", pa.string()), ("properties", pa.map_(pa.string(), pa.string())), ("flag", pa.int32()),
    ("bornTimestamp", pa.int64()), ("bornHost", pa.string()), ("reconsumeTimes", pa.int32()),
    ("storeTimestamp", pa.int64()), ("storeHost", pa.string()), ("sysFlag", pa.int32()),
    ("preparedTransactionOffset", pa.int64()), ("propertiesString", pa.string()), ("commitLogOffset", pa.int64()),
])


@dataclass
class WriteOptions:
    replay: bool = False
    lock_timeout_ms: int = 30000
    config: dict[str, str] | None = None  # StoreConfig fields for a new store (or overriding inference)
    config_file: str | None = None
    topic: str | None = None  # every row's topic, for a DataFrame without a topic column

    @classmethod
    def from_options(cls, options: dict[str, str]) -> WriteOptions:
        from dataclasses import fields as dc_fields
        names = {f.name for f in dc_fields(StoreConfig)}
        cfg = {k: v for k, v in options.items() if k in names}
        topic = options.get("topic")
        if topic is not None:
            from ..format.message import illegal_topic
            why = illegal_topic(topic)
            if why:
                raise StoreError(f"rocketstore write: option topic: {why}")
        return cls(replay=str(options.get("replay", "false")).lower() == "true",
                   lock_timeout_ms=int(options.get("lockTimeoutMs", 30000)), config=cfg or None,
                   config_file=options.get("config"), topic=topic)

    def store_config(self) -> StoreConfig | None:
        base = StoreConfig.load(self.config_file) if self.config_file else None
        if self.config:
            options = StoreConfig.from_mapping(self.config, source="write options")
            return base.overlay(options) if base else options  # only the keys given count as explicit
        return base


@dataclass
class WriterSetup:
    """What a writer's tasks need to encode as the store will: the store, the options, its limits."""
    root: str
    opts: WriteOptions
    max_message_size: int
    segment_size: int
    auto_v2: bool


def writer_setup(roots: list[str], config_options: dict[str, str], columns: Iterable[str]) -> WriterSetup:
    """Check a write's target, options and columns (batch writer and stream sink alike) and find the store's
    limits: its broker.conf and, for an existing store, its measured geometry."""
    from .remote import is_tier_uri
    if len(roots) != 1:
        raise StoreError("rocketstore write: save(path) / start(path) takes exactly one store directory")
    if is_tier_uri(roots[0]):
        raise StoreError(f"rocketstore write: {roots[0]} is a tier; a store uploads its own tier "
                         "(write to the store directory)")
    opts = WriteOptions.from_options(config_options)
    check_columns(columns, opts.topic)
    cfg = opts.store_config()
    if os.path.isdir(roots[0]):
        from ..storage.geometry import store_config
        cfg = store_config(roots[0], cfg)
    cfg = cfg or StoreConfig()
    return WriterSetup(roots[0], opts, cfg.maxMessageSize, cfg.mappedFileSizeCommitLog,
                       cfg.autoMessageVersionOnTopicLen)


def check_columns(names: Iterable[str], topic_option: str | None = None) -> None:
    """Refuse a DataFrame without topic/body or with columns the writer does not know (typos show).

    With the ``topic`` option the DataFrame must not have a topic column: which of the two was meant
    cannot be told, and a guess would put messages in the wrong topic."""
    names = list(names)
    if topic_option is not None and "topic" in names:
        raise StoreError(f"rocketstore write: the DataFrame has a topic column and the topic option is set "
                         f"({topic_option!r}); drop the column or the option")
    missing = [c for c in ("topic", "body") if c not in names and not (c == "topic" and topic_option is not None)]
    if missing:
        raise StoreError(f"rocketstore write needs the columns topic (or the topic option) and body; missing: "
                         f"{', '.join(missing)}")
    unknown = [c for c in names if c not in CONTENT and c not in IGNORED]
    if unknown:
        raise StoreError(f"rocketstore write: unknown column(s) {', '.join(unknown)} (known: "
                         f"{', '.join(CONTENT + sorted(IGNORED))})")


def _col(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    i = batch.schema.get_field_index(name)
    return batch.column(i) if i >= 0 else None


def _col_or_nulls(batch: pa.RecordBatch, name: str, typ: pa.DataType) -> pa.Array:
    a = _col(batch, name)
    return pa.nulls(batch.num_rows, typ) if a is None else a.cast(typ)


def _ms(arr: pa.Array | None, n: int) -> pa.Array:
    if arr is None:
        return pa.nulls(n, pa.int64())
    if pa.types.is_timestamp(arr.type):
        us = arr.cast(pa.timestamp("us", tz=arr.type.tz)).cast(pa.int64())
        return pc.divide(us, 1000)  # exact for the millisecond times a store holds
    return arr.cast(pa.int64())


def normalize(batch: pa.RecordBatch, replay: bool, topic: str | None = None) -> pa.RecordBatch:
    """One input batch in NORMALIZED_SCHEMA (types converted, absent columns null; ``topic``: every row's)."""
    n = batch.num_rows
    cols: dict[str, pa.Array] = {}
    cols["topic"] = pa.repeat(pa.scalar(topic, pa.string()), n) if topic is not None else \
        _col(batch, "topic").cast(pa.string())
    body = _col(batch, "body")
    cols["body"] = body.cast(pa.binary()) if not pa.types.is_binary(body.type) else body
    for name, typ in (("queueId", pa.int32()), ("flag", pa.int32()), ("reconsumeTimes", pa.int32())):
        a = _col(batch, name)
        cols[name] = pa.nulls(n, typ) if a is None else a.cast(typ)
    cols["tags"] = _col_or_nulls(batch, "tags", pa.string())
    keys = _col(batch, "keys")
    if keys is None:
        keys = pa.nulls(n, pa.string())
    elif pa.types.is_list(keys.type) or pa.types.is_large_list(keys.type):
        keys = pc.binary_join(keys.cast(pa.list_(pa.string())), " ")
    cols["keys"] = keys.cast(pa.string())
    props = _col(batch, "properties")
    cols["properties"] = pa.nulls(n, NORMALIZED_SCHEMA.field("properties").type) if props is None else props.cast(
        NORMALIZED_SCHEMA.field("properties").type)
    cols["bornTimestamp"] = _ms(_col(batch, "bornTimestamp"), n)
    cols["bornHost"] = _col_or_nulls(batch, "bornHost", pa.string())
    for name in REPLAY:
        typ = NORMALIZED_SCHEMA.field(name).type
        a = _col(batch, name) if replay else None
        if name == "storeTimestamp":
            cols[name] = _ms(a, n)
        else:
            cols[name] = pa.nulls(n, typ) if a is None else a.cast(typ)
    return pa.RecordBatch.from_arrays([cols[f.name] for f in NORMALIZED_SCHEMA], schema=NORMALIZED_SCHEMA)


# ---------------------------------------------------------------- executor side

@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while staging or committing: both build hundreds of thousands of
    short-lived tuples and messages (none in a cycle), and the collections they set off cost a quarter of
    the commit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class StagedPart:
    path: str
    rows: int
    partition: int
    attempt: int


# What a task stages per row: the record as MessageEncoder made it (all but the fields stamped under the
# put lock), what the dispatcher needs of it, and the replay's store time and order.
ENCODED_SCHEMA = pa.schema([
    ("topic", pa.string()), ("queueId", pa.int32()), ("total", pa.int32()), ("magic", pa.uint32()),
    ("bodyCrc", pa.int32()), ("flag", pa.int32()), ("sysFlag", pa.int32()), ("bornTimestamp", pa.int64()),
    ("bornAddr", pa.binary()), ("bornPort", pa.int32()), ("storeAddr", pa.binary()), ("storePort", pa.int32()),
    ("reconsumeTimes", pa.int32()), ("preparedTransactionOffset", pa.int64()), ("body", pa.binary()),
    ("tail", pa.binary()),
    ("tagsCode", pa.int64()), ("fromLog", pa.bool_()), ("storeTimestamp", pa.int64()),
    ("commitLogOffset", pa.int64()), ("indexHashes", pa.list_(pa.int32())),
    ("rowId", pa.string()),  # the stream sink's row identity (spark/sink.py); null in a batch write
])
# The staged columns a task computes; the others are the normalised input's own (nulls as the encoder reads them).
_COMPUTED = ["total", "magic", "bodyCrc", "sysFlag", "bornTimestamp", "bornAddr", "bornPort", "storeAddr",
             "storePort", "tail", "tagsCode", "fromLog", "indexHashes"]
# Rows per staged batch: the driver puts the rows of each queue in a batch together.
STAGED_BATCH_ROWS = 65536


def _properties(arr: pa.Array) -> list[dict[str, str]]:
    """A map column as dicts, from its flat keys and values (``to_pylist`` builds a tuple per entry)."""
    offsets = arr.offsets.to_pylist()  # into the whole child arrays, which a slice of a map column shares
    base = offsets[0]
    keys = arr.keys.slice(base, offsets[-1] - base).to_pylist()
    items = arr.items.slice(base, offsets[-1] - base).to_pylist()
    valid = arr.is_valid().to_pylist() if arr.null_count else None
    out = []
    for i in range(len(arr)):
        lo, hi = offsets[i] - base, offsets[i + 1] - base
        out.append(dict(zip(keys[lo:hi], items[lo:hi])) if hi > lo and (valid is None or valid[i]) else {})
    return out


class RowEncoder:
    """Encodes a task's rows with the put path's own :class:`MessageEncoder`, so that a row the store would
    refuse fails its task (the job aborts and the store is never touched), and the driver only stamps."""

    def __init__(self, replay: bool, max_message_size: int, segment_size: int | None, auto_v2: bool = True) -> None:
        self.replay = replay
        self.encoder = MessageEncoder(max_message_size, auto_v2)
        self.segment_size = segment_size
        self.now_ms = int(time.time() * 1000)  # the born time of rows without one

    def messages(self, nb: pa.RecordBatch) -> Iterator[Message]:
        """A normalised batch's rows as messages, built column by column (a dict per row costs as much again)."""
        cols = [_properties(nb.column(name)) if name == "properties" else nb.column(name).to_pylist()
                for name in CONTENT]
        if not self.replay:
            for topic, body, qid, tags, keys, props, flag, born_ts, born_host, reconsume in zip(*cols):
                yield Message(topic, body, qid or 0, tags, keys, props, flag or 0, born_timestamp=born_ts,
                              born_host=born_host, reconsume_times=reconsume or 0)
            return
        for (topic, body, qid, tags, keys, props, flag, born_ts, born_host, reconsume, store_ts, store_host, sys_flag,
             prepared, props_string) in zip(*cols, *(nb.column(name).to_pylist() for name in REPLAY[:-1])):
            yield Message(topic, body, qid or 0, tags, keys, props, flag or 0, sys_flag=sys_flag or 0,
                          born_timestamp=born_ts, born_host=born_host, store_host=store_host,
                          reconsume_times=reconsume or 0, prepared_transaction_offset=prepared or 0,
                          properties_string=props_string, store_timestamp=store_ts)

    def encode(self, nb: pa.RecordBatch, where: str, first_row: int) -> pa.RecordBatch:
        """A normalised batch as staged rows (ENCODED_SCHEMA); StoreError names the row (``where`` row
        ``first_row + i``) the store would refuse."""
        encode, dispatch_info = self.encoder.encode, self.encoder.dispatch_info
        now_ms, segment = self.now_ms, self.segment_size
        computed: list[tuple] = []
        keyed: list[int] = []  # rows with keys to hash, and their (topic, UNIQ_KEY, KEYS)
        keys_of: list[tuple[str, str | None, str | None]] = []
        for i, m in enumerate(self.messages(nb)):
            try:
                if m.body is None:
                    raise codec.RecordError("body is null (RocketMQ messages need a body)")
                rec = encode(m, now_ms)
                if segment is not None and rec[1] + codec.BLANK_RECORD_SIZE > segment:
                    raise codec.MessageTooLarge(f"a {rec[1]}-byte record does not fit the store's {segment}-byte "
                                                "commitlog segments (mappedFileSizeCommitLog)")
            except (codec.RecordError, ValueError) as e:
                raise StoreError(f"{where} row {first_row + i}: {e}") from None
            info = dispatch_info(m)  # None: the dispatcher parses the stored properties itself (fromLog)
            if info is not None and (info[1] or info[2]):
                keyed.append(i)
                keys_of.append((m.topic, info[2], info[1]))
            # (header, total, magic, crc, qid, flag, sysFlag, bornTs, bornAddr, bornPort, storeAddr, storePort, ...)
            computed.append((rec[1], rec[2], rec[3], rec[6], rec[7], rec[8], rec[9], rec[10], rec[11], rec[15],
                             0 if info is None else info[0], info is None))
        n = nb.num_rows
        hashes: list[list[int] | None] = [None] * n
        for i, h in zip(keyed, key_hashes_many(keys_of)):
            hashes[i] = h
        cols = dict(zip(_COMPUTED, [*zip(*computed), hashes]))
        return pa.RecordBatch.from_arrays(
            [pa.array(cols[f.name], f.type) if f.name in cols else
             pc.fill_null(nb.column(f.name), 0) if f.name in ("queueId", "flag", "reconsumeTimes",
                                                               "preparedTransactionOffset") else
             pa.nulls(n, f.type) if f.name == "rowId" else
             nb.column(f.name) for f in ENCODED_SCHEMA], schema=ENCODED_SCHEMA)


# The stream sink's marking of a normalised batch: the batch to encode and each row's identity (spark/sink.py).
RowMarker = Callable[[pa.RecordBatch], tuple[pa.RecordBatch, list[str]]]


def stage(batches: Iterator[pa.RecordBatch], staging_dir: str, partition: int, attempt: int,
          opts: WriteOptions, max_message_size: int, segment_size: int | None = None,
          auto_v2: bool = True, mark: RowMarker | None = None) -> StagedPart:
    """Encode and stage one task's rows (ENCODED_SCHEMA, an Arrow IPC file).

    A replay keeps every row and sorts them by commitLogOffset when that column is present.  ``mark`` (the
    stream sink) changes each normalised batch before it is encoded and gives the rows' ids (column rowId).
    """
    os.makedirs(staging_dir, exist_ok=True)
    path = os.path.join(staging_dir, f"part-{partition:05d}-{attempt}-{uuid.uuid4().hex[:8]}.arrow")
    tmp = path + ".tmp"
    enc = RowEncoder(opts.replay, max_message_size, segment_size, auto_v2)
    rows = 0
    pending: list[pa.RecordBatch] = []
    with gc_paused(), pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, ENCODED_SCHEMA) as writer:
        def flush() -> None:
            table = pa.Table.from_batches(pending, ENCODED_SCHEMA)
            if opts.replay and table.column("commitLogOffset").null_count < table.num_rows:
                table = table.sort_by([("commitLogOffset", "ascending")])  # stable; rows without go last
            for b in table.combine_chunks().to_batches(max_chunksize=STAGED_BATCH_ROWS):
                writer.write_batch(b)
            pending.clear()

        staged = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            check_columns(batch.schema.names, opts.topic)
            nb = normalize(batch, opts.replay, opts.topic)
            ids = None
            if mark is not None:
                nb, ids = mark(nb)
            encoded = enc.encode(nb, f"partition {partition}", rows)
            if ids is not None:
                encoded = encoded.set_column(ENCODED_SCHEMA.get_field_index("rowId"), ENCODED_SCHEMA.field("rowId"),
                                             pa.array(ids, pa.string()))
            pending.append(encoded)
            rows += batch.num_rows
            staged += batch.num_rows
            if not opts.replay and staged >= STAGED_BATCH_ROWS:
                flush()
                staged = 0
        if pending:
            flush()
    os.replace(tmp, path)
    return StagedPart(path, rows, partition, attempt)


# ---------------------------------------------------------------- driver side

def open_for_append(root: str, opts: WriteOptions) -> MessageStore:
    """The store, writable; waits up to lockTimeoutMs while another writer holds its lock."""
    deadline = time.monotonic() + opts.lock_timeout_ms / 1000
    cfg = opts.store_config()
    while True:
        try:
            return MessageStore.open(root, cfg)
        except StoreLockedError:
            if time.monotonic() >= deadline:
                raise StoreLockedError(f"{root}: another writer holds the store's lock "
                                       f"(waited {opts.lock_timeout_ms} ms, option lockTimeoutMs)") from None
            time.sleep(0.1)


# A staged row on the driver: (topic, queueId, EncodedRecord, storeTimestamp, tagsCode, indexHashes, fromLog, rowId).
StagedRow = tuple


def _part_rows(part: StagedPart, grouped: bool) -> Iterator[StagedRow]:
    """A part's staged rows; ``grouped`` (a plain append): the rows of each staged batch queue by queue, each
    queue's in their order (only how queues interleave in the commitlog changes, which no consumer sees), so
    that puts are long runs of one queue."""
    header = codec.HEADER_BY_HOST_FLAGS
    with pa.memory_map(part.path) as src:
        reader = pa.ipc.open_file(src)
        for i in range(reader.num_record_batches):
            b = reader.get_batch(i)
            cols = [b.column(name).to_pylist() for name in ENCODED_SCHEMA.names if name != "commitLogOffset"]
            rows = [(topic, qid, (header[sf & 0x30], total, magic, crc, qid, flag, sf, born_ts, born_addr, born_port,
                                  store_addr, store_port, reconsume, prepared, body, tail), store_ts, code, hashes,
                     from_log, row_id)
                    for (topic, qid, total, magic, crc, flag, sf, born_ts, born_addr, born_port, store_addr,
                         store_port, reconsume, prepared, body, tail, code, from_log, store_ts, hashes, row_id)
                    in zip(*cols)]
            if grouped:
                queues: dict[tuple[str, int], list[StagedRow]] = {}
                for r in rows:
                    run = queues.get(r[:2])
                    if run is None:
                        queues[r[:2]] = [r]
                    else:
                        run.append(r)
                for run in queues.values():
                    yield from run
            else:
                yield from rows


def _staged_rows(parts: list[StagedPart], replay: bool) -> Iterator[StagedRow]:
    """The staged rows in partition order; a replay's in commitLogOffset order across parts (each part is
    sorted; rows without one go last)."""
    if not replay:
        for p in parts:
            yield from _part_rows(p, True)
        return

    def keyed(p: StagedPart) -> Iterator[tuple[int, int, int, StagedRow]]:
        with pa.memory_map(p.path) as src:
            reader = pa.ipc.open_file(src)
            offsets = [o for i in range(reader.num_record_batches)
                       for o in reader.get_batch(i).column("commitLogOffset").to_pylist()]
        for j, (off, r) in enumerate(zip(offsets, _part_rows(p, False))):
            yield (off if off is not None else 2 ** 63, p.partition, j, r)
    for *_k, row in heapq.merge(*(keyed(p) for p in parts)):
        yield row


# A put holds at most this many records and bytes (a batch must fit one commitlog segment).
BATCH_MESSAGES = 512
BATCH_BYTES = 1 << 20


def batches(rows: Iterable[StagedRow], segment_size: int) -> Iterator[list[StagedRow]]:
    """Consecutive staged rows of one topic, queue and store time (None but in a replay) as put units;
    transaction records go alone (a batch cannot hold them)."""
    limit = min(BATCH_BYTES, segment_size // 4)
    run: list[StagedRow] = []
    key = None
    size = 0
    for r in rows:
        rec = r[2]
        alone = rec[6] & codec.TRANSACTION_MASK
        if run and (alone or size + rec[1] > limit or len(run) >= BATCH_MESSAGES or
                    (r[0], r[1], r[3]) != key):
            yield run
            run, size = [], 0
        if alone:
            yield [r]
            continue
        if not run:
            key = (r[0], r[1], r[3])
        run.append(r)
        size += rec[1]
    if run:
        yield run


def commit(root: str, parts: list[StagedPart], opts: WriteOptions) -> dict[str, Any]:
    """Append the staged rows in put units; return a summary.

    Raises StoreError naming what was written if a put fails (a refused put writes nothing of itself).
    """
    store = open_for_append(root, opts)
    try:
        return append(store, parts, opts)
    finally:
        store.close()


def append(store: MessageStore, parts: list[StagedPart], opts: WriteOptions,
           skip: Callable[[StagedRow], bool] | None = None) -> dict[str, Any]:
    """Append the staged rows to a store opened for writing, in put units, and wait for their dispatch;
    ``skip`` leaves out the rows it is true for (the stream sink's rows an earlier attempt wrote)."""
    root = store.root
    parts = sorted(parts, key=lambda p: p.partition)
    rows: Iterable[StagedRow] = _staged_rows(parts, opts.replay)
    if skip is not None:
        rows = (r for r in rows if not skip(r))
    total = sum(p.rows for p in parts)
    written = 0
    first = last = None
    t0 = time.monotonic()
    with gc_paused():
        for run in batches(rows, store.config.mappedFileSizeCommitLog):
            topic, qid, _rec, store_ts, *_ = run[0]
            codes = [r[4] for r in run]
            hashes = [r[5] for r in run]
            dispatch = None if any(r[6] for r in run) else (
                codes if any(codes) else None, None if hashes.count(None) == len(hashes) else hashes)
            res = store.put_encoded(topic, qid, [r[2] for r in run], dispatch, store_ts)
            if not res.ok:
                where = (f"wrote {written} of {total} messages" +
                         (f" (commitlog offsets {first}..{last})" if written else "") +
                         f"; message {written + 1}" + (f"..{written + len(run)}" if len(run) > 1 else "") +
                         f" (topic {topic!r}, queue {qid}) was refused: {res.status.value}: {res.error}")
                log.error("%s: %s", root, where)
                raise StoreError(f"{root}: {where}")
            if first is None or res.commit_log_offset < first:
                first = res.commit_log_offset
            end = res.offsets[-1]
            last = end if last is None else max(last, end)
            written += len(run)
    store.wait_dispatched()
    summary = {"store": root, "messages": written, "firstOffset": first, "lastOffset": last,
               "seconds": round(time.monotonic() - t0, 3)}
    log.info("appended %d messages to %s (offsets %s..%s) in %.2f s", written, root, first, last,
             summary["seconds"])
    return summary


def cleanup(staging_dir: str) -> None:
    shutil.rmtree(staging_dir, ignore_errors=True)
    parent = os.path.dirname(staging_dir)
    try:
        os.rmdir(parent)  # only when no other job is staging
    except OSError:
        pass
