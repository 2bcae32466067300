"""Mechanics of the model-based test (tests/safety/test_model_based.py): the model of acknowledged messages, the child
writer that is SIGKILLed, and the power-loss image with random later pages and directory entries.

Run as a script it is the child writer::

    model.py STORE PLAN.json ACKS [SHADOW]

or, with ``--cli``, the ``rocketstore`` CLI with the store's syncs recorded in the run's shadow (a CLI
process's recovery, repair or import is a writer like any other)::

    model.py --cli STORE SHADOW rocketstore-args...

It opens STORE with the plan's config (syncs shadowed into SHADOW when given, see
helpers/powerloss.py), puts the plan's messages one put (or batch) at a time and
appends one JSON line per acknowledged put to ACKS, fsynced (ACKS is outside the
store root, so its fsync is real), before the next put.  At the end it closes the
store cleanly when the plan says so, else waits to be killed.

Every message carries its identity: body ``m<uid>|<bytes derived from uid>``,
keys ``k<uid>`` (sometimes a second key ``x<uid>``), so a record read back from
any path (get, query, a commitlog walk, a dump) names the put it came from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rocketstore import Message, MessageStore, PutMessageStatus, StoreConfig  # noqa: E402

PAGE = 4096
SECTOR = 512
SECTOR_TEAR = 0.3  # of the later pages a power-loss image keeps, the share written only in part (sector by sector)
DIRSYNC = ".dirsync"  # under the shadow: the entries of each directory as of its last fsync
# (topic, queue id, weight): busy queues, quiet ones (a few messages: their consume-queue file is rarely flushed)
QUEUES = [("Busy", 0, 10.0), ("Busy", 1, 8.0), ("Busy", 2, 4.0), ("Quiet", 0, 0.6), ("Quiet", 3, 0.4),
          ("Rare", 1, 0.2)]
TAGS = ["TagA", "TagB", "TagC", None]
# Targeted runs (environment; unset, the seeds replay as listed): ROCKETSTORE_MODEL_TOPICS, the topics puts go to
# (comma list of Busy, Quiet, Rare, Fresh: a child writer's queue born early); ROCKETSTORE_MODEL_CONF, config keys
# every open uses over the drawn ones (``flushIntervalCommitLog=600000,...``: an ASYNC writer that never flushes).
TOPICS = {t.strip() for t in os.environ.get("ROCKETSTORE_MODEL_TOPICS", "Busy,Quiet,Rare,Fresh").split(",")}
CONF_OVER = {k.strip(): (int(v) if v.strip().lstrip("-").isdigit() else v.strip()) for k, v in
             (kv.split("=", 1) for kv in os.environ.get("ROCKETSTORE_MODEL_CONF", "").split(",") if "=" in kv)}
# The share of puts that are imported records with old store times (rocketstore import, MessageStore's import
# path): recovery's start must not trust a segment that begins with one (checkpoint offsets, commit 9e34ad3).
IMPORTED = float(os.environ.get("ROCKETSTORE_MODEL_IMPORTED", "0.15"))
IMPORT_RUN = 16


# ---------------------------------------------------------------- messages

def body_of(uid: int, size: int) -> bytes:
    """The body of message ``uid``: its identity, then ``size`` bytes derived from it (no store may invent it)."""
    return b"m%d|" % uid + random.Random(uid).randbytes(size)


def uid_of(body: bytes) -> int | None:
    """The uid a body names, or None for a body no model message has."""
    head, sep, _ = body.partition(b"|")
    if not sep or not head.startswith(b"m") or not head[1:].isdigit():
        return None
    return int(head[1:])


@dataclass
class Spec:
    """One message the test puts (or a child writer is asked to put)."""
    uid: int
    topic: str
    qid: int
    size: int
    keys: str
    tags: str | None
    stored_at: int | None = None  # an imported record's original store time (epoch ms), kept by the put

    def message(self) -> Message:
        return Message(self.topic, body_of(self.uid, self.size), queue_id=self.qid, tags=self.tags, keys=self.keys,
                       store_timestamp=self.stored_at)

    def to_json(self) -> list[Any]:
        return [self.uid, self.topic, self.qid, self.size, self.keys, self.tags, self.stored_at]

    @classmethod
    def from_json(cls, v: list[Any]) -> "Spec":
        return cls(*v)


def imported_store_time(uid: int, share: float | None = None) -> int | None:
    """The original store time of put ``uid`` when it is an imported record, else None: runs of 16 uids (an
    import replays a dump's records one after another), ``share`` of them (default ROCKETSTORE_MODEL_IMPORTED or
    IMPORTED), one to five years back, a millisecond apart within a run.  Drawn from the uid, not from a run's
    random stream, so the seeds' operations stay as they were."""
    share = IMPORTED if share is None else share
    r = random.Random(uid // IMPORT_RUN * 2654435761 + 17)
    if r.random() >= share:
        return None
    return int(time.time() * 1000) - r.randint(365, 5 * 365) * 86_400_000 + uid % IMPORT_RUN


def gen_puts(rng: random.Random, next_uid: int, n_puts: int) -> list[list[Spec]]:
    """``n_puts`` puts (a fifth of them batches of 2-4) over the busy and quiet queues; some are imported
    records with old store times (:func:`imported_store_time`, one time for a batch, as a put of a batch keeps
    its first message's): a segment may then begin with a record older than every checkpoint time."""
    queues = [q for q in QUEUES if q[0] in TOPICS]
    weights = [w for _, _, w in queues]
    out = []
    for _ in range(n_puts):
        topic, qid, _ = rng.choices(queues, weights)[0]
        n = rng.randint(2, 4) if rng.random() < 0.2 else 1
        batch = []
        stored_at = imported_store_time(next_uid)
        for _ in range(n):
            uid = next_uid
            next_uid += 1
            size = rng.randint(1, 300) if rng.random() < 0.85 else rng.randint(300, 3000)
            keys = f"k{uid} x{uid}" if rng.random() < 0.2 else f"k{uid}"
            batch.append(Spec(uid, topic, qid, size, keys, rng.choice(TAGS), stored_at))
        out.append(batch)
    return out


def put_specs(store: MessageStore, batch: list[Spec]):
    msgs = [s.message() for s in batch]
    return store.put(msgs[0]) if len(msgs) == 1 else store.put_batch(msgs)


# ---------------------------------------------------------------- the model

@dataclass
class Msg:
    """An acknowledged message (or an unacknowledged one found in the store and adopted)."""
    spec: Spec
    qoff: int
    required: bool = True  # False: it may legitimately be gone (an ASYNC ack across a power loss, a put in flight)
    phy: int | None = None  # commitlog offset and record size, learnt from the commitlog walk
    rec_size: int | None = None
    how: str = ""  # how it was acknowledged: "inproc-SYNC_FLUSH", "kill-ASYNC_FLUSH", ...

    @property
    def slot(self) -> tuple[str, int, int]:
        return (self.spec.topic, self.spec.qid, self.qoff)


@dataclass
class Model:
    """What the store must hold: every acknowledged message still inside retention, at its queue offset."""
    msgs: dict[int, Msg] = field(default_factory=dict)  # uid -> message
    next_off: dict[tuple[str, int], int] = field(default_factory=dict)  # the queue offset the next put must get
    uncertain: set[tuple[str, int]] = field(default_factory=set)  # queues whose end may have legitimately moved
    pending: dict[int, tuple[Spec, str]] = field(default_factory=dict)  # put but not acknowledged: may be present
    removed_below: int = 0  # commitlog offset below which retention removed data
    floor: dict[tuple[str, int], int] = field(default_factory=dict)  # per queue: offsets below went by retention
    # Messages dropped because their local record was damaged while the tier already held their segment intact:
    # once retention deletes the local copy, reads go to the tier, and the message is there again.
    tier_copies: dict[int, Msg] = field(default_factory=dict)
    next_uid: int = 1

    def slot_owner(self) -> dict[tuple[str, int, int], Msg]:
        return {m.slot: m for m in self.msgs.values()}

    def expect(self, topic: str, qid: int) -> int:
        return self.next_off.get((topic, qid), 0)

    def ack(self, batch: list[Spec], qoff: int, how: str, required: bool = True) -> str | None:
        """Record an acknowledged put; returns a problem when its queue offset is not the one the model expects."""
        t, q = batch[0].topic, batch[0].qid
        want = self.expect(t, q)
        problem = None
        owner = self.slot_owner()
        for j, s in enumerate(batch):
            if (t, q, qoff + j) in owner:
                problem = (f"{how}: put of uid {s.uid} acknowledged with queue offset {t}-{q}@{qoff + j}, "
                           f"already given to uid {owner[(t, q, qoff + j)].spec.uid}")
        if problem is None and qoff != want and not ((t, q) in self.uncertain and qoff > want):
            problem = f"{how}: put acknowledged with queue offset {t}-{q}@{qoff}, the model expects {want}"
        for j, s in enumerate(batch):
            self.msgs[s.uid] = Msg(s, qoff + j, required=required, how=how)
            self.pending.pop(s.uid, None)
        self.next_off[(t, q)] = max(want, qoff + len(batch))
        self.uncertain.discard((t, q))
        return problem

    def drop(self, m: Msg, why: str) -> None:
        """A message legitimately gone (retention, power loss of an unsynced ack, an operator's cut)."""
        self.drop_many([m], why)

    def drop_many(self, gone: list[Msg], why: str) -> None:
        for m in gone:
            del self.msgs[m.spec.uid]
            key = (m.spec.topic, m.spec.qid)
            if why == "retention":
                self.floor[key] = max(self.floor.get(key, 0), m.qoff + 1)
        if why == "retention":
            return
        for key in {(m.spec.topic, m.spec.qid) for m in gone}:
            # the store may hand the lost offsets out again (they are in no record), or leave a gap
            self.uncertain.add(key)
            rest = [x.qoff for x in self.msgs.values() if (x.spec.topic, x.spec.qid) == key]
            lost = min(m.qoff for m in gone if (m.spec.topic, m.spec.qid) == key)
            self.next_off[key] = max(self.floor.get(key, 0), max(rest) + 1 if rest else lost)

    def revive(self, uid: int) -> Msg | None:
        """A message of :attr:`tier_copies` read back (from the tier's intact copy): held again, at its offset."""
        m = self.tier_copies.pop(uid, None)
        if m is None:
            return None
        self.msgs[uid] = m
        m.required = True
        key = (m.spec.topic, m.spec.qid)
        self.next_off[key] = max(self.next_off.get(key, 0), m.qoff + 1)
        return m

    def queue_keys(self) -> list[tuple[str, int]]:
        return sorted({(m.spec.topic, m.spec.qid) for m in self.msgs.values()} | set(self.next_off))

    def in_queue(self, topic: str, qid: int) -> list[Msg]:
        return sorted((m for m in self.msgs.values() if m.spec.topic == topic and m.spec.qid == qid),
                      key=lambda m: m.qoff)


# ---------------------------------------------------------------- config

def model_config(rng_or_seed: random.Random | int, flush: str, tier_uri: str = "", **over: Any) -> StoreConfig:
    """Small geometry (commitlog segments of 32 KiB, queue files of 10 units, index files of 128 entries) so
    files roll within a few steps; how often the consume queues are flushed varies."""
    rng = rng_or_seed if isinstance(rng_or_seed, random.Random) else random.Random(rng_or_seed)
    kw: dict[str, Any] = dict(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
                              maxIndexNum=128, flushDiskType=flush, warmAheadBytes=0,
                              flushIntervalCommitLog=rng.choice([5, 50, 500]),
                              flushIntervalConsumeQueue=rng.choice([5, 50, 1000]),
                              flushConsumeQueueLeastPages=rng.choice([0, 2, 2]),
                              flushConsumeQueueThoroughInterval=rng.choice([60000, 2000, 300]),
                              flushCommitLogThoroughInterval=rng.choice([10000, 1000]),
                              fileReservedTime=72, tieredStoreFileReservedTime=0, tieredStoreUploadInterval=3600_000)
    if tier_uri:
        kw["tieredStoreUri"] = tier_uri
    kw.update(over)
    kw.update(CONF_OVER)
    return StoreConfig(**kw)


def conf_dict(cfg: StoreConfig) -> dict[str, Any]:
    keys = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum", "flushDiskType",
            "warmAheadBytes", "flushIntervalCommitLog", "flushIntervalConsumeQueue", "flushConsumeQueueLeastPages",
            "flushConsumeQueueThoroughInterval", "flushCommitLogThoroughInterval",
            "fileReservedTime", "tieredStoreFileReservedTime", "tieredStoreUploadInterval", "tieredStoreUri")
    return {k: getattr(cfg, k) for k in keys}


# ---------------------------------------------------------------- power loss: pages and directory entries

def _rel_dir_file(shadow: Path, rel: str) -> Path:
    return shadow / DIRSYNC / ((rel.replace(os.sep, "%") or ".") + ".json")


def record_dir_listing(root: Path, shadow: Path, directory: Path) -> None:
    """Write (atomically, a SIGKILL never tears it) the entries of ``directory`` as durable."""
    rel = os.path.relpath(directory, root)
    rel = "" if rel == "." else rel
    dest = _rel_dir_file(shadow, rel)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(os.listdir(directory))))
    os.replace(tmp, dest)


def seed_shadow(live: Path, shadow: Path) -> None:
    """Before a power-loss run: everything on disk now counts as durable (files and directory entries)."""
    from helpers.powerloss import seed_shadow_files
    if shadow.exists():
        shutil.rmtree(shadow)
    seed_shadow_files(live, shadow)
    for d, _dirs, _files in os.walk(live):
        record_dir_listing(live, shadow, Path(d))


def mark_durable(live: Path, shadow: Path, path: Path) -> None:
    """``path`` (a file under ``live``) and its name count as synced as they are now: a file the operator wrote
    (broker.conf), which the model does not cut the power under."""
    from helpers.powerloss import seed_file
    seed_file(path, shadow)
    record_dir_listing(live, shadow, path.parent)


def install_dir_shadow(live: str, shadow: str) -> Any:
    """SyncShadow, plus: an fsync of a directory under the store root records its entries as durable."""
    from helpers.powerloss import SyncShadow

    class DirShadow(SyncShadow):
        def _sync_fd(self, fd: int, real: Any) -> None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if path and os.path.isdir(path) and (path == self.root or path.startswith(self.root + os.sep)):
                real(fd)
                with self._lock:
                    record_dir_listing(Path(self.root), Path(self.shadow), Path(path))
                return
            super()._sync_fd(fd, real)

    return DirShadow(live, shadow).install()


def crash_image_pages(live: Path, shadow: Path, dest: Path, rng: random.Random, keep: float,
                      dir_entries: bool) -> dict[str, str]:
    """The directory a power cut leaves: each file as of its last sync (never-synced: zeros of its length), plus
    each later-written 4 KiB page kept with probability ``keep`` (the kernel wrote some dirty pages back on its own).
    With ``dir_entries``, a file whose name is in no listing of its directory as of that directory's last fsync
    vanishes unless a coin says its entry reached the disk anyway.  Returns each file's fate.

    A kept page is torn (``SECTOR_TEAR`` of them): each of its 512-byte sectors is the new one or the synced one by
    a coin, as when the cut comes while the disk writes the page (a sector is the unit a disk writes whole): a
    record's tail then holds zeros or older bytes with written bytes before and after it in the page.  Those coins
    come from their own generator, seeded from ``rng``'s state without drawing from it, so the steps a seed
    replays are the ones it had before sector tears were modelled."""
    from helpers.powerloss import synced_copy
    sectors = random.Random(repr(rng.getstate()[1][:16]))
    fate: dict[str, str] = {}
    listings: dict[str, set[str]] = {}
    dsd = shadow / DIRSYNC
    if dsd.is_dir():
        for f in dsd.iterdir():
            if f.suffix == ".json":
                rel = f.stem.replace("%", os.sep)
                listings["" if rel == "." else rel] = set(json.loads(f.read_text()))
    for d, _dirs, files in os.walk(live):
        for name in files:
            src = Path(d) / name
            rel = str(src.relative_to(live))
            reldir = os.path.dirname(rel)
            if dir_entries and name not in listings.get(reldir, set()) and rng.random() < 0.5:
                # a created file whose directory was never synced after: the name is gone (and its parent too,
                # when that is new: its files go with it)
                fate[rel] = "unlinked"
                continue
            if dir_entries and reldir and not _dir_durable(reldir, listings) and rng.random() < 0.5:
                fate[rel] = "unlinked (directory)"
                continue
            try:
                data = src.read_bytes()
            except FileNotFoundError:
                continue
            synced = synced_copy(live, shadow, rel)
            base = synced.read_bytes() if synced is not None else bytes(len(data))
            out = bytearray(base)
            if len(data) > len(out) and rng.random() < keep:
                out.extend(bytes(len(data) - len(out)))  # the file's new size reached the disk
            kept = torn = 0
            for pos in range(0, min(len(out), len(data)), PAGE):
                if data[pos:pos + PAGE] != out[pos:pos + PAGE] and rng.random() < keep:
                    if sectors.random() < SECTOR_TEAR:  # the cut came while the disk wrote the page's sectors
                        for s in range(pos, min(pos + PAGE, len(out), len(data)), SECTOR):
                            if sectors.random() < 0.5:
                                out[s:s + SECTOR] = data[s:s + SECTOR]
                        torn += 1
                    else:
                        out[pos:pos + PAGE] = data[pos:pos + PAGE]
                        kept += 1
            o = dest / rel
            o.parent.mkdir(parents=True, exist_ok=True)
            o.write_bytes(bytes(out))
            fate[rel] = ("synced" if synced is not None else "zeroed") + (f"+{kept}p" if kept else "") + \
                (f"+{torn}t" if torn else "")
    return fate


def _dir_durable(reldir: str, listings: dict[str, set[str]]) -> bool:
    parent, name = os.path.split(reldir)
    return name in listings.get(parent, set()) and (not parent or _dir_durable(parent, listings))


# ---------------------------------------------------------------- the child writer

def child_main(argv: list[str]) -> None:
    store_dir, plan_path, acks = argv[0], argv[1], argv[2]
    shadow = argv[3] if len(argv) > 3 else None
    with open(plan_path, encoding="utf-8") as fh:
        plan = json.load(fh)
    if shadow:
        install_dir_shadow(store_dir, shadow)
    store = MessageStore.open(store_dir, StoreConfig(**plan["config"]))
    fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b'{"open": true}\n')
    for i, raw in enumerate(plan["puts"]):
        if plan.get("stop_after") is not None and i >= plan["stop_after"]:
            break  # wait to be killed after exactly this many puts (a kill that replays the same)
        batch = [Spec.from_json(v) for v in raw]
        r = put_specs(store, batch)
        line = {"i": i, "status": r.status.value, "q": r.queue_offset if r.status is PutMessageStatus.PUT_OK else None}
        os.write(fd, (json.dumps(line) + "\n").encode())
        os.fsync(fd)
    if plan.get("close"):
        store.close()
        os.write(fd, b'{"closed": true}\n')
        os.fsync(fd)
        return
    while True:
        time.sleep(1)


def cli_main(argv: list[str]) -> int:
    """``rocketstore`` with the syncs of the store ``argv[0]`` recorded in the shadow ``argv[1]``."""
    install_dir_shadow(argv[0], argv[1])
    from rocketstore.cli.main import main
    sys.argv = ["rocketstore", *argv[2:]]
    return main(argv[2:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cli"]:
        sys.exit(cli_main(sys.argv[2:]))
    child_main(sys.argv[1:])
