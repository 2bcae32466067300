"""The broker's Prometheus metrics (``/metrics`` of the admin endpoint), through ``prometheus_client``.

Each broker has its own CollectorRegistry (several brokers in one process, as in tests, do not clash).
Counters (puts, gets, bytes, ACL refusals) are counted where the work happens; the gauges (lag per group
and queue, flush and dispatch lag, disk usage) are read from a snapshot that the admin server takes on the
broker's loop just before it renders the page, so that no thread walks the broker's tables while the loop
changes them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SnapshotCollector(Collector):
    """Gauges from the last snapshot ({"lag": rows, "flushLagBytes": n, ...})."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self.snapshot
        lag = GaugeMetricFamily("rocketstore_consumer_lag_messages",
                                "Messages of a queue after the group's committed offset",
                                labels=["group", "topic", "queue_id"])
        inflight = GaugeMetricFamily("rocketstore_consumer_inflight_messages",
                                     "Messages received by the group and not yet acked (pop state)",
                                     labels=["group", "topic", "queue_id"])
        for r in s.get("lag", ()):
            labels = [r["group"], r["topic"], str(r["queueId"])]
            lag.add_metric(labels, r["lag"])
            if r.get("inFlight") is not None:
                inflight.add_metric(labels, r["inFlight"])
        yield lag
        yield inflight
        for key, name, doc in (
                ("flushLagBytes", "rocketstore_flush_lag_bytes", "Commitlog bytes written and not yet flushed"),
                ("dispatchBehindBytes", "rocketstore_dispatch_lag_bytes",
                 "Commitlog bytes not yet dispatched to the consume queues and the index"),
                ("diskUsedRatio", "rocketstore_disk_used_ratio", "Used share of the store's disk (0..1)"),
                ("clients", "rocketstore_clients", "Connected clients"),
                ("maxPhyOffset", "rocketstore_commitlog_max_offset_bytes", "End of the commitlog")):
            if s.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=s[key])


class BrokerMetrics:
    """Counters of one broker and the page that shows them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.puts = Counter("rocketstore_put_messages", "Messages the broker stored (PUT_OK): sends, and delayed, transaction and dead-letter messages it moved",
                            registry=self.registry)
        self.put_failures = Counter("rocketstore_put_failures", "Puts the store did not answer PUT_OK",
                                    registry=self.registry)
        self.bytes_in = Counter("rocketstore_put_bytes", "Body bytes of the messages stored",
                                registry=self.registry)
        self.gets = Counter("rocketstore_get_messages", "Messages delivered to consumers", registry=self.registry)
        self.bytes_out = Counter("rocketstore_get_bytes", "Body bytes of the messages delivered",
                                 registry=self.registry)
        self.acl_refusals = Counter("rocketstore_acl_refusals", "Requests refused by ACL, by reason",
                                    ["reason"], registry=self.registry)
        self.gauges = SnapshotCollector()
        self.registry.register(self.gauges)
        self._render_lock = threading.Lock()

    def refused(self, reason: str) -> None:
        """One ACL refusal: ``unauthenticated`` (UNAUTHORIZED) or ``forbidden`` (FORBIDDEN)."""
        self.acl_refusals.labels(reason).inc()

    def stored(self, ok: bool, body_bytes: int) -> None:
        if ok:
            self.puts.inc()
            self.bytes_in.inc(body_bytes)
        else:
            self.put_failures.inc()

    def delivered(self, messages: int, body_bytes: int) -> None:
        if messages:
            self.gets.inc(messages)
            self.bytes_out.inc(body_bytes)

    def render(self, take_snapshot: Callable[[], dict[str, Any]]) -> bytes:
        """The text exposition, with the gauges of a fresh snapshot (``take_snapshot`` runs on the loop)."""
        with self._render_lock:
            self.gauges.snapshot = take_snapshot()
            return generate_latest(self.registry)


def count_deliveries(pop: Any, metrics: BrokerMetrics) -> None:
    """Count what ``pop.receive`` hands out (the receive path belongs to the queue-semantics code; this wraps
    the one call every delivery goes through instead of editing it)."""
    receive = pop.receive

    def counted(*args: Any, **kw: Any) -> Any:
        deliveries, dead = receive(*args, **kw)
        metrics.delivered(len(deliveries), sum(len(d.message.body or b"") for d in deliveries))
        return deliveries, dead

    pop.receive = counted
