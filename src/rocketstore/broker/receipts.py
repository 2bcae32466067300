"""Receipt handles that cannot be guessed or altered: the pop handle plus an HMAC.

The pop service's own handle (``queue_offset_token``) names a queue entry and a
per-delivery token.  A consumer gets ``<handle>_<mac>``, where the MAC is
HMAC-SHA256 under a broker secret over the group, topic and handle.  A handle
whose MAC does not verify is unknown: Ack, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue answer INVALID_RECEIPT_HANDLE.

Transaction ids are sealed the same way (:meth:`ReceiptSigner.seal_transaction`):
the store's offset message id of the half message plus a MAC over the real topic
and that id, so EndTransaction cannot name a half message it was not given.

The secret is 32 random bytes in ``<store>/config/receiptSecret`` (mode 0600),
created at the first start and kept, so handles stay valid over a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

from ..errors import ConfigError

log = logging.getLogger(__name__)

SECRET_FILE = "receiptSecret"
MAC_BYTES = 16
# Stands in for the group in a transaction id's MAC: no group name contains a NUL, so a receipt handle's MAC
# never verifies as a transaction id's, nor the other way round.
_TRANSACTION_DOMAIN = "\x00transaction"


def load_or_create_secret(config_dir: str) -> bytes:
    path = os.path.join(config_dir, SECRET_FILE)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        data = b""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the receipt secret: {e.strerror}") from None
    if data:
        try:
            secret = bytes.fromhex(data.decode("ascii").strip())
        except ValueError:
            secret = b""
        if len(secret) < 16:
            raise ConfigError(f"{path}: not a receipt secret (expected at least 32 hex digits); "
                              f"delete it to make a new one (handles already given out stop working)")
        return secret
    secret = secrets.token_bytes(32)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(secret.hex() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    log.info("created %s", path)
    return secret


class ReceiptSigner:
    def __init__(self, secret: bytes) -> None:
        self._key = secret

    def _mac(self, group: str, topic: str, handle: str) -> str:
        msg = f"{group}\n{topic}\n{handle}".encode("utf-8")
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[: MAC_BYTES * 2]

    def seal(self, group: str, topic: str, handle: str) -> str:
        return f"{handle}_{self._mac(group, topic, handle)}"

    def open(self, group: str, topic: str, sealed: str) -> str | None:
        """The pop handle inside ``sealed``, or None when the MAC does not verify."""
        handle, sep, mac = (sealed or "").rpartition("_")
        if not sep or not handle or len(mac) != MAC_BYTES * 2:
            return None
        expected = self._mac(group, topic, handle)
        return handle if hmac.compare_digest(expected.encode("ascii"), mac.lower().encode("utf-8")) else None

    def seal_transaction(self, topic: str, txid: str) -> str:
        """The transaction id a producer gets for the half message ``txid`` of the real topic ``topic``."""
        return self.seal(_TRANSACTION_DOMAIN, topic, txid)

    def open_transaction(self, topic: str, sealed: str) -> str | None:
        """The half message's id inside ``sealed``, or None unless it was sealed for ``topic``."""
        return self.open(_TRANSACTION_DOMAIN, topic, sealed)
