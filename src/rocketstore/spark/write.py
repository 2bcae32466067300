"""Appending a DataFrame to a store: executors stage validated rows, the driver appends them under the store's lock.

``df.write.format("rocketstore").mode("append").save(path)`` runs in two steps:

1. every task normalises and validates its rows (topic legal and short enough,
   body and properties within RocketMQ's limits) and writes them as an Arrow
   IPC file under ``<store>/.spark-staging/<job>/``; a bad row fails the task,
   so the job aborts and the store is never touched;
2. the driver's commit opens the store writable, which takes its ``lock`` (one
   writer at a time; it waits up to ``lockTimeoutMs`` for another writer to
   finish), appends the staged rows in partition order, waits for dispatch and
   closes the store cleanly.  If a put is refused half-way, the error names how
   many messages were written and their commitlog offsets; the store stays
   readable and consistent (every appended message is a complete record).

``replay=true`` keeps every stored field (store time and host, sysFlag, the
exact properties string) and appends in ``commitLogOffset`` order when that
column is present, as ``rocketstore import`` does: exporting a store and
replaying the export into an empty store of the same geometry reproduces its
commitlog byte for byte.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .. import codec
from ..config import StoreConfig
from ..errors import StoreError, StoreLockedError
from ..message import Message
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

STAGED_SCHEMA = pa.schema([
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

    @classmethod
    def from_options(cls, options: dict[str, str]) -> WriteOptions:
        from dataclasses import fields as dc_fields
        names = {f.name for f in dc_fields(StoreConfig)}
        cfg = {k: v for k, v in options.items() if k in names}
        return cls(replay=str(options.get("replay", "false")).lower() == "true",
                   lock_timeout_ms=int(options.get("lockTimeoutMs", 30000)), config=cfg or None,
                   config_file=options.get("config"))

    def store_config(self) -> StoreConfig | None:
        base = StoreConfig.load(self.config_file) if self.config_file else None
        if self.config:
            options = StoreConfig.from_mapping(self.config, source="write options")
            return base.overlay(options) if base else options  # only the keys given count as explicit
        return base


def check_columns(names: Iterable[str]) -> None:
    """Refuse a DataFrame without topic/body or with columns the writer does not know (typos show)."""
    names = list(names)
    missing = [c for c in ("topic", "body") if c not in names]
    if missing:
        raise StoreError(f"rocketstore write needs the columns topic and body; missing: {', '.join(missing)}")
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


def normalize(batch: pa.RecordBatch, replay: bool) -> pa.RecordBatch:
    """One input batch in the staged schema (types converted, absent columns null)."""
    n = batch.num_rows
    cols: dict[str, pa.Array] = {}
    topic = _col(batch, "topic")
    cols["topic"] = topic.cast(pa.string())
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
    cols["properties"] = pa.nulls(n, STAGED_SCHEMA.field("properties").type) if props is None else props.cast(
        STAGED_SCHEMA.field("properties").type)
    cols["bornTimestamp"] = _ms(_col(batch, "bornTimestamp"), n)
    cols["bornHost"] = _col_or_nulls(batch, "bornHost", pa.string())
    for name in REPLAY:
        typ = STAGED_SCHEMA.field(name).type
        a = _col(batch, name) if replay else None
        if name == "storeTimestamp":
            cols[name] = _ms(a, n)
        else:
            cols[name] = pa.nulls(n, typ) if a is None else a.cast(typ)
    return pa.RecordBatch.from_arrays([cols[f.name] for f in STAGED_SCHEMA], schema=STAGED_SCHEMA)


def to_message(row: dict[str, Any], replay: bool) -> Message:
    props = dict(row["properties"] or [])
    keys = row["keys"]
    m = Message(topic=row["topic"], body=row["body"], queue_id=row["queueId"] or 0, tags=row["tags"],
                keys=keys, properties=props, flag=row["flag"] or 0, born_timestamp=row["bornTimestamp"],
                born_host=row["bornHost"], reconsume_times=row["reconsumeTimes"] or 0)
    if replay:
        m.store_timestamp = row["storeTimestamp"]
        m.store_host = row["storeHost"]
        m.sys_flag = row["sysFlag"] or 0
        m.prepared_transaction_offset = row["preparedTransactionOffset"] or 0
        m.properties_string = row["propertiesString"]
    return m


def _topic_facts(topic: Any, where: str) -> tuple[int, bool]:
    """A topic's encoded length and whether it takes the V2 magic; refuses what the store refuses."""
    from ..store import illegal_topic
    err = illegal_topic(topic)
    if err:
        raise StoreError(f"{where}: {err}")
    try:
        codec.topic_tail(topic)
    except (codec.RecordError, ValueError) as e:
        raise StoreError(f"{where}: {e}") from None
    return len(topic.encode("utf-8")), codec.java_len(topic) > 127


def validate(row: dict[str, Any], where: str, max_message_size: int, replay: bool,
             segment_size: int | None = None, topics: dict[str, tuple[int, bool]] | None = None) -> None:
    """The checks the store makes before a put, so that a bad row fails its task rather than the commit.

    ``topics`` memoises the per-topic checks across the rows of a task (a task sees few topics).
    """
    topic = row["topic"]
    facts = topics.get(topic) if topics is not None and isinstance(topic, str) else None
    if facts is None:
        facts = _topic_facts(topic, where)
        if topics is not None:
            topics[topic] = facts
    if row["body"] is None:
        raise StoreError(f"{where}: body is null (RocketMQ messages need a body)")
    try:
        m = to_message(row, replay)
        props = (m.properties_string if m.properties_string is not None else m.build_properties()).encode("utf-8")
        if len(props) > codec.MAX_PROPERTIES_BYTES:
            raise codec.PropertiesTooLarge(f"properties are {len(props)} bytes, more than {codec.MAX_PROPERTIES_BYTES}")
        if len(row["body"]) > max_message_size:
            raise codec.MessageTooLarge(f"body is {len(row['body'])} bytes, more than maxMessageSize "
                                        f"{max_message_size}")
        if not 0 <= m.queue_id < 2 ** 31:
            raise codec.RecordError(f"queue id {m.queue_id} out of range")
        hosts = [codec.parse_host(h) if isinstance(h, str) else None for h in (m.born_host, m.store_host)]
        if segment_size is not None:
            sys_flag = codec.with_host_flags(m.sys_flag, hosts[0][0] if hosts[0] else b"\0" * 4,
                                             hosts[1][0] if hosts[1] else b"\0" * 4)
            size = codec.record_length(len(row["body"]), facts[0], len(props), sys_flag, facts[1])
            if size + codec.BLANK_RECORD_SIZE > segment_size:
                raise codec.MessageTooLarge(f"a {size}-byte record does not fit the store's {segment_size}-byte "
                                            "commitlog segments (mappedFileSizeCommitLog)")
    except (codec.RecordError, ValueError) as e:
        raise StoreError(f"{where}: {e}") from None


# ---------------------------------------------------------------- executor side

@dataclass
class StagedPart:
    path: str
    rows: int
    partition: int
    attempt: int


def stage(batches: Iterator[pa.RecordBatch], staging_dir: str, partition: int, attempt: int,
          opts: WriteOptions, max_message_size: int, segment_size: int | None = None) -> StagedPart:
    """Validate and stage one task's rows (sorted by commitLogOffset when replaying)."""
    os.makedirs(staging_dir, exist_ok=True)
    path = os.path.join(staging_dir, f"part-{partition:05d}-{attempt}-{uuid.uuid4().hex[:8]}.arrow")
    tmp = path + ".tmp"
    rows = 0
    staged: list[pa.RecordBatch] = []
    topics: dict[str, tuple[int, bool]] = {}
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, STAGED_SCHEMA) as writer:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            check_columns(batch.schema.names)
            nb = normalize(batch, opts.replay)
            for i, row in enumerate(nb.to_pylist()):
                validate(row, f"partition {partition} row {rows + i}", max_message_size, opts.replay, segment_size,
                         topics)
            rows += nb.num_rows
            if opts.replay:
                staged.append(nb)
            else:
                writer.write_batch(nb)
        if staged:
            table = pa.Table.from_batches(staged, STAGED_SCHEMA)
            if table.column("commitLogOffset").null_count < table.num_rows:
                table = table.sort_by([("commitLogOffset", "ascending")])
            for b in table.to_batches(max_chunksize=8192):
                writer.write_batch(b)
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


def _rows(parts: list[StagedPart]) -> Iterator[dict[str, Any]]:
    for p in parts:
        with pa.memory_map(p.path) as src:
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield from reader.get_batch(i).to_pylist()


def _messages(parts: list[StagedPart]) -> Iterator[Message]:
    """The staged rows of a plain append as messages, built column by column: a row dict per message
    (``to_pylist``) costs about as much again as the put itself."""
    for p in parts:
        with pa.memory_map(p.path) as src:
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                cols = [b.column(name).to_pylist() for name in CONTENT]
                for topic, body, qid, tags, keys, props, flag, born_ts, born_host, reconsume in zip(*cols):
                    yield Message(topic=topic, body=body, queue_id=qid or 0, tags=tags, keys=keys,
                                  properties=dict(props) if props else {}, flag=flag or 0, born_timestamp=born_ts,
                                  born_host=born_host, reconsume_times=reconsume or 0)


def _merged_rows(parts: list[StagedPart]) -> Iterator[dict[str, Any]]:
    """Staged rows in commitLogOffset order across parts (each part is sorted); rows without one go last."""
    def keyed(p: StagedPart) -> Iterator[tuple[int, int, int, dict[str, Any]]]:
        for j, r in enumerate(_rows([p])):
            off = r["commitLogOffset"]
            yield (off if off is not None else 2 ** 63, p.partition, j, r)
    for *_k, row in heapq.merge(*(keyed(p) for p in parts)):
        yield row


# A put_batch holds at most this many messages and body bytes (a batch must fit one commitlog segment).
BATCH_MESSAGES = 512
BATCH_BYTES = 1 << 20


def batches(messages: Iterable[Message], replay: bool, segment_size: int) -> Iterator[list[Message]]:
    """The staged messages as put_batch units of one topic and queue.

    A plain append groups rows by queue within a window of rows (each queue keeps the rows' order;
    only the interleaving of queues in the commitlog changes, which no consumer sees).  A replay
    keeps the commitlog order exactly, so it batches only consecutive rows of one queue with the
    same store time, and puts transaction records alone (a batch cannot hold them).
    """
    limit = min(BATCH_BYTES, segment_size // 4)
    if replay:
        run: list[Message] = []
        size = 0
        for m in messages:
            alone = m.sys_flag & codec.TRANSACTION_MASK
            if run and (alone or size + len(m.body) > limit or len(run) >= BATCH_MESSAGES or
                        (m.topic, m.queue_id, m.store_timestamp) != (run[0].topic, run[0].queue_id,
                                                                      run[0].store_timestamp)):
                yield run
                run, size = [], 0
            if alone:
                yield [m]
                continue
            run.append(m)
            size += len(m.body)
        if run:
            yield run
        return
    queues: dict[tuple[str, int], tuple[list[Message], int]] = {}
    pending = 0
    for m in messages:
        key = (m.topic, m.queue_id)
        run, size = queues.get(key, ([], 0))
        if run and (size + len(m.body) > limit or len(run) >= BATCH_MESSAGES):
            yield run
            pending -= len(run)
            run, size = [], 0
        run.append(m)
        queues[key] = (run, size + len(m.body))
        pending += 1
        if pending >= 8 * BATCH_MESSAGES:  # bound the window: flush every queue's run
            for run, _ in queues.values():
                if run:
                    yield run
            queues.clear()
            pending = 0
    for run, _ in queues.values():
        if run:
            yield run


def commit(root: str, parts: list[StagedPart], opts: WriteOptions) -> dict[str, Any]:
    """Append the staged rows in put_batch units; return a summary.

    Raises StoreError naming what was written if a put fails (a refused batch writes nothing of itself).
    """
    parts = sorted(parts, key=lambda p: p.partition)
    total = sum(p.rows for p in parts)
    written = 0
    first = last = None
    t0 = time.monotonic()
    store = open_for_append(root, opts)
    try:
        messages = (to_message(r, True) for r in _merged_rows(parts)) if opts.replay else _messages(parts)
        for batch in batches(messages, opts.replay, store.config.mappedFileSizeCommitLog):
            r = store.put(batch[0]) if len(batch) == 1 else store.put_batch(batch)
            if not r.ok:
                m = batch[0]
                where = (f"wrote {written} of {total} messages" +
                         (f" (commitlog offsets {first}..{last})" if written else "") +
                         f"; message {written + 1}" + (f"..{written + len(batch)}" if len(batch) > 1 else "") +
                         f" (topic {m.topic!r}, queue {m.queue_id}) was refused: {r.status.value}: {r.error}")
                log.error("%s: %s", root, where)
                raise StoreError(f"{root}: {where}")
            if first is None or r.commit_log_offset < first:
                first = r.commit_log_offset
            end = r.offsets[-1]
            last = end if last is None else max(last, end)
            written += len(batch)
        store.wait_dispatched()
    finally:
        store.close()
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
