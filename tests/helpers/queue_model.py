"""Mechanics of the queue model-based test (tests/safety/test_model_queues.py): agent processes that hold a store
and SimpleConsumers and run the test's commands, so that the test can SIGKILL them at any moment.

An :class:`AgentProc` is a forked child (the test process opens no store itself, so a fork is safe and costs
milliseconds, not an interpreter start) running :class:`Agent`: the writer ``W`` (the store writable, with its
timer service) or a reader ``R`` (the store opened read-only in another process, as a second process of
receivers would).  Commands and answers are JSON lines over two pipes.  Every command carries the model's clock
(epoch ms): the agent's store is opened with a clock that returns it, so invisible times, back-offs and delays
pass when the test says so, never by sleeping.  Message identity comes from helpers/model.py: body
``m<uid>|<bytes derived from uid>``, keys ``k<uid>``.

Power cuts at the store's sync points (``op_arm``): the writer shadows every sync of a file under the store
(helpers/powerloss.py SyncShadow) and kills itself right after the k-th one; the test builds the crash image
(helpers/powerloss.py crash_image) from the shadow.

Power cuts of the journal alone: each agent copies ``config/popState.journal`` to a shadow file whenever it
fsyncs the journal (under the pop-state flock, so the copy is what that fsync made durable);
:func:`journal_image` then builds the journal a power cut leaves from the shadow and the live file.
"""

from __future__ import annotations

import base64
import json
import os
import random
import select
import signal
import time
from typing import Any

from helpers.model import body_of
from helpers.powerloss import SyncShadow

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.queues import ReceiptHandleError, RetryPolicy
from rocketstore.queues import simple_consumer as simple_consumer_module
from rocketstore.queues import state as state_module

FIFO_KEY = "__SHARDINGKEY"
LINGER = 0.02


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


SECTOR = 512  # a page's write may be torn at sector boundaries by a power cut (no atomic 4 KiB write)
PAGE = 4096
JOURNAL = os.path.join("config", "popState.journal")


def install_journal_shadow(root: str, shadow: str) -> None:
    """In an agent: after every fsync of the pop-state journal, copy the journal to ``shadow`` (atomically) and
    append a byte to ``shadow.count``.  The fsync runs under the pop-state flock, so no other process appends
    between it and the copy."""
    real = os.fsync
    journal = os.path.realpath(os.path.join(root, JOURNAL))

    def fsync(fd: int) -> None:
        real(fd)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if path == journal:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            tmp = f"{shadow}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, shadow)
            with open(shadow + ".count", "ab") as fh:  # one byte per fsync: the test sees that one happened
                fh.write(b".")

    os.fsync = fsync


def journal_image(live: bytes, synced: bytes, rng: random.Random, keep: float, unit: int = PAGE
                  ) -> tuple[bytes, str]:
    """The journal a power cut leaves: ``synced`` (its content at its last fsync) plus, of what was written
    after, each ``unit`` (a 4 KiB page, or a 512-byte sector of a page write torn by the cut) with probability
    ``keep`` (the kernel wrote some back on its own; a unit that did not reach the disk reads as zeros when the
    file's new size did).  Bytes the file shares with ``synced`` from its
    start stay (a torn tail cut off and written again touches only what follows).  A journal started again since
    the fsync (a compaction truncated it and wrote a header naming a new base) is either still the synced one
    (the truncation did not reach the disk) or the new one with its lost pages zeroed.  Returns the image and a
    few words saying which."""
    if synced and live[:live.find(b"\n") + 1] != synced[:synced.find(b"\n") + 1]:
        if rng.random() < 0.5:
            return synced, f"the synced journal ({len(synced)} bytes; its restart since did not reach the disk)"
        start = 0
    else:
        start = len(os.path.commonprefix([live, synced]))
    end = rng.choice([start, len(live), rng.randint(start, len(live))])  # how far the file's size got
    out = bytearray(live[:end])
    lost = 0
    for page in range(start - start % unit, end, unit):
        lo, hi = max(page, start), min(page + unit, end)
        if hi > lo and rng.random() >= keep:
            out[lo:hi] = bytes(hi - lo)
            lost += 1
    again = " (a journal since started again)" if synced and not start else ""
    return bytes(out), (f"{start} bytes as synced{again}, {end - start} of {len(live) - start} later bytes' size "
                        f"kept, {lost} {unit}-byte unit(s) lost")


class Agent:
    """A store and named SimpleConsumers; :meth:`run` executes one command dict and returns the answer dict."""

    def __init__(self, root: str, conf: dict[str, Any], writable: bool, now: int, compact: int = 0) -> None:
        self.now = now
        if compact:  # popState.json rewritten (and the journal started again) after this many journal bytes
            state_module.COMPACT_BYTES = compact
        # Buffered acks are written at the receiver's next call, at ACK_BATCH, at flush and close, and ACK_LINGER
        # (wall-clock) seconds after the first of them: short here, the test waits for it (op_settle) before it
        # lets the store's clock move on.
        simple_consumer_module.ACK_LINGER = LINGER
        self.root = root
        self.store = MessageStore.open(root, StoreConfig(**conf), read_only=not writable, clock=self.clock)
        self.consumers: dict[str, Any] = {}

    def clock(self) -> float:
        return self.now / 1000.0

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.now = max(self.now, int(cmd.get("now", self.now)))
        try:
            return {"ok": getattr(self, "op_" + cmd["op"])(*cmd.get("a", []))}
        except ReceiptHandleError as e:
            return {"err": "ReceiptHandleError", "msg": str(e)}

    # ------------------------------------------------------------ commands
    def op_put(self, topic: str, qid: int, uid: int, size: int, tags: str | None, props: dict[str, str],
               deliver_at: int | None, delay_level: int) -> list[Any]:
        m = Message(topic, body_of(uid, size), queue_id=qid, tags=tags, keys=f"k{uid}", properties=props,
                    deliver_at=deliver_at, delay_level=delay_level)
        r = self.store.put(m)
        self.store.wait_dispatched()
        return [r.status.value, r.queue_offset if r.ok else None, r.error]

    def op_consumer(self, name: str, group: str, topic: str, fifo: bool, filt: str, inv_ms: int, max_rc: int,
                    backoff: list[int], sync: bool) -> None:
        self.consumers[name] = self.store.simple_consumer(
            group, topic, tag_filter=filt, invisible_duration=inv_ms / 1000, fifo=fifo, ack_sync_flush=sync,
            retry_policy=RetryPolicy(max_rc, tuple(backoff)))

    def op_receive(self, name: str, n: int) -> list[list[Any]]:
        return [[m.topic, m.queue_id, m.queue_offset, b64(m.body or b""), m.tags, m.keys, m.delivery_attempt,
                 m.receipt_handle, m.properties.get(FIFO_KEY)] for m in self.consumers[name].receive(n)]

    def op_ack(self, name: str, handle: str) -> None:
        self.consumers[name].ack(handle)

    def op_nack(self, name: str, handle: str) -> None:
        self.consumers[name].nack(handle)

    def op_cid(self, name: str, handle: str, ms: int) -> str:
        return self.consumers[name].change_invisible_duration(handle, ms / 1000)

    def op_flush(self, name: str) -> None:
        self.consumers[name].flush()

    def op_close(self, name: str) -> None:
        self.consumers.pop(name).close()

    def op_settle(self, names: list[str]) -> list[str]:
        """Wait (wall clock, at most 5 s) until these receivers' buffered acks are written; the ones still not."""
        deadline = time.monotonic() + 5
        while True:
            left = [n for n in names if n in self.consumers and self.consumers[n]._pending_acks]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(LINGER / 4)

    def op_tick(self) -> int:
        """A timer round at the current time (the timer thread runs too, on the same clock)."""
        n = self.store.timer.deliver_due() if self.store.timer is not None else 0
        self.store.wait_dispatched()
        return n

    def op_walk(self, topics: list[str]) -> list[list[Any]]:
        """Every message of these topics' queues: [topic, qid, qoff, body, tags, keys, shard]."""
        if not self.store.read_only:
            self.store.wait_dispatched()  # a dead letter a receive just put
        out = []
        for topic, qid in sorted(self.store.queue_keys()):
            if topic not in topics:
                continue
            off = self.store.min_offset_in_queue(topic, qid)
            end = self.store.max_offset_in_queue(topic, qid)
            while off < end:
                r = self.store.get(topic, qid, off, 32)
                for m in r.messages:
                    out.append([m.topic, m.queue_id, m.queue_offset, b64(m.body or b""), m.tags, m.keys,
                                m.properties.get(FIFO_KEY)])
                if r.next_begin_offset <= off:
                    raise AssertionError(f"walk {topic}-{qid} stuck at {off}: {r.status.name}")
                off = r.next_begin_offset
        return out

    def op_resend(self, group: str, dlq_offset: int) -> list[Any]:
        """``rocketstore dlq resend --group G --msg-id ...``'s work for the dead letter at ``dlq_offset``."""
        from rocketstore.cli.dlq import dead_letters
        from rocketstore.queues.dlq import resend_message
        for _, m in dead_letters(self.store, group):
            if m.queue_offset == dlq_offset:
                msg = resend_message(m)
                r = self.store.put(msg)
                self.store.wait_dispatched()
                return [r.status.value, msg.topic, r.queue_offset if r.ok else None]
        return ["NOT_FOUND", None, None]

    def op_arm(self, shadow: str, k: int) -> None:
        """From now on every sync of a store file is shadowed under ``shadow`` (already seeded with the files as
        they are: a disk after a reboot) and the power goes (SIGKILL, no cleanup) right after the ``k``-th one,
        wherever it lands: between a timer round's copies and its state write, a dead letter's put and the pop
        state's, a flush thread's commitlog sync..."""
        shadowing = SyncShadow(self.root, shadow).install()  # first: a file a thread replaces meanwhile is seen
        shadowing.seed()
        count = [0]

        def after_sync(rel: str) -> None:
            count[0] += 1
            if count[0] >= k:
                os.kill(os.getpid(), signal.SIGKILL)
        shadowing.after_sync = after_sync

    def op_shutdown(self) -> None:
        for c in self.consumers.values():
            c.close()
        self.consumers.clear()
        self.store.close()


def serve(rfd: int, wfd: int, root: str, conf: dict[str, Any], writable: bool, now: int, compact: int,
          shadow: str | None = None) -> None:
    """The child's loop: one JSON command per line in, one JSON answer per line out."""
    if shadow:
        install_journal_shadow(root, shadow)
    try:
        agent = Agent(root, conf, writable, now, compact)
        ans: dict[str, Any] = {"ok": "ready"}
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails naming it
        agent, ans = None, {"crash": f"{type(e).__name__}: {e}"}
    os.write(wfd, (json.dumps(ans) + "\n").encode())
    if agent is None:
        return
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        cmd = json.loads(line)
        try:
            ans = agent.run(cmd)
        except Exception as e:  # noqa: BLE001
            import traceback
            ans = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        os.write(wfd, (json.dumps(ans) + "\n").encode())
        if cmd["op"] == "shutdown":
            return


class AgentError(AssertionError):
    """The agent crashed (an exception the store should not raise) or did not answer."""


class AgentProc:
    """The test's handle on one forked agent."""

    def __init__(self, name: str, root: str, conf: dict[str, Any], writable: bool, now: int,
                 compact: int = 0, shadow: str | None = None) -> None:
        self.name = name
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the test
            code = 0
            try:
                os.close(w1)
                os.close(r2)
                serve(r1, w2, root, conf, writable, now, compact, shadow)
            except BaseException:  # noqa: BLE001
                code = 3
            finally:
                os._exit(code)
        os.close(r1)
        os.close(w2)
        self.pid, self.wfd, self.rfd = pid, w1, r2
        self.buf = b""
        self.alive = True
        ready = self._read(60)
        if "ok" not in ready:
            self.kill()
            raise AgentError(f"agent {name} did not open the store: {ready.get('crash')}")

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"agent {self.name} did not answer within {timeout} s")
            ready, _, _ = select.select([self.rfd], [], [], left)
            if ready:
                chunk = os.read(self.rfd, 1 << 16)
                if not chunk:
                    raise AgentError(f"agent {self.name} died")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, op: str, now: int, *a: Any) -> None:
        os.write(self.wfd, (json.dumps({"op": op, "now": now, "a": list(a)}) + "\n").encode())

    def call(self, op: str, now: int, *a: Any) -> dict[str, Any]:
        self.send(op, now, *a)
        ans = self._read(60)
        if "crash" in ans:
            raise AgentError(f"agent {self.name}: {op}{tuple(a)} raised {ans['crash']}")
        return ans

    def call_or_death(self, op: str, now: int, *a: Any) -> dict[str, Any] | None:
        """A call that may end in the agent's death (an armed power cut): its answer, or None if it died."""
        self.send(op, now, *a)
        try:
            ans = self._read(60)
        except AgentError as e:
            if not str(e).endswith("died"):
                raise
            return None
        if "crash" in ans:
            raise AgentError(f"agent {self.name}: {op}{tuple(a)} raised {ans['crash']}")
        return ans

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self.wfd)
        os.close(self.rfd)

    def shutdown(self, now: int) -> None:
        self.call("shutdown", now)
        self.alive = False
        os.waitpid(self.pid, 0)
        os.close(self.wfd)
        os.close(self.rfd)
