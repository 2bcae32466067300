"""SendDedup: a client's resend of a message already stored is answered with the stored one's result.

Clients resend a message (same message id) when an answer does not reach them, also across a broker
restart.  Recent sends are remembered in memory (id -> queue offset, transaction id, body digest).  An id
this process has not seen, but that the client may have minted before the broker started, is looked up in
the store's index (it maps ``topic#UNIQ_KEY`` to records), so a resend after a restart or a crash is not
stored twice; no extra file is kept.  The lookup is skipped when no record stored before this process started
is left in the commitlog (a new store, or everything older deleted): then there is nothing it could find.

A message is a resend only when its body is the stored body too.  A different message reusing an id is
stored (as RocketMQ stores every send) and logged, never dropped.  Only messages put straight into their
topic are found through the index: delay messages not yet due and half messages live in system topics
and are remembered in memory only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections import OrderedDict
from typing import Any

from ..errors import CorruptRecordError

log = logging.getLogger(__name__)

DEDUP_CAPACITY = 100_000
# Message ids of version 1 carry the client's clock (seconds since 2021-01-01 UTC at hex 18..26); ids minted
# up to this long after the broker started are looked up too, for clients whose clock is ahead.
CLOCK_SKEW_MS = 300_000
_ID_EPOCH_MS = 1609459200000
MAX_INDEX_HITS = 32


def _keyed_digest(body: bytes) -> int:
    """Python's own hash of the body: SipHash with this process's random key (64 bits), about a quarter of
    the cost of BLAKE2b for a 1 KiB body.  Digests live in this process's memory only, so the key never has
    to be the same twice; being secret, it leaves a client no way to make two bodies collide."""
    return hash(body)


def _fixed_digest(body: bytes) -> bytes:
    """A 128-bit BLAKE2b digest: used when hash randomization is off (PYTHONHASHSEED set), when anybody can
    compute Python's hash of a body and so craft a second body that a resend check would take for the first."""
    return hashlib.blake2b(body, digest_size=16).digest()


def hash_key_is_random() -> bool:
    """Whether Python's hash of bytes has a random key in this process (PYTHONHASHSEED unset or "random")."""
    return bool(sys.flags.ignore_environment) or os.environ.get("PYTHONHASHSEED", "random") == "random"


# What a resend's body is compared by (equal bodies, equal digests): see SendDedup.recent.
digest = _keyed_digest if hash_key_is_random() else _fixed_digest


def minted_ms(message_id: str) -> int | None:
    """When a version-1 message id was minted (epoch ms, the client's clock); None for other formats."""
    if len(message_id) != 34 or not message_id.startswith("01"):
        return None
    try:
        return _ID_EPOCH_MS + int(message_id[18:26], 16) * 1000
    except ValueError:
        return None


class SendDedup:
    def __init__(self, store: Any, capacity: int = DEDUP_CAPACITY) -> None:
        self.store = store
        self.capacity = capacity
        self.started_ms = int(time.time() * 1000)
        # The commitlog's end when this process started taking sends: a record stored before it lies below.
        self.stored_before = store.max_phy_offset()
        self._none_older = False  # set once no record older than this process is left
        self._recent: OrderedDict[tuple[str, str], tuple[int, str, Any]] = OrderedDict()

    def remember(self, topic: str, message_id: str, offset: int, txid: str, body_digest: Any) -> None:
        self._recent[(topic, message_id)] = (offset, txid, body_digest)
        if len(self._recent) > self.capacity:
            self._recent.popitem(last=False)

    def recent(self, topic: str, message_id: str, body_digest: Any) -> tuple[int, str] | None:
        """(queue offset, transaction id) of an earlier send of this id and body made by this process."""
        seen = self._recent.get((topic, message_id))
        if seen is None:
            return None
        if seen[2] != body_digest:
            log.warning("message id %s of topic %s is reused by a message with another body; stored as a new "
                        "message", message_id, topic)
            return None
        return seen[0], seen[1]

    def needs_lookup(self, topic: str, message_id: str) -> bool:
        """Whether the id may belong to a message stored before this process started (then ask ``stored``)."""
        if self._none_older or not message_id or not self.store.config.messageIndexEnable \
                or (topic, message_id) in self._recent:
            return False
        if self.store.min_phy_offset() >= self.stored_before:
            self._none_older = True  # (the commitlog's start only moves on)
            return False  # no record older than this process is left: nothing to find (and no thread hop)
        minted = minted_ms(message_id)
        return minted is None or minted < self.started_ms + CLOCK_SKEW_MS

    def stored(self, topic: str, message_id: str, body: bytes) -> int | None:
        """The queue offset of a stored message of ``topic`` with this id and body (blocking: store reads)."""
        minted = minted_ms(message_id)
        begin = max(0, minted - 2 * CLOCK_SKEW_MS) if minted is not None else 0
        try:
            found = self.store.query(topic, message_id, MAX_INDEX_HITS, begin).messages
        except CorruptRecordError as e:
            log.error("looking for an earlier send of %s in %s: %s; stored as a new message", message_id, topic, e)
            return None
        for m in found:
            if m.uniq_key == message_id and m.body == body:
                return m.queue_offset
        if found:
            log.warning("message id %s of topic %s is reused by a message with another body; stored as a new "
                        "message", message_id, topic)
        return None
