"""Times on the command line: epoch milliseconds, ISO-8601, or relative to now ("-1h").

Store timestamps are epoch milliseconds, so every time flag ends up as one.
``parse_time_ms`` accepts what operators type:

- ``1700000000000``: epoch milliseconds, as before;
- ``2026-11-25T10:00:00Z``, ``2026-11-25 10:00:00+01:00``, ``2026-11-25``: ISO-8601; without a
  zone the local time zone applies (as Kafka's ``--to-datetime``);
- ``-1h``, ``-30m``, ``-2d``, ``-10s``, ``-500ms``, ``-1w``, ``now``: relative to now.
"""

from __future__ import annotations

import argparse
import re
import time
from datetime import datetime

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_RELATIVE = re.compile(r"^([+-])\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)$")
# What argparse may take as a value although it starts with "-": negative numbers and relative times.
NEGATIVE_VALUE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+(?:\.\d+)?(?:ms|s|m|h|d|w)$")


def parse_time_ms(text: str, now_ms: int | None = None) -> int:
    """``text`` as epoch milliseconds; ValueError says what was expected."""
    s = text.strip()
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    if s.lower() == "now":
        return now_ms
    m = _RELATIVE.match(s.lower())
    if m:
        sign = -1 if m.group(1) == "-" else 1
        return now_ms + sign * int(float(m.group(2)) * _UNITS_MS[m.group(3)])
    iso = s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s
    try:
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: expected epoch milliseconds, ISO-8601 "
                         "(2026-11-25T10:00:00Z) or relative to now (-1h, -30m, -2d, now)") from None
    return int(dt.timestamp() * 1000)  # a naive datetime is local time


def time_arg(text: str) -> int:
    """argparse ``type=`` for time flags: a bad value is a usage error (exit 2, one line)."""
    try:
        return parse_time_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
