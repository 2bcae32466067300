"""Atomic JSON files: every config file the store or broker owns is written through here.

``write_json_atomic`` writes a temp file, fsyncs it, keeps the previous file
as ``.bak``, renames the temp file over the target and fsyncs the directory,
so a power cut leaves either the old or the new file.  ``read_json`` falls
back to ``.bak`` (with a warning) when the file is missing or corrupt.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def fsync_dir(directory: str) -> None:
    """Make a directory's entries (a created, renamed or deleted name) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` and fsync it (the first step of every durable write here)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_file_durably(path: str, data: bytes) -> None:
    """Write a small file in place, fsync it and its directory (a marker file a power cut must not lose)."""
    _write_synced(path, data)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def replace_file_durably(path: str, data: bytes) -> None:
    """Write a small file whole or not at all: a temp file beside it, fsynced, renamed over it, its directory
    fsynced.  An in-place rewrite (:func:`write_file_durably`) cut by a power loss leaves the file torn (the
    queue registry read back with a line of zeros refused the open: store model seed 61036)."""
    tmp = f"{path}.tmp"
    _write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, obj: Any) -> None:
    write_bytes_atomic(path, json.dumps(obj, ensure_ascii=False, indent=2, sort_keys=True).encode("utf-8"))


def write_bytes_atomic(path: str, data: bytes) -> None:
    """``write_json_atomic`` for JSON already encoded (``data`` must be a JSON document)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    _write_synced(tmp, data)
    if os.path.exists(path):
        bak = f"{path}.bak"
        try:
            with open(path, "rb") as src:
                json.loads(src.read().decode("utf-8"))  # only a good file becomes the backup
            os.replace(path, bak)
        except (ValueError, OSError):
            log.warning("%s: current file is corrupt; keeping the older backup", path)
    os.replace(tmp, path)
    fsync_dir(directory)


_UNQUOTED_INT_KEY = re.compile(r'([{,]\s*)(-?\d+)(\s*:)')


def loads_lenient(text: str) -> Any:
    """JSON, or fastjson's JSON with bare integer map keys (RocketMQ writes ``{0:12,1:7}``)."""
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(_UNQUOTED_INT_KEY.sub(r'\1"\2"\3', text))


def read_json(path: str, default: Any = None, loads: Callable[[str], Any] = json.loads) -> Any:
    """The file's JSON, else the backup's (with a warning), else ``default``.

    ``loads`` parses the text (the broker passes one that also takes RocketMQ's fastjson output)."""
    for candidate in (path, f"{path}.bak"):
        try:
            with open(candidate, "rb") as fh:
                value = loads(fh.read().decode("utf-8"))
        except FileNotFoundError:
            continue
        except (ValueError, OSError) as e:
            log.warning("%s: unreadable (%s); trying the backup", candidate, e)
            continue
        if candidate != path:
            log.warning("%s: missing or corrupt; using %s", path, candidate)
        return value
    return default
