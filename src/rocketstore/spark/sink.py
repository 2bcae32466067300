"""The streaming sink: ``df.writeStream.format("rocketstore").option("checkpointLocation", ...).start(store)``.

Each micro-batch is written as the batch writer writes (:mod:`rocketstore.spark.write`): the tasks check and
encode their rows and stage them under ``<store>/.spark-staging/<query id>-<batch id>/``; the driver's
``commit(messages, batchId)`` appends them under the store's lock.  Nothing reaches the store before the
driver's commit, so a task that fails or is retried leaves nothing behind.

Exactly once.  Spark re-runs a micro-batch whose commit it has not recorded in the checkpoint: after a driver
crash anywhere between the append and the checkpoint's commit log, the same batch (the same rows, from a
replayable source) comes back to ``commit``.  Two things make that retry append nothing twice:

* every message carries the property ``SPARK_SINK_ROW`` = ``<query id>:<batch id>:<row digest>`` (the query
  id is Spark's, kept in the checkpoint; the digest a BLAKE2b-128 of the row's content, so it does not depend
  on how the batch is partitioned or ordered on the retry);
* a journal per query, ``<store>/spark-sinks/<query id>.json`` (atomic writes), says which batch was last
  appended whole (``committed``) and, while one is being appended, from which commitlog offset
  (``pending``).  It lives in the store, beside the data it describes.

The commit: under the store's lock, a batch at or below ``committed`` is skipped; if a ``pending`` append of
it was cut short, the records from its offset on are scanned, and the rows of this batch found there
(counted by digest, as a multiset: equal rows are equal) are left out; ``pending`` is written durably before
the first put; after the append is flushed (the store closed) ``committed`` is written.  A crash before
``pending`` leaves nothing of the batch; between ``pending`` and ``committed``, the retry finds what was
written; after ``committed``, the retry is skipped.  A journal cut between the two renames of its atomic write is read
from its ``.bak`` (the state before that write); a query past its first batch that finds no journal at all
(lost) counts this batch's rows over the whole local log, and so does a first batch whose query's checkpoint
holds the sink's start mark (:class:`SinkStart`).  A damaged record among the rows counted is refused
(the count would stop there).  As with every Spark sink, exactly once needs a source that
replays a batch with the same rows (files, Kafka-like sources, ``rocketstore`` itself).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from ..errors import StoreError
from ..storage.jsonfile import write_json_atomic
from ..store import MessageStore
from . import write

log = logging.getLogger(__name__)

SINK_PROPERTY = "SPARK_SINK_ROW"
JOURNALS = "spark-sinks"
# Spark's local properties of a micro-batch's tasks (StreamExecution.QUERY_ID_KEY, MicroBatchExecution.BATCH_ID_KEY).
QUERY_ID_KEY = "sql.streaming.queryId"
BATCH_ID_KEY = "streaming.sql.batchId"

_PROPS = write.NORMALIZED_SCHEMA.field("properties").type
_HASHED = write.CONTENT  # what a row is: the columns a message is built from


def row_digest(values: tuple) -> str:
    return hashlib.blake2b(repr(values).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class RowMarker:
    """Puts ``SPARK_SINK_ROW`` on each row of a normalised batch; the rows' ids are the property values."""

    def __init__(self, query_id: str, batch_id: int) -> None:
        self.prefix = f"{query_id}:{batch_id}:"

    def __call__(self, nb: pa.RecordBatch) -> tuple[pa.RecordBatch, list[str]]:
        cols = [nb.column(name).to_pylist() for name in _HASHED]
        p = _HASHED.index("properties")
        ids, props = [], []
        for values in zip(*cols):
            own = [kv for kv in (values[p] or []) if kv[0] != SINK_PROPERTY]
            row_id = self.prefix + row_digest(values[:p] + (sorted(own),) + values[p + 1:])
            ids.append(row_id)
            props.append(own + [(SINK_PROPERTY, row_id)])
        i = nb.schema.get_field_index("properties")
        return nb.set_column(i, nb.schema.field(i), pa.array(props, _PROPS)), ids


# ---------------------------------------------------------------- the journal

class SinkJournal:
    """``<store>/spark-sinks/<query id>.json``: the last batch appended whole, and a batch being appended."""

    def __init__(self, root: str, query_id: str) -> None:
        if not query_id or not all(c.isalnum() or c == "-" for c in query_id):
            raise StoreError(f"rocketstore sink: query id {query_id!r} is not a Spark query id")
        self.path = os.path.join(root, JOURNALS, f"{query_id}.json")
        self.query_id = query_id

    def read(self) -> dict[str, Any]:
        """The journal's state; a journal that is missing while its ``.bak`` is there is the ``.bak``'s.

        ``write_json_atomic`` moves the current file to ``.bak`` before it renames the new one into place: a
        kill or power cut between the two leaves only ``.bak``, the state before that write, which is right
        for the retry (before a ``committed``: the pending append, whose rows the retry finds and leaves out;
        before a ``pending``: the last committed batch, nothing of the next one written yet).  Read as "no
        journal", it would append the whole batch again."""
        data = self._load(self.path)
        if data is None:
            data = self._load(f"{self.path}.bak")
            if data is None:
                return {"queryId": self.query_id, "committed": None, "pending": None}
            log.warning("%s: missing; using %s.bak (a write of the journal was cut between its renames)",
                        self.path, self.path)
        return data

    def present(self) -> bool:
        """Whether the journal (or its ``.bak``) is there: a query that appended a batch here always has one."""
        return os.path.exists(self.path) or os.path.exists(f"{self.path}.bak")

    def _load(self, path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read().decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # no fallback to an older state: it could let a batch in twice
            raise StoreError(f"{path}: unreadable ({e}); the sink cannot tell which batches this store "
                             "holds, nothing was appended") from None
        if not isinstance(data, dict) or data.get("queryId") != self.query_id:
            raise StoreError(f"{path}: not this query's sink journal; nothing was appended")
        return data

    def write(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.path, state)


class SinkStart:
    """``<checkpointLocation>/rocketstore-sink/<store digest>.json``: this query began appending to this store.

    The journal alone cannot tell a first batch whose journal was lost from a new query's first batch: both
    find no journal.  Spark's checkpoint keeps the query's id; the sink writes this mark there (durably) before
    the journal's first ``pending`` and the first put.  A query that finds no journal but its mark has appended
    here before (its rows may be anywhere in the log); with neither it is new.  Losing the checkpoint loses the
    query id with it (Spark starts a new query), so no earlier attempt's rows can be mistaken for this one's.
    Only a checkpoint on a local file system (a path or ``file:``) can be marked; elsewhere (hdfs://, s3a://)
    a first batch's lost journal is not told apart (as before), which the log says."""

    DIR = "rocketstore-sink"

    def __init__(self, checkpoint: str | None, root: str) -> None:
        self.path: str | None = None
        local = _local_path(checkpoint)
        if local is not None:
            digest = hashlib.blake2b(os.path.realpath(root).encode("utf-8", "surrogatepass"), digest_size=16)
            self.path = os.path.join(local, self.DIR, f"{digest.hexdigest()}.json")
        self.checkpoint = checkpoint

    def seen(self, query_id: str) -> bool:
        if self.path is None:
            return False
        try:
            with open(self.path, "rb") as fh:
                data = json.loads(fh.read().decode("utf-8"))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:  # cannot tell: taken as seen (a count of the log, never a double)
            log.warning("%s: unreadable (%s); taken as an earlier start of query %s", self.path, e, query_id)
            return True
        return not isinstance(data, dict) or data.get("queryId") in (None, query_id)

    def note(self, query_id: str, root: str) -> None:
        if self.path is None:
            log.warning("rocketstore sink: checkpointLocation %r is not a local directory; a lost journal of "
                        "query %s's first batch would not be told from a new query's", self.checkpoint, query_id)
            return
        from ..storage.jsonfile import fsync_dir, write_json_atomic
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            fsync_dir(os.path.dirname(parent))
        write_json_atomic(self.path, {"queryId": query_id, "store": os.path.realpath(root)})


def _local_path(location: str | None) -> str | None:
    """The local directory of a checkpoint location (a path, ``file:/dir`` or ``file:///dir``); None for
    another scheme or none given."""
    if not location:
        return None
    text = str(location)
    if text.startswith("file:"):
        text = text[len("file:"):]
        if text.startswith("//"):
            text = text[2:]
            if not text.startswith("/"):  # file://host/dir: not this machine's
                return None
    elif "://" in text:
        return None
    return os.path.abspath(text)


def written_rows(store: MessageStore, from_offset: int, prefix: str) -> Counter[str]:
    """The ids of the rows of one batch (``SPARK_SINK_ROW`` starting with ``prefix``) from ``from_offset`` on;
    StoreError at a damaged record."""
    found: Counter[str] = Counter()
    for offset, _size, msg, err in store.messages(from_offset, read_body=False):
        if msg is None:  # the walk ends here: counting on would miss the rows after it and append them twice
            raise StoreError(f"{store.root}: the record at commitlog offset {offset} is damaged ({err}); the sink "
                             f"cannot tell which rows of batch {prefix.split(':')[1]} an earlier attempt wrote "
                             "after it, nothing was appended (repair the store, then restart the query)")
        value = (msg.properties or {}).get(SINK_PROPERTY)
        if value is not None and value.startswith(prefix):
            found[value] += 1
    return found


def _leave_out(already: Counter[str]) -> Callable[[write.StagedRow], bool]:
    """True for as many rows of each digest as an earlier attempt wrote (a multiset: equal rows are equal)."""
    def skip(row: write.StagedRow) -> bool:
        if already.get(row[7], 0) > 0:
            already[row[7]] -= 1
            return True
        return False
    return skip


def commit_batch(root: str, query_id: str, batch_id: int, parts: list[write.StagedPart],
                 opts: write.WriteOptions, checkpoint: str | None = None) -> dict[str, Any]:
    """Append one micro-batch's staged rows exactly once (see the module's docstring); a summary.
    ``checkpoint``: the query's checkpointLocation (:class:`SinkStart`)."""
    journal = SinkJournal(root, query_id)
    store = write.open_for_append(root, opts)
    try:
        state = journal.read()
        committed = state.get("committed")
        if committed is not None and batch_id <= committed:
            log.warning("%s: batch %d of query %s is already in the store (the journal's last is %d); "
                        "not appended again", root, batch_id, query_id, committed)
            return {"store": root, "messages": 0, "skipped": True}
        pending = state.get("pending")
        if pending is None and not journal.present():
            # Missing is not empty: a query past its first batch that finds no journal lost it (or appended
            # nothing so far), and so did one whose checkpoint says it began appending here; an attempt of this
            # batch may have written rows anywhere in the local log.
            start_mark = SinkStart(checkpoint, root)
            if batch_id > 0 or start_mark.seen(query_id):
                log.warning("%s: no journal %s for batch %d of query %s; looking through the whole log for rows "
                            "an earlier attempt wrote", root, journal.path, batch_id, query_id)
                pending = {"batch": batch_id, "from": store.min_phy_offset()}
            start_mark.note(query_id, root)  # before the journal's pending and the first put
        skip = None
        if pending is not None:  # an earlier attempt was cut short: leave out what it wrote
            # Past the log's end when a power cut took the log's tail back below it (and the attempt's rows with
            # it): this attempt appends from the end, where the next retry must look.
            start = min(int(pending["from"]), store.max_phy_offset())
            already = written_rows(store, start, f"{query_id}:{batch_id}:")
            log.warning("%s: batch %d of query %s: an earlier attempt appended %d of its rows from commitlog "
                        "offset %d; appending the rest", root, batch_id, query_id, sum(already.values()), start)
            skip = _leave_out(already)
        else:
            start = store.max_phy_offset()
        journal.write({"queryId": query_id, "committed": committed, "pending": {"batch": batch_id, "from": start}})
        summary = write.append(store, parts, opts, skip)
    finally:
        store.close()  # flushes: the batch is durable before the journal says so
    journal.write({"queryId": query_id, "committed": batch_id, "pending": None})
    summary["batchId"] = batch_id
    return summary


# ---------------------------------------------------------------- the Spark side

@dataclass
class StagedBatch(WriterCommitMessage):
    part: write.StagedPart
    query_id: str
    batch_id: int


class RocketStoreStreamWriter(DataSourceStreamArrowWriter):
    """``writeStream.format("rocketstore")``: options and columns as the batch writer's (``replay`` aside)."""

    def __init__(self, setup: write.WriterSetup, checkpoint: str | None = None) -> None:
        self.setup = setup  # the batch writer's checks of target, options and columns (write.writer_setup)
        self.checkpoint = checkpoint  # the query's checkpointLocation option (SinkStart)
        if self.setup.opts.replay:
            raise StoreError("rocketstore sink: replay is for batch imports (a stream's store times are new)")

    def staging(self, query_id: str, batch_id: int) -> str:
        return os.path.join(self.setup.root, write.STAGING, f"{query_id}-{batch_id}")

    def write(self, iterator: Any) -> WriterCommitMessage:
        from pyspark import TaskContext
        ctx = TaskContext.get()
        query_id = ctx.getLocalProperty(QUERY_ID_KEY) if ctx else None
        batch_id = ctx.getLocalProperty(BATCH_ID_KEY) if ctx else None
        if not query_id or batch_id is None:
            raise StoreError("rocketstore sink: this task has no streaming query id and batch id "
                             f"(local properties {QUERY_ID_KEY}, {BATCH_ID_KEY}); is it a writeStream?")
        s = self.setup
        part = write.stage(iterator, self.staging(query_id, int(batch_id)), ctx.partitionId(), ctx.attemptNumber(),
                           s.opts, s.max_message_size, s.segment_size, s.auto_v2, RowMarker(query_id, int(batch_id)))
        return StagedBatch(part, query_id, int(batch_id))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        got = [m for m in messages if m is not None]
        queries = {m.query_id for m in got}
        if len(queries) > 1 or any(m.batch_id != batchId for m in got):
            raise StoreError(f"rocketstore sink: batch {batchId}'s tasks report batches "
                             f"{sorted({(m.query_id, m.batch_id) for m in got})}; nothing was appended")
        if not queries:
            return
        query_id = queries.pop()
        try:
            parts = [m.part for m in got if m.part.rows]
            if parts:
                summary = commit_batch(self.setup.root, query_id, batchId, parts, self.setup.opts, self.checkpoint)
                log.info("sink %s batch %d: %s", query_id, batchId, summary)
        finally:
            write.cleanup(self.staging(query_id, batchId))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        for query_id in {m.query_id for m in messages if m is not None}:
            write.cleanup(self.staging(query_id, batchId))
        log.warning("stream write to %s, batch %d aborted; nothing of it was appended", self.setup.root, batchId)
