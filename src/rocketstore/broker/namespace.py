"""Namespaces: a client's topics and groups live apart from every other namespace's.

As RocketMQ wraps them, a resource ``Orders`` of namespace ``tenantA`` is
stored as ``tenantA%Orders`` (retry and DLQ names keep their prefix in front:
``%DLQ%tenantA%Billing``).  Clients see the plain name with
``resource_namespace`` set.  ACL resources are matched against the wrapped name,
so ``Topic:tenantA%*`` covers all of tenant A's topics and nothing of tenant B.
"""

from __future__ import annotations

import re

SEPARATOR = "%"
_PREFIXES = ("%RETRY%", "%DLQ%")
_NAMESPACE = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def illegal_namespace(ns: str) -> str | None:
    """Why ``ns`` cannot be a namespace (it must not contain the separator), or None."""
    if ns and not _NAMESPACE.fullmatch(ns):
        return f"namespace {ns[:70]!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$"
    return None


def wrap(ns: str, name: str) -> str:
    """The stored name of ``name`` in namespace ``ns``."""
    if not ns or not name:
        return name
    for p in _PREFIXES:
        if name.startswith(p):
            return f"{p}{ns}{SEPARATOR}{name[len(p):]}"
    return f"{ns}{SEPARATOR}{name}"


def unwrap(ns: str, stored: str) -> str:
    """The name a client of namespace ``ns`` knows ``stored`` by (``stored`` itself if not of ``ns``)."""
    if not ns:
        return stored
    for p in _PREFIXES:
        if stored.startswith(p + ns + SEPARATOR):
            return p + stored[len(p) + len(ns) + 1:]
    if stored.startswith(ns + SEPARATOR):
        return stored[len(ns) + 1:]
    return stored
