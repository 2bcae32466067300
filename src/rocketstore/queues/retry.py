"""RocketMQ's retry policy for pop consumers: how long a nacked (or timed-out) message waits, and when it is dead.

RocketMQ counts deliveries: a message is delivered at most ``maxReconsumeTimes + 1`` times (16 + 1 by
default), then moved to ``%DLQ%<group>``.  A nack waits by the "customized" back-off of concurrent
consumers, RocketMQ's delay levels 3..18: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h (the last
one repeats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_RECONSUME_TIMES = 16
CUSTOMIZED_BACKOFF_MS: tuple[int, ...] = tuple(s * 1000 for s in (
    10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200))
DLQ_PREFIX = "%DLQ%"
RETRY_PREFIX = "%RETRY%"


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


@dataclass(frozen=True)
class RetryPolicy:
    """``max_reconsume_times`` redeliveries after the first delivery; ``backoff_ms[i]`` after the (i+1)-th."""

    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    backoff_ms: tuple[int, ...] = field(default=CUSTOMIZED_BACKOFF_MS)

    def __post_init__(self) -> None:
        if self.max_reconsume_times < 0:
            raise ValueError(f"max_reconsume_times must be >= 0, not {self.max_reconsume_times}")
        if not self.backoff_ms or any(b < 0 for b in self.backoff_ms):
            raise ValueError("backoff_ms must be a non-empty sequence of non-negative milliseconds")

    @property
    def max_attempts(self) -> int:
        """Deliveries before the message goes to the DLQ (PopService's ``max_attempts``)."""
        return self.max_reconsume_times + 1

    def next_delay_ms(self, attempts: int) -> int:
        """The wait before the next delivery of a message delivered ``attempts`` times so far."""
        return self.backoff_ms[min(max(attempts, 1), len(self.backoff_ms)) - 1]
