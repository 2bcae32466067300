"""Transactional messages, stored the way RocketMQ's TransactionalMessageService stores them.

* A half message goes to ``RMQ_SYS_TRANS_HALF_TOPIC`` (queue 0) with
  ``REAL_TOPIC``, ``REAL_QID`` and ``TRAN_MSG=true``: no consumer sees it.  Its
  transaction id is the record's offset message id, so EndTransaction finds the
  half message through the commitlog even after a restart.  The producer gets
  that id sealed with a MAC over the real topic (:class:`ReceiptSigner`), so an
  id cannot be guessed from the commitlog offset, nor used through another topic.
* EndTransaction must name the half message's own topic and message id; a
  topic that is blank or not a legal name is ILLEGAL_TOPIC.
* COMMIT puts a copy into the real topic (sysFlag TRANSACTION_COMMIT,
  preparedTransactionOffset = the half record); COMMIT and ROLLBACK both write
  an op record to ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` whose body is the half
  message's queue offset (tag ``d``), which marks it resolved.
* Progress through both topics is kept in ``consumerOffset.json`` under the
  group ``CID_RMQ_SYS_TRANS``, as RocketMQ does.  At start the op topic and then
  the half topic are read from there to find the unresolved half messages.
* An unresolved half message older than ``transactionTimeOut`` (or its
  ``CHECK_IMMUNITY_TIME_IN_SECONDS``) is checked: a
  ``recover_orphaned_transaction_command`` goes over the Telemetry stream of a
  live producer that publishes to its topic, every
  ``transactionCheckInterval``, at most ``transactionCheckMax`` times; then it
  is discarded (rolled back) with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..format import codec
from ..format.codec import MessageExt
from ..format.message import GetMessageStatus, Message, PutMessageResult
from .config import BrokerConfig
from .convert import P_CHECK_IMMUNITY, P_REAL_QID, P_REAL_TOPIC, P_TRAN, Code, to_pb
from ..storage.consumer_offsets import ConsumerOffsetManager
from .tasks import cancel, every
from ..queues.pop import now_ms
from .proto import pb, svc
from .receipts import ReceiptSigner
from .timer import restore
from .topics import MAX_TOPIC_LEN, TRANS_GROUP, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, illegal_name

log = logging.getLogger(__name__)
OP_TAG = "d"


@dataclass
class Half:
    offset: int
    phy: int
    topic: str
    message_id: str
    next_check: int
    checks: int = 0


class TransactionService:
    def __init__(self, store: Any, offsets: ConsumerOffsetManager, cfg: BrokerConfig, store_host: tuple[bytes, int],
                 put: Callable[[Message], Awaitable[PutMessageResult]], notify: Callable[[str], None],
                 send_check: Callable[[str, Any], bool]) -> None:
        self.store = store
        self.offsets = offsets
        self.cfg = cfg
        self.store_host = store_host
        self.put = put
        self.notify = notify
        self.send_check = send_check
        # Seals transaction ids.  The server sets the broker's persistent signer (ids stay valid over a restart);
        # until then a random key, so an id is never unsealed.
        self.signer = ReceiptSigner(secrets.token_bytes(32))
        self.pending: dict[int, Half] = {}
        self.op_refs: dict[int, int] = {}  # half queue offset -> op queue offset (resolved, above committed)
        self.resolving: set[int] = set()
        self.half_committed = 0
        self.op_next = 0
        self._task: asyncio.Task | None = None
        self._load()

    # ------------------------------------------------------------ loading
    def _scan(self, topic: str, start: int, read_body: bool):
        off = max(start, self.store.min_offset_in_queue(topic, 0))
        hi = self.store.max_offset_in_queue(topic, 0)
        while off < hi:
            res = self.store.get(topic, 0, off, 32, read_body=read_body)
            if res.status is GetMessageStatus.OFFSET_TOO_SMALL:
                off = res.min_offset
                continue
            yield from res.messages
            if res.next_begin_offset <= off:
                break
            off = res.next_begin_offset

    def _load(self) -> None:
        self.half_committed = self.offsets.get(TRANS_HALF_TOPIC, TRANS_GROUP, 0) or 0
        op_start = self.offsets.get(TRANS_OP_HALF_TOPIC, TRANS_GROUP, 0) or 0
        for m in self._scan(TRANS_OP_HALF_TOPIC, op_start, True):
            try:
                half_off = int((m.body or b"").decode("ascii"))
            except ValueError:
                continue
            if half_off >= self.half_committed:
                self.op_refs[half_off] = m.queue_offset
        self.op_next = max(op_start, self.store.max_offset_in_queue(TRANS_OP_HALF_TOPIC, 0))
        now = now_ms()
        for m in self._scan(TRANS_HALF_TOPIC, self.half_committed, False):
            if m.queue_offset not in self.op_refs:
                self.pending[m.queue_offset] = self._half(m, now)
        self.half_committed = max(self.half_committed, self.store.min_offset_in_queue(TRANS_HALF_TOPIC, 0))
        self._advance()
        if self.pending:
            log.info("%d unresolved transactions", len(self.pending))

    def _half(self, m: MessageExt, now: int) -> Half:
        props = m.properties
        delay = self.cfg.transactionTimeOut
        immunity = props.get(P_CHECK_IMMUNITY)
        if immunity and immunity.isdigit():
            delay = max(delay, int(immunity) * 1000)
        return Half(m.queue_offset, m.commit_log_offset, props.get(P_REAL_TOPIC, ""), m.uniq_key or "",
                    max(now, m.store_timestamp + delay) if m.store_timestamp else now + delay)

    def _advance(self) -> None:
        hi = self.store.max_offset_in_queue(TRANS_HALF_TOPIC, 0)
        while self.half_committed < hi and self.half_committed not in self.pending \
                and self.half_committed not in self.resolving:
            self.op_refs.pop(self.half_committed, None)
            self.half_committed += 1
        for k in [k for k in self.op_refs if k < self.half_committed]:
            del self.op_refs[k]
        op_committed = min(self.op_refs.values(), default=self.op_next)
        self.offsets.commit(TRANS_HALF_TOPIC, TRANS_GROUP, 0, self.half_committed)
        self.offsets.commit(TRANS_OP_HALF_TOPIC, TRANS_GROUP, 0, op_committed)

    # ------------------------------------------------------------ producing
    async def submit(self, msg: Message) -> tuple[PutMessageResult, str]:
        """Store a half message; its transaction id."""
        props = dict(msg.properties)
        props[P_REAL_TOPIC] = msg.topic
        props[P_REAL_QID] = str(msg.queue_id)
        props[P_TRAN] = "true"
        half = Message(topic=TRANS_HALF_TOPIC, body=msg.body, queue_id=0, properties=props, flag=msg.flag,
                       sys_flag=codec.TRANSACTION_NOT_TYPE, born_timestamp=msg.born_timestamp,
                       born_host=msg.born_host, store_host=msg.store_host)
        res = await self.put(half)
        if res.ok:
            delay = self.cfg.transactionTimeOut
            immunity = props.get(P_CHECK_IMMUNITY)
            if immunity and immunity.isdigit():
                delay = max(delay, int(immunity) * 1000)
            self.pending[res.queue_offset] = Half(res.queue_offset, res.commit_log_offset, msg.topic,
                                                  props.get("UNIQ_KEY", ""), now_ms() + delay)
        return res, (self.signer.seal_transaction(msg.topic, res.msg_id) if res.ok else "")

    def _find(self, topic: str, message_id: str, sealed: str) -> MessageExt | None:
        """The half message of ``sealed`` when it was sealed for ``topic`` and is ``message_id``, else None."""
        txid = self.signer.open_transaction(topic, sealed)
        if txid is None:
            return None
        try:
            raw = bytes.fromhex(txid)
        except ValueError:
            return None
        if len(raw) not in (16, 28):
            return None
        try:
            m = self.store.look(int.from_bytes(raw[-8:], "big"))
        except Exception:
            return None
        if m.topic != TRANS_HALF_TOPIC or m.properties.get(P_REAL_TOPIC) != topic or m.uniq_key != message_id:
            return None
        return m

    async def end(self, topic: str, message_id: str, txid: str, resolution: int, source: int) -> tuple[int, str]:
        """Commit or roll back the half message of ``txid``.  Only through the half message's own topic (the
        caller was authorised for it) and message id, and only with an id this broker sealed for that topic."""
        why = illegal_name(topic, "topic", MAX_TOPIC_LEN)
        if why:
            return Code.ILLEGAL_TOPIC, why
        if not txid or not txid.strip():
            return Code.INVALID_TRANSACTION_ID, "transaction id is blank"
        if not message_id:
            return Code.INVALID_TRANSACTION_ID, "message id is blank"
        m = self._find(topic, message_id, txid.strip())
        if m is None:
            return Code.INVALID_TRANSACTION_ID, (f"no half message {message_id[:64]!r} of topic {topic} for "
                                                 f"transaction {txid[:80]!r}")
        off = m.queue_offset
        if off < self.half_committed or off in self.op_refs:
            return Code.OK, "already resolved"
        if off in self.resolving:
            return Code.OK, "being resolved"
        if resolution not in (pb.TransactionResolution.COMMIT, pb.TransactionResolution.ROLLBACK):
            h = self.pending.get(off)
            if h is not None:
                h.next_check = now_ms() + self.cfg.transactionCheckInterval
            return Code.OK, "still unknown; will check again"
        commit = resolution == pb.TransactionResolution.COMMIT
        self.resolving.add(off)
        try:
            if commit:
                real = restore(m, self.store_host, sys_flag=codec.TRANSACTION_COMMIT,
                               drop=(P_REAL_TOPIC, P_REAL_QID, P_TRAN))
                real.prepared_transaction_offset = m.commit_log_offset
                res = await self.put(real)
                if not res.ok:
                    return Code.INTERNAL_SERVER_ERROR, f"commit failed: {res.status.value} {res.error or ''}"
                self.notify(real.topic)
            if not await self._write_op(off):
                return Code.INTERNAL_SERVER_ERROR, "could not record the transaction's resolution"
        finally:
            self.resolving.discard(off)
        self.pending.pop(off, None)
        self._advance()
        log.debug("transaction %s %s (%s)", txid, "committed" if commit else "rolled back",
                  pb.TransactionSource.Name(source) if source in pb.TransactionSource.values() else source)
        return Code.OK, "committed" if commit else "rolled back"

    async def _write_op(self, half_off: int) -> bool:
        op = Message(topic=TRANS_OP_HALF_TOPIC, body=str(half_off).encode("ascii"), queue_id=0, tags=OP_TAG,
                     store_host=self.store_host)
        res = await self.put(op)
        if not res.ok:
            log.error("op record for half offset %d not written: %s", half_off, res.status.value)
            return False
        self.op_refs[half_off] = res.queue_offset
        self.op_next = max(self.op_next, res.queue_offset + 1)
        return True

    # ------------------------------------------------------------ checking
    def start(self) -> None:
        period = min(1.0, self.cfg.transactionCheckInterval / 1000)
        self._task = asyncio.get_running_loop().create_task(every(period, self.check_once, "transaction check"),
                                                            name="transaction-check")

    async def stop(self) -> None:
        await cancel(self._task)

    async def check_once(self) -> None:
        now = now_ms()
        for off, h in sorted(self.pending.items()):
            if h.next_check > now or off in self.resolving:
                continue
            if h.checks >= self.cfg.transactionCheckMax:
                log.warning("transaction of message %s on %s unresolved after %d checks; discarded (rolled back)",
                            h.message_id, h.topic, h.checks)
                self.resolving.add(off)
                try:
                    ok = await self._write_op(off)
                finally:
                    self.resolving.discard(off)
                if ok:
                    self.pending.pop(off, None)
                    self._advance()
                continue
            h.next_check = now + self.cfg.transactionCheckInterval
            try:
                m = self.store.look(h.phy)
            except Exception as e:
                log.error("half message at %d unreadable (%s); discarded", h.phy, e)
                self.pending.pop(off, None)
                self._advance()
                continue
            cmd = self.check_command(m)
            if self.send_check(h.topic, cmd):
                h.checks += 1
                log.debug("asked a producer of %s about transaction %s (check %d)", h.topic, h.message_id,
                          h.checks)

    def check_command(self, m: MessageExt) -> Any:
        """The Telemetry command that asks a producer about a half message."""
        cmd = svc.TelemetryCommand()
        rec = cmd.recover_orphaned_transaction_command
        to_pb(m, rec.message)
        real = m.properties.get(P_REAL_TOPIC, m.topic)
        rec.message.topic.name = real
        rec.message.system_properties.message_type = pb.MessageType.TRANSACTION
        rec.transaction_id = self.signer.seal_transaction(
            real, codec.offset_msg_id(m.store_addr, m.store_port, m.commit_log_offset))
        return cmd

