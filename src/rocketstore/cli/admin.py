"""Operator verbs (mqadmin's topicList/topicStatus, consumerProgress, resetOffsetByTime, queryMsgById):
``topics``, ``groups``, ``lag``, ``reset-offset``, ``msg``.

While ``rocketstore serve`` holds the store, ``topics``, ``groups``, ``lag`` and
``reset-offset`` ask the running broker through its admin endpoint
(:mod:`rocketstore.cli.live`): its tables and offsets are in its memory, and
only it may change them.  Otherwise they work on the files: all but
``reset-offset`` open the store read-only; ``reset-offset`` takes the store's
lock for the time of the change, so it refuses (exit 2) while another writer
has the store open, and writes ``config/consumerOffset.json`` atomically (see
:mod:`rocketstore.storage.group_offsets`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..format import codec
from ..storage.consumer_offsets import read_json_lenient
from . import live
from .main import emit
from .format import JSON, MESSAGE_COLUMNS, add_store_command, add_text_bodies_flag, message_json, \
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

def topic_table(store: MessageStore, configured_queues: dict[str, tuple[int, int]] | None = None
                ) -> list[dict[str, Any]]:
    """Every topic with consume queues or in ``config/topics.json``: queues on disk, messages, configured queues.

    ``configured_queues`` (name -> (readQueueNums, writeQueueNums)) replaces the file: a running broker's
    table."""
    rows: dict[str, dict[str, Any]] = {}
    for q in store.state()["queues"]:
        r = rows.setdefault(q["topic"], {"topic": q["topic"], "queues": 0, "messages": 0, "minOffset": 0,
                                         "maxOffset": 0, "readQueueNums": None, "writeQueueNums": None})
        r["queues"] += 1
        r["messages"] += q["messageTotalInQueue"]
        r["minOffset"] += q["minOffsetInQueue"]
        r["maxOffset"] += q["maxOffsetInQueue"]
    if configured_queues is None:
        configured = read_json_lenient(os.path.join(store.paths.config, "topics.json")) or {}
        table = (configured.get("topicConfigTable") or {}) if isinstance(configured, dict) else {}
        configured_queues = {n: (c.get("readQueueNums"), c.get("writeQueueNums")) for n, c in table.items()
                             if isinstance(c, dict)} if isinstance(table, dict) else {}
    for name, (rq, wq) in configured_queues.items():
        r = rows.setdefault(name, {"topic": name, "queues": 0, "messages": 0, "minOffset": 0, "maxOffset": 0,
                                   "readQueueNums": None, "writeQueueNums": None})
        r["readQueueNums"], r["writeQueueNums"] = rq, wq
    return [rows[t] for t in sorted(rows)]


TOPIC_ACTIONS = ("list", "create", "update", "delete")
GROUP_ACTIONS = ("list", "create", "delete", "clients")


def live_broker(args: argparse.Namespace) -> live.LiveBroker | None:
    """The admin endpoint of the broker holding ``args.store`` (None: no broker, work offline)."""
    return live.find(args.store, live.credentials(getattr(args, "admin_user", None),
                                                  getattr(args, "admin_secret_file", None)))


def _needs_broker(args: argparse.Namespace, verb: str) -> CliError:
    return CliError(f"{args.store}: '{verb}' changes a running broker's tables and no broker serves this store "
                    "(start 'rocketstore serve'; offline, serve --topic/--group create them at start)")


def _perm(text: str) -> int:
    named = {"rw": 6, "r": 4, "w": 2, "none": 0, "-": 0}
    t = text.strip().lower()
    if t in named:
        return named[t]
    if t.isdigit() and 0 <= int(t) <= 7:
        return int(t)
    raise argparse.ArgumentTypeError(f"{text!r} is not a permission (rw, r, w, none, or RocketMQ's 0..7)")


def cmd_topics(args: argparse.Namespace) -> int:
    broker = live_broker(args)
    if args.action != "list":
        if broker is None:
            raise _needs_broker(args, f"topics {args.action}")
        if not args.name:
            raise CliError(f"topics {args.action} needs a topic NAME")
        req: dict[str, Any] = {"name": args.name}
        for key, v in (("queues", args.queues), ("readQueueNums", args.read_queues),
                       ("writeQueueNums", args.write_queues), ("perm", args.perm), ("type", args.type)):
            if v is not None:
                req[key] = v
        out = broker.call(f"topics.{args.action}", req)
        if args.format == JSON:
            emit(out)
        else:
            print_rows([out["topic"]] if "topic" in out else [out], tuple((out.get("topic") or out).keys()),
                       args.format)
        return 0
    if broker is not None:
        rows = broker.call("topics.list")["topics"]
        columns: tuple[str, ...] = ("topic", "queues", "messages", "readQueueNums", "writeQueueNums", "perm",
                                    "type")
    else:
        with open_read_only(args) as store:
            rows = topic_table(store)
        columns = ("topic", "queues", "messages", "readQueueNums", "writeQueueNums")
    if args.format == JSON:
        emit({"topics": rows})
    else:
        print_rows(rows, columns, args.format)
    return 0


# ---------------------------------------------------------------- groups and lag

def lag_table(store: MessageStore, group: str | None = None, topic: str | None = None,
              table: dict[str, dict[int, int]] | None = None) -> list[dict[str, Any]]:
    """Per group, topic and queue: the committed offset, the queue's range and the lag (messages behind).

    A group whose offset is below the queue's minimum (messages deleted before it
    read them) lags by the whole queue and is flagged ``behindMin``.  ``table`` ("topic@group" -> queue ->
    offset) replaces ``config/consumerOffset.json``: a running broker's offsets."""
    rows = []
    if table is None:
        table = read_offsets(store.root).table
    for key, queues in sorted(table.items()):
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
    broker = live_broker(args)
    columns: tuple[str, ...] = ("group", "topic", "queueId", "consumerOffset", "brokerOffset", "lag")
    if broker is not None:  # the broker's memory: offsets committed since its last write of the file count
        rows = broker.call("lag", {"group": args.group, "topic": args.topic})["lag"]
        columns += ("inflight",)
        where = "the running broker"
    else:
        with open_read_only(args) as store:
            rows = lag_table(store, args.group, args.topic)
            pops = {(s["group"], s["topic"]): s["queues"] for s in group_stats(store.root)}
        for r in rows:
            r["inflight"] = pops.get((r["group"], r["topic"]), {}).get(r["queueId"], 0)
        if pops:  # the column only for stores with SimpleConsumer (pop) groups
            columns += ("inflight",)
        where = "config/consumerOffset.json"
    if args.group is not None and not rows:
        raise CliError(f"{args.store}: no committed offsets for group {args.group!r}"
                       + (f" on topic {args.topic!r}" if args.topic else "") + f" in {where}")
    if args.format == JSON:
        emit({"lag": rows, "totalLag": sum(r["lag"] for r in rows),
              "source": "broker" if broker is not None else "file"})
    else:
        print_rows(rows, columns, args.format)
    return 0


def cmd_groups(args: argparse.Namespace) -> int:
    broker = live_broker(args)
    if args.action in ("create", "delete"):
        if broker is None:
            raise _needs_broker(args, f"groups {args.action}")
        if not args.name:
            raise CliError(f"groups {args.action} needs a group NAME")
        req: dict[str, Any] = {"name": args.name}
        if args.orderly:
            req["orderly"] = True
        if args.retry_max_times is not None:
            req["retryMaxTimes"] = args.retry_max_times
        out = broker.call(f"groups.{args.action}", req)
        if args.format == JSON:
            emit(out)
        else:
            print(f"{args.action}d group {args.name}")
        return 0
    if args.action == "clients":
        if broker is None:
            raise _needs_broker(args, "groups clients")
        rows = broker.call("groups.clients", {"group": args.name})["clients"]
        if args.format == JSON:
            emit({"clients": rows})
        else:
            print_rows(rows, ("group", "clientId", "user", "language", "version", "alive"), args.format)
        return 0
    if broker is not None:
        out = broker.call("groups.list")["groups"]
        if args.format == JSON:
            emit({"groups": out})
        else:
            print_rows(out, ("group", "clients", "topics", "lag", "orderly", "retryMaxTimes"), args.format)
        return 0
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
                               "stop it first (a broker with its admin endpoint on, adminPort, is asked "
                               "instead)") from None
    try:
        yield
    finally:
        lock.release()


RESET_HOWS = ("time", "offset", "earliest", "latest", "shift")


def reset_plan(store: MessageStore, topic: str, queue_id: int | None, how: str, value: int | None,
               committed: Callable[[int], int | None]) -> list[dict[str, Any]]:
    """Where a reset puts a group in each queue of ``topic`` (or ``queue_id``): ``how`` is ``time`` (first
    message stored at or after ``value`` ms), ``offset`` (``value``), ``earliest``, ``latest`` or ``shift``
    (the committed offset moved by ``value``, as kafka-consumer-groups' --shift-by); every target is clamped
    to the queue's range.  ``committed(queue)`` is the group's offset now (None: never committed)."""
    if how not in RESET_HOWS:
        raise CliError(f"unknown reset {how!r} (one of {', '.join(RESET_HOWS)})")
    if how in ("time", "offset", "shift") and type(value) is not int:
        raise CliError(f"reset by {how} needs an integer value")
    if queue_id is not None and type(queue_id) is not int:
        raise CliError("queueId must be an integer")
    qids = sorted(q for t, q in store.queue_keys() if t == topic)
    if queue_id is not None:
        if queue_id not in qids:
            raise CliError(f"{store.root}: topic {topic!r} has no queue {queue_id}")
        qids = [queue_id]
    if not qids:
        raise CliError(f"{store.root}: topic {topic!r} has no consume queues")
    rows = []
    for q in qids:
        lo, hi = store.min_offset_in_queue(topic, q), store.max_offset_in_queue(topic, q)
        old = committed(q)
        if how == "time":
            new = store.offset_by_time(topic, q, value, LOWER)
        elif how == "offset":
            new = value
        elif how == "shift":
            new = (lo if old is None else max(old, lo)) + value
        else:
            new = lo if how == "earliest" else hi
        rows.append({"topic": topic, "queueId": q, "oldOffset": old, "newOffset": min(max(new, lo), hi),
                     "minOffset": lo, "maxOffset": hi})
    return rows


def _reset_how(args: argparse.Namespace) -> tuple[str, int | None]:
    if args.to_time is not None:
        return "time", args.to_time
    if args.to_offset is not None:
        return "offset", args.to_offset
    if args.shift_by is not None:
        return "shift", args.shift_by
    return ("earliest", None) if args.to_earliest else ("latest", None)


def cmd_reset_offset(args: argparse.Namespace) -> int:
    """Live (a broker serves the store): a plan unless --execute, applied by the broker (its memory and
    files).  Offline: applied at once unless --dry-run, under the store's lock (as before)."""
    how, value = _reset_how(args)
    broker = live_broker(args)
    columns: tuple[str, ...] = ("group", "topic", "queueId", "oldOffset", "newOffset")
    if broker is not None:
        out = broker.call("reset-offset", {"group": args.group, "topic": args.topic, "queueId": args.queue_id,
                                           "how": how, "value": value, "execute": args.execute})
        rows, executed = out["reset"], out["executed"]
        columns += ("inflight",)
    else:
        executed = not args.dry_run
        with store_locked_offline(args.store), open_read_only(args) as store:
            reset_plan(store, args.topic, args.queue_id, how, value, lambda q: None)  # names bad queues first
            with updating_offsets(args.store) as manager:
                rows = reset_plan(store, args.topic, args.queue_id, how, value,
                                  lambda q: manager.get(args.topic, args.group, q))
                for r in rows:
                    r["group"] = args.group
                    if executed:
                        manager.commit(args.topic, args.group, r["queueId"], r["newOffset"])
    if args.format == JSON:
        emit({"reset": rows, "executed": executed})
    else:
        print_rows(rows, columns, args.format)
        if not executed:
            sys.stderr.write("dry run: nothing changed" + (" (add --execute to apply)" if broker else "") + "\n")
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
        # Its header did not name this id either, so the offset may just as well not start a record (a mistyped
        # id): say both, never claim damage the store may not have.
        raise CorruptRecordError(f"no intact message with id {msg_id}: commitlog offset {decoded[2]}, which an "
                                 f"offset msgId of that value names, holds no intact record (a damaged record, or "
                                 f"not the start of one): {damage}", path=damage.path, offset=damage.offset)
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

def _live_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-user", metavar="USER",
                   help=f"ACL Super user for a running broker with ACL on (default ${live.USER_ENV}; the "
                        f"secret comes from ${live.SECRET_ENV} or --admin-secret-file)")
    p.add_argument("--admin-secret-file", metavar="FILE", help="file holding the --admin-user's secret")


def register(sub: argparse._SubParsersAction) -> None:
    add = functools.partial(add_store_command, sub)

    live_note = (" While 'rocketstore serve' holds the store, asks the running broker (its admin endpoint, "
                 "config/admin.json).")
    p = add("topics", cmd_topics, "topics with their queue and message counts (also topics of config/topics.json "
            "without messages); create, update, delete on a running broker." + live_note)
    p.add_argument("action", nargs="?", choices=TOPIC_ACTIONS, default="list",
                   help="list (default); create, update, delete need a running broker")
    p.add_argument("name", nargs="?", metavar="NAME", help="topic to create, update or delete")
    p.add_argument("--queues", type=nonneg, metavar="N", help="read and write queue count (create default: "
                   "the broker's defaultTopicQueueNums)")
    p.add_argument("--read-queues", type=nonneg, metavar="N", help="readQueueNums only")
    p.add_argument("--write-queues", type=nonneg, metavar="N", help="writeQueueNums only")
    p.add_argument("--perm", type=_perm, metavar="PERM", help="rw, r, w, none (or RocketMQ's perm bits 0..7)")
    p.add_argument("--type", type=str.upper, metavar="TYPE", help="message type: NORMAL, FIFO, DELAY, "
                   "TRANSACTION or MIXED")
    _live_flags(p)

    p = add("groups", cmd_groups, "consumer groups with their lag per topic; create, delete and connected clients "
            "on a running broker." + live_note)
    p.add_argument("action", nargs="?", choices=GROUP_ACTIONS, default="list",
                   help="list (default); create, delete, clients need a running broker")
    p.add_argument("name", nargs="?", metavar="NAME", help="group to create or delete (clients: only this group)")
    p.add_argument("--orderly", action="store_true", help="create: a FIFO group (consumeMessageOrderly)")
    p.add_argument("--retry-max-times", type=nonneg, metavar="N", help="create: retryMaxTimes")
    _live_flags(p)

    p = add("lag", cmd_lag, "consumer lag per group, topic and queue (committed offset against the queue's end; "
            "a running broker's memory when one serves the store, else config/consumerOffset.json)")
    p.add_argument("--group", help="only this group")
    p.add_argument("--topic", help="only this topic")
    _live_flags(p)

    p = add("reset-offset", cmd_reset_offset, "set a group's committed offsets of a topic.  While a broker "
            "serves the store: prints the plan, --execute applies it through the broker.  Offline: applies at "
            "once (--dry-run only prints) under the store's lock (atomic write)")
    p.add_argument("--group", required=True, help="consumer group whose offsets are set")
    p.add_argument("--topic", required=True, help="topic whose queues are set")
    p.add_argument("--queue-id", type=nonneg, help="only this queue (default: every queue of the topic)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-time", type=time_arg, metavar="TIME",
                    help="first message stored at or after TIME (epoch ms, ISO-8601, or -1h style)")
    to.add_argument("--to-offset", type=nonneg, metavar="N", help="queue offset N (clamped to the queue's range)")
    to.add_argument("--to-earliest", action="store_true", help="each queue's first message")
    to.add_argument("--to-latest", action="store_true", help="each queue's end (skip everything stored)")
    to.add_argument("--shift-by", type=int, metavar="N", help="move each committed offset by N (negative: back; "
                    "clamped to the queue's range)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--execute", action="store_true", help="running broker: apply the plan (default: print it)")
    mode.add_argument("--dry-run", action="store_true", help="offline: print the plan, change nothing")
    _live_flags(p)

    p = add("msg", cmd_msg, "a message by id: offset msgId (decoded to its commitlog offset) or UNIQ_KEY "
            "(through the index)", default_format=JSON)
    p.add_argument("--id", required=True, metavar="MSGID", help="offset msgId (32 or 56 hex digits) or UNIQ_KEY")
    p.add_argument("--topic", help="look the UNIQ_KEY up in this topic only (default: every topic)")
    p.add_argument("--no-body", action="store_true", help="omit the body")
    add_text_bodies_flag(p)
