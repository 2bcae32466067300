"""The running broker's admin endpoint: the CLI's live verbs (``topics``, ``groups``, ``lag``,
``reset-offset``) and Prometheus ``/metrics``, over HTTP on ``adminHost:adminPort`` (loopback by default).

HTTP rather than a Unix socket: Prometheus scrapes HTTP, so one small server does both, and the CLI
needs nothing but the standard library.  It runs in its own thread (``http.server``); every action runs
on the broker's event loop (``run_coroutine_threadsafe``), as the gRPC calls do, so the broker's tables
are only ever touched by the loop.  The protocol and who may call it are described in
:mod:`rocketstore.cli.live`, the client side; ``/metrics`` needs no credentials.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Awaitable, Callable

from ..errors import CliError, ConfigError
from ..cli.admin import lag_table, reset_plan, topic_table
from ..cli.live import DATE_HEADER, SCHEME, endpoint_path, signature
from ..services.metrics import snapshot as store_snapshot
from .acl import AccessControl, AuthenticationError, parse_date_time
from .metrics import CONTENT_TYPE
from ..queues.pop import QueueState
from .topics import (MAX_GROUP_LEN, MAX_TOPIC_LEN, PERM_READ, PERM_WRITE, TOPIC_TYPES, TRANS_GROUP, GroupConfig,
                     TopicConfig, illegal_name, is_broker_topic, is_system_topic)

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
CALL_TIMEOUT = 60.0


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- the actions (on the loop)

class AdminActions:
    """What the endpoint can do, on a started :class:`~rocketstore.broker.broker.Broker`."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.store = broker.store
        self.table: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "topics.list": self.topics_list, "topics.create": self.topics_create,
            "topics.update": self.topics_update, "topics.delete": self.topics_delete,
            "groups.list": self.groups_list, "groups.create": self.groups_create,
            "groups.delete": self.groups_delete, "groups.clients": self.groups_clients,
            "lag": self.lag, "reset-offset": self.reset_offset}

    # -------------------------------------------------------- topics
    async def topics_list(self, req: dict[str, Any]) -> dict[str, Any]:
        topics = self.broker.topics.topics
        rows = topic_table(self.store, {n: (t.read_queue_nums, t.write_queue_nums) for n, t in topics.items()})
        for r in rows:
            t = topics.get(r["topic"])
            r["perm"] = perm_text(t.perm) if t else None
            r["type"] = (t.message_type or "") if t else None
        return {"topics": rows}

    def _topic_from(self, req: dict[str, Any], base: TopicConfig | None) -> TopicConfig:
        name = _text(req, "name")
        rq = _int(req, "readQueueNums", base.read_queue_nums if base else None)
        wq = _int(req, "writeQueueNums", base.write_queue_nums if base else None)
        queues = _int(req, "queues", None)
        if queues is not None:
            rq = queues if "readQueueNums" not in req else rq
            wq = queues if "writeQueueNums" not in req else wq
        if rq is None or wq is None:
            rq = wq = self.broker.topics.default_queues
        if not (0 <= rq <= 1024 and 0 <= wq <= 1024) or rq + wq == 0:
            raise AdminError(400, f"topic {name}: queue counts must be in 0..1024, not both 0")
        perm = _int(req, "perm", base.perm if base else PERM_READ | PERM_WRITE)
        if not 0 <= perm <= 7:
            raise AdminError(400, f"topic {name}: perm must be 0..7 (4 read, 2 write, 1 inherit)")
        mtype = req.get("type", base.message_type if base else None) or None
        if mtype is not None:
            mtype = str(mtype).upper()
            if mtype not in TOPIC_TYPES:
                raise AdminError(400, f"topic {name}: type must be one of {', '.join(TOPIC_TYPES)}")
        return TopicConfig(name, rq, wq, perm, mtype, base.order if base else False,
                           dict(base.extra or {}) if base else None)

    def _admin_topic(self, name: str) -> None:
        why = illegal_name(name, "topic", MAX_TOPIC_LEN)
        if why:
            raise AdminError(400, why)
        if is_system_topic(name) or is_broker_topic(name):
            raise AdminError(403, f"topic {name} is a system, retry or dead letter topic; the broker manages it")

    async def topics_create(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _text(req, "name")
        self._admin_topic(name)
        if name in self.broker.topics.topics:
            raise AdminError(409, f"topic {name} exists (use update)")
        t = self.broker.topics.put_topic(self._topic_from(req, None))
        log.info("admin: created topic %s (%d/%d queues, perm %s)", name, t.read_queue_nums, t.write_queue_nums,
                 perm_text(t.perm))
        return {"topic": topic_json(t)}

    async def topics_update(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _text(req, "name")
        self._admin_topic(name)
        old = self.broker.topics.topics.get(name)
        if old is None:
            raise AdminError(404, f"topic {name} does not exist")
        t = self.broker.topics.put_topic(self._topic_from(req, old))
        log.info("admin: updated topic %s (%d/%d queues, perm %s)", name, t.read_queue_nums, t.write_queue_nums,
                 perm_text(t.perm))
        return {"topic": topic_json(t)}

    async def topics_delete(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _text(req, "name")
        self._admin_topic(name)
        if self.broker.topics.delete_topic(name) is None:
            raise AdminError(404, f"topic {name} does not exist")
        log.info("admin: deleted topic %s (its messages stay until retention removes them)", name)
        return {"deleted": name}

    # -------------------------------------------------------- groups
    def _clients(self, group: str | None = None) -> list[dict[str, Any]]:
        registry = self.broker.clients
        rows = []
        for cid, c in sorted(registry.clients.items()):
            if not c.group or (group is not None and c.group != group):
                continue
            rows.append({"group": c.group, "clientId": cid, "user": c.user, "language": c.language,
                         "version": c.version, "topics": sorted(c.subscriptions), "alive": registry.alive(cid)})
        return rows

    async def groups_list(self, req: dict[str, Any]) -> dict[str, Any]:
        lag: dict[str, int] = {}
        topics: dict[str, set[str]] = {}
        for r in self._lag_rows(None, None):
            lag[r["group"]] = lag.get(r["group"], 0) + r["lag"]
            topics.setdefault(r["group"], set()).add(r["topic"])
        clients: dict[str, int] = {}
        for c in self._clients():
            clients[c["group"]] = clients.get(c["group"], 0) + 1
        names = (set(self.broker.topics.groups) | set(lag) | set(clients)) - {TRANS_GROUP}
        rows = []
        for n in sorted(names):
            g = self.broker.topics.groups.get(n)
            rows.append({"group": n, "configured": g is not None, "orderly": g.orderly if g else None,
                         "retryMaxTimes": g.retry_max_times if g else None, "clients": clients.get(n, 0),
                         "topics": ",".join(sorted(topics.get(n, ()))), "lag": lag.get(n, 0)})
        return {"groups": rows}

    async def groups_create(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _text(req, "name")
        why = illegal_name(name, "group", MAX_GROUP_LEN)
        if why:
            raise AdminError(400, why)
        if name in self.broker.topics.groups:
            raise AdminError(409, f"group {name} exists")
        retries = _int(req, "retryMaxTimes", self.broker.topics.default_retry_max_times)
        if retries < 0:
            raise AdminError(400, f"group {name}: retryMaxTimes must not be negative")
        g = self.broker.topics.put_group(GroupConfig(name, bool(req.get("orderly", False)), retries))
        log.info("admin: created consumer group %s", name)
        return {"group": g.to_json()}

    async def groups_delete(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _text(req, "name")
        if self.broker.topics.delete_group(name) is None:
            raise AdminError(404, f"group {name} does not exist")
        log.info("admin: deleted consumer group %s (its committed offsets are kept)", name)
        return {"deleted": name}

    async def groups_clients(self, req: dict[str, Any]) -> dict[str, Any]:
        group = req.get("group")
        return {"clients": self._clients(str(group) if group else None)}

    # -------------------------------------------------------- lag and offsets
    def _in_flight(self, group: str, topic: str, queue_id: int) -> int | None:
        """Messages received and not acked, from the pop state's public queue table (None: not known)."""
        qs = getattr(self.broker.pop, "queues", {}).get((group, topic, queue_id))
        return len(qs.entries) if qs is not None else None

    def _lag_rows(self, group: str | None, topic: str | None) -> list[dict[str, Any]]:
        self.broker.dispatch_now()  # every message stored so far counts
        table = {k: v for k, v in self.broker.offsets.table.items() if not k.endswith("@" + TRANS_GROUP)}
        rows = lag_table(self.store, group, topic, table=table)
        for r in rows:
            r["inflight"] = self._in_flight(r["group"], r["topic"], r["queueId"])
        return rows

    async def lag(self, req: dict[str, Any]) -> dict[str, Any]:
        rows = self._lag_rows(req.get("group"), req.get("topic"))
        return {"lag": rows, "totalLag": sum(r["lag"] for r in rows), "source": "broker"}

    async def reset_offset(self, req: dict[str, Any]) -> dict[str, Any]:
        group, topic = _text(req, "group"), _text(req, "topic")
        if is_system_topic(topic) or group == TRANS_GROUP:
            raise AdminError(403, f"{topic}@{group} is the broker's own; not reset")
        how = _text(req, "how")
        value = req.get("value")
        queue_id = req.get("queueId")
        offsets = self.broker.offsets
        try:
            rows = reset_plan(self.store, topic, queue_id, how, value, lambda q: offsets.get(topic, group, q))
        except (CliError, ConfigError) as e:
            raise AdminError(400, str(e)) from None
        for r in rows:
            r["group"] = group
            r["inflight"] = self._in_flight(group, topic, r["queueId"]) or 0
        execute = bool(req.get("execute"))
        if execute:
            for r in rows:
                self._reset_queue(group, topic, r["queueId"], r["newOffset"])
            if not await self.broker.persist(final=True):
                raise AdminError(500, "the new offsets are set but writing consumerOffset.json failed; see the "
                                      "broker's log")
            self.broker.longpoll.notify_group(topic, group)
            log.info("admin: reset %s@%s: %s", topic, group,
                     ", ".join(f"queue {r['queueId']} {r['oldOffset']} -> {r['newOffset']}" for r in rows))
        return {"reset": rows, "executed": execute}

    def _reset_queue(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Move the group's position in one queue: a fresh pop state at ``offset`` (messages in flight are
        forgotten: their acks no longer count, as after RocketMQ's resetOffset) and the committed offset."""
        pop = self.broker.pop
        key = (group, topic, queue_id)
        old = pop.queues.get(key)
        qs = QueueState(group, topic, queue_id, offset, old.fifo if old is not None else False)
        qs.recompute_due()
        pop.queues[key] = qs
        pop.dirty = True
        self.broker.offsets.commit(topic, group, queue_id, offset)

    # -------------------------------------------------------- metrics
    def metrics_snapshot(self) -> dict[str, Any]:
        self.broker.dispatch_now()
        s = store_snapshot(self.store.files, self.store.metrics, self.store.disk_guard,
                           self.store.dispatch_behind_bytes())
        return {"lag": self._lag_rows(None, None), "flushLagBytes": s["flushLagBytes"],
                "dispatchBehindBytes": s["dispatchBehindBytes"], "diskUsedRatio": s["disk"].get("usedRatio"),
                "maxPhyOffset": s["maxPhyOffset"], "clients": len(self.broker.clients.clients)}


def perm_text(perm: int) -> str:
    return ("R" if perm & PERM_READ else "-") + ("W" if perm & PERM_WRITE else "-")


def topic_json(t: TopicConfig) -> dict[str, Any]:
    return {"topic": t.name, "readQueueNums": t.read_queue_nums, "writeQueueNums": t.write_queue_nums,
            "perm": perm_text(t.perm), "type": t.message_type or ""}


def _text(req: dict[str, Any], key: str) -> str:
    v = req.get(key)
    if not isinstance(v, str) or not v:
        raise AdminError(400, f"{key} is required")
    return v


def _int(req: dict[str, Any], key: str, default: int | None) -> int | None:
    v = req.get(key, default)
    if v is not None and (type(v) is not int):
        raise AdminError(400, f"{key} must be an integer")
    return v


# ---------------------------------------------------------------- HTTP

class AdminServer:
    """The HTTP server, its thread and ``admin.json``."""

    def __init__(self, broker: Any, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 access: AccessControl | None) -> None:
        self.actions = AdminActions(broker)
        self.metrics = broker.metrics
        self.loop = loop
        self.access = access
        self.token = None if access is not None else secrets.token_urlsafe(32)
        self.file = endpoint_path(broker.config_dir)
        handler = type("Handler", (_Handler,), {"admin": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise CliError(f"cannot listen on {host}:{port} for the admin endpoint: {e.strerror}") from None
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="admin-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.thread.start()
        doc: dict[str, Any] = {"url": self.url, "pid": os.getpid(), "acl": self.access is not None}
        if self.token:
            doc["token"] = self.token
        _write_private(self.file, doc, private=self.token is not None)
        log.info("admin endpoint on %s (/metrics, /admin/*; %s)", self.url,
                 "ACL Super users" if self.access else f"token in {self.file}")

    def stop(self) -> None:
        try:
            os.unlink(self.file)
        except FileNotFoundError:
            pass
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    # -------------------------------------------------------- requests (in the HTTP thread)
    def authenticate(self, headers: Any, method: str, path: str, body: bytes) -> str:
        auth = headers.get("Authorization", "")
        if self.access is None:
            if not auth.startswith("Bearer ") or not hmac.compare_digest(auth[7:].encode(), self.token.encode()):
                raise AdminError(401, f"no or wrong admin token (it is in {self.file})")
            return ""
        scheme, _, rest = auth.partition(" ")
        if scheme != SCHEME:
            raise AdminError(401, f"ACL is on: requests must be signed ({SCHEME}) by a Super user")
        fields = dict(p.strip().partition("=")[::2] for p in rest.split(","))
        user_name, sig = fields.get("Credential", ""), fields.get("Signature", "")
        date_time = headers.get(DATE_HEADER, "")
        try:
            signed_at = parse_date_time(date_time)
        except AuthenticationError as e:
            raise AdminError(401, str(e)) from None
        if abs(time.time() - signed_at) > self.access.skew:
            raise AdminError(401, f"{DATE_HEADER} {date_time} is more than {int(self.access.skew)} s away from "
                                  "the broker's clock")
        user = self.access.acl.users.get(user_name)
        if user is None or not user.enabled or not hmac.compare_digest(
                signature(user.password, date_time, method, path, body).encode(), sig.lower().encode()):
            raise AdminError(401, f"user {user_name[:64]!r} is unknown, disabled or its signature does not match")
        if not user.super_user:
            raise AdminError(403, f"user {user_name!r} is not a Super user; the admin endpoint is for Super users")
        return user_name

    def run(self, action: str, req: dict[str, Any]) -> dict[str, Any]:
        fn = self.actions.table.get(action)
        if fn is None:
            raise AdminError(404, f"unknown admin action {action!r}")
        return asyncio.run_coroutine_threadsafe(fn(req), self.loop).result(CALL_TIMEOUT)

    def render_metrics(self) -> bytes:
        async def snap() -> dict[str, Any]:
            return self.actions.metrics_snapshot()
        return self.metrics.render(lambda: asyncio.run_coroutine_threadsafe(snap(), self.loop).result(CALL_TIMEOUT))


class _Handler(BaseHTTPRequestHandler):
    admin: AdminServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("admin %s: " + format, self.client_address[0], *args)

    def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, doc: dict[str, Any]) -> None:
        self._answer(status, json.dumps(doc, ensure_ascii=False).encode("utf-8"))

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] != "/metrics":
            return self._json(404, {"error": f"no {self.path[:80]} here (GET /metrics, POST /admin/<action>)"})
        try:
            self._answer(200, self.admin.render_metrics(), CONTENT_TYPE)
        except Exception as e:  # the loop is stopping, or a collector failed: say so, keep serving
            log.warning("rendering /metrics failed: %s", e)
            self._json(503, {"error": f"metrics unavailable: {e}"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY:
                raise AdminError(413, f"request body over {MAX_BODY} bytes")
            body = self.rfile.read(length)
            if not self.path.startswith("/admin/"):
                raise AdminError(404, f"no {self.path[:80]} here (POST /admin/<action>)")
            user = self.admin.authenticate(self.headers, "POST", self.path, body)
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise AdminError(400, "the body is not JSON") from None
            if not isinstance(req, dict):
                raise AdminError(400, "the body must be a JSON object")
            action = self.path[len("/admin/"):]
            log.debug("admin %s by %s", action, user or "token")
            self._json(200, self.admin.run(action, req))
        except AdminError as e:
            if e.status in (401, 403):
                if self.admin.access is not None:
                    self.admin.metrics.refused("unauthenticated" if e.status == 401 else "forbidden")
                log.info("admin request from %s refused: %s", self.client_address[0], e)
            self._json(e.status, {"error": str(e)})
        except ValueError as e:
            self._json(400, {"error": str(e)})
        except Exception as e:
            log.exception("admin request %s failed", self.path[:80])
            self._json(500, {"error": f"{type(e).__name__}: {e}"})


def _write_private(path: str, doc: dict[str, Any], *, private: bool) -> None:
    """Write ``doc`` atomically (temp file + rename), mode 0600 when it holds the token."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        if private:
            os.fchmod(fh.fileno(), 0o600)  # an older temp file keeps its mode otherwise
        json.dump(doc, fh)
    os.replace(tmp, path)
