"""``rocketstore serve STORE``: the RocketMQ 5 gRPC broker on a store."""

from __future__ import annotations

import argparse
import logging

from ..errors import CliError


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port number (0..65535; 0 picks a free one)")
    return v


def _admin_port(text: str) -> int:
    return -1 if text.strip() == "-1" else _port(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the store to RocketMQ 5 clients over gRPC",
        description="Run a broker that speaks RocketMQ 5's gRPC protocol (apache.rocketmq.v2.MessagingService) "
                    "on STORE, so the official clients can produce and consume.  Stops cleanly on SIGTERM/SIGINT. "
                    "Prints one JSON line with the address once it listens.")
    p.add_argument("store", help="store directory (created when missing)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8081, help="port (default 8081; 0 picks a free port)")
    p.add_argument("--config", metavar="BROKER_CONF",
                   help="broker.conf with store and broker keys (flushDiskType, autoCreateTopicEnable, ...)")
    p.add_argument("--acl", action="store_true",
                   help="require signed requests and check permissions against the users and ACLs in "
                        "STORE/config/acl.json (or authConfigPath); sets authenticationEnabled and "
                        "authorizationEnabled")
    p.add_argument("--admin-port", type=_admin_port, metavar="PORT",
                   help="admin endpoint (live topics/groups/lag/reset-offset, /metrics) on adminHost (127.0.0.1) "
                        "and this port (default adminPort: 0 picks a free one; -1 turns it off)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    auto = p.add_mutually_exclusive_group()
    auto.add_argument("--auto-create-topics", dest="auto_create", action="store_true", default=None,
                      help="create unknown topics on first use (default unless the config says otherwise)")
    auto.add_argument("--no-auto-create-topics", dest="auto_create", action="store_false",
                      help="answer TOPIC_NOT_FOUND for topics not in config/topics.json")
    p.add_argument("--topic", action="append", default=[], metavar="NAME[:QUEUES[:TYPE]]",
                   help="create or update a topic in config/topics.json before serving; TYPE is NORMAL, FIFO, "
                        "DELAY, TRANSACTION or MIXED (repeatable)")
    p.add_argument("--group", action="append", default=[], metavar="NAME[:orderly=true,retryMaxTimes=N]",
                   help="create or update a consumer group in config/subscriptionGroup.json (repeatable)")
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .config import load_broker_conf
        from .server import ServeOptions, serve
        from .topics import parse_group_spec, parse_topic_spec
    except ImportError as e:
        raise CliError(f"serve needs the broker extras (grpcio, rocketmq-python-client): {e}") from None
    store_cfg, broker_cfg = load_broker_conf(args.config)
    if args.acl:
        broker_cfg = broker_cfg.replace(authenticationEnabled=True, authorizationEnabled=True)
    if args.admin_port is not None:
        broker_cfg = broker_cfg.replace(adminPort=args.admin_port)
    if args.auto_create is not None:
        broker_cfg = broker_cfg.replace(autoCreateTopicEnable=args.auto_create)
    topics = tuple(parse_topic_spec(s) for s in args.topic)
    groups = tuple(parse_group_spec(s, broker_cfg.defaultRetryMaxTimes) for s in args.group)
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("rocketstore.broker").setLevel(logging.INFO)
    return serve(ServeOptions(store=args.store, host=args.host, port=args.port, store_config=store_cfg,
                              broker_config=broker_cfg, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              topics=topics, groups=groups))
