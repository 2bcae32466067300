"""Committing consumer-group offsets from outside the broker: read, change, write back under a lock.

The offsets live in RocketMQ's ``config/consumerOffset.json``
(``{"offsetTable": {"Topic@Group": {"0": 12}}}``), read and written by the
broker's :class:`~rocketstore.storage.consumer_offsets.ConsumerOffsetManager` (atomic
write, ``.bak``, fastjson tolerant).  Several processes (embedded consumers,
``reset-offset``) may commit to one file: each commit takes an OS lock on
``config/consumerOffset.json.lock``, re-reads the file and changes only its own
entries, so no process loses another's commit.  A running broker (``serve``)
keeps the table in memory and rewrites the whole file: it owns the file while it
runs.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from .consumer_offsets import ConsumerOffsetManager, loads_lenient
from ..errors import StoreError


def config_dir(root: str) -> str:
    return os.path.join(root, "config")


def read_offsets(root: str) -> ConsumerOffsetManager:
    """The committed offsets of every group (empty when the file does not exist)."""
    return ConsumerOffsetManager(config_dir(root), strict=True)


@contextmanager
def updating_offsets(root: str) -> Iterator[ConsumerOffsetManager]:
    """The current offsets, locked against other committers; what the block changes is written atomically."""
    directory = config_dir(root)
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "consumerOffset.json.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = os.path.join(directory, "consumerOffset.json")
        if not _readable_or_absent(path):
            raise StoreError(f"{path}: unreadable, and so is its .bak; refusing to overwrite the offsets of "
                             "every group (repair or remove the file)")
        manager = ConsumerOffsetManager(directory, strict=True)
        yield manager
        snapshot = manager.snapshot()
        if snapshot is not None:
            manager.write(snapshot)
    finally:
        os.close(fd)  # releases the lock


def _readable_or_absent(path: str) -> bool:
    """Whether the offsets file or its backup parses, or neither exists (a first commit)."""
    present = False
    for candidate in (path, f"{path}.bak"):
        try:
            with open(candidate, "rb") as fh:
                present = True
                loads_lenient(fh.read().decode("utf-8"))
            return True
        except (ValueError, OSError):  # missing, unreadable or not JSON
            continue
    return not present


def commit_offsets(root: str, topic: str, group: str, offsets: dict[int, int]) -> None:
    """Set ``group``'s committed offset of each queue of ``topic`` (the next offset to consume)."""
    with updating_offsets(root) as manager:
        for queue_id, offset in offsets.items():
            manager.commit(topic, group, queue_id, offset)
