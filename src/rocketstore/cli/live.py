"""The client side of a running broker's admin endpoint (``rocketstore serve`` writes where it listens).

While ``serve`` holds a store it writes ``<store>/config/admin.json``::

    {"url": "http://127.0.0.1:40123", "pid": 4242, "acl": false, "token": "..."}

(atomically; removed on a clean stop).  A file left by a broker that died is recognised by the store's
lock being free: the verbs then work offline, as without a broker.

Requests are ``POST /admin/<action>`` with a JSON body, answered with JSON (``{"error": "..."}`` and a 4xx
status when refused).  Who may ask:

* ACL off: whoever can read ``admin.json`` (it is then mode 0600 and holds a random ``token``, sent as
  ``Authorization: Bearer <token>``): the same people who could change the store's files offline.
* ACL on: an ACL Super user, signing each request with its secret (``admin.json`` then holds no token)::

      x-mq-date-time: 20261127T013000Z
      Authorization: RocketstoreAdmin-HMAC-SHA256 Credential=<user>, Signature=<hex>

  where the signature is HMAC-SHA256(secret, date-time + "\\n" + method + "\\n" + path + "\\n" +
  hex SHA-256 of the body): unlike the clients' signature, which covers the date only, it binds the request,
  so a captured header cannot be replayed with another body.  The user comes from ``--admin-user`` or
  ``$ROCKETSTORE_ADMIN_USER``, the secret from ``$ROCKETSTORE_ADMIN_SECRET`` or ``--admin-secret-file``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..errors import CliError, StoreError, StoreLockedError
from ..paths import StorePaths
from ..storage.store_lock import StoreLock, held_here

log = logging.getLogger(__name__)

ENDPOINT_FILE = "admin.json"
SCHEME = "RocketstoreAdmin-HMAC-SHA256"
DATE_HEADER = "x-mq-date-time"
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
USER_ENV = "ROCKETSTORE_ADMIN_USER"
SECRET_ENV = "ROCKETSTORE_ADMIN_SECRET"
TIMEOUT = 30.0


def endpoint_path(config_dir: str) -> str:
    return os.path.join(config_dir, ENDPOINT_FILE)


def string_to_sign(date_time: str, method: str, path: str, body: bytes) -> bytes:
    return "\n".join((date_time, method.upper(), path, hashlib.sha256(body).hexdigest())).encode("utf-8")


def signature(secret: str, date_time: str, method: str, path: str, body: bytes) -> str:
    """Lowercase hex HMAC-SHA256 of :func:`string_to_sign` with the user's secret."""
    return hmac.new(secret.encode("utf-8"), string_to_sign(date_time, method, path, body), hashlib.sha256).hexdigest()


@dataclass
class Credentials:
    user: str
    secret: str


def credentials(user: str | None, secret_file: str | None) -> Credentials | None:
    """The admin credentials of the command line and environment (None when no user is named)."""
    user = user or os.environ.get(USER_ENV)
    if not user:
        return None
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as fh:
                secret = fh.read().strip()
        except OSError as e:
            raise CliError(f"{secret_file}: {e.strerror}") from None
    else:
        secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise CliError(f"admin user {user!r} has no secret: set ${SECRET_ENV} or pass --admin-secret-file")
    return Credentials(user, secret)


def _store_held(root: str) -> bool:
    """Whether a process holds the store open for writing (probing its lock, released at once)."""
    if held_here(root):
        return True
    lock = StoreLock(root)
    try:
        lock.acquire()
    except StoreLockedError:
        return True
    except StoreError:
        return True  # we may not take the lock (another user's store): believe the file
    lock.release()
    return False


class LiveBroker:
    """A running broker's admin endpoint."""

    def __init__(self, url: str, *, token: str | None, acl: bool, creds: Credentials | None, where: str) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.acl = acl
        self.creds = creds
        self.where = where

    def call(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST one action; its JSON answer, or CliError with the broker's one-line reason."""
        path = f"/admin/{action}"
        body = json.dumps(payload or {}).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.acl:
            if self.creds is None:
                raise CliError(f"the broker of {self.where} has ACL on: name a Super user with --admin-user or "
                               f"${USER_ENV} (secret in ${SECRET_ENV})")
            dt = time.strftime(DATE_FORMAT, time.gmtime())
            headers[DATE_HEADER] = dt
            headers["Authorization"] = (f"{SCHEME} Credential={self.creds.user}, "
                                        f"Signature={signature(self.creds.secret, dt, 'POST', path, body)}")
        elif self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read().decode("utf-8")).get("error") or e.reason
            except (ValueError, AttributeError, OSError):
                why = e.reason
            raise CliError(f"broker of {self.where}: {why}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise CliError(f"broker of {self.where} at {self.url} does not answer: {reason}") from None


def find(store: str, creds: Credentials | None = None) -> LiveBroker | None:
    """The admin endpoint of the broker serving ``store``; None when no broker holds it (work offline)."""
    path = endpoint_path(StorePaths(store).config)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (FileNotFoundError, NotADirectoryError):  # no broker (a path that is no store is refused by the open)
        return None
    except PermissionError:
        raise CliError(f"{path}: no permission to read the running broker's admin endpoint (ACL off: only the "
                       "store's owner may use it)") from None
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); working offline", path, e)
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
        log.warning("%s: not an admin endpoint record; working offline", path)
        return None
    if not _store_held(store):
        log.info("%s: left by a broker that is gone (the store is not locked); working offline", path)
        return None
    return LiveBroker(doc["url"], token=doc.get("token"), acl=bool(doc.get("acl")), creds=creds, where=store)
