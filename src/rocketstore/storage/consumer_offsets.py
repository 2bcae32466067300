"""Consumer group progress in RocketMQ's ``config/consumerOffset.json`` (ConsumerOffsetManager).

Layout: ``{"offsetTable": {"<topic>@<group>": {"<queueId>": <offset>}}, "dataVersion": {...}}``.  The
offset is the first queue offset the group has not consumed.  RocketMQ writes
the file with fastjson, whose integer map keys come out unquoted
(``{0:12,1:7}``); such files are read too.  Writes go through
:func:`rocketstore.storage.jsonfile.write_json_atomic` (temp file, fsync, rename, ``.bak``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from ..errors import StoreLoadError
from .jsonfile import loads_lenient, read_json, write_json_atomic

log = logging.getLogger(__name__)


def read_json_lenient(path: str) -> Any:
    """Like jsonfile.read_json (falls back to ``.bak`` with a warning) but accepting fastjson output."""
    return read_json(path, loads=loads_lenient)


class ConsumerOffsetManager:
    """Committed offsets per (topic, group, queue)."""

    def __init__(self, config_dir: str, *, strict: bool = False, problems: list[str] | None = None) -> None:
        """Load the file (or its ``.bak``).

        The file is written by other programs, so its shape is checked.  An entry that is not
        ``"topic@group": {queueId: offset}`` raises StoreLoadError naming it when ``strict``; else it is
        skipped, described in ``problems`` when given, otherwise logged (the broker)."""
        self.path = os.path.join(config_dir, "consumerOffset.json")
        self.table: dict[str, dict[int, int]] = {}
        self.version = 0
        self.dirty = False
        self._fastjson = False
        self._strict = strict
        self._problems = problems
        text: str | None = None
        try:
            with open(self.path, "rb") as fh:
                text = fh.read().decode("utf-8")
            json.loads(text)
        except ValueError:  # not JSON (or not UTF-8): fastjson's own output, or a corrupt file
            try:
                if text is not None:
                    loads_lenient(text)
                    self._fastjson = True  # RocketMQ's own file: kept as the .bak on the first write
            except ValueError:
                pass  # corrupt: read from the .bak below, which must stay the backup
        except OSError:
            pass
        data = read_json_lenient(self.path)
        if data is None:
            return
        if not isinstance(data, dict):
            return self._bad(f"the file holds a {type(data).__name__}, not an object with an offsetTable")
        table = data.get("offsetTable") or {}
        if not isinstance(table, dict):
            return self._bad(f"offsetTable is a {type(table).__name__}, not an object")
        version = data.get("dataVersion") or {}
        counter = version.get("counter", 0) if isinstance(version, dict) else 0
        self.version = counter if type(counter) is int else 0
        for key, queues in table.items():
            if "@" not in key or not isinstance(queues, dict):
                self._bad(f"offsetTable[{key!r}] is not a \"topic@group\" key with an object of queue offsets")
                continue
            entry: dict[int, int] = {}
            for qid, off in queues.items():
                if not str(qid).lstrip("-").isdigit() or type(off) is not int:
                    self._bad(f"offsetTable[{key!r}][{qid!r}] = {off!r} is not a queue id with an integer offset")
                    continue
                entry[int(qid)] = off
            self.table[key] = entry

    def _bad(self, what: str) -> None:
        if self._strict:
            raise StoreLoadError(f"{self.path}: {what}")
        if self._problems is not None:
            self._problems.append(f"{self.path}: {what}; consumer positions there are not checked")
        else:
            log.warning("%s: %s; ignored", self.path, what)

    @staticmethod
    def key(topic: str, group: str) -> str:
        return f"{topic}@{group}"

    def get(self, topic: str, group: str, queue_id: int) -> int | None:
        return self.table.get(self.key(topic, group), {}).get(queue_id)

    def commit(self, topic: str, group: str, queue_id: int, offset: int) -> None:
        queues = self.table.setdefault(self.key(topic, group), {})
        if queues.get(queue_id) != offset:
            queues[queue_id] = offset
            self.dirty = True

    def snapshot(self) -> dict[str, Any] | None:
        """The file's content if something changed since the last snapshot, else None."""
        if not self.dirty:
            return None
        self.dirty = False
        self.version += 1
        return {"offsetTable": {k: {str(q): o for q, o in sorted(v.items())} for k, v in sorted(self.table.items())},
                "dataVersion": {"counter": self.version, "stateVersion": 0, "timestamp": int(time.time() * 1000)}}

    def write(self, snapshot: dict[str, Any]) -> None:
        if self._fastjson:
            self._fastjson = False
            try:
                os.replace(self.path, f"{self.path}.bak")
            except OSError:
                pass
        write_json_atomic(self.path, snapshot)


def lowest_committed_offsets(config_dir: str, problems: list[str] | None = None) -> dict[tuple[str, int], int]:
    """Lowest committed offset per queue over all groups, from ``config/consumerOffset.json`` (as the broker reads
    it: fastjson's unquoted keys too).  An entry of the wrong shape raises StoreLoadError naming it, or, given
    ``problems`` (retention's warnings), is described there and skipped."""
    manager = ConsumerOffsetManager(config_dir, strict=problems is None, problems=problems)
    out: dict[tuple[str, int], int] = {}
    for key, queues in manager.table.items():
        topic = key.rsplit("@", 1)[0]
        for qid, off in queues.items():
            out[(topic, qid)] = min(out.get((topic, qid), off), off)
    return out
