"""Dead letters: the message RocketMQ writes to ``%DLQ%<group>``, and the one re-sent from there.

A dead letter keeps the original body, flag, keys, tags and born fields; it gains RocketMQ's properties
``DLQ_ORIGIN_TOPIC`` and ``RETRY_TOPIC`` (the topic it came from), ``DLQ_ORIGIN_MESSAGE_ID`` and
``ORIGIN_MESSAGE_ID`` (its UNIQ_KEY, or offset message id), and ``RECONSUME_TIME`` (deliveries so far).
Re-sending puts it back on its original topic without the DLQ properties (its UNIQ_KEY stays, so an
idempotent consumer recognises it).
"""

from __future__ import annotations

from typing import Any

from ..format.codec import MessageExt
from ..format.message import Message
from .retry import DLQ_PREFIX, dlq_topic

P_DLQ_TOPIC = "DLQ_ORIGIN_TOPIC"
P_DLQ_MSG_ID = "DLQ_ORIGIN_MESSAGE_ID"
P_ORIGIN_MSG_ID = "ORIGIN_MESSAGE_ID"
P_RETRY_TOPIC = "RETRY_TOPIC"
P_RECONSUME = "RECONSUME_TIME"
_DLQ_ONLY = (P_DLQ_TOPIC, P_DLQ_MSG_ID, P_RETRY_TOPIC, P_RECONSUME)


def dead_letter(m: MessageExt, group: str, topic: str, attempts: int, store_host: Any = None) -> Message:
    """The ``%DLQ%<group>`` copy of ``m`` (read from ``topic``) after ``attempts`` deliveries."""
    props = dict(m.properties)
    uniq = props.get("UNIQ_KEY") or m.msg_id
    props.setdefault(P_DLQ_TOPIC, topic)
    props.setdefault(P_DLQ_MSG_ID, uniq)
    props.setdefault(P_ORIGIN_MSG_ID, uniq)
    props[P_RETRY_TOPIC] = topic
    props[P_RECONSUME] = str(attempts)
    return Message(topic=dlq_topic(group), body=m.body or b"", queue_id=0, properties=props, flag=m.flag,
                   sys_flag=m.sys_flag & ~0xC, born_timestamp=m.born_timestamp,
                   born_host=(m.born_addr, m.born_port), store_host=store_host, reconsume_times=attempts)


def origin_topic(m: MessageExt) -> str | None:
    """The topic a dead letter came from (None: not a dead letter)."""
    props = m.properties
    return props.get(P_DLQ_TOPIC) or props.get(P_RETRY_TOPIC)


def resend_message(m: MessageExt) -> Message:
    """The message to put on its original topic again, from its dead letter ``m``."""
    topic = origin_topic(m)
    if not topic or not m.topic.startswith(DLQ_PREFIX):
        raise ValueError(f"message {m.msg_id} in {m.topic} is not a dead letter (no {P_DLQ_TOPIC})")
    props = {k: v for k, v in m.properties.items() if k not in _DLQ_ONLY}
    return Message(topic=topic, body=m.body or b"", properties=props, flag=m.flag,
                   born_timestamp=m.born_timestamp, born_host=(m.born_addr, m.born_port))
