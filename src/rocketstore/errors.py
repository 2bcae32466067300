"""Exceptions.  Each message names the file (and offset) it is about."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of everything rocketstore raises on purpose."""


class StoreLoadError(StoreError):
    """A store directory that cannot be loaded: missing, not a store, or a file of a bad name or size."""


class CommitLogDamagedError(StoreLoadError):
    """A writable open that would truncate intact records after damage in the commitlog: nothing in the
    commitlog was changed, and ``verify --repair`` (which keeps every valid record) is the way on."""


class CommitLogWriteError(StoreError):
    """Appending to a commitlog segment failed (an I/O error from the kernel): the put is not stored."""


class CorruptRecordError(StoreError):
    """A record that does not decode, whose body fails its CRC, or that is not the one its consume-queue
    unit or index entry claims: the message says which file and offset (also as ``path``/``offset``)."""

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path  # the commitlog segment file
        self.offset = offset  # the record's commitlog offset


class StoreLockedError(StoreError):
    """The store's lock file is held by another open store (this or another process)."""


class StoreClosedError(StoreError):
    """An operation on a store that has been closed."""


class ReadOnlyStoreError(StoreError):
    """A write on a store opened read-only."""


class ConfigError(StoreError):
    """A config value RocketMQ would not accept, or that cannot work with the files present."""


class CliError(StoreError):
    """A user error on the command line: printed as one line, exit status 2."""


class TierError(StoreError):
    """The tier (bucket) could not be read or written; the message names the URI and key."""
