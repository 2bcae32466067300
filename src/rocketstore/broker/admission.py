"""Admission of calls before their request is read: authentication on metadata, and a cap on request bytes.

grpc.aio reads the whole request of a unary method (up to ``grpc.max_receive_message_length``, ~9 MiB) into
one ``bytes`` object before its handler runs; a stream method's requests are read only when its handler asks
for them.  So :meth:`Admission.admit`, which sees only the method and the metadata, is asked for every call
when gRPC looks up its handler (by the service's generic handler, :mod:`.wire`), and:

* refuses a call whose signature does not verify (ACL on) with a handler that never reads the request and
  answers UNAUTHORIZED in the reply's status, as the handlers do;
* hands an authenticated unary call to a stream-request wrapper that first reserves the largest frame the
  call could carry against ``maxInflightRequestBytes`` (overall) and
  ``maxInflightRequestBytesPerConnection`` (per gRPC peer), then reads it.  A reservation that does not fit
  waits up to :data:`ADMISSION_WAIT` seconds for earlier reads to finish, then the call gets gRPC
  RESOURCE_EXHAUSTED.  Once read, a SendMessage keeps its encoded size reserved until it is answered.

The metadata gRPC built for the handler lookup is handed to the handler (:func:`~.calls.hand_metadata`),
which then does not build it again from the context.

Telemetry streams are authenticated here but not metered: their reads wait for the next command, and a
reservation held meanwhile would starve everybody else (each command is small and read one at a time).

This is not a ``grpc.aio.ServerInterceptor``: gRPC runs interceptors as a chain of coroutines per call, and
the handler lookup is a plain call (about 10 us less per send).  The wrapper reads its one request with
``context.read()``, not from the request iterator: iterating creates an async generator per call, left
unfinished after the one message, whose finalizer then schedules a task through the loop's self-pipe (a
write, a wake-up and a task per call: about 30 us of CPU per send).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from asyncio import current_task
from typing import Any, AsyncIterator, Callable

import grpc

from .acl import AccessControl, AuthenticationError
from .calls import hand_metadata, peer_ip, set_status
from .wire import frame_size
from .convert import Code
from .proto import svc

log = logging.getLogger(__name__)

EOF = grpc.aio.EOF
ADMISSION_WAIT = 1.0  # seconds a read waits for room under the caps before RESOURCE_EXHAUSTED
_UNMETERED = frozenset(("Telemetry",))


def _reply_type(method: str) -> Callable[[], Any]:
    return svc.TelemetryCommand if method == "Telemetry" else getattr(svc, f"{method}Response")


class RequestBudget:
    """Request bytes being read or handled, overall and per connection; first come, first served."""

    def __init__(self, total: int, per_connection: int) -> None:
        self.total, self.per_connection = total, per_connection
        self.used = 0
        self.by_peer: dict[str, int] = {}
        self._waiters: collections.deque[tuple[str, int, asyncio.Future]] = collections.deque()

    def _fits(self, peer: str, n: int) -> bool:
        return self.used + n <= self.total and self.by_peer.get(peer, 0) + n <= self.per_connection

    def _add(self, peer: str, n: int) -> None:
        self.used += n
        self.by_peer[peer] = self.by_peer.get(peer, 0) + n

    def try_take(self, peer: str, n: int) -> bool:
        """Reserve ``n`` bytes for ``peer`` if they fit now and nobody waits before us."""
        if not self._waiters and self._fits(peer, n):
            self._add(peer, n)
            return True
        return False

    async def take(self, peer: str, n: int, wait: float) -> bool:
        """Reserve ``n`` bytes for ``peer``; False when they did not fit within ``wait`` seconds."""
        if self.try_take(peer, n):
            return True
        fut = asyncio.get_running_loop().create_future()
        entry = (peer, n, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
            return True
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():
                return True  # granted just as the wait ended
            fut.cancel()
            return False
        except asyncio.CancelledError:  # the call went away while waiting
            if fut.done() and not fut.cancelled():
                self.give(peer, n)
            else:
                fut.cancel()
            raise
        finally:
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass

    def give(self, peer: str, n: int) -> None:
        if n <= 0:
            return
        self.used -= n
        left = self.by_peer.get(peer, 0) - n
        if left > 0:
            self.by_peer[peer] = left
        else:
            self.by_peer.pop(peer, None)
        if not self._waiters:
            return
        for p, m, fut in list(self._waiters):  # in arrival order; a waiter that does not fit is skipped
            if not fut.done() and self._fits(p, m):
                self._add(p, m)
                fut.set_result(True)


class Admission:
    """Authenticate on metadata and meter request bytes before any request body is read."""

    def __init__(self, access: AccessControl | None, budget: RequestBudget | None, frame_limit: int) -> None:
        self.access = access
        self.budget = budget
        self.frame_limit = frame_limit
        self._metered: dict[str, Any] = {}
        self.on_refused: Callable[[str], None] | None = None  # the broker's ACL refusal counter, once it exists
        self._looked_up: tuple[Any, Any] | None = None  # (task, metadata) of the last handler lookup

    def admit(self, handler: Any, details: Any) -> Any:
        """The handler gRPC is to run for a call of ``handler``'s method (``details``: its method and metadata)."""
        # gRPC runs the lookup in the call's own task and starts the handler right after it: the metered
        # handler takes the metadata from here when its task is the one that looked up (see _lookup_metadata).
        self._looked_up = (current_task(), details.invocation_metadata)
        if self.access is not None:
            refusal = self._authenticate(handler, details)
            if refusal is not None:
                return refusal
        found = self._metered.get(details.method)
        if found is None or found[0] is not handler:
            method = details.method.rsplit("/", 1)[-1]
            metered = handler if self.budget is None or method in _UNMETERED or handler.request_streaming \
                else self._meter(handler, method)
            found = self._metered[details.method] = (handler, metered)
        return found[1]

    def _lookup_metadata(self) -> Any:
        """The metadata of this task's handler lookup, or None when another task looked up since (then the
        handler reads the context's own)."""
        looked, self._looked_up = self._looked_up, None
        return looked[1] if looked is not None and looked[0] is current_task() else None

    def _authenticate(self, handler: Any, details: Any) -> Any:
        """None when the call's signature verifies, else a handler refusing it."""
        h = {}
        for k, v in details.invocation_metadata or ():
            if k in ("authorization", "x-mq-date-time") and k not in h:
                h[k] = v if isinstance(v, str) else v.decode("latin-1")
        try:
            self.access.authenticate(h.get("authorization", ""), h.get("x-mq-date-time", ""))
        except AuthenticationError as e:
            if self.on_refused is not None:
                self.on_refused("unauthenticated")
            return self._refusal(handler, details.method.rsplit("/", 1)[-1], str(e))
        return None

    @staticmethod
    def _refusal(handler: Any, method: str, why: str) -> Any:
        """A handler that answers UNAUTHORIZED without reading the request."""
        reply_type = _reply_type(method)

        def reply(context: Any) -> Any:
            log.info("unauthenticated %s from %s: %s", method, peer_ip(context.peer() or "") or "?", why)
            r = reply_type()
            set_status(r.status, Code.UNAUTHORIZED, why)
            return r

        if handler.response_streaming:
            async def refuse_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
                yield reply(context)
            return grpc.stream_stream_rpc_method_handler(refuse_stream, response_serializer=handler.response_serializer)

        async def refuse(request_iterator: Any, context: Any) -> Any:
            return reply(context)
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)

    def _meter(self, handler: Any, method: str) -> Any:
        """``handler`` (a unary-request one) behind a reservation of the largest frame, taken before the read."""
        budget, limit, keep_size = self.budget, self.frame_limit, method == "SendMessage"
        lookup_metadata = self._lookup_metadata

        async def read(context: Any) -> tuple[Any, str, int]:
            """Reserve, read the request, keep what a send holds; (request or None at EOF, peer, kept)."""
            peer = context.peer() or ""
            if not budget.try_take(peer, limit) and not await budget.take(peer, limit, ADMISSION_WAIT):
                log.info("%s from %s refused: %d request bytes in flight (%d from it), caps %d / %d", method,
                         peer, budget.used, budget.by_peer.get(peer, 0), budget.total, budget.per_connection)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"too many request bytes in flight (maxInflightRequestBytes {budget.total}, "
                                    f"per connection {budget.per_connection}); retry later")
            kept = 0  # what stays reserved once read; all of it is given back if the read fails or is cancelled
            try:
                request = await context.read()  # (not the request iterator: see the module's docstring)
                if request is EOF:
                    request = None
                elif keep_size:
                    size = frame_size(request)
                    if size is None and hasattr(request, "ByteSize"):
                        size = request.ByteSize()
                    kept = min(limit, size or 0)
            finally:
                budget.give(peer, limit - kept)
            return request, peer, kept

        def no_request(context: Any) -> Any:
            r = _reply_type(method)()
            set_status(r.status, Code.BAD_REQUEST, f"{method} without a request message")
            return r

        if handler.response_streaming:
            async def metered_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
                md = lookup_metadata()  # (before the first await)
                request, peer, kept = await read(context)
                try:
                    if request is None:
                        yield no_request(context)
                        return
                    hand_metadata(context, md, peer)
                    async for r in handler.unary_stream(request, context):
                        yield r
                finally:
                    budget.give(peer, kept)
            return grpc.stream_stream_rpc_method_handler(metered_stream, request_deserializer=handler.request_deserializer,
                                                         response_serializer=handler.response_serializer)

        async def metered(request_iterator: Any, context: Any) -> Any:
            md = lookup_metadata()  # (before the first await)
            request, peer, kept = await read(context)
            try:
                if request is None:
                    return no_request(context)
                hand_metadata(context, md, peer)
                return await handler.unary_unary(request, context)
            finally:
                budget.give(peer, kept)
        return grpc.stream_unary_rpc_method_handler(metered, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
