"""Queue semantics in the library (issue 27): RocketMQ 5's SimpleConsumer, retries, dead letters and delays.

The facade (``rocketstore.store``) imports this package downward; its modules are given the store object and
never name MessageStore.
"""

from .aio import AsyncSimpleConsumer  # noqa: F401  (qcore: receive/ack/retry/DLQ/FIFO)
from .retry import RetryPolicy  # noqa: F401
from .simple_consumer import ReceiptHandleError, ReceivedMessage, SimpleConsumer  # noqa: F401
from .timer import DELAY_LEVELS_MS, TIMER_TOPIC, TimerService, delay_level_ms  # noqa: F401  (qdelay: delays)
