"""``dump --follow``: keep printing messages as another process appends them (``tail -f`` for a store).

A read-only store is a view of the files as they were when it was opened.  At
its end the follower looks at the commitlog file where the next record would
start (one 8-byte ``pread`` every ``interval``) and opens a fresh read-only view
once a record header is there, continuing from the same commitlog offset.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Iterator

from . import codec
from .codec import MessageExt
from .errors import StoreError, StoreLoadError
from .mapped_file import file_name
from .selection import Selection
from .store import MessageStore

log = logging.getLogger(__name__)
_HEAD = struct.Struct(">iI")


def record_after(commitlog_dir: str, file_size: int, offset: int) -> bool:
    """Whether a record (not a blank) starts at ``offset``, or after the blank that ends its segment."""
    for _ in range(2):
        pos = offset % file_size
        path = os.path.join(commitlog_dir, file_name(offset - pos))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            raw = os.pread(fd, _HEAD.size, pos) if pos + _HEAD.size <= file_size else b""
        finally:
            os.close(fd)
        if len(raw) == _HEAD.size:
            size, magic = _HEAD.unpack(raw)
            if magic in (codec.MAGIC_V1, codec.MAGIC_V2) and size > 0:
                return True
            if magic != codec.BLANK_MAGIC:
                return False
        offset = offset - pos + file_size  # a blank or the file's end: the next segment's first record
    return False


def follow(open_store: Callable[[], MessageStore], sel: Selection, *, read_body: bool = True,
           interval: float = 0.2) -> Iterator[MessageExt]:
    """The selection's messages, then those appended later, until its limits or ``to_time`` are reached."""
    store = open_store()
    try:
        offset = sel.start(store)
        n = size = 0
        while True:
            before = offset
            for off, rec_size, msg, problem in store.messages(offset, read_body=read_body):
                if msg is None:
                    raise StoreError(f"scan stopped at commitlog offset {off}: {problem}")
                offset = off + rec_size
                if sel.to_time is not None and msg.store_timestamp > sel.to_time:
                    return
                if (sel.topic is not None and msg.topic != sel.topic) or \
                        (sel.from_time is not None and msg.store_timestamp < sel.from_time):
                    continue
                yield msg
                n += 1
                size += msg.size
                if sel.reached(n, size):
                    return
            if offset == before:
                time.sleep(interval)  # nothing new in this view (a torn tail, say): do not spin on re-opens
            while not record_after(store.paths.commitlog, store.config.mappedFileSizeCommitLog, offset):
                time.sleep(interval)
            try:
                fresh = open_store()
            except StoreLoadError as e:  # a segment the writer is creating right now
                log.debug("re-open failed, retrying: %s", e)
                time.sleep(interval)
                continue
            store.close()
            store = fresh
    finally:
        store.close()
