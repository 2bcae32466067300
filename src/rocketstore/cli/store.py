"""Store subcommands: init, dump, state, get, query, offset-by-time, verify, put, import, recover, retention, admin."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .main import emit, load_config
from .format import JSON, MESSAGE_COLUMNS, add_format_flag, add_text_bodies_flag, message_json, message_row, \
print_rows
from ..errors import CliError, StoreError
from ..config import PRESETS, StoreConfig
from ..storage.geometry import init_store, reserved_bytes
from ..storage.consume_queue import LOWER, UPPER
from ..format.message import GetMessageStatus, Message, parse_tag_filter
from .progress import progress_bar
from ..selection import Selection
from ..store import MessageStore
from .timeparse import time_arg


def nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must not be negative")
    return v


def _positive(text: str) -> int:
    v = nonneg(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def open_read_only(args: argparse.Namespace) -> MessageStore:
    return MessageStore.open(args.store, load_config(getattr(args, "config", None)), read_only=True)


def open_writable(args: argparse.Namespace, **kw: Any) -> MessageStore:
    return MessageStore.open(args.store, load_config(getattr(args, "config", None)),
                             allow_quarantine=getattr(args, "allow_quarantine", False), **kw)


def cmd_init(args: argparse.Namespace) -> int:
    """Create a store directory holding a broker.conf with a preset geometry; every later open reads it."""
    created = init_store(args.store, args.preset)
    emit({"store": args.store, "preset": args.preset, "created": created, **PRESETS[args.preset]})
    return 0


# ---------------------------------------------------------------- readers

def cmd_dump(args: argparse.Namespace) -> int:
    import json
    sel = selection_from_args(args)
    out = sys.stdout
    skipped: list[int] = []

    def skip(offset: int, problem: str) -> None:
        skipped.append(offset)
        sys.stderr.write(f"rocketstore: skipped damaged record at commitlog offset {offset}: {problem}\n")

    with open_read_only(args) as store:
        n = size = 0
        more = None
        if args.follow:
            from ..tail_view import follower
            more = follower(store, args.interval, out.flush, until=args.to_time)
        try:
            for msg in sel.scan(store, read_body=not args.no_body, more=more,
                                on_damaged=skip if args.skip_damaged else None):
                out.write(json.dumps(message_json(msg, not args.no_body, args.text_bodies),
                                     ensure_ascii=False) + "\n")
                n += 1
                size += msg.size
        except StoreError as e:
            raise CliError(str(e)) from None
        report = store.recovery_report
        if not sel.reached(n, size) and report is not None and report.stopped_because:
            raise CliError(f"scan stopped at commitlog offset {report.process_offset}: {report.stopped_because}")
    if skipped:
        sys.stderr.write(f"rocketstore: dump: {n} message(s) written, {len(skipped)} damaged record(s) skipped\n")
        return 1
    return 0


def selection_from_args(args: argparse.Namespace) -> Selection:
    """The --topic/--from-offset/--from-time/--to-time/--max-messages/--max-bytes flags as a Selection."""
    limit = args.max_messages if args.max_messages is not None else getattr(args, "limit", None)
    return Selection(topic=args.topic, from_offset=getattr(args, "from_offset", None), from_time=args.from_time,
                     to_time=args.to_time, max_messages=limit, max_bytes=args.max_bytes)


def add_selection_flags(p: argparse.ArgumentParser) -> None:
    """The flags of selection_from_args (shared by dump and spark export)."""
    p.add_argument("--topic", help="only this topic")
    p.add_argument("--max-messages", type=nonneg, metavar="N", help="at most N messages")
    p.add_argument("--max-bytes", type=_positive, metavar="N", help="stop once N bytes of records are taken")
    p.add_argument("--from-time", type=time_arg, metavar="TIME", help="store time to start at: epoch ms, ISO-8601 "
                   "or relative (-1h) (seeks through the consume queues)")
    p.add_argument("--to-time", type=time_arg, metavar="TIME", help="store time to stop after (as --from-time)")


def cmd_state(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        state = store.state()
    if args.format == JSON:
        emit(state)
    else:
        print_rows(state["queues"], ("topic", "queueId", "minOffsetInQueue", "maxOffsetInQueue",
                                     "messageTotalInQueue"), args.format)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        r = store.get(args.topic, args.queue_id, args.offset, args.max, parse_tag_filter(args.tags),
                      read_body=not args.no_body)
        report = store.recovery_report
        cut = report.queues_truncated.get(f"{args.topic}-{args.queue_id}") if report is not None else None
        if cut and report.stopped_because and r.status in (GetMessageStatus.OFFSET_OVERFLOW_ONE,
                                                            GetMessageStatus.OFFSET_OVERFLOW_BADLY):
            raise CliError(f"{args.topic}/{args.queue_id}: {cut} message(s) from queue offset {r.max_offset} on "
                           f"are past commitlog offset {report.process_offset}, where the record check stopped: "
                           f"{report.stopped_because}")
        _emit_messages(args, r.to_json(not args.no_body), r.messages)
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        r = store.query(args.topic, args.key, args.max, args.begin, args.end, read_body=not args.no_body)
        _emit_messages(args, r.to_json(not args.no_body), r.messages)
    return 0


def _emit_messages(args: argparse.Namespace, doc: dict[str, Any], messages: list[Any]) -> None:
    """A get/query result: the JSON document (bodies as text with --text-bodies), or one row per message."""
    if args.format != JSON:
        print_rows([message_row(m, not args.no_body) for m in messages], MESSAGE_COLUMNS, args.format)
        return
    if args.text_bodies:
        doc["messages"] = [message_json(m, not args.no_body, True) for m in messages]
    emit(doc)


def cmd_offset_by_time(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        emit({"offset": store.offset_by_time(args.topic, args.queue_id, args.timestamp, args.boundary)})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..recovery.verify import verify_store
    if args.dry_run and not args.repair:
        raise CliError("--dry-run goes with --repair: verify alone never writes")
    if args.repair:
        from ..recovery.repair import repair_store
        result = repair_store(args.store, load_config(args.config), dry_run=args.dry_run)
    else:
        with open_read_only(args) as store:
            total = sum(f.file_size for f in store.commitlog.queue.files)
            with progress_bar(total, "verify", unit="B") as bar:
                result = verify_store(store.files, bar)
    if args.json:
        emit(result)
    else:
        print_verify_table(result)
    return 0 if result["ok"] else 1


def print_verify_table(result: dict[str, Any]) -> None:
    rows = [("segments", result["segments"]), ("records", result["records"]),
            ("bytes checked", result["bytesChecked"]), ("consume queues", result["consumeQueues"]),
            ("consume-queue units", result["consumeQueueUnits"]), ("index files", result["indexFiles"]),
            ("index entries", result["indexEntries"]), ("problems", len(result["problems"]))]
    if "repaired" in result:
        rows.append(("would repair" if result.get("dryRun") else "repaired", ", ".join(result["repaired"]) or "nothing"))
        rows.append(("records not kept", len(result["lost"])))
        if result.get("restored"):
            rows.append(("from the tier's copy", len(result["restored"])))
    if result.get("quarantine"):
        rows.append(("originals kept in", result["quarantine"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        sys.stdout.write(f"{k:<{width}}  {v}\n")
    for s in result.get("lost", []):
        sys.stdout.write(f"  {'not kept':<15} {s['file']} @ {s['offset']} ({s['length']} bytes, {s['action']}): "
                         f"{s['reason']}\n")
    for s in result.get("restored", []):
        sys.stdout.write(f"  {'from the tier':<15} {s['file']} @ {s['offset']} ({s['length']} bytes): {s['reason']}; "
                         "the tier's intact copy written back\n")
    for g in result.get("gaps", []):
        sys.stdout.write(f"  {'gap':<15} {g['topic']}-{g['queueId']} queue offsets {g['from']}..{g['to']}: no record "
                         "left in the commitlog\n")
    for u in result.get("unplaced", []) + result.get("suspect", []):
        why = u.get("reason") or ", ".join(f"{k} reads {v['read']!r}, old unit says {v['unitSays']!r}"
                                           for k, v in u["fields"].items())
        sys.stdout.write(f"  {'kept as it reads':<15} record @ {u.get('commitLogOffset', u.get('offset'))}: {why}\n")
    for k in result.get("kept", []):
        sys.stdout.write(f"  {'kept':<15} {k['file']}: {k['detail']}\n")
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
    emit({**r.to_json(), "reservedBytes": reserved_bytes(args.store)["total"]})
    if not r.ok:
        raise CliError(f"put refused: {r.status.value}: {r.error}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import os
    from ..importer import import_file
    if os.path.isdir(args.source):
        raise CliError(f"{args.source}: a directory, not a dump file (JSON lines)")
    passes = 1 if args.continue_on_error else 2  # validate, then write
    total = os.path.getsize(args.source) * passes  # (an unreadable file fails here, before the store is opened)
    created = not os.path.exists(args.store)
    with open_writable(args) as store:
        try:
            with progress_bar(total, "import", unit="B") as bar:
                result = import_file(store, args.source, args.continue_on_error, bar)
        except (StoreError, OSError):  # (OSError: the file became unreadable after the size was taken)
            unused = created and store.max_phy_offset() == 0
            store.close()
            if unused:  # the store this command made and never wrote to: leave no trace of it either
                import shutil
                shutil.rmtree(args.store)
            raise
        store.wait_dispatched()
        emit({"imported": result.imported, "skipped": result.skipped, "maxPhyOffset": store.max_phy_offset()})
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    store = open_writable(args, start_services=False)
    try:
        report = store.recovery_report
        state = store.state()
    finally:
        store.close()
    emit({"recovery": report.to_json() if report else None, "queuesRefilled": store.queues_to_rebuild,
          "state": state})
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    from ..services.clean import retention_plan
    with open_read_only(args) as store:
        plan = retention_plan(store.files, store.clean_service)
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


def cmd_stats(args: argparse.Namespace) -> int:
    import os
    import time
    from ..services.metrics import not_live_reason, read_metrics
    if not os.path.isdir(args.store):
        raise CliError(f"{args.store}: " + ("not a directory (a store is a directory)" if os.path.exists(args.store)
                                            else "no such store directory"))
    if not args.live:
        with open_read_only(args) as store:
            state = store.state()
            segments = len(store.commitlog.queue.files)
            disk = store.disk_guard.to_json()
        topics: dict[str, int] = {}
        for q in state["queues"]:
            topics[q["topic"]] = topics.get(q["topic"], 0) + q["messageTotalInQueue"]
        out = {"segments": segments, "minPhyOffset": state["minPhyOffset"], "maxPhyOffset": state["maxPhyOffset"],
               "topics": topics, "disk": disk, "live": read_metrics(args.store)}
        if args.json:
            emit(out)
        else:
            for t, n in sorted(topics.items()):
                sys.stdout.write(f"{t:<40} {n:>12,} messages\n")
            sys.stdout.write(f"{'commitlog':<40} {out['maxPhyOffset'] - out['minPhyOffset']:>12,} bytes in "
                             f"{segments} segment(s)\n")
            sys.stdout.write(f"{'disk used':<40} {disk['usedRatio'] * 100:>11.1f} %\n")
        return 0
    shown = 0
    header = f"{'time':<9} {'puts':>10} {'put p50/p99 ms':>16} {'lock p99 ms':>12} {'flush lag':>12} " \
             f"{'dispatch lag':>13} {'disk':>6}  state"
    while args.count is None or shown < args.count:
        m = read_metrics(args.store)
        if m is None:
            raise CliError(f"{args.store}: {not_live_reason(args.store)}")
        if args.json:
            emit(m)
        else:
            if shown % 20 == 0:
                sys.stdout.write(header + "\n")
            pl, lh = m["putLatency"], m["lockHold"]
            sys.stdout.write(
                f"{time.strftime('%H:%M:%S', time.localtime(m['time'] / 1000)):<9} {m['puts']:>10} "
                f"{pl.get('p50Ms', 0):>7.3f}/{pl.get('p99Ms', 0):<8.3f} {lh.get('p99Ms', 0):>12.4f} "
                f"{m['flushLagBytes']:>12} {m['dispatchBehindBytes']:>13} {m['disk']['usedRatio'] * 100:>5.1f}%  "
                f"{'writeable' if m['writeable'] else 'REFUSING: ' + str(m['notWriteableReason'])}"
                f"{'; INDEX: ' + m['indexError'] if m.get('indexError') else ''}\n")
            sys.stdout.flush()
        shown += 1
        if args.count is None or shown < args.count:
            time.sleep(args.interval)
    return 0


# ---------------------------------------------------------------- wiring

def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, handler: Any, help: str, config: bool = True, writes: bool = False,
            parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help)
        p.add_argument("store", metavar="STORE", help="store root directory (storePathRootDir)")
        if config:
            p.add_argument("--config", metavar="FILE", help="broker.conf style file (key=value), over "
                           "STORE/broker.conf; geometry keys it leaves out are measured from the files")
        if writes:
            p.add_argument("--allow-quarantine", action="store_true",
                           help="let an explicit geometry key win over the files, and move more than one file "
                           "of a kind to STORE/quarantine/ (refused otherwise)")
        p.set_defaults(handler=handler)
        return p

    p = add("init", cmd_init, "create a store whose STORE/broker.conf fixes its geometry", config=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="default: RocketMQ's (1 GiB segments, 420 MB index files); small: 64 MiB segments, "
                   "600 KB consume-queue files, 4.2 MB index files")

    p = add("dump", cmd_dump, "every message in commitlog order, one JSON object per line (each record is checked: "
            "body CRC, and its PHYSICALOFFSET against its position; a damaged record or a stale copy of another "
            "stops the dump with exit status 2)")
    p.add_argument("--no-body", action="store_true", help="omit bodies (they are still checked against their CRC)")
    p.add_argument("--skip-damaged", action="store_true", help="report each damaged record on stderr, resume at "
                   "the next intact record, and exit 1 if any was skipped")
    add_selection_flags(p)
    p.add_argument("--from-offset", type=nonneg, metavar="N", help="start at this commitlog offset")
    p.add_argument("--limit", type=nonneg, metavar="N", help="same as --max-messages")
    add_text_bodies_flag(p)
    p.add_argument("--follow", action="store_true", help="at the end, wait for and print new messages "
                   "(another process writes; stops at --to-time or the limits)")
    p.add_argument("--interval", type=float, default=0.2, metavar="S", help="--follow: how often to look for new "
                   "records (default 0.2 s)")

    p = add("state", cmd_state, "offsets, checkpoint and queues as JSON")
    add_format_flag(p, JSON)

    p = add("get", cmd_get, "read a consume queue (RocketMQ's getMessage)")
    p.add_argument("--topic", required=True, help="topic to read")
    p.add_argument("--queue-id", type=nonneg, required=True, metavar="Q", help="queue id within the topic")
    p.add_argument("--offset", type=nonneg, required=True, metavar="N", help="queue offset to start at")
    p.add_argument("--max", type=_positive, default=32, metavar="N", help="at most N messages (default 32)")
    p.add_argument("--tags", help='tag filter, e.g. "TagA||TagB" or "*"')
    p.add_argument("--no-body", action="store_true", help="omit bodies")
    add_format_flag(p, JSON)
    add_text_bodies_flag(p)

    p = add("query", cmd_query, "messages by key or UNIQ_KEY through the index (queryMessage)")
    p.add_argument("--topic", required=True, help="topic of the messages")
    p.add_argument("--key", required=True, help="a key (KEYS) or UNIQ_KEY")
    p.add_argument("--max", type=_positive, default=32, metavar="N", help="at most N messages (default 32)")
    p.add_argument("--begin", type=time_arg, default=0, metavar="TIME",
                   help="earliest store time: epoch ms, ISO-8601 or -1h style")
    p.add_argument("--end", type=time_arg, default=2 ** 63 - 1, metavar="TIME",
                   help="latest store time: epoch ms, ISO-8601 or -1h style")
    p.add_argument("--no-body", action="store_true", help="omit bodies")
    add_format_flag(p, JSON)
    add_text_bodies_flag(p)

    p = add("offset-by-time", cmd_offset_by_time, "queue offset for a store timestamp")
    p.add_argument("--topic", required=True, help="topic of the queue")
    p.add_argument("--queue-id", type=nonneg, required=True, metavar="Q", help="queue id within the topic")
    p.add_argument("--timestamp", type=time_arg, required=True, metavar="TIME",
                   help="store time: epoch ms, ISO-8601 or -1h style")
    p.add_argument("--boundary", choices=[LOWER, UPPER], default=LOWER,
                   help="which offset when several messages share the time (default lower)")

    p = add("verify", cmd_verify, "CRC-check records, cross-check consume queues and index (exit 1 if not OK)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--repair", action="store_true", help="offline: rewrite damaged commitlog spans so every valid "
                   "record after them stays readable (originals kept in quarantine/), rebuild consume queues, "
                   "index and checkpoint; exit 1 if any record could not be kept")
    p.add_argument("--dry-run", action="store_true", help="with --repair: report what it would do, write nothing")

    p = add("put", cmd_put, "put one message and print the result (and the bytes the store's files reserve)",
            writes=True)
    p.add_argument("--topic", required=True, help="topic to put into")
    p.add_argument("--queue-id", type=nonneg, default=0, metavar="Q", help="queue id (default 0)")
    p.add_argument("--tags", help="the message's tag")
    p.add_argument("--keys", help='space-separated keys, e.g. "k1 k2"')
    p.add_argument("--property", action="append", default=[], metavar="K=V", help="a user property (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--body", help="body text (UTF-8); without --body or --body-file the body is read from stdin")
    g.add_argument("--body-file", metavar="FILE", help="body from this file")
    g.add_argument("-", dest="stdin_body", action="store_true", help="body from stdin (the default)")

    p = add("import", cmd_import, "replay dump output (JSON lines) into a store, byte for byte", writes=True)
    p.add_argument("--from", dest="source", required=True, metavar="FILE.jsonl",
                   help="dump output or a golden expected.jsonl")
    p.add_argument("--continue-on-error", action="store_true",
                   help="skip bad lines (each named on stderr) instead of importing nothing")

    add("recover", cmd_recover, "open with recovery, close cleanly, print what was recovered and the state",
        writes=True)

    p = add("retention", cmd_retention, "dry run of expired-file cleaning: what would be deleted and why")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")

    p = add("stats", cmd_stats, "messages per topic and disk use; --live: put latency, lock hold, flush and "
            "dispatch lag of the process that has the store open")
    p.add_argument("--live", action="store_true", help="follow the live metrics of the open store")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between --live samples")
    p.add_argument("--count", type=_positive, metavar="N", help="stop after N samples")

    admin = sub.add_parser("admin", help="administrative commands (mqadmin counterparts)")
    asub = admin.add_subparsers(dest="admin_command", metavar="ADMIN_COMMAND")
    asub.required = True
    add("delete-expired", cmd_delete_expired, "delete expired commitlog files now (deleteExpiredCommitLog)",
        writes=True, parent=asub)


__all__ = ["register", "StoreConfig"]
