"""Store subcommands: dump, state, get, query, offset-by-time, verify, put, import, recover, retention, admin."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .cli import CliError, emit, load_config
from .config import StoreConfig
from .consume_queue import LOWER, UPPER
from .message import Message, parse_tag_filter
from .progress import progress_bar
from .store import MessageStore, iter_json_lines


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must not be negative")
    return v


def _positive(text: str) -> int:
    v = _nonneg(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def open_read_only(args: argparse.Namespace) -> MessageStore:
    return MessageStore.open(args.store, load_config(getattr(args, "config", None)), read_only=True)


def open_writable(args: argparse.Namespace, **kw: Any) -> MessageStore:
    return MessageStore.open(args.store, load_config(getattr(args, "config", None)), **kw)


# ---------------------------------------------------------------- readers

def cmd_dump(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        n = 0
        out = sys.stdout
        import json
        for _off, _size, msg, problem in store.messages(args.from_offset if args.from_offset is not None else -1,
                                                        read_body=not args.no_body):
            if msg is None:
                raise CliError(f"scan stopped: {problem}")
            if args.topic is not None and msg.topic != args.topic:
                continue
            out.write(json.dumps(msg.to_json(not args.no_body), ensure_ascii=False) + "\n")
            n += 1
            if args.limit is not None and n >= args.limit:
                return 0
        report = store.recovery_report
        if report is not None and report.stopped_because:
            raise CliError(f"scan stopped at commitlog offset {report.process_offset}: {report.stopped_because}")
    return 0


def cmd_state(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        emit(store.state())
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        r = store.get(args.topic, args.queue_id, args.offset, args.max, parse_tag_filter(args.tags),
                      read_body=not args.no_body)
        emit(r.to_json(not args.no_body))
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        r = store.query(args.topic, args.key, args.max, args.begin, args.end, read_body=not args.no_body)
        emit(r.to_json(not args.no_body))
    return 0


def cmd_offset_by_time(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        emit({"offset": store.offset_by_time(args.topic, args.queue_id, args.timestamp, args.boundary)})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_store
    if args.repair:
        from .repair import repair_store
        result = repair_store(args.store, load_config(args.config))
    else:
        with open_read_only(args) as store:
            total = sum(f.file_size for f in store.commitlog.queue.files)
            with progress_bar(total, "verify", unit="B") as bar:
                result = verify_store(store, bar)
    if args.json:
        emit(result)
    else:
        _print_verify_table(result)
    return 0 if result["ok"] else 1


def _print_verify_table(result: dict[str, Any]) -> None:
    rows = [("segments", result["segments"]), ("records", result["records"]),
            ("bytes checked", result["bytesChecked"]), ("consume queues", result["consumeQueues"]),
            ("consume-queue units", result["consumeQueueUnits"]), ("index files", result["indexFiles"]),
            ("index entries", result["indexEntries"]), ("problems", len(result["problems"]))]
    if "repaired" in result:
        rows.append(("repaired", ", ".join(result["repaired"]) or "nothing"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        sys.stdout.write(f"{k:<{width}}  {v}\n")
    for p in result["problems"]:
        sys.stdout.write(f"  {p['kind']:<15} {p['file']} @ {p['offset']}: {p['detail']}\n")
    sys.stdout.write("OK\n" if result["ok"] else "INCONSISTENT\n")


# ---------------------------------------------------------------- writers

def cmd_put(args: argparse.Namespace) -> int:
    if args.body_file is not None:
        with open(args.body_file, "rb") as fh:
            body = fh.read()
    elif args.body is not None:
        body = args.body.encode("utf-8")
    else:
        body = sys.stdin.buffer.read()
    props = {}
    for kv in args.property:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise CliError(f"--property {kv!r}: expected key=value")
        props[k] = v
    msg = Message(args.topic, body, queue_id=args.queue_id, tags=args.tags, keys=args.keys, properties=props)
    with open_writable(args) as store:
        r = store.put(msg)
        store.wait_dispatched()
    emit(r.to_json())
    if not r.ok:
        raise CliError(f"put refused: {r.status.value}: {r.error}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .importer import import_messages
    lines = list(iter_json_lines(args.source))
    with open_writable(args) as store:
        with progress_bar(len(lines), "import", unit="msg") as bar:
            results = import_messages(store, lines, bar)
        store.wait_dispatched()
        emit({"imported": sum(r.msg_num for r in results), "maxPhyOffset": store.max_phy_offset()})
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    store = open_writable(args, start_services=False)
    try:
        report = store.recovery_report
        state = store.state()
    finally:
        store.close()
    emit({"recovery": report.to_json() if report else None, "state": state})
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    from .clean import retention_plan
    with open_read_only(args) as store:
        plan = retention_plan(store)
    if args.json:
        emit(plan)
        return 0
    for seg in plan["segments"]:
        sys.stdout.write(f"{seg['file']}  age {seg['ageHours']:8.1f} h  {seg['size']:>12} B  "
                         f"{'DELETE' if seg['wouldDelete'] else 'keep  '}  {seg['reason']}\n")
    d = plan["disk"]
    sys.stdout.write(f"disk used {d['usedRatio'] * 100:.1f} %  (max {d['diskMaxUsedSpaceRatio'] * 100:.0f} %, "
                     f"forcibly {d['diskSpaceCleanForciblyRatio'] * 100:.0f} %, "
                     f"warning {d['diskSpaceWarningLevelRatio'] * 100:.0f} %)\n")
    for w in plan["warnings"]:
        sys.stdout.write(f"warning: {w}\n")
    return 0


def cmd_delete_expired(args: argparse.Namespace) -> int:
    with open_writable(args, start_services=False) as store:
        deleted = store.delete_expired_commit_log()
        emit({"deleted": deleted, "state": store.state()})
    return 0


# ---------------------------------------------------------------- wiring

def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, handler: Any, help: str, config: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("store", metavar="STORE", help="store root directory (storePathRootDir)")
        if config:
            p.add_argument("--config", metavar="FILE", help="broker.conf style file (key=value)")
        p.set_defaults(handler=handler)
        return p

    p = add("dump", cmd_dump, "every message in commitlog order, one JSON object per line")
    p.add_argument("--no-body", action="store_true", help="omit bodies")
    p.add_argument("--topic", help="only this topic")
    p.add_argument("--from-offset", type=_nonneg, metavar="N", help="start at this commitlog offset")
    p.add_argument("--limit", type=_nonneg, metavar="N", help="at most N messages")

    add("state", cmd_state, "offsets, checkpoint and queues as JSON")

    p = add("get", cmd_get, "read a consume queue (RocketMQ's getMessage)")
    p.add_argument("--topic", required=True)
    p.add_argument("--queue-id", type=_nonneg, required=True)
    p.add_argument("--offset", type=_nonneg, required=True)
    p.add_argument("--max", type=_positive, default=32)
    p.add_argument("--tags", help='tag filter, e.g. "TagA||TagB" or "*"')
    p.add_argument("--no-body", action="store_true")

    p = add("query", cmd_query, "messages by key or UNIQ_KEY through the index (queryMessage)")
    p.add_argument("--topic", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--max", type=_positive, default=32)
    p.add_argument("--begin", type=_int, default=0, metavar="MS")
    p.add_argument("--end", type=_int, default=2 ** 63 - 1, metavar="MS")
    p.add_argument("--no-body", action="store_true")

    p = add("offset-by-time", cmd_offset_by_time, "queue offset for a store timestamp")
    p.add_argument("--topic", required=True)
    p.add_argument("--queue-id", type=_nonneg, required=True)
    p.add_argument("--timestamp", type=_int, required=True, metavar="MS")
    p.add_argument("--boundary", choices=[LOWER, UPPER], default=LOWER)

    p = add("verify", cmd_verify, "CRC-check records, cross-check consume queues and index (exit 1 if not OK)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--repair", action="store_true", help="rebuild consume queues, index and checkpoint offline")

    p = add("put", cmd_put, "put one message and print the result")
    p.add_argument("--topic", required=True)
    p.add_argument("--queue-id", type=_nonneg, default=0)
    p.add_argument("--tags")
    p.add_argument("--keys", help='space-separated keys, e.g. "k1 k2"')
    p.add_argument("--property", action="append", default=[], metavar="K=V")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--body", help="body text (UTF-8)")
    g.add_argument("--body-file", metavar="FILE")

    p = add("import", cmd_import, "replay dump output (JSON lines) into a store, byte for byte")
    p.add_argument("--from", dest="source", required=True, metavar="FILE.jsonl")

    add("recover", cmd_recover, "open with recovery, close cleanly, print what was recovered and the state")

    p = add("retention", cmd_retention, "dry run of expired-file cleaning: what would be deleted and why")
    p.add_argument("--json", action="store_true")

    admin = sub.add_parser("admin", help="administrative commands (mqadmin counterparts)")
    asub = admin.add_subparsers(dest="admin_command", metavar="ADMIN_COMMAND")
    asub.required = True
    p = asub.add_parser("delete-expired", help="delete expired commitlog files now (deleteExpiredCommitLog)")
    p.add_argument("store", metavar="STORE")
    p.add_argument("--config", metavar="FILE")
    p.set_defaults(handler=cmd_delete_expired)


__all__ = ["register", "StoreConfig"]
