"""rocketstore: Apache RocketMQ's message store in Python, byte-compatible with RocketMQ 5.x files."""

from .format.codec import MessageExt
from .config import StoreConfig
from .errors import (ConfigError, CorruptRecordError, ReadOnlyStoreError, StoreClosedError, StoreError,
                     StoreLoadError, StoreLockedError)
from .format.message import (GetMessageResult, GetMessageStatus, Message, PutMessageResult, PutMessageStatus,
                             QueryMessageResult, parse_tag_filter)
from .storage.geometry import init_store
from .store import MessageStore
from .queues.simple_consumer import set_view_follower
from .tail_view import extend_view

set_view_follower(lambda store, topics: extend_view(store, topics))  # a read-only store's receivers follow the writer

__all__ = ["MessageStore", "StoreConfig", "init_store", "Message", "MessageExt", "PutMessageResult", "PutMessageStatus",
           "GetMessageResult", "GetMessageStatus", "QueryMessageResult", "parse_tag_filter", "StoreError",
           "StoreLoadError", "StoreLockedError", "StoreClosedError", "ReadOnlyStoreError", "ConfigError",
           "CorruptRecordError"]
__version__ = "0.1.0"
