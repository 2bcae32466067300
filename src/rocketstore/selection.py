"""Which messages a ``dump`` or an ``export`` takes: topic, time window and size limits.

One definition serves both tools so that ``rocketstore dump`` and
``rocketstore spark export`` with the same flags select the same messages.
The start is found through the consume queues (``MessageStore.seek_offset``),
not by scanning from the first segment; the scan behind it drops finished
segments from the page cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import StoreError

if TYPE_CHECKING:
    from .format.codec import MessageExt
    from .store import MessageStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """Messages of ``topic`` stored in [from_time, to_time] (epoch ms, inclusive), in commitlog order,
    starting at ``from_offset`` if given, stopping after ``max_messages`` or once ``max_bytes`` of
    records (their full on-disk size) have been taken."""

    topic: str | None = None
    from_offset: int | None = None
    from_time: int | None = None
    to_time: int | None = None
    max_messages: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("from_offset", "from_time", "to_time", "max_messages", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                # (a time as text, which the CLI's flags take: refused here, not a TypeError deep in the scan)
                raise StoreError(f"Selection {name}={value!r}: expected an int"
                                 + (" (epoch milliseconds)" if name.endswith("time") else ""))

    @property
    def limited(self) -> bool:
        return self.max_messages is not None or self.max_bytes is not None

    def start(self, store: MessageStore) -> int:
        """The commitlog offset the scan starts at."""
        if self.from_offset is not None:
            return self.from_offset
        return store.seek_offset(self.topic, self.from_time)

    def scan(self, store: MessageStore, *, read_body: bool = True,
             more: Callable[[], bool] | None = None,
             on_damaged: Callable[[int, str], None] | None = None) -> Iterator[MessageExt]:
        """The selected messages; a damaged record (it does not decode, or the body read fails its CRC)
        stops the scan with a StoreError, or, given ``on_damaged``, is passed to it as (commitlog offset,
        problem) and skipped: the scan resumes at the next intact record.

        ``more``, if given, is called at the end of the records: True goes on from
        there (``dump --follow`` waits for the writer and extends the view)."""
        if self.reached(0, 0):
            return
        n = size = 0
        offset = self.start(store)
        while True:
            for off, rec_size, msg, problem in store.messages(offset, read_body=read_body, drop_cache=True,
                                                              skip_damaged=on_damaged is not None):
                if msg is None:
                    if on_damaged is not None:
                        on_damaged(off, problem or "damaged record")
                        offset = off + max(rec_size, 1)
                        continue
                    hint = ""
                    if off == self.from_offset and n == 0:  # the first record, where the caller said to start
                        hint = (" (the start offset given may not be the start of a record: take one from a "
                                "message's commitLogOffset)")
                    raise StoreError(f"scan stopped at commitlog offset {off}: {problem}{hint}")
                offset = off + rec_size
                if self.to_time is not None and msg.store_timestamp > self.to_time:
                    return  # store times ascend in commitlog order (stamped under the put lock)
                if self.topic is not None and msg.topic != self.topic:
                    continue
                if self.from_time is not None and msg.store_timestamp < self.from_time:
                    continue
                yield msg
                n += 1
                size += msg.size
                if self.reached(n, size):
                    return
            if more is None or not more():
                return
            first = store.min_readable_offset()
            if offset < first:  # the writer's retention removed records the scan had not reached
                log.warning("%s: records from commitlog offset %d to %d were removed (retention) before they were "
                            "read; going on from %d", store.root, offset, first, first)
                offset = first

    def reached(self, messages: int, size: int) -> bool:
        """Whether ``messages`` taken totalling ``size`` bytes fill the limits."""
        return (self.max_messages is not None and messages >= self.max_messages) or \
            (self.max_bytes is not None and size >= self.max_bytes)

    def offset_range(self, store: MessageStore) -> tuple[int, int | None]:
        """[start, end) in commitlog offsets holding the selection; end None means up to the store's end.

        Only a size limit needs a walk (headers only) to find the end; a time
        window alone is left to the reader's timestamp filter.
        """
        start = self.start(store)
        if not self.limited:
            return start, None
        end = start
        for msg in self.scan(store, read_body=False):
            end = msg.commit_log_offset + msg.size
        return start, end
