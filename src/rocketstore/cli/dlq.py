"""``rocketstore dlq``: the dead letters of consumer groups (``%DLQ%<group>``), and re-sending them.

``dlq list STORE [--group G]`` lists the dead letters with the topic and message id they came from.
``dlq resend STORE --group G (--msg-id ID | --all) [--execute]`` puts them back on their original topics;
without ``--execute`` it only shows what it would re-send (a dry run).  Re-sending needs the store to itself
(it opens it for writing: refused while a broker or writer has it).  The dead letter stays in the DLQ
(RocketMQ's console does the same); re-sending it twice sends two copies, with the same UNIQ_KEY.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from ..errors import CliError
from ..format.codec import MessageExt
from ..queues.dlq import origin_topic, resend_message
from ..queues.retry import DLQ_PREFIX, dlq_topic
from ..store import MessageStore
from .format import JSON, add_store_command
from .main import emit
from .format import print_rows
from .store import open_read_only, open_writable

COLUMNS = ("group", "queueOffset", "msgId", "originTopic", "originMsgId", "reconsumeTimes", "storeTimestamp")


def dead_letters(store: MessageStore, group: str | None) -> list[tuple[str, MessageExt]]:
    """(group, message) of every dead letter of ``group`` (None: of every group), in DLQ order."""
    out = []
    for topic, qid in sorted(store.queue_keys()):
        if not topic.startswith(DLQ_PREFIX) or (group is not None and topic != dlq_topic(group)):
            continue
        offset = store.min_offset_in_queue(topic, qid)
        end = store.max_offset_in_queue(topic, qid)
        while offset < end:
            res = store.get(topic, qid, offset, 32)
            if not res.messages:
                break
            out += [(topic[len(DLQ_PREFIX):], m) for m in res.messages]
            offset = max(res.next_begin_offset, offset + 1)
    return out


def _row(group: str, m: MessageExt) -> dict[str, Any]:
    return {"group": group, "queueOffset": m.queue_offset, "msgId": m.properties.get("UNIQ_KEY") or m.msg_id,
            "originTopic": origin_topic(m), "originMsgId": m.properties.get("ORIGIN_MESSAGE_ID"),
            "reconsumeTimes": m.reconsume_times, "storeTimestamp": m.store_timestamp}


def cmd_list(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        rows = [_row(g, m) for g, m in dead_letters(store, args.group)]
    if args.format == JSON:
        emit({"deadLetters": rows})
    else:
        print_rows(rows, COLUMNS, args.format)
    return 0


def _chosen(letters: list[tuple[str, MessageExt]], args: argparse.Namespace) -> list[MessageExt]:
    if args.all:
        return [m for _, m in letters]
    chosen = [m for _, m in letters if args.msg_id in (m.msg_id, m.properties.get("UNIQ_KEY"),
                                                       m.properties.get("ORIGIN_MESSAGE_ID"))]
    if not chosen:
        raise CliError(f"{args.store}: no dead letter {args.msg_id!r} in {dlq_topic(args.group)}")
    return chosen


def cmd_resend(args: argparse.Namespace) -> int:
    opener = open_writable if args.execute else open_read_only
    with opener(args) as store:
        chosen = _chosen(dead_letters(store, args.group), args)
        rows = []
        for m in chosen:
            try:
                msg = resend_message(m)
            except ValueError as e:
                raise CliError(f"{args.store}: {e}") from None
            row = {**_row(args.group, m), "resent": False}
            if args.execute:
                res = store.put(msg)
                if not res.ok:
                    raise CliError(f"{args.store}: re-sending {row['msgId']} to {msg.topic} failed: "
                                   f"{res.status.value} (resent so far: {sum(r['resent'] for r in rows)})")
                row["resent"] = True
                row["newOffset"] = res.queue_offset
            rows.append(row)
        if args.execute:
            store.wait_dispatched()
    if args.format == JSON:
        emit({"dryRun": not args.execute, "messages": rows})
    else:
        print_rows(rows, COLUMNS + ("resent",), args.format)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dlq", help="dead letters of consumer groups (%%DLQ%%<group>): list, re-send",
                       description=__doc__.split("\n\n")[0])
    dsub = p.add_subparsers(dest="dlq_command", required=True, metavar="{list,resend}")

    add = functools.partial(add_store_command, dsub)

    q = add("list", cmd_list, "dead letters with the topic and message id they came from")
    q.add_argument("--group", help="only this consumer group's DLQ")
    q = add("resend", cmd_resend, "put dead letters back on their original topic (dry run without --execute)")
    q.add_argument("--group", required=True, help="the consumer group whose DLQ to read")
    which = q.add_mutually_exclusive_group(required=True)
    which.add_argument("--msg-id", help="the dead letter's message id (UNIQ_KEY, offset id or ORIGIN_MESSAGE_ID)")
    which.add_argument("--all", action="store_true", help="every dead letter of the group")
    q.add_argument("--execute", action="store_true", help="really re-send (default: show what would be sent)")
