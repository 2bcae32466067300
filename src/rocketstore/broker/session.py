"""Client sessions: QueryRoute, Heartbeat, the Telemetry stream (settings, commands), client termination."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from .convert import Code
from .proto import pb, svc
from .topics import MAX_GROUP_LEN, illegal_name
from .wire import Undecodable
from .calls import PUB, STREAM_GRACE, SUB, Caller, guarded, set_status

log = logging.getLogger(__name__)


class Sessions:
    """The route / heartbeat / Telemetry part of :class:`~rocketstore.broker.service.MessagingService`."""

    @guarded(svc.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        resp = svc.QueryRouteResponse()
        caller = self._caller(context, resp.status)
        name = caller and self._resolve(caller, resp.status, request.topic, "Topic", PUB + SUB)
        if name is None:
            return resp
        t = await self._topic_for(name, create=True, status=resp.status)
        if t is None:
            return resp
        for qid in range(t.queue_count):
            mq = resp.message_queues.add()
            self._fill_queue(mq, t, qid, request.topic, request.endpoints)
            mq.accept_message_types.extend(getattr(pb.MessageType, n) for n in t.accepts())
        set_status(resp.status, Code.OK)
        return resp

    @guarded(svc.HeartbeatResponse)
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        resp = svc.HeartbeatResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        cid = caller.client_id
        if not cid:
            set_status(resp.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
            return resp
        group = None
        if request.HasField("group") and request.group.name:
            group = self._resolve(caller, resp.status, request.group, "Group", SUB)
            if group is None:
                return resp
            # Only check the name: the group is created by settings or a receive, which know its topics.
            why = illegal_name(group, "group", MAX_GROUP_LEN)
            if why:
                set_status(resp.status, Code.ILLEGAL_CONSUMER_GROUP, why)
                return resp
        if request.client_type not in pb.ClientType.values():
            set_status(resp.status, Code.UNRECOGNIZED_CLIENT_TYPE, f"unknown client type {request.client_type}")
            return resp
        c = self.broker.clients.touch(cid)
        c.user, c.namespace = caller.user, caller.namespace
        if request.client_type:
            c.client_type = request.client_type
        if group:
            c.group = group
        set_status(resp.status, Code.OK)
        return resp

    async def _settings_reply(self, caller: Caller, cmd: Any) -> Any:
        s = cmd.settings
        reply = svc.TelemetryCommand()
        if s.client_type not in pb.ClientType.values():
            set_status(reply.status, Code.UNRECOGNIZED_CLIENT_TYPE, f"unknown client type {s.client_type}")
            return reply
        if s.HasField("publishing"):
            topics = [self._resolve(caller, reply.status, r, "Topic", PUB) for r in s.publishing.topics]
            if None in topics:
                return reply
        elif s.HasField("subscription"):
            group = self._resolve(caller, reply.status, s.subscription.group, "Group", SUB)
            subs = {}
            for e in s.subscription.subscriptions:
                name = group and self._resolve(caller, reply.status, e.topic, "Topic", SUB)
                if name is None:
                    return reply
                subs[name] = (e.expression.type, e.expression.expression)
            if group is None:
                return reply
        c = self.broker.clients.touch(caller.client_id)
        c.user, c.namespace = caller.user, caller.namespace
        if s.HasField("client_type"):
            c.client_type = s.client_type
        c.language = pb.Language.Name(s.user_agent.language) if s.user_agent.language in pb.Language.values() else ""
        c.version = s.user_agent.version
        out = reply.settings
        out.CopyFrom(s)
        if s.HasField("publishing"):
            c.publishing = set(topics)
            out.publishing.max_body_size = self.broker.store.config.maxMessageSize
            out.publishing.validate_message_type = True
            bp = out.backoff_policy
            bp.max_attempts = 3
            bp.exponential_backoff.initial.nanos = 10_000_000
            bp.exponential_backoff.max.seconds = 1
            bp.exponential_backoff.multiplier = 2
        elif s.HasField("subscription"):
            sub = s.subscription
            c.subscriptions = subs
            fifo_topics = any((t := self.topics.topics.get(name)) is not None and t.message_type == "FIFO"
                              for name in c.subscriptions)
            g = await self._group_for(group, reply.status, fifo_topics)
            if g is None:
                return reply
            c.group = group
            out.subscription.fifo = g.orderly
            out.subscription.receive_batch_size = self.cfg.maxReceiveBatchSize
            if s.client_type == pb.ClientType.PUSH_CONSUMER or not sub.HasField("long_polling_timeout") \
                    or sub.long_polling_timeout.seconds <= 0:
                out.subscription.long_polling_timeout.seconds = max(1, self.cfg.longPollingTimeout // 1000)
            bp = out.backoff_policy
            bp.max_attempts = g.max_attempts
            for sec in self.cfg.delay_levels_seconds():
                bp.customized_backoff.next.add().seconds = sec
        else:
            set_status(reply.status, Code.BAD_REQUEST, "settings carry neither publishing nor subscription")
            return reply
        out.metric.on = False
        set_status(reply.status, Code.OK)
        return reply

    async def Telemetry(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        from .clients import TelemetryStream
        reply = svc.TelemetryCommand()
        caller = self._caller(context, reply.status)
        if caller is not None and not caller.client_id:
            set_status(reply.status, Code.CLIENT_ID_REQUIRED, "x-mq-client-id is missing")
        if caller is None or not caller.client_id:
            yield reply
            return
        cid = caller.client_id
        stream = TelemetryStream(cid)
        clients = self.broker.clients
        clients.add_stream(cid, stream)

        async def read() -> None:
            try:
                async for cmd in request_iterator:
                    clients.touch(cid)
                    if isinstance(cmd, Undecodable):
                        bad = svc.TelemetryCommand()
                        set_status(bad.status, cmd.code, cmd.why)
                        stream.send(bad)
                    elif cmd.HasField("settings"):
                        stream.send(await self._settings_reply(caller, cmd))
                    # thread_stack_trace / verify_message_result replies need no answer
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the client went away, or sent garbage
                log.debug("telemetry stream of %s ended: %s", cid, e)
            finally:
                stream.close()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    break
                yield item
        finally:
            reader.cancel()
            if clients.remove_stream(cid, stream):
                # Its last stream broke (a push consumer killed): unless it reconnects within a second, the
                # receipts it renewed go back then, not after clientExpireTime.
                asyncio.get_running_loop().call_later(STREAM_GRACE, self._stream_gone, cid)

    def _stream_gone(self, cid: str) -> None:
        if not self.broker.clients.has_stream(cid):
            n = self.broker.pop.release_client(cid)
            if n:
                log.info("client %s lost its Telemetry stream; %d in-flight messages released", cid, n)

    @guarded(svc.NotifyClientTerminationResponse)
    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        resp = svc.NotifyClientTerminationResponse()
        caller = self._caller(context, resp.status)
        if caller is None:
            return resp
        cid = caller.client_id
        if cid:
            n = self.broker.pop.release_client(cid)
            self.broker.clients.remove(cid)
            log.debug("client %s terminated; %d messages released", cid, n)
        set_status(resp.status, Code.OK)
        return resp

    # ------------------------------------------------------------ producing
