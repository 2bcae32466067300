"""ObjectStore: the bucket a tiered store uploads to, reached through ``pyarrow.fs``.

Why pyarrow: it is already a dependency (the Spark source), it speaks S3 with
ranged reads (``read_at``) and multipart uploads, and the same code runs on a
Spark executor that has only pyarrow and the rocketstore zip.  ``file://``
URIs use pyarrow's local filesystem (a tier on a mounted disk, and handy in
tests); ``s3://bucket/prefix`` uses S3 with RocketMQ's tieredstore key names
for endpoint and credentials (``objectStoreEndpoint`` ...), falling back to
the AWS environment variables when they are not given.
"""

from __future__ import annotations

import logging
import os
import posixpath
import zlib
from typing import Any
from urllib.parse import urlparse

from ..config import TierLocation
from ..errors import ConfigError, TierError

log = logging.getLogger(__name__)

UPLOAD_CHUNK = 8 * 1024 * 1024  # bytes read from a segment per write to the upload stream


def require_pyarrow_fs(uri: str) -> Any:
    """``pyarrow.fs``, or a one-line ConfigError saying how to get it (a plain ``pip install`` has no pyarrow)."""
    try:
        import pyarrow.fs as pafs
    except ImportError as e:
        raise ConfigError(f"tieredStoreUri={uri}: tiered storage needs pyarrow ({e}); install it with "
                          "pip install 'rocketstore[tier]'") from None
    return pafs


def open_filesystem(loc: TierLocation) -> Any:
    """A ``pyarrow.fs`` filesystem for ``loc`` (S3 with bounded timeouts, or the local one)."""
    pafs = require_pyarrow_fs(loc.uri)
    if loc.scheme == "file":
        return pafs.LocalFileSystem()
    kw: dict[str, Any] = {"connect_timeout": 5, "request_timeout": 60}
    endpoint = loc.endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint:
        u = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        kw["endpoint_override"] = u.netloc
        kw["scheme"] = u.scheme or "https"
    if loc.region:
        kw["region"] = loc.region
    if loc.access_key or loc.secret_key:
        if not (loc.access_key and loc.secret_key):
            raise ConfigError(f"tieredStoreUri={loc.uri}: objectStoreAccessKey and objectStoreSecretKey go together")
        kw["access_key"], kw["secret_key"] = loc.access_key, loc.secret_key
    try:
        return pafs.S3FileSystem(**kw)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid / OSError kinds
        raise TierError(f"{loc.uri}: cannot set up the S3 client: {e}") from None


class ObjectStore:
    """Whole-object writes and ranged reads of one tier; every error is a TierError naming the key."""

    def __init__(self, loc: TierLocation) -> None:
        self.loc = loc
        self.fs = open_filesystem(loc)
        self._files: dict[str, Any] = {}  # open handles of sealed objects: a ranged read is one GET, no HEAD
        # file://: whether a write may create the tier's directory.  Only before the store first published
        # there: later, a missing directory is an unmounted disk, and writing would fill the mount point.
        self.create_root = True

    def root_missing(self) -> str | None:
        """For a ``file://`` tier whose directory does not exist: why that is an error; else None."""
        if self.loc.scheme == "file" and not os.path.isdir(self.loc.prefix):
            return f"{self.loc.uri}: the tier directory {self.loc.prefix} does not exist (not mounted?)"
        return None

    def _err(self, what: str, key: str, e: BaseException) -> TierError:
        missing = self.root_missing()
        if missing is not None:
            return TierError(f"{missing}: {what} {key}")
        return TierError(f"{self.loc.uri}: {what} {key}: {e}")

    def read(self, key: str, pos: int, length: int) -> bytes:
        """``length`` bytes at ``pos`` of object ``key`` (fewer only at the object's end)."""
        try:
            f = self._files.get(key)
            if f is None:
                f = self._files[key] = self.fs.open_input_file(self.loc.key(key))
            return f.read_at(length, pos)
        except Exception as e:  # noqa: BLE001
            self._files.pop(key, None)
            raise self._err("cannot read", key, e) from None

    def size(self, key: str) -> int | None:
        """The object's size, or None when there is none."""
        import pyarrow.fs as pafs
        try:
            info = self.fs.get_file_info(self.loc.key(key))
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot stat", key, e) from None
        return info.size if info.type == pafs.FileType.File else None

    def get_bytes(self, key: str) -> bytes | None:
        """The whole object, or None when there is none."""
        if self.size(key) is None:
            return None
        try:
            with self.fs.open_input_stream(self.loc.key(key)) as f:
                return f.read()
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot read", key, e) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a whole object and read it back (S3 makes it visible only once complete, a local tier by a
        rename after fsync: readers never see half of it, and a power cut never leaves a torn one)."""
        path = self.loc.key(key)
        try:
            if self.loc.scheme == "file":
                self._write_local(path, [data])
            else:
                with self.fs.open_output_stream(path) as out:
                    out.write(data)
        except TierError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot write", key, e) from None
        back = self.get_bytes(key)
        if back != data:
            raise TierError(f"{self.loc.uri}: {key} reads back as {None if back is None else len(back)} bytes that "
                            f"differ from the {len(data)} written")

    def put_file(self, local_path: str, key: str, length: int) -> int:
        """Upload the first ``length`` bytes of a local file as ``key``; return their CRC-32.

        The object is read back and its CRC-32 compared with the local bytes' before this returns: a short or
        altered object raises and is never reported uploaded (retention deletes local files on that word).
        """
        path = self.loc.key(key)
        crc = 0

        def chunks() -> Any:
            nonlocal crc
            with open(local_path, "rb") as src:
                left = length
                while left > 0:
                    chunk = src.read(min(UPLOAD_CHUNK, left))
                    if not chunk:
                        raise OSError(f"{local_path} ended {left} bytes early")
                    crc = zlib.crc32(chunk, crc)
                    yield chunk
                    left -= len(chunk)

        try:
            if self.loc.scheme == "file":
                self._write_local(path, chunks())
            else:
                with self.fs.open_output_stream(path) as out:
                    for chunk in chunks():
                        out.write(chunk)
        except TierError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot upload to", key, e) from None
        got = self.size(key)
        if got != length:
            raise TierError(f"{self.loc.uri}: uploaded {key} is {got} bytes, expected {length}")
        back = self.checksum(key)
        if back != crc:
            raise TierError(f"{self.loc.uri}: uploaded {key} reads back with CRC-32 {back}, but {local_path} has "
                            f"{crc}; not counted as uploaded")
        return crc

    def checksum(self, key: str) -> int:
        """The CRC-32 of the whole object (read in chunks): what an upload is checked against."""
        self._files.pop(key, None)
        crc = 0
        try:
            with self.fs.open_input_stream(self.loc.key(key)) as f:
                while chunk := f.read(UPLOAD_CHUNK):
                    crc = zlib.crc32(chunk, crc)
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot read back", key, e) from None
        return crc

    def _write_local(self, path: str, chunks: Any) -> None:
        """A ``file://`` object: temp file, fsync, rename, fsync the directory (and any directory made)."""
        from ..storage.jsonfile import fsync_dir
        self._ensure_parent(path)
        tmp = path + ".tmp"
        with open(tmp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def delete(self, key: str) -> None:
        self._files.pop(key, None)
        try:
            self.fs.delete_file(self.loc.key(key))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise self._err("cannot delete", key, e) from None

    def make_root(self) -> None:
        """Create a ``file://`` tier's directory (durably): the store's first publish, before anything says
        the store published there (from then on ``create_root`` is off)."""
        if self.loc.scheme == "file" and not os.path.isdir(self.loc.prefix):
            self._ensure_parent(posixpath.join(self.loc.prefix, "x"))

    def _ensure_parent(self, path: str) -> None:
        """Make the object's directory, each new one durable in its parent (never the tier's root once the
        store published there: see ``create_root``)."""
        from ..storage.jsonfile import fsync_dir
        if not self.create_root:
            missing = self.root_missing()
            if missing is not None:
                raise TierError(missing)
        made = []
        d = posixpath.dirname(path)
        while not os.path.isdir(d):
            made.append(d)
            d = posixpath.dirname(d)
        for d in reversed(made):
            os.makedirs(d, exist_ok=True)
            fsync_dir(posixpath.dirname(d))
