"""Run the broker: open the store, serve gRPC (plaintext or TLS), stop cleanly on SIGTERM/SIGINT.

Shutdown order: stop accepting RPCs (in-flight ones get a short grace), stop the
broker's services and write its state files, then close the store, which
flushes and removes the ``abort`` file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from ..config import StoreConfig
from ..errors import CliError, ConfigError
from ..store import MessageStore
from .acl import AccessControl, load_access_control
from .admin import AdminServer
from .admission import Admission, RequestBudget
from .broker import Broker
from .config import BrokerConfig
from .receipts import ReceiptSigner, load_or_create_secret
from .service import MessagingService
from .tasks import cancel, every
from .topics import GroupConfig, TopicConfig
from . import wire

log = logging.getLogger(__name__)
ACL_POLL = 2.0  # seconds between looks at the ACL file (it is also read again on SIGHUP)

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
    # No bandwidth-delay probing: with it, gRPC grows a stream's receive window to megabytes and buffers a request
    # nobody asked to read (a refused, unauthenticated 9 MB frame cost its full size).  Without it a stream gets
    # window for the message its handler is reading, and 64 KiB otherwise.
    ("grpc.http2.bdp_probe", 0),
]


@dataclass
class ServeOptions:
    store: str
    host: str = "127.0.0.1"
    port: int = 8081
    store_config: StoreConfig | None = None
    broker_config: BrokerConfig | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    topics: tuple[TopicConfig, ...] = ()
    groups: tuple[GroupConfig, ...] = ()
    grace: float = 3.0


def bind_address(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"[{host.strip('[]')}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def store_host_of(host: str, port: int) -> tuple[bytes, int]:
    """The STOREHOST written into records: the bind address when it is an IP, else 127.0.0.1."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        if not ip.is_unspecified:
            return ip.packed, port
    except ValueError:
        pass
    return b"\x7f\x00\x00\x01", port


async def serve_async(opts: ServeOptions, *, ready: Callable[[str, int], None] | None = None,
                      stop_event: asyncio.Event | None = None) -> None:
    """Listen first (a busy port leaves the store untouched), then open the store and serve."""
    bcfg = opts.broker_config or BrokerConfig()
    access = load_access_control(bcfg, opts.store)  # a bad ACL file stops us before the store is touched
    limit = wire.hard_frame_limit((opts.store_config or StoreConfig()).maxMessageSize)
    admission = admission_of(bcfg, access, limit)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", -1), *KEEPALIVE_OPTIONS])
    port = _bind(server, opts)
    taken = _port_taken(bcfg.adminHost, bcfg.adminPort) if bcfg.adminPort > 0 else None
    if taken is not None:  # (before the store is opened, as for the gRPC port)
        raise CliError(f"cannot listen on {bcfg.adminHost}:{bcfg.adminPort} for the admin endpoint: {taken}")
    store = MessageStore.open(opts.store, opts.store_config)
    try:
        await _serve_store(server, port, store, bcfg, opts, ready, stop_event, access, admission)
    finally:
        store.close()
        log.info("store %s closed", opts.store)


def _reload_acl(access: AccessControl) -> Callable[[], Any]:
    async def step() -> None:
        access.reload()
    return step


def admission_of(bcfg: BrokerConfig, access: AccessControl | None, frame_limit: int) -> Admission:
    """Authentication on metadata and the request byte caps, checked before a request is read."""
    for key in ("maxInflightRequestBytes", "maxInflightRequestBytesPerConnection"):
        if getattr(bcfg, key) < frame_limit:
            raise ConfigError(f"{key}={getattr(bcfg, key)}: must be at least the largest request frame, "
                              f"{frame_limit} bytes (2 x maxMessageSize + 1 MiB)")
    budget = RequestBudget(bcfg.maxInflightRequestBytes, bcfg.maxInflightRequestBytesPerConnection)
    return Admission(access, budget, frame_limit)


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, tried with a plain socket first: gRPC's core logs a failed bind on
    stderr itself, beside the one line the CLI prints (the server binds without SO_REUSEPORT, as this does)."""
    if port == 0:
        return None
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _bind(server: Any, opts: ServeOptions) -> int:
    address = bind_address(opts.host, opts.port)
    taken = _port_taken(opts.host, opts.port)
    if taken is not None:
        raise CliError(f"cannot listen on {address}: {taken}")
    try:
        if opts.tls_cert or opts.tls_key:
            if not (opts.tls_cert and opts.tls_key):
                raise CliError("TLS needs both --tls-cert and --tls-key")
            try:
                with open(opts.tls_key, "rb") as fh:
                    key = fh.read()
                with open(opts.tls_cert, "rb") as fh:
                    cert = fh.read()
            except OSError as e:
                raise CliError(f"{e.filename}: {e.strerror}") from None
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise CliError(f"cannot listen on {address}: {e}") from None
    if not port:
        raise CliError(f"cannot listen on {address}")
    return port


async def _serve_store(server: Any, port: int, store: MessageStore, bcfg: BrokerConfig, opts: ServeOptions,
                       ready: Callable[[str, int], None] | None, stop_event: asyncio.Event | None,
                       access: AccessControl | None = None, admission: Admission | None = None) -> None:
    broker = Broker(store, bcfg, store_host_of(opts.host, port))
    if admission is not None:
        admission.on_refused = broker.metrics.refused
    receipts = ReceiptSigner(load_or_create_secret(broker.config_dir))
    for t in opts.topics:
        broker.topics.put_topic(t)
    for g in opts.groups:
        broker.topics.put_group(g)
    await broker.start()
    admin = None
    if bcfg.adminPort >= 0:  # admin endpoint (live CLI verbs, /metrics): see broker/admin.py
        try:
            admin = AdminServer(broker, asyncio.get_running_loop(), bcfg.adminHost, bcfg.adminPort, access)
        except BaseException:
            await broker.stop()
            raise
    broker.transactions.signer = receipts  # transaction ids sealed with the persistent secret
    service = MessagingService(broker, opts.host, port, receipts=receipts, access=access)
    wire.add_service(service, server, max_send_bytes=wire.soft_send_limit(store.config.maxMessageSize),
                     admit=None if admission is None else admission.admit)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread
    acl_watch = None
    if access is not None:
        acl_watch = loop.create_task(every(ACL_POLL, _reload_acl(access), "ACL reload"), name="acl-reload")
        try:
            loop.add_signal_handler(signal.SIGHUP, access.reload, True)
            installed.append(signal.SIGHUP)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    try:
        await server.start()
        if admin is not None:
            admin.start()
        log.info("serving apache.rocketmq.v2.MessagingService on %s (%s%s) for store %s",
                 bind_address(opts.host, port), "TLS" if opts.tls_cert else "plaintext",
                 "" if access is None else ", ACL on", opts.store)
        if ready:
            ready(opts.host, port)
        await stop.wait()
        log.info("shutting down")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if admin is not None:
            admin.stop()
        await cancel(acl_watch)
        await server.stop(opts.grace)
        await broker.stop()


def serve(opts: ServeOptions, *, announce: bool = True) -> int:
    """Serve until SIGTERM/SIGINT.  With ``announce``, print one JSON line when listening."""
    def ready(host: str, port: int) -> None:
        if announce:
            sys.stdout.write(json.dumps({"listening": bind_address(host, port), "host": host, "port": port,
                                         "store": opts.store}) + "\n")
            sys.stdout.flush()

    asyncio.run(serve_async(opts, ready=ready))
    return 0
