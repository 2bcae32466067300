"""Authentication and authorization in the manner of RocketMQ 5's ACL 2.0.

Users and their ACLs are read from one JSON file (``<store>/config/acl.json``
unless ``authConfigPath`` names another), with RocketMQ's names::

    {"users": [{"username": "ak", "password": "sk", "userType": "Normal", "userStatus": "enable"}],
     "acls":  [{"subject": "User:ak",
                "policies": [{"resource": ["Topic:Orders", "Group:Billing"], "actions": ["Pub", "Sub"],
                              "sourceIps": ["10.0.0.0/8"], "decision": "Allow"}]}]}

A policy may also be RocketMQ's ``AclInfo`` shape, ``{"policyType": "Custom",
"entries": [{"resource": "Topic:Orders", ...}]}``.

Authentication checks the ``authorization`` header the official clients send
(``MQv2-HMAC-SHA1 Credential=<ak>, SignedHeaders=x-mq-date-time,
Signature=<hex HMAC-SHA1(sk, x-mq-date-time)>``) and how far the signed
date-time is from the broker's clock.

Authorization follows RocketMQ's ``AclAuthorizationHandler``: Super users may do
everything; otherwise the entries that match the resource, one of the
requested actions and the source address are ranked (a literal name before a
prefix, a longer prefix before a shorter one, a prefix before ``Topic:*``,
``Topic:*`` before ``*``; among equals DENY before ALLOW, and Custom policies
before Default ones) and the first one decides.  No matching entry: denied.

The file is checked strictly (a key not listed here is refused, naming the key and the entry: a typo such
as ``userTyp`` must not silently make a Normal user), read again on SIGHUP and when its size or
modification time changes (a bad new file is logged and the ACL in force kept), and a warning is logged
when its secrets are readable by the group or others.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import ConfigError

log = logging.getLogger(__name__)

ACL_FILE = "acl.json"
SCHEME = "MQv2-HMAC-SHA1"
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
ACTIONS = ("All", "Any", "Pub", "Sub", "Create", "Update", "Delete", "Get", "List")
RESOURCE_TYPES = ("Cluster", "Namespace", "Topic", "Group")
POLICY_TYPES = ("Custom", "Default")
USER_KEYS = frozenset(("username", "password", "userType", "userStatus"))
ACL_KEYS = frozenset(("subject", "policies"))
ENTRY_KEYS = frozenset(("resource", "actions", "sourceIps", "decision"))
POLICY_KEYS = ENTRY_KEYS | {"policyType", "entries"}
VERIFIED_CACHE = 4096  # signatures remembered (then forgotten all at once)


class AuthenticationError(Exception):
    """The caller is not who it claims (answered with UNAUTHORIZED)."""


class AuthorizationError(Exception):
    """The caller may not do this (answered with FORBIDDEN)."""


@dataclass(frozen=True)
class User:
    username: str
    password: str
    super_user: bool = False
    enabled: bool = True


@dataclass(frozen=True)
class Resource:
    """``Topic:Orders`` (literal), ``Topic:order-*`` (prefix), ``Topic:*`` (any topic) or ``*`` (anything)."""

    type: str | None  # None: any type
    name: str | None  # None: any name of the type
    prefixed: bool = False

    @classmethod
    def parse(cls, key: str) -> "Resource":
        key = key.strip()
        if key == "*":
            return cls(None, None)
        rtype, sep, name = key.partition(":")
        canon = {t.lower(): t for t in RESOURCE_TYPES}.get(rtype.strip().lower())
        if not sep or canon is None:
            raise ValueError(f"resource {key!r} is not <{'|'.join(RESOURCE_TYPES)}>:<name>, <type>:*, or *")
        name = name.strip()
        if not name:
            raise ValueError(f"resource {key!r} has no name")
        if name == "*":
            return cls(canon, None)
        if name.endswith("*"):
            return cls(canon, name[:-1], True)
        if "*" in name:
            raise ValueError(f"resource {key!r}: '*' may only end a name")
        return cls(canon, name)

    def matches(self, rtype: str, name: str) -> bool:
        if self.type is None:
            return True
        if self.type != rtype:
            return False
        if self.name is None:
            return True
        return name.startswith(self.name) if self.prefixed else name == self.name

    def rank(self) -> tuple[int, int]:
        """Sort key: more specific first (literal, longer prefix, shorter prefix, type-wide, anything)."""
        if self.type is None:
            return 4, 0
        if self.name is None:
            return 3, 0
        if self.prefixed:
            return 2, -len(self.name)
        return 1, 0


@dataclass(frozen=True)
class PolicyEntry:
    resource: Resource
    actions: frozenset[str]
    allow: bool
    source_ips: tuple[Any, ...] = ()  # ip_network objects; empty: from anywhere

    def matches(self, rtype: str, name: str, actions: Iterable[str], source_ip: str) -> bool:
        if not self.resource.matches(rtype, name):
            return False
        if "All" not in self.actions and not any(a in self.actions for a in actions):
            return False
        if self.source_ips:
            try:
                ip = ipaddress.ip_address(source_ip)
            except ValueError:
                return False
            return any(ip in net for net in self.source_ips)
        return True


@dataclass
class AclConfig:
    users: dict[str, User] = field(default_factory=dict)
    # subject ("User:ak") -> (custom entries, default entries)
    acls: dict[str, tuple[list[PolicyEntry], list[PolicyEntry]]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> "AclConfig":
        """Read and check the file; any problem is a ConfigError naming the file and the entry."""
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the ACL file: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: not an ACL file: nested too deeply") from None
        try:
            return cls.from_json(doc)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_json(cls, doc: Any) -> "AclConfig":
        if not isinstance(doc, dict):
            raise ValueError("the top level must be an object with 'users' and 'acls'")
        unknown = set(doc) - {"users", "acls"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} (expected 'users' and 'acls')")
        out = cls()
        for i, u in enumerate(_list(doc.get("users", []), "users")):
            where = f"users[{i}]"
            _known_keys(u, USER_KEYS, where)
            name, password = _text(u, "username", where), _text(u, "password", where)
            utype = str(u.get("userType", "Normal"))
            if utype.lower() not in ("super", "normal"):
                raise ValueError(f"{where}.userType={utype!r}: must be Super or Normal")
            status = str(u.get("userStatus", "enable"))
            if status.lower() not in ("enable", "disable"):
                raise ValueError(f"{where}.userStatus={status!r}: must be enable or disable")
            if name in out.users:
                raise ValueError(f"{where}: user {name!r} appears twice")
            out.users[name] = User(name, password, utype.lower() == "super", status.lower() == "enable")
        for i, a in enumerate(_list(doc.get("acls", []), "acls")):
            where = f"acls[{i}]"
            subject = _text(a, "subject", where)
            if not subject.startswith("User:") or subject[5:] not in out.users:
                raise ValueError(f"{where}.subject={subject!r}: must be User:<a username of 'users'>")
            where = f"acls[{i}] ({subject})"
            _known_keys(a, ACL_KEYS, where)
            custom, default = out.acls.setdefault(subject, ([], []))
            for j, p in enumerate(_list(a.get("policies", []), f"{where}.policies")):
                pwhere = f"{where}.policies[{j}]"
                _known_keys(p, POLICY_KEYS, pwhere)
                ptype = str(p.get("policyType", "Custom"))
                if ptype.lower() not in ("custom", "default"):
                    raise ValueError(f"{pwhere}.policyType={ptype!r}: must be Custom or Default")
                target = custom if ptype.lower() == "custom" else default
                entries = p["entries"] if "entries" in p else [p]
                for k, e in enumerate(_list(entries, f"{pwhere}.entries")):
                    target.extend(_entries(e, f"{pwhere}.entries[{k}]", ENTRY_KEYS) if "entries" in p
                                  else _entries(e, pwhere, POLICY_KEYS))
        return out


def _known_keys(obj: Any, known: frozenset[str], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, not {type(obj).__name__} {str(obj)[:40]!r}")
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected one of {', '.join(sorted(known))})")


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"{where} must be a list")
    return v


def _text(obj: Any, key: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object")
    v = obj.get(key)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}.{key} must be a non-empty string")
    return v


def _entries(e: Any, where: str, keys: frozenset[str] = ENTRY_KEYS) -> list[PolicyEntry]:
    _known_keys(e, keys, where)
    res = e.get("resource")
    keys = [res] if isinstance(res, str) else res
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{where}.resource must be a resource like 'Topic:Orders' or a list of them")
    canon = {a.lower(): a for a in ACTIONS}
    actions = set()
    for a in _list(e.get("actions"), f"{where}.actions"):
        if not isinstance(a, str) or a.lower() not in canon:
            raise ValueError(f"{where}.actions: {a!r} is not one of {', '.join(ACTIONS)}")
        actions.add(canon[a.lower()])
    if not actions:
        raise ValueError(f"{where}.actions is empty")
    decision = str(e.get("decision", ""))
    if decision.lower() not in ("allow", "deny"):
        raise ValueError(f"{where}.decision={decision!r}: must be Allow or Deny")
    nets = []
    for ip in _list(e.get("sourceIps", []), f"{where}.sourceIps"):
        try:
            nets.append(ipaddress.ip_network(str(ip), strict=False))
        except ValueError:
            raise ValueError(f"{where}.sourceIps: {ip!r} is not an IP address or CIDR block") from None
    out = []
    for k in keys:
        try:
            r = Resource.parse(k)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        out.append(PolicyEntry(r, frozenset(actions), decision.lower() == "allow", tuple(nets)))
    return out


def parse_authorization(header: str) -> tuple[str, str]:
    """(access key, signature) from ``MQv2-HMAC-SHA1 Credential=ak, SignedHeaders=..., Signature=hex``."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme != SCHEME or not rest:
        raise AuthenticationError(f"authorization header is not '{SCHEME} Credential=..., Signature=...'")
    fields = {}
    for part in rest.split(","):
        k, sep, v = part.strip().partition("=")
        if not sep:
            raise AuthenticationError("authorization header has a field without '='")
        fields[k.strip()] = v.strip()
    ak = fields.get("Credential", "").split("/")[0]
    return ak, fields.get("Signature", "")


def parse_date_time(text: str) -> float:
    """Epoch seconds of an ``x-mq-date-time`` value (``yyyyMMdd'T'HHmmss'Z'``)."""
    try:
        return float(calendar.timegm(time.strptime(text.strip(), DATE_FORMAT)))
    except ValueError:
        raise AuthenticationError(f"x-mq-date-time {text[:40]!r} is not yyyyMMddTHHmmssZ") from None


def sign(secret: str, date_time: str) -> str:
    """The signature a client computes: lowercase hex HMAC-SHA1(secret, date-time)."""
    return hmac.new(secret.encode("utf-8"), date_time.encode("utf-8"), hashlib.sha1).hexdigest()


class AccessControl:
    """Checks callers against an :class:`AclConfig`."""

    def __init__(self, acl: AclConfig, *, skew_ms: int = 15 * 60 * 1000, authorize: bool = True,
                 path: str = "") -> None:
        self.acl = acl
        self.path = path  # the file ``acl`` came from ("" when given in code): what reload() reads
        self._stamp = _stamp(path) if path else None
        self.skew = skew_ms / 1000
        self.authorization = authorize
        # (authorization, date-time) -> (user, signed at): the clients sign a whole second, so a busy client's
        # requests share a header; each call is checked twice (admission, then the handler).
        self._verified: dict[tuple[str, str], tuple[str, float]] = {}

    def reload(self, force: bool = False) -> bool:
        """Read the file again when it changed (size, modification time, inode), or always with ``force``.
        A file that is now bad is logged and the ACL in force kept.  True when a new ACL took effect."""
        if not self.path:
            return False
        stamp = _stamp(self.path)
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            acl = AclConfig.load(self.path)
        except ConfigError as e:
            log.error("ACL not reloaded, the one in force is kept: %s", e)
            return False
        warn_if_readable(self.path)
        self.acl = acl
        self._verified.clear()  # a password changed or a user disabled takes effect now
        log.info("ACL reloaded from %s: %d users", self.path, len(acl.users))
        return True

    def authenticate(self, authorization: str, date_time: str, now: float | None = None) -> str:
        """The user name of a correctly signed, fresh request; AuthenticationError otherwise."""
        hit = self._verified.get((authorization, date_time))
        if hit is not None:
            now = time.time() if now is None else now
            if abs(now - hit[1]) <= self.skew:
                return hit[0]
        user = self._authenticate(authorization, date_time, now)
        if len(self._verified) >= VERIFIED_CACHE:
            self._verified.clear()
        self._verified[(authorization, date_time)] = (user, parse_date_time(date_time))
        return user

    def _authenticate(self, authorization: str, date_time: str, now: float | None) -> str:
        if not authorization:
            raise AuthenticationError("no authorization header")
        ak, signature = parse_authorization(authorization)
        if not ak:
            raise AuthenticationError("no access key (Credential) in the authorization header")
        if not date_time:
            raise AuthenticationError("no x-mq-date-time header")
        signed_at = parse_date_time(date_time)
        now = time.time() if now is None else now
        if abs(now - signed_at) > self.skew:
            raise AuthenticationError(f"x-mq-date-time {date_time} is more than {int(self.skew)} s away from "
                                      f"the broker's clock")
        user = self.acl.users.get(ak)
        if user is None:
            raise AuthenticationError(f"user {ak[:64]!r} is not found")
        if not user.enabled:
            raise AuthenticationError(f"user {ak!r} is disabled")
        expected = sign(user.password, date_time)
        if not hmac.compare_digest(expected.encode("ascii"), signature.lower().encode("ascii", "replace")):
            raise AuthenticationError(f"signature of user {ak!r} does not match")
        return ak

    def allowed(self, username: str, rtype: str, name: str, actions: Iterable[str], source_ip: str = "") -> bool:
        if not self.authorization:
            return True
        user = self.acl.users.get(username)
        if user is None or not user.enabled:
            return False
        if user.super_user:
            return True
        actions = tuple(actions)
        custom, default = self.acl.acls.get(f"User:{username}", ([], []))
        for entries in (custom, default):
            hits = [e for e in entries if e.matches(rtype, name, actions, source_ip)]
            if hits:
                hits.sort(key=lambda e: (e.resource.rank(), e.allow))
                return hits[0].allow
        return False

    def authorize(self, username: str, rtype: str, name: str, actions: Iterable[str], source_ip: str = "") -> None:
        actions = tuple(actions)
        if not self.allowed(username, rtype, name, actions, source_ip):
            raise AuthorizationError(f"User:{username} has no permission to {'/'.join(actions)} "
                                     f"{rtype}:{name} from {source_ip or 'unknown address'}")


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def warn_if_readable(path: str) -> None:
    """Log a warning when the file holding the users' secrets may be read by its group or by others."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s holds the users' secrets but is readable by %s (mode %o); chmod 600 it", path,
                    "group and others" if mode & stat.S_IRGRP and mode & stat.S_IROTH
                    else "its group" if mode & stat.S_IRGRP else "others", stat.S_IMODE(mode))


def load_access_control(cfg: Any, store_dir: str) -> AccessControl | None:
    """The AccessControl a BrokerConfig asks for (None when ACL is off); ConfigError for a bad file."""
    if not (cfg.authenticationEnabled or cfg.authorizationEnabled):
        return None
    path = cfg.authConfigPath or os.path.join(store_dir, "config", ACL_FILE)
    access = AccessControl(AclConfig.load(path), skew_ms=cfg.authDateTimeSkew, authorize=cfg.authorizationEnabled,
                           path=path)
    warn_if_readable(path)
    return access
