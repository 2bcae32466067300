"""Operator verbs (mqadmin's topicList/topicStatus, consumerProgress, resetOffsetByTime, queryMsgById):
``topics``, ``groups``, ``lag``, ``reset-offset``, ``msg``.

All but ``reset-offset`` open the store read-only.  ``reset-offset`` is offline:
it takes the store's lock for the time of the change, so it refuses (exit 2)
while a broker or any writer has the store open, and writes
``config/consumerOffset.json`` atomically (see :mod:`rocketstore.storage.group_offsets`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..format import codec
from ..storage.consumer_offsets import read_json_lenient
from .main import emit
from .format import JSON, MESSAGE_COLUMNS, TABLE, add_format_flag, add_text_bodies_flag, message_json, \
message_row, print_rows
from .store import nonneg, open_read_only
from ..storage.consume_queue import LOWER
from ..errors import CliError, CorruptRecordError, StoreLockedError
from ..storage.group_offsets import read_offsets, updating_offsets
from ..paths import StorePaths
from ..store import MessageStore
from ..storage.store_lock import StoreLock
from ..queues.inspect import group_stats
from .timeparse import time_arg


# ---------------------------------------------------------------- topics

def topic_table(store: MessageStore) -> list[dict[str, Any]]:
    """Every topic with consume queues or in ``config/topics.json``: queues on disk, messages, configured queues."""
    rows: dict[str, dict[str, Any]] = {}
    for q in store.state()["queues"]:
        r = rows.setdefault(q["topic"], {"topic": q["topic"], "queues": 0, "messages": 0, "minOffset": 0,
                                         "maxOffset": 0, "readQueueNums": None, "writeQueueNums": None})
        r["queues"] += 1
        r["messages"] += q["messageTotalInQueue"]
        r["minOffset"] += q["minOffsetInQueue"]
        r["maxOffset"] += q["maxOffsetInQueue"]
    configured = read_json_lenient(os.path.join(store.paths.config, "topics.json")) or {}
    for name, conf in (configured.get("topicConfigTable") or {}).items() if isinstance(configured, dict) else ():
        r = rows.setdefault(name, {"topic": name, "queues": 0, "messages": 0, "minOffset": 0, "maxOffset": 0,
                                   "readQueueNums": None, "writeQueueNums": None})
        if isinstance(conf, dict):
            r["readQueueNums"] = conf.get("readQueueNums")
            r["writeQueueNums"] = conf.get("writeQueueNums")
    return [rows[t] for t in sorted(rows)]


def cmd_topics(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        rows = topic_table(store)
    if args.format == JSON:
        emit({"topics": rows})
    else:
        print_rows(rows, ("topic", "queues", "messages", "readQueueNums", "writeQueueNums"), args.format)
    return 0


# ---------------------------------------------------------------- groups and lag

def lag_table(store: MessageStore, group: str | None = None, topic: str | None = None) -> list[dict[str, Any]]:
    """Per group, topic and queue: the committed offset, the queue's range and the lag (messages behind).

    A group whose offset is below the queue's minimum (messages deleted before it
    read them) lags by the whole queue and is flagged ``behindMin``."""
    rows = []
    for key, queues in sorted(read_offsets(store.root).table.items()):
        t, _, g = key.rpartition("@")
        if (group is not None and g != group) or (topic is not None and t != topic):
            continue
        for qid in sorted(set(queues) | {q for tt, q in store.queue_keys() if tt == t}):
            lo, hi = store.min_offset_in_queue(t, qid), store.max_offset_in_queue(t, qid)
            committed = queues.get(qid)
            start = lo if committed is None else max(committed, lo)
            rows.append({"group": g, "topic": t, "queueId": qid, "consumerOffset": committed, "minOffset": lo,
                         "brokerOffset": hi, "lag": max(0, hi - start),
                         "behindMin": committed is not None and committed < lo})
    return rows


def cmd_lag(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        rows = lag_table(store, args.group, args.topic)
        pops = {(s["group"], s["topic"]): s["queues"] for s in group_stats(store.root)}
    for r in rows:
        r["inflight"] = pops.get((r["group"], r["topic"]), {}).get(r["queueId"], 0)
    if args.group is not None and not rows:
        raise CliError(f"{args.store}: no committed offsets for group {args.group!r}"
                       + (f" on topic {args.topic!r}" if args.topic else "") + " in config/consumerOffset.json")
    if args.format == JSON:
        emit({"lag": rows, "totalLag": sum(r["lag"] for r in rows)})
    else:
        pop_columns = ("inflight",) if pops else ()  # only for stores with SimpleConsumer (pop) groups
        print_rows(rows, ("group", "topic", "queueId", "consumerOffset", "brokerOffset", "lag") + pop_columns,
                   args.format)
    return 0


def cmd_groups(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        rows = lag_table(store)
        pops = {(s["group"], s["topic"]): s for s in group_stats(store.root, store)}  # SimpleConsumer groups
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        pop = pops.get((r["group"], r["topic"]), {})
        g = groups.setdefault((r["group"], r["topic"]), {"group": r["group"], "topic": r["topic"], "queues": 0,
                                                         "lag": 0, "inflight": pop.get("inflight", 0),
                                                         "retry": pop.get("retry_depth", 0),
                                                         "dlq": pop.get("dlq_depth", 0)})
        g["queues"] += 1
        g["lag"] += r["lag"]
    out = [groups[k] for k in sorted(groups)]
    if args.format == JSON:
        emit({"groups": out})
    else:
        pop_columns = ("inflight", "retry", "dlq") if pops else ()  # only for stores with pop groups
        print_rows(out, ("group", "topic", "queues", "lag") + pop_columns, args.format)
    return 0


# ---------------------------------------------------------------- reset-offset

@contextmanager
def store_locked_offline(root: str) -> Iterator[None]:
    """Hold the store's locks as a writer does (:class:`StoreLock`: the ``flock`` on the directory and the
    record lock on ``lock``) so no writer starts while offline tools change files; StoreLockedError when a
    writer has them.  The directory lock is what a live writer still holds after someone deleted ``lock``."""
    paths = StorePaths(root)
    if not os.path.isdir(paths.commitlog):
        raise CliError(f"{root}: not a message store (no commitlog directory)")
    lock = StoreLock(root)
    try:
        lock.acquire()
    except StoreLockedError:
        raise StoreLockedError(f"{paths.lock}: store is open by a running process (broker or writer); "
                               "stop it first, reset-offset works offline") from None
    try:
        yield
    finally:
        lock.release()


def cmd_reset_offset(args: argparse.Namespace) -> int:
    with store_locked_offline(args.store):
        with open_read_only(args) as store:
            qids = [q for t, q in store.queue_keys() if t == args.topic]
            if args.queue_id is not None:
                if args.queue_id not in qids:
                    raise CliError(f"{args.store}: topic {args.topic!r} has no queue {args.queue_id}")
                qids = [args.queue_id]
            if not qids:
                raise CliError(f"{args.store}: topic {args.topic!r} has no consume queues")
            targets = {}
            for q in qids:
                lo, hi = store.min_offset_in_queue(args.topic, q), store.max_offset_in_queue(args.topic, q)
                if args.to_time is not None:
                    targets[q] = store.offset_by_time(args.topic, q, args.to_time, LOWER)
                elif args.to_offset is not None:
                    targets[q] = min(max(args.to_offset, lo), hi)
                else:
                    targets[q] = lo if args.to_earliest else hi
        rows = []
        with updating_offsets(args.store) as manager:
            for q, new in sorted(targets.items()):
                rows.append({"group": args.group, "topic": args.topic, "queueId": q,
                             "oldOffset": manager.get(args.topic, args.group, q), "newOffset": new})
                manager.commit(args.topic, args.group, q, new)
    if args.format == JSON:
        emit({"reset": rows})
    else:
        print_rows(rows, ("group", "topic", "queueId", "oldOffset", "newOffset"), args.format)
    return 0


# ---------------------------------------------------------------- msg --id

def find_by_id(store: MessageStore, msg_id: str, topic: str | None = None) -> tuple[str, list[codec.MessageExt]]:
    """Messages with this id: an offset msgId of this store (decoded to its commitlog offset and checked),
    else a UNIQ_KEY (client message id) looked up through the index in ``topic`` or every topic."""
    decoded = codec.decode_offset_msg_id(msg_id)
    damage: CorruptRecordError | None = None
    if decoded is not None:
        offset = decoded[2]
        if store.min_readable_offset() <= offset < store.max_phy_offset():
            try:
                m = store.look(offset)
            except CorruptRecordError as e:
                m = None
                damage = e
                if _header_names(store, offset, msg_id, topic):  # the record of this id, with its body damaged
                    raise CorruptRecordError(f"message {msg_id} (commitlog offset {offset}) is damaged: {e}",
                                             path=e.path, offset=e.offset) from None
            if m is not None and m.msg_id == msg_id.upper() and (topic is None or m.topic == topic):
                return "offsetMsgId", [m]
    topics = [topic] if topic is not None else sorted({t for t, _ in store.queue_keys()})
    hits = []
    for t in topics:
        for m in store.query(t, msg_id, max_num=store.config.maxMsgsNumBatch).messages:
            if m.uniq_key == msg_id:
                hits.append(m)
    if not hits and damage is not None:  # the id may name that record: say what is there, not "no message"
        raise CorruptRecordError(f"no intact message with id {msg_id}: commitlog offset {decoded[2]}, which an "
                                 f"offset msgId of that value names, holds a damaged record: {damage}",
                                 path=damage.path, offset=damage.offset)
    return "uniqKey", sorted(hits, key=lambda m: m.commit_log_offset)


def _header_names(store: MessageStore, offset: int, msg_id: str, topic: str | None) -> bool:
    """Whether the record header at ``offset`` (read without its body) carries this offset msgId and topic."""
    try:
        m = store.look(offset, read_body=False)
    except CorruptRecordError:
        return False
    return m.msg_id == msg_id.upper() and (topic is None or m.topic == topic)


def cmd_msg(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        how, msgs = find_by_id(store, args.id, args.topic)
        if not msgs:
            raise CliError(f"{args.store}: no message with id {args.id}: neither an offset msgId of this store "
                           "nor a UNIQ_KEY in the index" + (f" of topic {args.topic!r}" if args.topic else ""))
        if args.format == JSON:
            emit({"id": args.id, "resolvedBy": how,
                  "messages": [message_json(m, not args.no_body, args.text_bodies) for m in msgs]})
        else:
            print_rows([message_row(m, not args.no_body) for m in msgs], MESSAGE_COLUMNS, args.format)
    return 0


# ---------------------------------------------------------------- wiring

def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, handler: Any, help: str, default_format: str = TABLE) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("store", metavar="STORE", help="store root directory (storePathRootDir)")
        p.add_argument("--config", metavar="FILE", help="broker.conf style file (key=value)")
        add_format_flag(p, default_format)
        p.set_defaults(handler=handler)
        return p

    add("topics", cmd_topics, "topics with their queue and message counts (also topics of config/topics.json "
        "without messages)")
    add("groups", cmd_groups, "consumer groups of config/consumerOffset.json with their lag per topic")
    p = add("lag", cmd_lag, "consumer lag per group, topic and queue (committed offset against the queue's end)")
    p.add_argument("--group", help="only this group")
    p.add_argument("--topic", help="only this topic")

    p = add("reset-offset", cmd_reset_offset, "set a group's committed offsets of a topic (offline: refuses "
            "while the store is open by a writer; atomic write)")
    p.add_argument("--group", required=True, help="consumer group whose offsets are set")
    p.add_argument("--topic", required=True, help="topic whose queues are set")
    p.add_argument("--queue-id", type=nonneg, help="only this queue (default: every queue of the topic)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-time", type=time_arg, metavar="TIME",
                    help="first message stored at or after TIME (epoch ms, ISO-8601, or -1h style)")
    to.add_argument("--to-offset", type=nonneg, metavar="N", help="queue offset N (clamped to the queue's range)")
    to.add_argument("--to-earliest", action="store_true", help="each queue's first message")
    to.add_argument("--to-latest", action="store_true", help="each queue's end (skip everything stored)")

    p = add("msg", cmd_msg, "a message by id: offset msgId (decoded to its commitlog offset) or UNIQ_KEY "
            "(through the index)", default_format=JSON)
    p.add_argument("--id", required=True, metavar="MSGID", help="offset msgId (32 or 56 hex digits) or UNIQ_KEY")
    p.add_argument("--topic", help="look the UNIQ_KEY up in this topic only (default: every topic)")
    p.add_argument("--no-body", action="store_true", help="omit the body")
    add_text_bodies_flag(p)

