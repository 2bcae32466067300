"""Output formats of the CLI: JSON for machines, aligned tables for people, CSV for spreadsheets.

``--format json`` keeps each command's JSON document; ``table`` and ``csv``
print one row per item (a queue, a message, a group's queue).  Bodies in rows
are UTF-8 text when they decode as UTF-8, else base64; ``bodyEncoding`` says
which (the same rule as ``--text-bodies`` for JSON).
"""

from __future__ import annotations

import argparse
import base64
import csv
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from ..format.codec import MessageExt

TABLE, JSON, CSV = "table", "json", "csv"
FORMATS = (TABLE, JSON, CSV)
MESSAGE_COLUMNS = ("topic", "queueId", "queueOffset", "commitLogOffset", "storeTime", "msgId", "tags", "keys",
                   "bodyLength", "bodyEncoding", "body")
_TABLE_CELL_MAX = 80


def add_format_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--format", choices=FORMATS, default=default,
                   help=f"output: {TABLE} (aligned columns), {JSON} or {CSV} (default {default})")
    p.add_argument("--json", dest="format", action="store_const", const=JSON, help="same as --format json")


def add_store_command(sub: Any, name: str, handler: Any, help: str,
                      default_format: str = TABLE) -> argparse.ArgumentParser:
    """A subcommand on a store: STORE, --config and the output format (the admin verbs and `dlq` share it)."""
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("store", metavar="STORE", help="store root directory (storePathRootDir)")
    p.add_argument("--config", metavar="FILE", help="broker.conf style file (key=value)")
    add_format_flag(p, default_format)
    p.set_defaults(handler=handler)
    return p


def add_text_bodies_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-bodies", action="store_true",
                   help='JSON: bodies as UTF-8 text when they are valid UTF-8, else base64, with "bodyEncoding" '
                        "saying which (import reads both)")


def body_text(body: bytes) -> tuple[str, str]:
    """(text, encoding): the body as UTF-8 text when it is valid UTF-8, else as base64."""
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), "base64"


def message_json(m: MessageExt, with_body: bool, text_bodies: bool) -> dict[str, Any]:
    """``MessageExt.to_json`` (dump's fields), with the body as text when asked and possible."""
    d = m.to_json(with_body)
    if text_bodies and with_body and m.body is not None:
        text, enc = body_text(m.body)
        d["body"], d["bodyEncoding"] = text, enc
    return d


def iso_time(ms: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC with milliseconds."""
    try:
        return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace(
            "+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return str(ms)


def message_row(m: MessageExt, with_body: bool = True) -> dict[str, Any]:
    row: dict[str, Any] = {"topic": m.topic, "queueId": m.queue_id, "queueOffset": m.queue_offset,
                           "commitLogOffset": m.commit_log_offset, "storeTime": iso_time(m.store_timestamp),
                           "msgId": m.msg_id, "tags": m.tags or "", "keys": m.keys or "",
                           "bodyLength": m.body_length, "bodyEncoding": "", "body": ""}
    if with_body and m.body is not None:
        row["body"], row["bodyEncoding"] = body_text(m.body)
    return row


def _cell(v: Any, limit: int | None) -> str:
    s = "" if v is None else str(v)
    s = s.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
    if limit is not None and len(s) > limit:
        s = s[:limit - 3] + "..."
    return s


def print_rows(rows: Iterable[dict[str, Any]], columns: Sequence[str], fmt: str) -> None:
    """Rows as an aligned table (numbers right-aligned, long cells cut) or as CSV with a header."""
    out = sys.stdout
    if fmt == CSV:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
        return
    rows = list(rows)
    cells = [[_cell(r.get(c), _TABLE_CELL_MAX) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), int) for r in rows) and rows != [] for c in columns]
    out.write("  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(columns, widths, numeric)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(row, widths, numeric)).rstrip() + "\n")
