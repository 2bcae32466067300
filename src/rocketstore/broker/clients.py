"""Connected clients: their settings, Telemetry streams and liveness (keyed by ``x-mq-client-id``)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from . import namespace as nsutil

log = logging.getLogger(__name__)

STREAM_QUEUE_SIZE = 256
OWNERS_CAPACITY = 100_000


class TelemetryStream:
    """Server-to-client commands of one Telemetry call.  Writes never block the broker: a stream whose
    client stopped reading fills its queue and further commands to it are dropped."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.queue: asyncio.Queue = asyncio.Queue(STREAM_QUEUE_SIZE)
        self.closed = False

    def send(self, cmd: Any) -> bool:
        if self.closed:
            return False
        try:
            self.queue.put_nowait(cmd)
            return True
        except asyncio.QueueFull:
            log.warning("client %s does not read its Telemetry stream; command dropped", self.client_id)
            return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.queue.put_nowait(None)
            except asyncio.QueueFull:
                pass


@dataclass
class ClientInfo:
    client_id: str
    client_type: int = 0
    group: str | None = None
    publishing: set[str] = field(default_factory=set)
    subscriptions: dict[str, tuple[int, str]] = field(default_factory=dict)
    streams: list[TelemetryStream] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)
    language: str = ""
    version: str = ""
    user: str = ""  # the authenticated user (ACL on)
    namespace: str = ""


class ClientRegistry:
    def __init__(self, expire_ms: int) -> None:
        self.expire = expire_ms / 1000
        self.clients: dict[str, ClientInfo] = {}
        # Whether a producer may be asked about a half message of a topic (set when ACL is on: PUB on it).
        self.may_check: Callable[[ClientInfo, str], bool] = lambda c, topic: True

    def touch(self, client_id: str) -> ClientInfo:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = ClientInfo(client_id)
        c.last_seen = time.monotonic()
        return c

    def alive(self, client_id: str) -> bool:
        c = self.clients.get(client_id)
        if c is None:
            return False
        return self.has_stream(client_id) or time.monotonic() - c.last_seen < self.expire

    def has_stream(self, client_id: str) -> bool:
        c = self.clients.get(client_id)
        return c is not None and any(not s.closed for s in c.streams)

    def add_stream(self, client_id: str, stream: TelemetryStream) -> None:
        self.touch(client_id).streams.append(stream)

    def remove_stream(self, client_id: str, stream: TelemetryStream) -> bool:
        """Forget a finished stream; True when it was the client's last open one."""
        stream.close()
        c = self.clients.get(client_id)
        if c is not None and stream in c.streams:
            c.streams.remove(stream)
            c.last_seen = time.monotonic()
            return not any(not s.closed for s in c.streams)
        return False

    def remove(self, client_id: str) -> ClientInfo | None:
        c = self.clients.pop(client_id, None)
        if c is not None:
            for s in c.streams:
                s.close()
        return c

    def expired(self) -> list[str]:
        now = time.monotonic()
        return [cid for cid, c in self.clients.items()
                if not any(not s.closed for s in c.streams) and now - c.last_seen >= self.expire]

    def producer_streams(self, topic: str) -> list[tuple[ClientInfo, TelemetryStream]]:
        """Open streams of producers that declared ``topic``; when none did, of any producer that may see it
        (one of the topic's namespace, and allowed to publish to it)."""
        from .proto import pb
        matching, others = [], []
        for c in self.clients.values():
            if c.client_type != pb.ClientType.PRODUCER:
                continue
            if c.namespace and nsutil.unwrap(c.namespace, topic) == topic:
                continue  # not a topic of the producer's namespace
            if not self.may_check(c, topic):
                continue
            streams = [(c, s) for s in c.streams if not s.closed]
            (matching if topic in c.publishing else others).extend(streams)
        return matching or others

    def send_to_producer(self, topic: str, cmd: Any) -> bool:
        """Ask one producer of ``topic`` about a transaction (the topic named as that producer knows it)."""
        streams = self.producer_streams(topic)
        random.shuffle(streams)
        for c, s in streams:
            out = cmd
            if c.namespace:
                out = type(cmd)()
                out.CopyFrom(cmd)
                t = out.recover_orphaned_transaction_command.message.topic
                t.name, t.resource_namespace = nsutil.unwrap(c.namespace, topic), c.namespace
            if s.send(out):
                return True
        return False

    def close_all(self) -> None:
        for c in self.clients.values():
            for s in c.streams:
                s.close()


class ClientOwners:
    """Which user each client id belongs to (ACL on): the user that first used it.

    Bindings of ids unused for longest are forgotten beyond ``capacity``, but never the binding of a
    client the registry still knows, so nobody can flood ids to take over a live client's."""

    def __init__(self, registry: ClientRegistry, capacity: int = OWNERS_CAPACITY) -> None:
        self.registry = registry
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def claim(self, client_id: str, user: str) -> str | None:
        """None when ``client_id`` is ``user``'s (binding it now if new), else the user it belongs to."""
        owner = self._owners.get(client_id)
        if owner is not None and owner != user:
            return owner
        self._owners[client_id] = user
        self._owners.move_to_end(client_id)
        if owner is None and len(self._owners) > self.capacity:
            for cid in list(self._owners):
                if len(self._owners) <= self.capacity:
                    break
                if cid != client_id and cid not in self.registry.clients:
                    del self._owners[cid]
        return None
