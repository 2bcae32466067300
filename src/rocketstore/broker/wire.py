"""Requests off the wire: decoded leniently, so that a bad frame gets a RocketMQ status code, not a gRPC error.

gRPC's generated registration parses each request with ``FromString``; bytes
that do not parse then fail the call with gRPC INTERNAL before any handler
runs, and the official clients resend on it.  Here each method's parser is
wrapped: a frame that does not parse, or is larger than the method's soft
limit, reaches the handler as an :class:`Undecodable` that the handler answers
with a body status (BAD_REQUEST, or MESSAGE_BODY_TOO_LARGE for SendMessage).
Frames above gRPC's own ``grpc.max_receive_message_length`` never reach Python;
gRPC answers them with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import grpc

from .proto import Code, svc_grpc

log = logging.getLogger(__name__)

# Largest request other than SendMessage that is parsed at all (an ack of 1024 entries is ~200 KB).
MAX_REQUEST_BYTES = 2 * 1024 * 1024


def hard_frame_limit(max_message_size: int) -> int:
    """gRPC's max receive length: larger frames are refused by gRPC itself (RESOURCE_EXHAUSTED)."""
    return max(max_message_size * 2 + 1024 * 1024, 8 * 1024 * 1024)


def soft_send_limit(max_message_size: int) -> int:
    """Largest SendMessage frame parsed; larger ones (up to the hard limit) get MESSAGE_BODY_TOO_LARGE."""
    return max_message_size + 1024 * 1024


_decoded: tuple[Any, int] | None = None  # the request decoded last and the size of its frame (frame_size)


def frame_size(request: Any) -> int | None:
    """The size of the frame ``request`` was decoded from, when it is the request decoded last (gRPC decodes a
    request as its handler reads it: the reader asks at once), else None; taken once.  Cheaper than
    ``ByteSize()``, which walks the message (~1 us for a 1 KiB send)."""
    global _decoded
    d = _decoded
    if d is not None and d[0] is request:
        _decoded = None
        return d[1]
    return None


class Undecodable:
    """Stands in for a request that could not be decoded; ``code`` and ``why`` go into the reply's status."""

    __slots__ = ("code", "why")

    def __init__(self, code: int, why: str) -> None:
        self.code, self.why = code, why


def lenient(method: str, parse: Callable[[bytes], Any], limit: int) -> Callable[[bytes], Any]:
    too_large = Code.MESSAGE_BODY_TOO_LARGE if method == "SendMessage" else Code.BAD_REQUEST

    def decode(data: bytes) -> Any:
        if len(data) > limit:
            log.info("%s request of %d bytes refused (limit %d)", method, len(data), limit)
            return Undecodable(too_large, f"{method} request of {len(data)} bytes exceeds the limit of {limit}")
        global _decoded
        try:
            request = parse(data)
        except Exception as e:  # protobuf's DecodeError, or anything a hostile frame provokes
            log.info("undecodable %s request of %d bytes: %s", method, len(data), e)
            return Undecodable(Code.BAD_REQUEST, f"{method} request of {len(data)} bytes is not a valid "
                                                 f"protobuf message")
        _decoded = (request, len(data))
        return request
    return decode


class _Capture:
    """Stands in for a server to take the generated registration's handlers."""

    def __init__(self) -> None:
        self.handlers: tuple[Any, ...] = ()

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.handlers = tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        pass  # also given as a generic handler


class LenientHandler(grpc.GenericRpcHandler):
    """The service's handlers with lenient decoding; each call's handler passes ``admit`` (when given), which
    sees the call's metadata before its request is read (:class:`~rocketstore.broker.admission.Admission`)."""

    def __init__(self, inner: tuple[Any, ...], limits: dict[str, int],
                 admit: Callable[[Any, Any], Any] | None = None) -> None:
        self.inner = inner
        self.limits = limits
        self.admit = admit
        self._cache: dict[str, Any] = {}

    def service(self, details: Any) -> Any:
        found = self._cache.get(details.method)
        if found is None:
            found = self._find(details)
            if found is None:
                return None
        return found if self.admit is None else self.admit(found, details)

    def _find(self, details: Any) -> Any:
        method = details.method
        for h in self.inner:
            found = h.service(details)
            if found is not None:
                name = method.rsplit("/", 1)[-1]
                limit = self.limits.get(name, MAX_REQUEST_BYTES)
                found = found._replace(request_deserializer=lenient(name, found.request_deserializer, limit))
                self._cache[method] = found  # only methods of the service: a client's made-up names are not kept
                return found
        return None


def add_service(servicer: Any, server: Any, *, max_send_bytes: int,
                admit: Callable[[Any, Any], Any] | None = None) -> None:
    """Register ``servicer`` as ``apache.rocketmq.v2.MessagingService`` with lenient request decoding, each
    call's handler passed through ``admit`` (handler, call details) -> handler when given."""
    cap = _Capture()
    svc_grpc.add_MessagingServiceServicer_to_server(servicer, cap)
    server.add_generic_rpc_handlers((LenientHandler(cap.handlers, {"SendMessage": max_send_bytes}, admit),))
