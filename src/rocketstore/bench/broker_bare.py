"""The bare reference server of the broker benchmark: grpc.aio answering MessagingService from memory.

``rocketstore serve`` costs what gRPC costs plus what the broker adds (checks,
the store, the pop state).  To tell the two apart, the benchmark runs the same
official-client load against this server in the same run: it answers every RPC
the Producer and the SimpleConsumer call (route, heartbeat, settings over
Telemetry, send, receive, ack) with the least work that keeps the client going.
Sent messages are kept in a deque per topic and handed out once; nothing is
written, checked or persisted.  The broker's figure divided by this one is the
share of gRPC's own throughput the broker keeps (issue 18's target: >= 0.8).

Run as ``python -m rocketstore.bench.broker_bare [--host H] [--port P]``; it prints
one JSON line with the port once listening, as ``rocketstore serve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import signal
import sys
import time
from typing import Any, AsyncIterator

import grpc

from ..broker.proto import Code, pb, svc, svc_grpc

QUEUES = 8


def _ok(status: Any) -> None:
    status.code = Code.OK
    status.message = "OK"


class BareMessagingService(svc_grpc.MessagingServiceServicer):
    """Trivial in-memory answers; one process, one loop, no state on disk."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.arrived = asyncio.Event()
        self.offsets = itertools.count()
        self.handles = itertools.count()
        self.inflight: dict[str, Any] = {}

    def _endpoints(self, out: Any) -> None:
        out.scheme = pb.AddressScheme.IPv4
        a = out.addresses.add()
        a.host, a.port = self.host, self.port

    async def QueryRoute(self, request: Any, context: Any) -> Any:
        resp = svc.QueryRouteResponse()
        for qid in range(QUEUES):
            mq = resp.message_queues.add()
            mq.topic.CopyFrom(request.topic)
            mq.id = qid
            mq.permission = pb.Permission.READ_WRITE
            mq.broker.name = "bare"
            self._endpoints(mq.broker.endpoints)
            mq.accept_message_types.append(pb.MessageType.NORMAL)
        _ok(resp.status)
        return resp

    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        resp = svc.QueryAssignmentResponse()
        a = resp.assignments.add()
        a.message_queue.topic.CopyFrom(request.topic)
        a.message_queue.id = -1
        a.message_queue.permission = pb.Permission.READ_WRITE
        a.message_queue.broker.name = "bare"
        self._endpoints(a.message_queue.broker.endpoints)
        _ok(resp.status)
        return resp

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        resp = svc.HeartbeatResponse()
        _ok(resp.status)
        return resp

    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        resp = svc.NotifyClientTerminationResponse()
        _ok(resp.status)
        return resp

    async def Telemetry(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for cmd in request_iterator:
            if not cmd.HasField("settings"):
                continue
            reply = svc.TelemetryCommand()
            out = reply.settings
            out.CopyFrom(cmd.settings)
            if out.HasField("publishing"):
                out.publishing.max_body_size = 4 * 1024 * 1024
                out.backoff_policy.max_attempts = 3
                out.backoff_policy.exponential_backoff.initial.nanos = 10_000_000
                out.backoff_policy.exponential_backoff.max.seconds = 1
                out.backoff_policy.exponential_backoff.multiplier = 2
            else:
                out.subscription.receive_batch_size = 32
                out.subscription.long_polling_timeout.seconds = 20
                out.backoff_policy.max_attempts = 16
                out.backoff_policy.customized_backoff.next.add().seconds = 1
            out.metric.on = False
            _ok(reply.status)
            yield reply

    async def SendMessage(self, request: Any, context: Any) -> Any:
        resp = svc.SendMessageResponse()
        for m in request.messages:
            e = resp.entries.add()
            e.message_id = m.system_properties.message_id
            e.offset = next(self.offsets)
            self.queues[m.topic.name].append(m)
            _ok(e.status)
        self.arrived.set()
        _ok(resp.status)
        return resp

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        q = self.queues[request.message_queue.topic.name]
        wait = request.long_polling_timeout.seconds + request.long_polling_timeout.nanos / 1e9
        deadline = time.monotonic() + min(wait or 1.0, 20.0)
        while not q:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        taken = [q.popleft() for _ in range(min(len(q), request.batch_size or 32))]
        first = svc.ReceiveMessageResponse()
        if taken:
            _ok(first.status)
        else:
            first.status.code, first.status.message = Code.MESSAGE_NOT_FOUND, "no new message"
        yield first
        now = time.time()
        for m in taken:
            r = svc.ReceiveMessageResponse()
            r.message.CopyFrom(m)
            sp = r.message.system_properties
            handle = str(next(self.handles))
            self.inflight[handle] = m
            sp.receipt_handle = handle
            sp.delivery_attempt = 1
            sp.store_timestamp.seconds = int(now)
            sp.body_digest.type = pb.DigestType.MD5
            sp.body_digest.checksum = hashlib.md5(m.body).hexdigest().upper()
            yield r
        r = svc.ReceiveMessageResponse()
        r.delivery_timestamp.seconds = int(now)
        yield r

    async def AckMessage(self, request: Any, context: Any) -> Any:
        resp = svc.AckMessageResponse()
        for e in request.entries:
            self.inflight.pop(e.receipt_handle, None)
            r = resp.entries.add()
            r.message_id, r.receipt_handle = e.message_id, e.receipt_handle
            _ok(r.status)
        _ok(resp.status)
        return resp

    async def ChangeInvisibleDuration(self, request: Any, context: Any) -> Any:
        resp = svc.ChangeInvisibleDurationResponse()
        resp.receipt_handle = request.receipt_handle
        _ok(resp.status)
        return resp


async def serve_bare(host: str, port: int) -> None:
    from ..broker.server import KEEPALIVE_OPTIONS
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 * 1024 * 1024),
                                      ("grpc.max_send_message_length", -1), *KEEPALIVE_OPTIONS])
    port = server.add_insecure_port(f"{host}:{port}")
    svc_grpc.add_MessagingServiceServicer_to_server(BareMessagingService(host, port), server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    sys.stdout.write(json.dumps({"listening": f"{host}:{port}", "host": host, "port": port}) + "\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rocketstore.bench.broker_bare", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    asyncio.run(serve_bare(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
