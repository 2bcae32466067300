"""StoreReader.read_batch: a queue's messages as one Arrow RecordBatch, decoded column-wise.

A consumer that wants thousands of messages (an export, an analytics job) pays
``get``'s price per message: a Python object per message and per field.  Here
the consume queue's units are read as one numpy array, each commitlog
segment's records are decoded at once by :func:`rocketstore.format.columns.decode`
(the Spark data source's decoder), and the rows come back as Arrow columns.

Every record is checked as ``get`` checks it before it is returned: the
record must decode (``decode``'s checks are ``codec.parse``'s), be the unit's
(TOTALSIZE, QUEUEID, QUEUEOFFSET, topic) and pass its BODYCRC, whichever
columns are asked for.  The first unit that fails any of these, and every
unit of an unusual kind (a blank unit, a record gone from the local disk), is
read through ``get`` itself from there on, so a read_batch returns exactly
the messages successive ``get`` calls return: the rows before a damaged
record, and an error naming the file and offset when the batch would start
at it.  Needs numpy and pyarrow (the ``spark`` extra).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import CorruptRecordError, StoreClosedError, StoreError, TierError
from ..format.message import GetMessageStatus
from .consume_queue import CQ_STORE_UNIT_SIZE

# The statuses after which a get's next_begin_offset passes units retention removed: read on from there.
_SKIP = (GetMessageStatus.MESSAGE_WAS_REMOVING, GetMessageStatus.OFFSET_FOUND_NULL)
NEXT_OFFSET_KEY = b"nextBeginOffset"  # the schema metadata key of the queue offset the next read starts at


class BatchReads:
    """StoreReader's column-wise read (a mixin: it uses the reader's files and its ``get``)."""

    def read_batch(self, topic: str, queue_id: int, offset: int, max_messages: int = 1024,
                   columns: Sequence[str] | None = None) -> Any:
        """Up to ``max_messages`` messages of ``topic``/``queue_id`` from queue offset ``offset`` as one
        ``pyarrow.RecordBatch`` of ``columns`` (default: every ``rocketstore dump`` field; the names and
        types of the Spark data source's schema).  The queue offset to read next is in the schema metadata
        under ``b"nextBeginOffset"`` (:data:`NEXT_OFFSET_KEY`).

        The same messages successive :meth:`get` calls (no tag filter) return from ``offset``, without
        ``get``'s per-call transfer caps: the rows end before a damaged record, and a read starting at
        one raises :class:`CorruptRecordError` naming the file and offset.  Bodies are checked against
        their BODYCRC even when the body column is not asked for.
        """
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from ..format import columns as cols
        from .queue_checked import UNIT_DTYPE
        names = list(cols.COLUMN_NAMES if columns is None else columns)
        unknown = [n for n in names if n not in cols.ARROW_TYPES]
        if unknown:
            raise StoreError(f"read_batch: unknown columns {unknown}; known: {', '.join(cols.COLUMN_NAMES)}")
        files = self.files
        if files.closed:
            raise StoreClosedError(f"{self.root}: store is closed")
        if files.lost_queues and (topic, queue_id) in files.lost_queues:
            raise self._lost_queue_error(topic, queue_id)
        if max_messages <= 0:
            return _finish(pa, [], names, cols, offset)
        # the units a fast read covers: [offset, stop), read as one array per consume-queue file
        cq = files.cq_table.get((topic, queue_id))
        units = []
        idx = offset
        if cq is not None:
            if cq.blank_min is not None:
                self.settle_queue_min(cq)
            lo, hi = cq.offset_range()
            stop = offset + max_messages if offset + max_messages < hi else hi
            while lo <= idx < stop:
                f = cq.hold_file_at(idx)
                if f is None:
                    break
                try:
                    p = idx * CQ_STORE_UNIT_SIZE - f.file_from_offset
                    n = min(stop - idx, (f.wrote_position - p) // CQ_STORE_UNIT_SIZE)
                    if n <= 0:
                        break
                    units.append(np.frombuffer(f.mm, UNIT_DTYPE, count=n, offset=p).copy())
                finally:
                    f.release()
                idx += n
        u = np.concatenate(units) if units else np.zeros(0, UNIT_DTYPE)
        phys, sizes = u["off"].astype(np.int64), u["size"].astype(np.int64)
        # units that name a record in the usual way; the first that does not ends the fast part
        plain = (phys >= 0) & (sizes > 0) & (sizes < 0x7FFFFFFF)
        n_fast = len(u) if plain.all() else int(np.argmin(plain))
        batches: list[Any] = []
        idx = offset
        file_size = self.commitlog.file_size
        while idx - offset < n_fast:
            i = idx - offset
            seg = self.commitlog.queue.find(int(phys[i]))
            if seg is None or not seg.hold():
                break
            try:
                base, wrote = seg.file_from_offset, seg.wrote_position
                seg_units = max(1, int(np.searchsorted(phys[i:n_fast], base + file_size)))  # in this segment
                pos = phys[i:i + seg_units] - base
                size = sizes[i:i + seg_units]
                inside = (pos >= 0) & (pos + size <= wrote)
                k = seg_units if inside.all() else int(np.argmin(inside))
                good = _checked(cols, np, pa, pc, seg, pos[:k], size[:k], wrote, names, topic, queue_id, idx) if k else None
            finally:
                seg.release()
            if good is None:
                break
            batch, k_good = good
            if k_good:
                batches.append(batch)
                idx += k_good
            if k_good < seg_units:
                break  # a unit the fast path does not take: get reads on from it
        missing = offset + max_messages - idx
        if missing > 0:
            msgs, idx = self._get_messages(topic, queue_id, idx, missing, have=bool(batches))
            k = _fitting(cols, np, msgs, names)
            if k < len(msgs):  # a time the timestamp column cannot hold: the batch ends before that record
                if not k and not batches:
                    raise self._unfit_time(msgs[0])
                msgs, idx = msgs[:k], msgs[k].queue_offset
            if msgs:
                batches.append(cols.messages_batch(msgs, names))
        return _finish(pa, batches, names, cols, idx)

    def _unfit_time(self, m: Any) -> CorruptRecordError:
        seg = self.commitlog.queue.find(m.commit_log_offset)
        path = seg.path if seg is not None else self.paths.commitlog
        return CorruptRecordError(
            f"{path} at offset {m.commit_log_offset}: {m.topic}/{m.queue_id} offset {m.queue_offset} has born "
            f"time {m.born_timestamp} ms and store time {m.store_timestamp} ms, outside the range of the "
            "timestamp columns (a damaged header?); get returns it, read_batch cannot", path=path,
            offset=m.commit_log_offset)

    def _get_messages(self, topic: str, queue_id: int, idx: int, count: int, have: bool) -> tuple[list, int]:
        """Up to ``count`` messages from unit ``idx`` through :meth:`get` (bodies read, so CRC-checked):
        the slow path for units the column-wise read does not take.  (messages, next unit)."""
        msgs: list[Any] = []
        while len(msgs) < count:
            try:
                r = self.get(topic, queue_id, idx, count - len(msgs))
            except (CorruptRecordError, TierError):
                if msgs or have:
                    break  # the rows before the damaged record; the next read starts at it and raises
                raise
            if not r.messages:
                if r.status in _SKIP and r.next_begin_offset > idx:
                    idx = r.next_begin_offset
                    continue
                if not msgs and not have:
                    idx = r.next_begin_offset  # where get says to go on (the queue's minimum, or its end)
                break
            msgs += r.messages
            idx = r.next_begin_offset
        return msgs, idx


def _checked(cols: Any, np: Any, pa: Any, pc: Any, seg: Any, pos: Any, size: Any, wrote: int, names: list[str],
             topic: str, queue_id: int, first: int) -> tuple[Any, int] | None:
    """Decode the records at file positions ``pos`` of ``seg`` and keep the leading rows that are their units'
    records (TOTALSIZE, QUEUEID, QUEUEOFFSET from ``first``, topic), bodies CRC-checked: (batch, rows kept),
    or None when a record there does not decode or fails its CRC (``get`` then reads from the first unit)."""
    view = cols.MappedView(seg.mm, seg.path, seg.file_from_offset, size=wrote)
    want = list(dict.fromkeys([*names, "size", "queueId", "queueOffset", "topic"]))
    try:
        batch = cols.decode(view, pos, want, None, limit=wrote, check_crc=True)
    except cols.RecordFormatError:
        return None
    n = len(pos)
    c = {nm: batch.column(nm) for nm in ("size", "queueId", "queueOffset")}
    ok = (c["size"].to_numpy() == size) & (c["queueId"].to_numpy() == queue_id) & \
        (c["queueOffset"].to_numpy() == np.arange(first, first + n, dtype=np.int64))
    ok &= pc.equal(batch.column("topic"), pa.scalar(topic, pa.string())).to_numpy(zero_copy_only=False)
    k = n if ok.all() else int(np.argmin(ok))
    if k < n:
        batch = batch.slice(0, k)
    if want != names:
        batch = pa.RecordBatch.from_arrays([batch.column(nm) for nm in names], schema=cols.arrow_schema(names))
    return batch, k


def _fitting(cols: Any, np: Any, msgs: list[Any], names: list[str]) -> int:
    """How many of ``msgs`` lead with times the asked-for timestamp columns hold."""
    fit = np.ones(len(msgs), dtype=bool)
    for name, attr in (("bornTimestamp", "born_timestamp"), ("storeTimestamp", "store_timestamp")):
        if name in names and msgs:
            fit &= cols.timestamps_fit(np.array([getattr(m, attr) for m in msgs], np.int64))
    return len(msgs) if fit.all() else int(np.argmin(fit))


def _finish(pa: Any, batches: list[Any], names: list[str], cols: Any, next_offset: int) -> Any:
    schema = cols.arrow_schema(names).with_metadata({NEXT_OFFSET_KEY: str(next_offset).encode()})
    if not batches:
        return pa.RecordBatch.from_arrays([pa.array([], cols.ARROW_TYPES[n]) for n in names], schema=schema)
    batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    return batch.replace_schema_metadata(schema.metadata)
