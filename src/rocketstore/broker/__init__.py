"""A RocketMQ 5 gRPC front end on a rocketstore: ``rocketstore serve STORE``.

The official clients (``rocketmq-python-client``, Java ...) talk to it through
``apache.rocketmq.v2.MessagingService``.  Broker state lives in the store
itself (system topics for half, op and timer messages) and in RocketMQ's JSON
files under ``<store>/config`` (topics, subscription groups, consumer offsets)
plus ``popState.json`` (in-flight receipts) and ``timerState.json``.
"""

from __future__ import annotations

from .config import BrokerConfig, load_broker_conf

__all__ = ["BrokerConfig", "load_broker_conf"]
