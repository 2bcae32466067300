"""``rocketstore tier status|upload STORE``: what of a tiered store is on local disk, in the bucket, or both."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .main import emit
from .format import JSON, TABLE, add_format_flag, print_rows
from .store import open_read_only, open_writable
from ..errors import CliError
from ..storage.index import index_file_size
from ..store import MessageStore


def tier_status(store: MessageStore) -> dict[str, Any]:
    """Per kind of file (commitlog, consumequeue, index): how many files, and bytes, are local only, in the
    tier only, or in both; the tier's offset range and the local one; the last error."""
    tier = store.tier
    if tier is None:
        raise CliError(f"{store.root}: no tieredStoreUri in the store's config (STORE/broker.conf or --config)")
    m = tier.manifest
    rows = []

    def row(kind: str, local: dict[str, int], remote: dict[str, int]) -> None:
        both = set(local) & set(remote)
        lo, ro = set(local) - both, set(remote) - both
        rows.append({"kind": kind, "localOnly": len(lo), "both": len(both), "tierOnly": len(ro),
                     "localOnlyBytes": sum(local[n] for n in lo), "bothBytes": sum(local[n] for n in both),
                     "tierOnlyBytes": sum(remote[n] for n in ro)})

    seg_size = store.config.mappedFileSizeCommitLog
    row("commitlog", {os.path.basename(f.path): f.file_size for f in store.commitlog.queue.files},
        {s.name: s.size for s in m.commitlog} if m else {})
    cq_size = store.config.mappedFileSizeConsumeQueue
    local_cq = {f"{cq.topic}/{cq.queue_id}/{os.path.basename(f.path)}": cq_size
                for cq in store.consume_queues() for f in cq.queue.files}
    row("consumequeue", local_cq,
        {f"{q}/{f.name}": cq_size for q, files in m.consumequeue.items() for f in files} if m else {})
    row("index", {os.path.basename(f.path): len(f.mm) for f in store.index_service.files},
        {i.name: index_file_size(store.config.maxHashSlotNum, store.config.maxIndexNum) for i in m.index} if m else {})
    blocked = tier.upload_blocked
    if blocked is None:  # a read-only open runs no upload round: look at the next segment to upload
        from ..tier.upload import upload_blocker
        sealed = store.commitlog.queue.files[:-1]
        nxt = [f for f in sealed if f.file_from_offset == m.end_offset] if m is not None and m.commitlog else \
            sealed[:1]
        blocked = upload_blocker(nxt[0]) if nxt else None
    sealed_pending = sum(1 for f in store.commitlog.queue.files[:-1]
                         if not tier.has_segment(f.file_from_offset, seg_size))
    return {"store": store.root, **tier.status(), "localMinOffset": store.min_phy_offset(),
            "maxOffset": store.max_phy_offset(), "readableFrom": store.min_readable_offset(),
            "sealedNotUploaded": sealed_pending, "files": rows, "uploadBlocked": blocked}


def cmd_status(args: argparse.Namespace) -> int:
    with open_read_only(args) as store:
        st = tier_status(store)
    if args.format == JSON:
        emit(st)
    else:
        span = "none yet" if st["minOffset"] is None else f"[{st['minOffset']}, {st['endOffset']})"
        print(f"tier {st['uri']}  offsets {span}  local from {st['localMinOffset']}"
              f"  max {st['maxOffset']}  sealed segments not uploaded: {st['sealedNotUploaded']}"
              + (f"  ERROR: {st['error']}" if st["error"] else "")
              + (f"  UPLOAD BLOCKED: {st['uploadBlocked']}" if st["uploadBlocked"] else ""))
        print_rows(st["files"], ("kind", "localOnly", "both", "tierOnly", "localOnlyBytes", "bothBytes",
                                 "tierOnlyBytes"), args.format)
    return 1 if st["error"] or st["uploadBlocked"] else 0


def cmd_upload(args: argparse.Namespace) -> int:
    from ..tier.upload import upload_round
    with open_writable(args, start_services=False) as store:
        if store.tier is None:
            raise CliError(f"{store.root}: no tieredStoreUri in the store's config (STORE/broker.conf or --config)")
        if store.tier.error is not None and not (store.tier.fault and store.tier.republishable):
            raise CliError(store.tier.error)  # (a lost or stale tier.json: upload_round republishes it)
        store.commitlog.flush(0)
        done = upload_round(store.files)
        emit({"store": store.root, "uploaded": done, **store.tier.status()})
        if store.tier.upload_blocked is not None:
            raise CliError(store.tier.upload_blocked)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    tier = sub.add_parser("tier", help="tiered storage: segments copied to s3://bucket/prefix (tieredStoreUri)")
    tsub = tier.add_subparsers(dest="tier_command", metavar="TIER_COMMAND", required=True)
    for name, handler, text in (
            ("status", cmd_status, "what is local, in the tier, or both, per kind of file (exit 1 when the tier "
             "cannot be read or is refused, or a damaged segment blocks uploads)"),
            ("upload", cmd_upload, "upload every sealed segment (and its queue and index files) now, with the "
             "store closed to other writers")):
        p = tsub.add_parser(name, help=text, description=text)
        p.add_argument("store", metavar="STORE", help="store root directory (storePathRootDir)")
        p.add_argument("--config", metavar="FILE", help="broker.conf style file (key=value), over STORE/broker.conf")
        if name == "status":
            add_format_flag(p, TABLE)
        p.set_defaults(handler=handler)
