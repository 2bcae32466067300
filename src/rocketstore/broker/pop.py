"""The broker's pop consumption is the library's: :mod:`rocketstore.queues.pop` (one implementation).

The broker runs :class:`PopService` on its event loop thread and writes ``config/popState.json`` itself
(batched, see ``Broker.persist``); the library's SimpleConsumers run the same class under the state file's
lock.  Both read and write the same file format, so a store's in-flight state carries over either way.
"""

from ..queues.pop import (MAX_BLOCKED_PER_QUEUE, MAX_READ_PER_QUEUE, DeadLetter, Delivery, Entry,  # noqa: F401
                          PopService, QueueState, TagFilter, now_ms)
