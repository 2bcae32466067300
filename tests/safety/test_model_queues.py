"""Model-based test of the library's queue semantics (issue 27; docs: /work/shared/design/data-safety.md, "the
model-based test"): random sequences of puts (plain, delayed, FIFO message groups, another topic), receives by
several receivers of a group in two processes, acks (ackSyncFlush on and off), nacks, change_invisible_duration,
time passing (the store's clock, driven by the test: no sleeping), maxReconsumeTimes exhaustion to
``%DLQ%<group>``, dead-letter re-sends, clean closes and reopens of receivers and processes, SIGKILL of the writer
or of the read-only receivers' process (idle, or in the middle of a call), torn tails of
``config/popState.journal`` and power cuts (both processes die; the journal keeps what its last fsync made durable
plus some later 4 KiB pages or 512-byte sectors, the rest zeros), each checked against a model of what every group
was given and acknowledged.

Processes (helpers/queue_model.py): ``W`` holds the store writable (its timer delivers delays) and receivers; ``R``
holds it read-only with receivers of the same groups.  Groups: ``GA`` (QT, every tag), ``GB`` (QT, ``TagA ||
TagB``), ``GF`` (QF, FIFO by ``__SHARDINGKEY``); topic QO is put to and consumed by nobody.

Checks, on every receive and after every step (a walk of every topic through W):

- a receive returns only messages of the receiver's topic matching its filter, with the body, tags and keys put;
- a message acknowledged (an ack written: ackSyncFlush, or a buffered ack applied by the receiver's next call,
  flush or close) is never delivered again to its group, also after a SIGKILL (the journal line is in the page
  cache); an ack still buffered when its process is killed may be lost (the documented window): the message comes
  back after its invisible time;
- a message is not delivered while invisible (held by a receiver, or backing off after a nack), whoever holds it,
  also after its holder was killed; its delivery attempt counts up by one; it is delivered at most
  maxReconsumeTimes + 1 times; a receipt handle is accepted exactly while it is the message's current one;
- a dead letter appears in ``%DLQ%<group>`` only after the last allowed delivery, and once (re-sending puts a new
  copy back on its topic, which the model then expects like any message);
- a delayed message is never in its topic before its time and is there exactly once after a timer round at or
  after its time, across restarts and kills;
- FIFO: a message group's next message is not delivered before the previous one (same queue) is acked or
  dead-lettered;
- at the end (``drain``): time passes far enough, W's receivers take and ack everything: every message put is
  acked or dead-lettered exactly once in every group that wants it (nothing lost, no duplicate dead letter).

A power cut may take back what the journal's last fsync did not cover (the agents copy the journal at each fsync,
helpers/queue_model.py; the model counts an fsync it saw during a step as covering what it knew before the step,
and an ackSyncFlush receiver's ack, nack or change_invisible_duration as covering everything up to it): an ack
without ackSyncFlush may be lost (the message comes back: redelivered, never lost: the drain still wants it acked or
dead-lettered), so may deliveries (attempt counts go back, no earlier than the fsync's; invisible times and handles
revert: a handle superseded since may work again).  An ack the fsync covered must hold: the message is never
delivered again, its handle refused.  Half the power cuts also take the commitlog's unflushed tail (ASYNC_FLUSH;
``cut_log``): the last few records, when they are plain puts the model knows, are zeroed (from a record's start or
inside it) and the model forgets those messages, acked or not; their queue offsets may be given again, and a
group's fsynced acks of them must not hide the next puts.  The store's other files are kept as written
(tests/safety/test_model_based.py cuts those).

Power cuts at the store's own sync points (``syncut``, ASYNC_FLUSH): the disk as of the step's start counts as
synced (a reboot: buffered acks settled first, so the model holds everything before as durable), then W shadows
every sync of a file under the store (helpers/powerloss.py SyncShadow, as the store model does) and dies right
after the k-th one (k random, 1-8; or at the end of the call) in a timer round (time moved to a pending delay's due
time), in a W receive, whose dead-letter mover runs (aimed at a message past its last delivery), or in a W ack; the
store restarts on the crash image (crash_image: each file as of its last sync, a file never synced zeroed).  So the
cut lands anywhere among the round's state write "delivering", its copies' puts, the commitlog flush and the state
write "delivered", or among the mover's pop-state write, the dead letter's put, its flush and the pop-state write
that lets the message go, or in a flush thread's sync.  Checked: at-least-once -- a due delayed message reaches its
topic at the next timer round (never "delivered" in a state that outlived its copy), a message past
maxReconsumeTimes reaches its DLQ or is delivered again (the drain wants it acked or dead-lettered), nothing
acknowledged before comes back or goes.

A kill in the middle of a call leaves the model uncertain of exactly that call's effect (the message may be held
until its invisible time, an ack may have landed); the checks it weakens say so where they do.

Knobs (environment): ROCKETSTORE_MODEL_SEEDS (seeds of the random test, default 30: 25-35 s on 2 busy
cores; with the log cut 54 s against 49 s without it, side by side at load 12; with ``syncut`` 13.6 and 13.3 s
against 12.3 and 11.5 s without it, alternating runs at load 1.9), ROCKETSTORE_MODEL_STEPS (steps per seed,
default 80), ROCKETSTORE_MODEL_SYNCUT (the weight of ``syncut`` among the ops, default 1 of 60; e.g. 8 to hunt in its
windows), ROCKETSTORE_MODEL_BASE_SEED (default 1), ROCKETSTORE_MODEL_SEED (replay one seed;
kills in the middle of a call land at a random moment, so a replay may need a few runs),
ROCKETSTORE_MODEL_KEEP_GOING=1 (every failing seed, each one's steps in its directory's failure.txt).

Bugs it found (regression tests in tests/library/test_queues_model_found.py).  Put back, the default run
(seeds 1-30, 80 steps) must fail again; seeds shift whenever the test's random choices change:

1. a buffered ack (no ackSyncFlush) stayed in the receiver's memory until its next call: a receiver that acked and
   then went on with other work let the message come back to another receiver after its invisible time (first
   run: 21 of 150 seeds, e.g. 112: "its ack by R6 is buffered in a live receiver"); put back now: 29 of 30 seeds,
   "acks buffered in live receivers ['W3'] are not written 5 s after the ack".
2. a read-only receiver clamped the state of another topic's group to its own view (which follows only its own
   topic), and its compaction wrote the clamped state (1043, 1046 of 60 steps; put back with the power-cut op in
   the run: seeds 15, 23; before it: 4, 7, 15, 17, 27): "delivery attempt 1, the model expects 2..2", "still
   invisible ... (held by W1)", "acknowledged before, delivered again", "dead-lettered before", "ack of uid 5
   refused, the model expects acceptance".
3. the writer killed between a dead letter's put and the state write put it into %DLQ%<group> a second time
   after the restart (3016 with 120 steps; put back: 2 of 100 seeds 5000-5099 with ROCKETSTORE_MODEL_STEPS=120,
   not reliably in the default run -- the kill must land inside that window): "%DLQ%GB holds uid 20 2 times".

Found while adding the power cut (by reading the code its images exercise; tests in the same file):

4. a journal line a power cut damaged (a lost page or sector inside it, a later one with its newline kept) hid
   the queue's earlier intact record: the queue fell back to popState.json and an ack fsynced by ackSyncFlush was
   lost (the message delivered again).  The runs rarely build that shape (put back: 0 of 200 seeds 1-200).
5. a power cut that loses the log's unflushed tail but not the fsynced acks left the pop state past the queue
   end; a read-only receiver kept it and the next puts, given those offsets again, were never delivered.  Found
   by reading; the log cut (``cut_log``) makes the shape, but removing ``write_clamped_state`` fails none of
   seeds 1-90 (one run; the writer clamps what it loads itself, the window needs the read-only process to write
   first): its named test stays the guard.

Found by the log cut (session 13; tests/safety/test_data_safety_lost_tail.py):

6. a lost tail that took every record of a queue: recovery kept the queue's first file, empty, while the queue
   registry kept its offsets; the next put got queue offset 1 but its unit was written at unit 0, where no get
   could read it (seed 2: "the record there is QT/2 offset 1 ... not the unit's offset 0").  Then a second lost
   tail left blank units only, read as a lost unit at offset 0 (a receiver stopped there; seed 2 again).
7. the writable open's clamp (write_clamped_state) looked only at popState.json and the journal: a group whose
   state was in consumerOffset.json alone (both lost with the tail, nothing fsynced without ackSyncFlush) kept
   a committed offset past the queue end, and the next put there was never delivered (seed 44 of 31-90:
   "drain: uid 9 at ('QT', 0, 0) was never acked nor dead-lettered in group GB").
8. the clamp judged "past the end" by the journal's record alone: a group whose journal (fsynced) ended its queue
   at the end while consumerOffset.json, which outlived the journal's unsynced tail, held a later committed
   offset (a receive passed over a message the cut took) was not written back; every later load, a read-only
   receiver's too, raised the committed offset from the file again over the next put there (seed 3188 of
   3000-3199: two cuts take QT-1's offset 1, the timer puts a delayed TagB message there, GB never receives it).

Found by the sync-point power cut (session 15; regression tests tests/safety/test_attack17_timer_powercut.py,
test_attack17_dlq_powercut.py): with attack17's two fixes reverted (the timer's and the mover's
``make_puts_durable`` before the state write), 14 of the default 30 seeds fail; 8 of them (7, 9, 13, 15, 18, 20,
23, 25) with "delay message uid 5 (due t+-9000) is not in QT after a timer round at its time" (timerState.json
said delivered, the copy was not on the disk); with the mover's alone reverted 6 of 30 (2, 6, 8, 14, 19, 26):
"drain: uid 1 at ('QT', 2, 0) was never acked nor dead-lettered in group GA", "FIFO group g3 delivered before
uid 3 ... was acked or dead-lettered" (the pop state let the message go, its dead letter was not on the disk).
Hunting (ROCKETSTORE_MODEL_SYNCUT=8, seeds 700-749, 100 steps) found a flaw of the image, not of the store:
crash_image dropped empty directories, so a queue directory whose files recovery had cut (a lost tail took all
its records) vanished while the registry kept the queue, and a read-only receiver held it as lost (seed 720,
"acks buffered in live receivers ['R50'] are not written 5 s after the ack"); crash_image now keeps them.  Seen
there and fixed in session 16: a read-only store's lost queues were fixed at its open (``lost_queues``), so its
receivers of that topic failed every call, buffered acks included, until reopened, even after the writer made the
queue again (the tail view now takes a lost queue back once its directory is back and no unfinished rebuild
names it; tests/library/test_queues_model_found.py).  Fixed from it too: the receiver's ack-linger thread retried a failing write at once, in a busy loop
(28888 tries in 5 s); it waits ACK_RETRY now (tests/library/test_queues_model_found.py).

Not modelled: power loss of the store's files beside the journal and the commitlog's tail outside ``syncut``
(which seeds everything before its call as synced: a plain put's unflushed tail is ``cut_log``'s), the broker's own
PopService (snapshots, auto-renew, release of a client's messages), retention under in-flight messages, blocking
receives (the doorbell), the asyncio twin, receivers of one group with different filters or FIFO settings, the
max-span/blocked limits (MAX_BLOCKED_PER_QUEUE, max_span), consumerOffset.json and reset-offset, a clock that
goes back.  A SIGKILL (not a power cut) during a timer round lands between a copy's put and the state write only by
chance.
"""

from __future__ import annotations

import os
import random
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.model import body_of, uid_of
from helpers.powerloss import crash_image, rebooted
from helpers.queue_model import FIFO_KEY, JOURNAL, LINGER, PAGE, SECTOR, AgentProc, journal_image, unb64

from rocketstore.format import codec

SEEDS = int(os.environ.get("ROCKETSTORE_MODEL_SEEDS", "30"))
STEPS = int(os.environ.get("ROCKETSTORE_MODEL_STEPS", "80"))
TOPIC, FIFO_TOPIC, OTHER = "QT", "QF", "QO"
GROUPS = {"GA": (TOPIC, False, "*"), "GB": (TOPIC, False, "TagA || TagB"), "GF": (FIFO_TOPIC, True, "*")}
TAGS = ["TagA", "TagB", "TagC", None]
SHARDS = ["g0", "g1", "g2", "g3"]
CONF = dict(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=50 * 20, maxHashSlotNum=64,
            maxIndexNum=256, warmAheadBytes=0, flushDiskType="ASYNC_FLUSH")
LOG_CUT_SHARE = 0.5  # power cuts that also take the commitlog's unflushed tail (cut_log)
OPS = {"put": 8, "put_delay": 3, "put_fifo": 5, "put_other": 1, "recv": 14, "ack": 9, "nack": 3, "cid": 2,
       "advance": 6, "flush": 2, "reopen": 1, "restart": 1, "kill": 2, "resend": 1, "powercut": 1,
       "syncut": int(os.environ.get("ROCKETSTORE_MODEL_SYNCUT", "1"))}


class Violation(AssertionError):
    pass


def tag_match(filt: str, tag: str | None) -> bool:
    if filt.strip() in ("", "*"):
        return True
    return tag is not None and tag in {t.strip() for t in filt.split("||")}


@dataclass
class Item:
    """One stored message of a consumed topic: a put, a delay's copy, or a dead letter's re-sent copy."""
    uid: int
    topic: str
    qid: int
    qoff: int
    size: int
    tags: str | None
    shard: str | None
    deliver_at: int | None = None


@dataclass
class Track:
    """An item as one group sees it."""
    lo: int = 0  # deliveries so far (lo..hi: a kill in the middle of a receive leaves it open)
    hi: int = 0
    holder: str | None = None
    handle: str | None = None
    visible_at: int = 0
    state: str = "open"  # open | acked | dlq
    maybe_acked: bool = False  # an ack whose process was killed in the call
    fuzzy: bool = False  # a call on it was cut by a kill: invisibility and handle unknown until its next delivery
    buffered: str | None = None  # receiver whose ack of the current handle is buffered (not written yet)
    # As of the journal's last fsync the model knows of (an ackSyncFlush receiver's ack, nack or
    # change_invisible_duration that changed something): what a power cut cannot take back.
    dur_lo: int = 0
    dur_acked: bool = False
    # Handles of it a power cut may have made current again (the state went back to a record before a later
    # delivery, nack or change_invisible_duration superseded them); cleared by its next delivery.
    revived: set[str] = field(default_factory=set)


@dataclass
class Receiver:
    name: str
    proc: str
    group: str
    inv: int
    sync: bool
    pending: list[tuple[Item, str]] = field(default_factory=list)


class Run:
    def __init__(self, tmp: Path, seed: int, steps: int) -> None:
        self.tmp, self.seed, self.n_steps = tmp, seed, steps
        self.rng = random.Random(seed)
        self.root = str(tmp / "store")
        self.now = int(time.time() * 1000)
        self.steps: list[str] = []
        self.uid = 1
        self.items: dict[tuple[str, int, int], Item] = {}
        self.tracks: dict[tuple[str, tuple[str, int, int]], Track] = {}
        self.sizes: dict[int, int] = {}
        self.delays: dict[int, dict[str, Any]] = {}  # uid -> at, qid, tags, certain, ticked (a round after its time)
        self.resends: dict[int, int] = {}  # uid -> copies re-sent (certain) ; maybe_resends: uncertain ones
        self.maybe_resends: dict[int, int] = {}
        self.pending_puts: dict[int, tuple[str, int, str | None, str | None]] = {}  # cut by a kill: may exist
        self.other: set[int] = set()
        self.dlq_seen: dict[str, dict[int, int]] = {g: {} for g in GROUPS}
        self.policy = {g: (self.rng.randint(0, 3), [self.rng.choice([500, 2000, 5000])
                                                     for _ in range(self.rng.randint(1, 3))]) for g in GROUPS}
        self.compact = self.rng.choice([0, 1500, 3000, 20000])  # journal bytes before popState.json is rewritten
        # receivers with ackSyncFlush: few of them leave long unsynced journal tails for a power cut to tear
        self.sync_share = self.rng.choice([0.5, 0.1, 0.0])
        self.procs: dict[str, AgentProc] = {}
        self.shadow = str(tmp / "journal.synced")  # the journal as of its last fsync (helpers/queue_model.py)
        self.receivers: dict[str, Receiver] = {}
        self.n_recv = 0
        self.old_handles: list[tuple[str, str]] = []  # (group, handle) once issued
        self.handle_keys: dict[tuple[str, str], tuple[str, int, int]] = {}  # (group, handle) -> its message's slot
        for p in ("W", "R"):
            self.spawn(p)

    # ------------------------------------------------------------ plumbing
    def note(self, s: str) -> None:
        self.steps.append(s)

    def fail(self, s: str) -> None:
        raise Violation(s)

    def max_attempts(self, group: str) -> int:
        return self.policy[group][0] + 1

    def backoff(self, group: str, attempts: int) -> int:
        b = self.policy[group][1]
        return b[min(max(attempts, 1), len(b)) - 1]

    def spawn(self, proc: str) -> None:
        self.procs[proc] = AgentProc(proc, self.root, CONF, proc == "W", self.now, self.compact, self.shadow)
        for g in GROUPS:
            for _ in range(self.rng.randint(1, 2)):
                self.new_receiver(proc, g)

    def new_receiver(self, proc: str, group: str, sync: bool | None = None) -> Receiver:
        self.n_recv += 1
        r = Receiver(f"{proc}{self.n_recv}", proc, group, self.rng.choice([1000, 3000, 8000]),
                     self.rng.random() < self.sync_share if sync is None else sync)
        topic, fifo, filt = GROUPS[group]
        self.procs[proc].call("consumer", self.now, r.name, group, topic, fifo, filt, r.inv, self.policy[group][0],
                              self.policy[group][1], r.sync)
        self.receivers[r.name] = r
        return r

    def call(self, proc: str, op: str, *a: Any) -> dict[str, Any]:
        return self.procs[proc].call(op, self.now, *a)

    def track(self, group: str, item: Item) -> Track:
        return self.tracks.setdefault((group, (item.topic, item.qid, item.qoff)), Track())

    def wants(self, group: str, item: Item) -> bool:
        topic, _, filt = GROUPS[group]
        return item.topic == topic and tag_match(filt, item.tags)

    def new_uid(self) -> int:
        self.uid += 1
        return self.uid - 1

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        names, weights = list(OPS), list(OPS.values())
        for i in range(self.n_steps):
            op = "put" if i == 0 else self.rng.choices(names, weights)[0]
            self.note(f"{i}:{op} t+{self.now % 100000}")
            before, sig = self.durable_marks(), self.shadow_sig()
            getattr(self, f"op_{op}")()
            if op not in ("powercut", "syncut") and self.shadow_sig() != sig:
                self.synced(before)  # the journal was fsynced during the step (a sync ack, a dead-letter move)
            self.walk(f"after step {i} ({op})")
        self.note("drain")
        self.drain()

    # ------------------------------------------------------------ puts
    def _put(self, topic: str, qid: int, tags: str | None, shard: str | None, deliver_at: int | None = None,
             level: int = 0) -> None:
        uid = self.new_uid()
        size = self.rng.randint(1, 200)
        self.sizes[uid] = size
        props = {FIFO_KEY: shard} if shard else {}
        ans = self.call("W", "put", topic, qid, uid, size, tags, props, deliver_at, level)["ok"]
        status, qoff, err = ans
        if status != "PUT_OK":
            self.fail(f"put of uid {uid} to {topic}-{qid} refused: {status} {err}")
        delayed = level or (deliver_at is not None and deliver_at > self.now)
        self.note(f"  put uid {uid} {topic}-{qid} tags={tags} shard={shard}"
                  f"{f' at t+{(deliver_at or self.now + 1000 * (1, 5, 10)[level - 1]) - self.now}' if delayed else ''}"
                  f" -> {qoff}")
        if delayed:
            at = deliver_at if deliver_at is not None else self.now + (1000, 5000, 10000)[level - 1]
            self.delays[uid] = {"at": at, "qid": qid, "tags": tags, "certain": True, "ticked": False}
        elif topic == OTHER:
            self.other.add(uid)
        else:
            self.add_item(Item(uid, topic, qid, qoff, size, tags, shard, deliver_at))

    def add_item(self, it: Item) -> None:
        key = (it.topic, it.qid, it.qoff)
        if key in self.items:
            self.fail(f"queue offset {key} given to uid {it.uid}, already held by uid {self.items[key].uid}")
        self.items[key] = it

    def op_put(self) -> None:
        self._put(TOPIC, self.rng.randrange(3), self.rng.choice(TAGS), None)

    def op_put_delay(self) -> None:
        qid, tags = self.rng.randrange(3), self.rng.choice(TAGS)
        k = self.rng.random()
        if k < 0.3:
            self._put(TOPIC, qid, tags, None, level=self.rng.randint(1, 3))
        elif k < 0.4:
            self._put(TOPIC, qid, tags, None, deliver_at=self.now - self.rng.randint(0, 5000))  # already due
        else:
            self._put(TOPIC, qid, tags, None, deliver_at=self.now + self.rng.randint(1, 15000))

    def op_put_fifo(self) -> None:
        shard = self.rng.choice(SHARDS)
        self._put(FIFO_TOPIC, int(shard[1]) % 2, self.rng.choice(TAGS), shard)

    def op_put_other(self) -> None:
        self._put(OTHER, self.rng.randrange(2), self.rng.choice(TAGS), None)

    # ------------------------------------------------------------ receivers
    def pick(self, proc: str | None = None) -> Receiver:
        names = sorted(n for n, r in self.receivers.items() if proc is None or r.proc == proc)
        return self.receivers[self.rng.choice(names)]

    def apply_pending(self, r: Receiver) -> None:
        """What the receiver's next call does first: write its buffered acks (each takes if still current)."""
        for it, h in r.pending:
            t = self.track(r.group, it)
            if t.buffered == r.name:
                t.buffered = None
            if t.state == "open" and (t.fuzzy or t.maybe_acked or self.dlq_due(r.group, it, t)):
                t.maybe_acked = True
            elif t.state == "open" and t.handle == h:
                t.state = "acked"
        r.pending.clear()

    def dlq_due(self, group: str, it: Item, t: Track) -> bool:
        return t.hi >= self.max_attempts(group)

    def op_recv(self, r: Receiver | None = None, n: int | None = None) -> list[tuple[Item, str]]:
        r = r or self.pick()
        n = n or self.rng.randint(1, 4)
        self.apply_pending(r)
        got = self.call(r.proc, "receive", r.name, n)["ok"]
        self.note(f"  {r.name}({r.group}) receive {n}: (uid, queue, offset, attempt) "
                  f"{[(uid_of(unb64(g[3])), g[1], g[2], g[6]) for g in got]}")
        return [self.delivered(r, topic, qid, qoff, unb64(body), tags, keys, attempt, handle, shard)
                for topic, qid, qoff, body, tags, keys, attempt, handle, shard in got]

    def delivered(self, r: Receiver, topic: str, qid: int, qoff: int, body: bytes, tags: Any, keys: Any, attempt: int,
                  handle: str, shard: Any) -> tuple[Item, str]:
        g = r.group
        gtopic, fifo, filt = GROUPS[g]
        where = f"{r.name}({g}) received {topic}-{qid}@{qoff}"
        if topic != gtopic:
            self.fail(f"{where}: a message of another topic (the group consumes {gtopic})")
        uid = uid_of(body)
        key = (topic, qid, qoff)
        if key not in self.items:
            self.walk(f"{where} (unknown slot)")
        it = self.items.get(key)
        if it is None:
            self.fail(f"{where}: uid {uid}, a slot the model does not know (no put, delay or re-send made it)")
        if uid != it.uid or body != body_of(it.uid, it.size) or tags != it.tags or keys != f"k{it.uid}":
            self.fail(f"{where}: body/tags/keys differ from uid {it.uid}'s (got uid {uid} tags {tags!r} keys {keys!r})")
        if not tag_match(filt, tags):
            self.fail(f"{where}: tags {tags!r} do not match the group's filter {filt!r}")
        t = self.track(g, it)
        what = f"{where} uid {it.uid} attempt {attempt}"
        if t.state == "acked":
            self.fail(f"{what}: acknowledged before, delivered again")
        if t.state == "dlq":
            self.fail(f"{what}: dead-lettered before, delivered again")
        if t.buffered is not None and not t.fuzzy:
            self.fail(f"{what}: its ack by {t.buffered} is buffered in a live receiver (not written yet), yet the "
                      f"message was delivered again")
        if not t.fuzzy and self.now < t.visible_at:
            self.fail(f"{what}: still invisible until t+{t.visible_at - self.now} ms (held by {t.holder})")
        if not (t.lo + 1 <= attempt <= t.hi + 1):
            self.fail(f"{what}: delivery attempt {attempt}, the model expects {t.lo + 1}..{t.hi + 1}")
        if attempt > self.max_attempts(g):
            self.fail(f"{what}: more than maxReconsumeTimes + 1 = {self.max_attempts(g)} deliveries")
        if it.deliver_at is not None and self.now < it.deliver_at:
            self.fail(f"{what}: delivered before its time (t+{it.deliver_at - self.now})")
        if fifo and it.shard:
            self.fifo_check(g, it, what)
        if t.maybe_acked:
            t.maybe_acked = False  # it was not acked after all
        t.lo = t.hi = attempt
        t.holder, t.handle, t.visible_at, t.fuzzy = r.name, handle, self.now + r.inv, False
        self.old_handles.append((g, handle))
        self.handle_keys[(g, handle)] = key
        t.revived.clear()
        return it, handle

    def fifo_check(self, g: str, it: Item, what: str) -> None:
        for again in (False, True):
            before = [x for k, x in self.items.items() if k[0] == it.topic and k[1] == it.qid and x.qoff < it.qoff
                      and x.shard == it.shard]
            open_ = [x for x in before if self.track(g, x).state == "open" and not self.track(g, x).maybe_acked
                     and not self.track(g, x).buffered]
            if not open_:
                return
            if not again:
                self.walk(f"{what} (FIFO check)")  # a dead letter made in this receive
        x = open_[0]
        self.fail(f"{what}: FIFO group {it.shard} delivered before uid {x.uid} at {x.qoff} (same queue) was acked "
                  f"or dead-lettered ({self.track(g, x)})")

    def held(self, r: Receiver) -> list[tuple[Item, Track]]:
        out = []
        for (g, key), t in self.tracks.items():
            if g == r.group and t.holder == r.name and t.handle and t.state == "open" and key in self.items:
                out.append((self.items[key], t))
        return sorted(out, key=lambda x: (x[0].topic, x[0].qid, x[0].qoff))

    def expect_valid(self, r: Receiver, it: Item, t: Track, h: str) -> bool | None:
        if t.fuzzy or t.maybe_acked or t.buffered or (self.dlq_due(r.group, it, t) and self.now >= t.visible_at):
            return None
        return t.state == "open" and t.handle == h

    def _handle_op(self, op: str) -> None:
        """ack / nack / cid on something a receiver holds, or (sometimes) on an old handle."""
        r = self.pick()
        mine = self.held(r)
        if mine and self.rng.random() < 0.9:
            it, t = self.rng.choice(mine)
            h = t.handle
        else:
            olds = [h for g, h in self.old_handles if g == r.group]
            if not olds:
                return
            h = self.rng.choice(olds)
            found = [(self.items[k], t) for (g, k), t in self.tracks.items()
                     if g == r.group and k in self.items and (t.handle == h or h in t.revived)]
            it, t = found[0] if found else (None, None)
        if not (op == "ack" and not r.sync):
            self.apply_pending(r)  # (a buffered ack only joins the others)
        expect = self.expect_valid(r, it, t, h) if it is not None else False
        if op == "ack" and not r.sync:
            self.call(r.proc, "ack", r.name, h)
            if it is not None:
                r.pending.append((it, h))
                if expect and self.now < t.visible_at:
                    t.buffered = r.name  # written within ACK_LINGER: before the message could come back
                elif expect is not False and t.state == "open":
                    t.maybe_acked = True  # after its invisible time (a race with a redelivery), or unknowable
                if len(r.pending) >= 256:
                    self.apply_pending(r)
            self.note(f"  {r.name} ack (buffered) {it.uid if it else '?'} expect {expect}")
            return
        ms = self.rng.choice([0, 500, 2000, 6000, 12000])
        args = (r.name, h, ms) if op == "cid" else (r.name, h)
        ans = self.call(r.proc, op, *args)
        ok = "ok" in ans
        self.note(f"  {r.name} {op}{f' {ms} ms' if op == 'cid' else ''} uid {it.uid if it else '?'}: "
                  f"{'ok' if ok else 'refused'} (model: {expect})")
        if expect is not None and ok != expect:
            self.fail(f"{r.name}({r.group}) {op} of {'uid %d' % it.uid if it else 'an old handle'} "
                      f"{'accepted' if ok else 'refused'}, the model expects {'acceptance' if expect else 'refusal'}"
                      f" ({t})")
        if it is not None and t.buffered and t.state == "open":
            if not ok:  # the buffered ack was written (ACK_LINGER) before this call
                t.state, t.buffered = "acked", None
                return
            t.buffered = None  # this call superseded the handle: the buffered ack will not take
        if not ok or it is None:
            return
        if op == "ack":
            t.state, t.maybe_acked = "acked", False
        elif op == "nack":
            t.visible_at, t.handle, t.holder = self.now + self.backoff(r.group, max(t.lo, 1)), None, None
            t.fuzzy = t.fuzzy or t.lo != t.hi
        else:
            t.visible_at, t.handle = self.now + ms, ans["ok"]
            self.old_handles.append((r.group, ans["ok"]))
            self.handle_keys[(r.group, ans["ok"])] = (it.topic, it.qid, it.qoff)
        if r.sync:
            self.synced()

    def synced(self, marks: dict[Any, tuple[int, bool]] | None = None) -> None:
        """The journal was fsynced (an ackSyncFlush call changed the state: now; else at some moment of a step:
        ``marks`` as before that step), with every record written before -- acks the model holds as written,
        every delivery so far: none of it may be lost to a power cut."""
        for tk, (lo, acked) in (marks if marks is not None else self.durable_marks()).items():
            t = self.tracks[tk]
            t.dur_lo = max(t.dur_lo, lo)
            t.dur_acked = t.dur_acked or acked

    def durable_marks(self) -> dict[Any, tuple[int, bool]]:
        return {tk: (t.lo, t.state == "acked") for tk, t in self.tracks.items()}

    def shadow_sig(self) -> int:
        """How many journal fsyncs the agents made so far."""
        try:
            return os.stat(self.shadow + ".count").st_size
        except FileNotFoundError:
            return 0

    def op_ack(self) -> None:
        self._handle_op("ack")

    def op_nack(self) -> None:
        self._handle_op("nack")

    def op_cid(self) -> None:
        self._handle_op("cid")

    def op_flush(self) -> None:
        r = self.pick()
        self.apply_pending(r)
        self.call(r.proc, "flush", r.name)
        self.note(f"  flush {r.name}")

    def op_reopen(self) -> None:
        r = self.pick()
        self.apply_pending(r)
        self.call(r.proc, "close", r.name)
        del self.receivers[r.name]
        n = self.new_receiver(r.proc, r.group)
        self.note(f"  closed {r.name}, opened {n.name}")

    # ------------------------------------------------------------ time
    def op_advance(self, ms: int | None = None) -> None:
        ms = ms if ms is not None else self.rng.choice([100, 1000, 3000, 8000, 20000])
        self.settle()
        self.now += ms
        n = self.call("W", "tick")["ok"]
        for d in self.delays.values():
            if d["at"] <= self.now:
                d["ticked"] = True
        self.note(f"  time +{ms} ms, timer round put {n}")

    def settle(self) -> None:
        """Before time passes: ACK_LINGER (wall clock) after an ack, a live receiver has written it."""
        for proc in ("W", "R"):
            names = [r.name for r in self.receivers.values() if r.proc == proc and r.pending]
            if not names:
                continue
            left = self.call(proc, "settle", names)["ok"]
            if left:
                self.fail(f"acks buffered in live receivers {left} are not written 5 s after the ack (ACK_LINGER "
                          f"is {LINGER} s): their messages would come back after their invisible time")
            for n in names:
                self.apply_pending(self.receivers[n])

    # ------------------------------------------------------------ processes
    def op_restart(self) -> None:
        proc = self.rng.choice(["W", "R"])
        for r in [r for r in self.receivers.values() if r.proc == proc]:
            self.apply_pending(r)
            del self.receivers[r.name]
        self.procs[proc].shutdown(self.now)
        self.note(f"  clean restart of {proc}")
        self.spawn(proc)

    def op_kill(self) -> None:
        proc = self.rng.choice(["W", "R"])
        mid = self.rng.random() < 0.5
        what = ""
        if mid:
            what = self.cut_call(proc)
        self.procs[proc].kill()
        for r in [r for r in self.receivers.values() if r.proc == proc]:
            for it, h in r.pending:  # buffered acks die with the process unless ACK_LINGER wrote them already
                t = self.track(r.group, it)
                if t.buffered == r.name:
                    t.buffered = None
                if t.state == "open" and t.handle == h:
                    t.maybe_acked = True
            del self.receivers[r.name]
        torn = self.rng.random() < 0.5 and self.tear_journal()
        self.note(f"  SIGKILL {proc}{' in ' + what if mid else ' idle'}{' + torn journal tail' if torn else ''}")
        self.spawn(proc)

    def op_powercut(self) -> None:
        """Power is cut: both processes die at once (one maybe in the middle of a call) and the pop-state
        journal keeps what its last fsync made durable plus some later pages (helpers/queue_model.py
        journal_image); the store's other files are kept as written (tests/safety/test_model_based.py cuts
        those).  What was not synced may be lost -- an ack without ackSyncFlush (the message comes back:
        redelivered, never lost), deliveries (their attempt counts and invisible times) -- but no ack or
        delivery before the last fsync."""
        mid = self.rng.random() < 0.4
        proc = self.rng.choice(["W", "R"])
        what = self.cut_call(proc) if mid else ""
        self.power_off()
        log_cut = self.cut_log() if self.rng.random() < LOG_CUT_SHARE else ""
        path = Path(self.root, JOURNAL)
        image, how = b"", "no journal"
        if path.exists():
            synced = Path(self.shadow).read_bytes() if os.path.exists(self.shadow) else b""
            image, how = journal_image(path.read_bytes(), synced, self.rng, self.rng.choice([0.0, 0.3, 0.7, 1.0]),
                                       self.rng.choice([SECTOR, PAGE]))
            path.write_bytes(image)
            Path(self.shadow).write_bytes(image)  # on the disk now
        self.back_to_synced()
        self.note(f"  power cut{' in ' + proc + ' ' + what if mid else ''}: journal {how}{log_cut}")
        self.spawn("W")
        self.spawn("R")

    def power_off(self) -> None:
        """Both processes die at once; acks buffered in their receivers may be lost."""
        for p in ("W", "R"):
            self.procs[p].kill()
        for r in list(self.receivers.values()):
            for it, h in r.pending:
                t = self.track(r.group, it)
                if t.state == "open" and t.handle == h:
                    t.maybe_acked = True
            del self.receivers[r.name]

    def back_to_synced(self) -> None:
        """(After a power cut.)  What the model knows goes back to the pop state's last fsync: acks since may be
        lost, deliveries since forgotten, handles superseded since current again."""
        issued: dict[tuple[str, tuple[str, int, int]], set[str]] = {}
        for (g, h), key in self.handle_keys.items():
            issued.setdefault((g, key), set()).add(h)
        for tk, t in self.tracks.items():
            t.buffered, t.holder = None, None
            t.revived |= issued.get(tk, set())
            if t.state == "acked" and not t.dur_acked:
                t.state, t.maybe_acked = "open", True  # its ack may be lost: it may come back
            if t.state == "open":
                t.fuzzy = True  # held or backing off as of some record since the fsync, or visible
                t.lo = min(t.lo, t.dur_lo)  # deliveries since the fsync may be forgotten

    def op_syncut(self) -> None:
        """A power cut at one of the store's own sync points (ASYNC_FLUSH), in W's timer round or in a W
        receive that dead-letters: the disk as of now counts as synced (a reboot), W shadows every later sync
        of a store file (helpers/powerloss.py SyncShadow) and dies right after the k-th one (or at the end of
        the call), and the store restarts on the crash image (crash_image: each file as of its last sync).  So
        the cut lands between a timer delivery's puts, its commitlog flush and its state write, or between a
        dead letter's put, its flush and the pop-state write, or in a flush thread's sync -- and whatever it
        took, a due delayed message must still reach its topic at the next timer round and a message past
        maxReconsumeTimes must still reach its DLQ (or be delivered again): never lost."""
        self.settle()  # buffered acks written: as of now everything is on the disk
        self.synced()
        due = sorted(d["at"] for uid, d in self.delays.items() if not any(x.uid == uid for x in self.items.values()))
        kind = "tick" if due and self.rng.random() < 0.7 else self.rng.choice(["tick", "receive", "receive", "ack"])
        r = self.pick("W")
        mine = self.held(r)
        if kind == "ack" and not mine:
            kind = "receive"
        # A receive aims at a message past its last allowed delivery, so that the mover runs in it
        exhausted = [(q, t) for q in self.receivers.values() if q.proc == "W" for it in self.items.values()
                     if self.wants(q.group, it) for t in [self.track(q.group, it)]
                     if t.state == "open" and self.dlq_due(q.group, it, t)]
        if kind == "receive" and exhausted:
            r, t = self.rng.choice(exhausted)
            self.now = max(self.now, t.visible_at)
        k = self.rng.randint(1, 8)
        disk = str(self.tmp / "disk.shadow")
        shutil.rmtree(disk, ignore_errors=True)
        w = self.procs["W"]
        w.call("arm", self.now, disk, k)
        if kind == "tick":
            self.now = max(self.now + 100, due[0] if due else 0) + self.rng.choice([0, 1000, 8000])
            ans = w.call_or_death("tick", self.now)
        elif kind == "ack":  # (an ack never makes another message vanish)
            it, t = self.rng.choice(mine)
            t.maybe_acked = True
            ans = w.call_or_death("ack", self.now, r.name, t.handle)
        else:
            self.now += self.rng.choice([0, 3000, 8000, 20000])  # back-offs and invisible times run out
            self.uncertain_receive(r)
            ans = w.call_or_death("receive", self.now, r.name, 4)
        self.power_off()
        image = self.tmp / "disk.image"
        shutil.rmtree(image, ignore_errors=True)
        fate = crash_image(self.root, disk, image)
        shutil.rmtree(self.root)
        os.replace(image, self.root)
        shutil.rmtree(disk, ignore_errors=True)
        rebooted(self.root)
        journal = Path(self.root, JOURNAL)
        if journal.exists():
            Path(self.shadow).write_bytes(journal.read_bytes())  # on the disk now
        self.back_to_synced()
        zeroed = sorted(f for f, how in fate.items() if how != "synced")
        self.note(f"  power cut at W's sync {k} in a {kind}{' (the call returned first)' if ans else ''}; "
                  f"never synced, zeroed: {zeroed}")
        self.spawn("W")
        self.spawn("R")

    def uncertain_receive(self, r: Receiver) -> None:
        """A receive whose answer the model will not know (cut by a kill): any deliverable message of the group
        may now be held, and delivered once more."""
        for it in self.items.values():
            t = self.track(r.group, it)
            if self.wants(r.group, it) and t.state == "open":
                t.fuzzy, t.hi = True, t.hi + 1
        self.apply_pending_uncertain(r)

    def cut_log(self) -> str:
        """(Power cut, both processes dead.)  The commitlog's unflushed tail (ASYNC_FLUSH) goes too: the last few
        records of its last segment are zeroed from a record's start or from inside it (torn), and the store
        restarts as after a reboot.  Only records of plain puts the model knows are cut (a delay's timer record
        or copy, a dead letter or a re-send would need the model to know what the timer or the mover made of
        it): the model forgets them, acked or not -- an ASYNC_FLUSH ack lost with the power -- and their queue
        offsets may be given again.  The pop state's acks of them may be in the fsynced journal: the group
        state then reaches past the queue end, and the next puts at those offsets must still be delivered."""
        segs = sorted(Path(self.root, "commitlog").glob("[0-9]" * 20))
        recs: list[tuple[int, int, Any]] = []
        for seg in reversed(segs):
            data = seg.read_bytes()
            pos = 0
            while pos + 8 <= len(data):
                try:
                    m = codec.decode(data, pos, len(data))
                except codec.RecordError:
                    break
                recs.append((int(seg.name) + pos, m.size, m))
                pos += m.size
            if recs:
                break
        tail: list[tuple[int, int, Any]] = []
        for off, size, m in reversed(recs):
            uid = uid_of(m.body)
            if m.topic not in (TOPIC, FIFO_TOPIC, OTHER) or uid is None or uid in self.delays or \
                    uid in self.resends or uid in self.maybe_resends:
                break
            tail.append((off, size, m))
        if not tail:
            return ""
        tail = tail[:self.rng.randint(1, min(len(tail), 4))]
        off, size, m = tail[-1]
        torn = self.rng.random() < 0.5
        # Torn: the cut lands in the header or at the body's first byte, so that the record fails its size or
        # body check.  A cut after the body (topic, properties: no CRC covers them) leaves a record that passes
        # recovery with its properties zeroed: the store model's open "torn record accepted" item, not driven here.
        head = size - len(m.body) - 3 - len(m.topic.encode()) - len(m.properties_string.encode())
        at = off + (self.rng.randint(1, head + 1) if torn else 0)
        seg = Path(self.root, "commitlog", "%020d" % (at - at % CONF["mappedFileSizeCommitLog"]))
        with open(seg, "r+b") as fh:
            length = fh.seek(0, os.SEEK_END)
            fh.seek(at % CONF["mappedFileSizeCommitLog"])
            fh.write(bytes(length - at % CONF["mappedFileSizeCommitLog"]))
        Path(self.root, "abort").write_text("4242")  # unclean, and from another boot: pages may be lost
        Path(self.root, "abort.bootid").write_text("boot-before-the-power-cut")
        lost = []
        for _, _, m in tail:
            uid = uid_of(m.body)
            lost.append(uid)
            self.pending_puts.pop(uid, None)
            if m.topic == OTHER:
                self.other.discard(uid)
                continue
            key = (m.topic, m.queue_id, m.queue_offset)
            it = self.items.get(key)
            if it is None or it.uid != uid:
                continue  # a put cut by a kill, never adopted
            del self.items[key]
            for g in GROUPS:
                self.tracks.pop((g, key), None)
            for hk in [hk for hk, k in self.handle_keys.items() if k == key]:
                del self.handle_keys[hk]
        return f"; commitlog cut at {at}{' (torn record)' if torn else ''}: uids {sorted(lost)} lost"

    def cut_call(self, proc: str) -> str:
        """Send a call and kill the process a moment later: the model does not know whether it happened."""
        rs = [r for r in self.receivers.values() if r.proc == proc]
        kind = self.rng.choice(["receive", "ack", "put", "tick"] if proc == "W" else ["receive", "ack"])
        if kind == "put":
            uid = self.new_uid()
            size = self.rng.randint(1, 200)
            self.sizes[uid] = size
            qid, tags = self.rng.randrange(3), self.rng.choice(TAGS)
            self.pending_puts[uid] = (TOPIC, qid, tags, None)
            self.procs[proc].send("put", self.now, TOPIC, qid, uid, size, tags, {}, None, 0)
        elif kind == "tick":
            self.procs[proc].send("tick", self.now)
        elif kind == "receive":
            r = self.rng.choice(rs)
            self.uncertain_receive(r)
            self.procs[proc].send("receive", self.now, r.name, 4)
        else:
            r = self.rng.choice(rs)
            mine = self.held(r)
            if not mine:
                return "nothing"
            it, t = self.rng.choice(mine)
            self.apply_pending_uncertain(r)
            t.maybe_acked = True
            self.procs[proc].send("ack", self.now, r.name, t.handle)
        time.sleep(self.rng.random() * 0.004)
        return kind

    def apply_pending_uncertain(self, r: Receiver) -> None:
        for it, _ in r.pending:
            t = self.track(r.group, it)
            if t.state == "open":
                t.maybe_acked = True
            t.buffered = None
        r.pending.clear()

    def tear_journal(self) -> bool:
        """A record cut short by the kill (never confirmed to anyone): a prefix of a plausible line, no newline."""
        p = Path(self.root, "config", "popState.journal")
        if not p.exists() or p.stat().st_size == 0:
            return False
        lines = p.read_bytes().split(b"\n")
        last = [ln for ln in lines if ln.strip()][-1]
        cut = self.rng.randint(1, max(1, len(last) - 1))
        with open(p, "ab") as fh:
            fh.write(last[:cut])
        return True

    # ------------------------------------------------------------ dead letters
    def op_resend(self) -> None:
        letters = [(g, w) for g in GROUPS for w in self.walk_list([f"%DLQ%{g}"])]
        if not letters:
            return
        g, w = self.rng.choice(letters)
        status, topic, qoff = self.call("W", "resend", g, w[2])["ok"]
        uid = uid_of(unb64(w[3]))
        self.note(f"  dlq resend {g} uid {uid} -> {topic} {qoff}: {status}")
        if status != "PUT_OK":
            self.fail(f"dlq resend of uid {uid} from %DLQ%{g}: {status}")
        self.resends[uid] = self.resends.get(uid, 0) + 1

    # ------------------------------------------------------------ the walk
    def walk_list(self, topics: list[str]) -> list[list[Any]]:
        return self.call("W", "walk", topics)["ok"]

    def walk(self, where: str) -> None:
        """Every topic through W: each slot a known message with its body; delays and re-sends once; dead letters
        only after the last delivery, once."""
        rows = self.walk_list([TOPIC, FIFO_TOPIC, OTHER] + [f"%DLQ%{g}" for g in GROUPS])
        copies: dict[int, int] = {}
        dlq: dict[str, dict[int, int]] = {g: {} for g in GROUPS}
        for topic, qid, qoff, body, tags, keys, shard in rows:
            body = unb64(body)
            uid = uid_of(body)
            w = f"{where}: walk {topic}-{qid}@{qoff}"
            if uid is None or uid not in self.sizes or body != body_of(uid, self.sizes[uid]):
                self.fail(f"{w}: a body no put made (uid {uid})")
            if keys != f"k{uid}":
                self.fail(f"{w}: uid {uid} with keys {keys!r}")
            if topic.startswith("%DLQ%"):
                g = topic[5:]
                dlq[g][uid] = dlq[g].get(uid, 0) + 1
                continue
            if topic == OTHER:
                if uid not in self.other:
                    self.fail(f"{w}: uid {uid} was not put to {OTHER}")
                continue
            key = (topic, qid, qoff)
            it = self.items.get(key)
            if it is None:
                it = self.adopt(w, uid, topic, qid, qoff, tags, shard)
            if it.uid != uid or it.tags != tags:
                self.fail(f"{w}: uid {uid} tags {tags!r}, the model holds uid {it.uid} tags {it.tags!r} there")
            copies[uid] = copies.get(uid, 0) + 1
        for uid, d in self.delays.items():
            n = copies.get(uid, 0)
            if n > 1 + self.resends.get(uid, 0) + self.maybe_resends.get(uid, 0):
                self.fail(f"{where}: delay message uid {uid} is in {TOPIC} {n} times")
            if n == 0 and d["ticked"] and d["certain"]:
                self.fail(f"{where}: delay message uid {uid} (due t+{d['at'] - self.now}) is not in {TOPIC} after a "
                          f"timer round at its time")
        for g in GROUPS:
            for uid, n in dlq[g].items():
                cands = [(it, self.track(g, it)) for it in self.items.values() if it.uid == uid and self.wants(g, it)]
                due = [(it, t) for it, t in cands if self.dlq_due(g, it, t) and t.state != "acked"]
                due.sort(key=lambda x: (x[1].state != "dlq", x[1].maybe_acked))  # the certain ones first
                if n > len(due):
                    self.fail(f"{where}: %DLQ%{g} holds uid {uid} {n} times; {len(due)} of its copies were delivered "
                              f"maxReconsumeTimes + 1 = {self.max_attempts(g)} times ({[str(t) for _, t in cands]})")
                for it, t in due[:n]:
                    t.state = "dlq"
            self.dlq_seen[g] = dlq[g]

    def adopt(self, w: str, uid: int, topic: str, qid: int, qoff: int, tags: Any, shard: Any) -> Item:
        """A slot the model did not put itself: a delay's copy, a re-sent dead letter, or a put cut by a kill."""
        d = self.delays.get(uid)
        prior = [x for x in self.items.values() if x.uid == uid]
        if d is not None and not prior:
            if self.now < d["at"]:
                self.fail(f"{w}: delay message uid {uid} is in {topic} before its time (t+{d['at'] - self.now})")
            if (topic, qid) != (TOPIC, d["qid"]):
                self.fail(f"{w}: delay message uid {uid} delivered to {topic}-{qid}, put for {TOPIC}-{d['qid']}")
            it = Item(uid, topic, qid, qoff, self.sizes[uid], tags, shard, d["at"])
        elif prior and len(prior) <= self.resends.get(uid, 0) + self.maybe_resends.get(uid, 0):
            it = Item(uid, topic, qid, qoff, self.sizes[uid], tags, shard)
        elif uid in self.pending_puts and not prior:
            t_, q_, tags_, _ = self.pending_puts.pop(uid)
            if (topic, qid, tags) != (t_, q_, tags_):
                self.fail(f"{w}: uid {uid} (a put cut by a kill) is in {topic}-{qid} tags {tags!r}")
            it = Item(uid, topic, qid, qoff, self.sizes[uid], tags, shard)
        else:
            self.fail(f"{w}: uid {uid}, which the model holds at {[(x.topic, x.qid, x.qoff) for x in prior]}: a "
                      f"copy nobody made (a delay delivered twice, a re-send that was not made)")
        self.add_item(it)
        return it

    # ------------------------------------------------------------ the end
    def drain(self) -> None:
        """Time passes far enough, W's receivers take and ack everything; then every message is acked or
        dead-lettered once in every group that wants it."""
        for r in list(self.receivers.values()):
            self.apply_pending(r)
            self.call(r.proc, "flush", r.name)
        takers = {g: self.new_receiver("W", g, sync=True) for g in GROUPS}  # (its acks are checked one by one)
        for rnd in range(60):
            self.op_advance(20000)
            got = 0
            for g, r in takers.items():
                for it, h in self.op_recv(r, 16):
                    got += 1
                    t = self.track(g, it)
                    ans = self.call("W", "ack", r.name, h)
                    if "ok" not in ans:
                        self.fail(f"drain: ack of uid {it.uid} by {r.name} refused ({t})")
                    t.state = "acked"
            self.walk(f"drain round {rnd}")
            if not got and rnd > 2:
                break
        for g in GROUPS:
            for it in self.items.values():
                if not self.wants(g, it):
                    continue
                t = self.track(g, it)
                if t.state == "open" and not t.maybe_acked:
                    self.fail(f"drain: uid {it.uid} at {(it.topic, it.qid, it.qoff)} was never acked nor dead-lettered "
                              f"in group {g} ({t})")
        for uid, d in self.delays.items():
            if d["certain"] and not any(x.uid == uid for x in self.items.values()):
                self.fail(f"drain: delay message uid {uid} never reached {TOPIC}")
        for uid in self.pending_puts:
            pass  # a put cut by a kill that never landed: legitimately absent

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()


def run_seed(tmp: Path, seed: int, steps: int) -> None:
    run = None
    try:
        run = Run(tmp, seed, steps)
        run.run()
    except Exception as e:  # noqa: BLE001
        detail = "" if isinstance(e, Violation) else "\n" + traceback.format_exc()
        raise Violation(f"seed {seed} (replay: ROCKETSTORE_MODEL_SEED={seed} ROCKETSTORE_MODEL_STEPS={steps})\n"
                        f"{type(e).__name__}: {e}{detail}\nsteps:\n  " + "\n  ".join(run.steps[-int(os.environ.get("ROCKETSTORE_MODEL_SHOW", "80")):] if run else [])
                        ) from None
    finally:
        if run is not None:
            run.close()


def test_model_queues_random(tmp_path: Path) -> None:
    """ROCKETSTORE_MODEL_SEEDS seeded sequences of ROCKETSTORE_MODEL_STEPS steps, each ending in a drain."""
    if os.environ.get("ROCKETSTORE_MODEL_SEED"):
        run_seed(tmp_path / "replay", int(os.environ["ROCKETSTORE_MODEL_SEED"]), STEPS)
        return
    base = int(os.environ.get("ROCKETSTORE_MODEL_BASE_SEED", "1"))
    keep_going = os.environ.get("ROCKETSTORE_MODEL_KEEP_GOING") == "1"
    failed = []
    for seed in range(base, base + SEEDS):
        try:
            run_seed(tmp_path / f"s{seed}", seed, STEPS)
        except AssertionError as e:
            if not keep_going:
                raise
            failed.append(f"seed {seed}: {str(e).splitlines()[1][:300]}")
            (tmp_path / f"s{seed}").mkdir(parents=True, exist_ok=True)
            (tmp_path / f"s{seed}" / "failure.txt").write_text(str(e))  # the steps, for a look
            continue
        shutil.rmtree(tmp_path / f"s{seed}", ignore_errors=True)
    assert not failed, f"{len(failed)} of {SEEDS} seeds failed:\n" + "\n".join(failed)
