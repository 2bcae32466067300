"""Seeded damage to a copy of a golden store, and the checks that every read of the damaged copy must pass.

``mutate`` damages one file of one kind (commitlog segment, consume-queue file, index file, checkpoint,
abort/lock/config json) with one operation (bit flips, a byte run, truncation, a zero-filled tail, extension,
deletion) and says exactly what it did, so a failing case can be replayed from its seed.  ``Golden`` answers
"is this message right?" from the store's expected.jsonl: the checkers return problem strings, never raise.
"""

from __future__ import annotations

import base64
import bisect
import json
import os
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from rocketstore import GetMessageStatus, MessageStore
from rocketstore.errors import StoreError
from rocketstore.recovery.damage import LOST_PROPERTY, LOST_TAG

KINDS = ("commitlog", "consumequeue", "index", "checkpoint", "json")
OPS = ("bitflip", "run", "truncate", "zero_tail", "extend", "delete")
# Files of the "json" kind that a golden store lacks are created first (with plausible contents), then damaged.
JSON_FILES = {
    "lock": None,
    "abort.bak": None,
    "abort": b"31961",
    "config/consumerOffset.json": json.dumps({"offsetTable": {"TopicA@g1": {"0": 3, "1": 5}}}).encode(),
    "config/topics.json": json.dumps({"topicConfigTable": {"TopicA": {"readQueueNums": 4}}}).encode(),
}


@dataclass
class Mutation:
    """What one fuzz case did to its copy; ``damaged_from`` is the first changed commitlog byte (global offset)."""

    seed: int
    store: str
    kind: str
    rel: str
    op: str
    pos: int
    length: int
    damaged_from: int | None

    def __str__(self) -> str:
        where = "" if self.damaged_from is None else f", first damaged commitlog byte {self.damaged_from}"
        return (f"seed={self.seed} store={self.store} {self.op} of {self.rel} at {self.pos} "
                f"(length {self.length}){where}")


def files_of_kind(root: Path, kind: str) -> list[str]:
    """The relative paths a mutation of ``kind`` may pick (json: also files to be created)."""
    if kind == "commitlog":
        return sorted(f"commitlog/{n}" for n in os.listdir(root / "commitlog"))
    if kind == "consumequeue":
        return sorted(str(p.relative_to(root)) for p in (root / "consumequeue").glob("*/*/*") if p.is_file())
    if kind == "index":
        return sorted(f"index/{n}" for n in os.listdir(root / "index"))
    if kind == "checkpoint":
        return ["checkpoint"]
    return sorted(JSON_FILES)


def mutate(root: Path, store: str, kind: str, seed: int, data_end: int) -> Mutation:
    """Damage one file of ``kind`` in the store copy at ``root``; ``data_end`` is the commitlog's max offset."""
    rng = random.Random(seed)
    rel = rng.choice(files_of_kind(root, kind))
    path = root / rel
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(JSON_FILES[rel] or b"")
    old = path.read_bytes()
    n = len(old)
    op = rng.choice(OPS)
    if op in ("bitflip", "run", "zero_tail") and n == 0:
        op = "extend"
    # Most damage goes where the data is (a commitlog segment's written part), some anywhere in the file.
    limit = n
    if kind == "commitlog":
        start = int(os.path.basename(rel))
        limit = max(1, min(n, data_end - start)) if rng.random() < 0.85 else n
    pos = rng.randrange(max(1, limit))
    new = bytearray(old)
    length = 0
    if op == "bitflip":
        length = rng.randint(1, 8)
        for i in range(pos, min(n, pos + length)):
            new[i] ^= 1 << rng.randrange(8)
    elif op == "run":
        length = rng.randint(1, 256)
        fill = rng.choice(["random", "zero", "ff"])
        run = rng.randbytes(length) if fill == "random" else bytes([0 if fill == "zero" else 0xFF]) * length
        run = run[:max(0, n - pos)]
        new[pos:pos + len(run)] = run
    elif op == "truncate":
        length = n - pos
        del new[pos:]
    elif op == "zero_tail":
        length = n - pos
        new[pos:] = bytes(n - pos)
    elif op == "extend":
        pos, length = n, rng.choice([1, 7, 20, 4096, rng.randint(1, 9000)])
        new += rng.randbytes(length) if rng.random() < 0.5 else bytes(length)
    if op == "delete":
        pos, length = 0, n
        path.unlink()
    else:
        path.write_bytes(bytes(new))
    damaged = None
    if kind == "commitlog":
        base = int(os.path.basename(rel))
        first = _first_difference(old, None if op == "delete" else bytes(new))
        damaged = None if first is None else base + first
    return Mutation(seed, store, kind, rel, op, pos, length, damaged)


def _first_difference(old: bytes, new: bytes | None) -> int | None:
    """Index of the first byte that differs (a deleted file differs at 0; a length change at the shorter end)."""
    if new is None:
        return 0
    n = min(len(old), len(new))
    step = 65536
    for i in range(0, n, step):
        a, b = old[i:min(n, i + step)], new[i:min(n, i + step)]
        if a != b:
            return i + next(j for j in range(len(a)) if a[j] != b[j])
    return None if len(old) == len(new) else n


class Golden:
    """The messages a golden store holds, by queue position and by commitlog offset."""

    def __init__(self, expected: list[dict]) -> None:
        self.expected = expected
        self.by_queue = {(e["topic"], e["queueId"], e["queueOffset"]): e for e in expected if e.get("cqUnit")}
        self.by_offset = {e["commitLogOffset"]: e for e in expected}
        self.max_offset = max(e["commitLogOffset"] + e["size"] for e in expected)
        self.queues = sorted({(e["topic"], e["queueId"]) for e in expected if e.get("cqUnit")})
        self._bodies: dict[int, bytes] = {}
        self._starts = sorted(self.by_offset)
        self.damaged_from: int | None = None  # of the case being checked: set by run_case for check_message

    def intact(self, e: dict) -> bool:
        """Whether the record ``e`` ends before the first damaged commitlog byte of the case being checked."""
        return self.damaged_from is None or e["commitLogOffset"] + e["size"] <= self.damaged_from

    def record_start(self, offset: int) -> int:
        """Start of the record holding ``offset`` (or of the record before the gap holding it)."""
        i = bisect.bisect_right(self._starts, offset)
        return self._starts[i - 1] if i else 0

    def body(self, e: dict) -> bytes:
        b = self._bodies.get(e["commitLogOffset"])
        if b is None:
            b = self._bodies[e["commitLogOffset"]] = base64.b64decode(e["body"])
        return b

    def intact_before(self, damaged_from: int | None) -> list[dict]:
        """Queued records that end before the first damaged commitlog byte (all of them when none is)."""
        return [e for e in self.by_queue.values()
                if damaged_from is None or e["commitLogOffset"] + e["size"] <= damaged_from]

    def check_message(self, m, where: str, topic: str | None = None, queue: tuple[str, int, int] | None = None,
                      key: str | None = None) -> str | None:
        """None if ``m`` is a message of the golden store, unaltered, and the one asked for."""
        e = self.by_offset.get(m.commit_log_offset)
        if e is None:
            return f"{where}: returned a record at commitlog offset {m.commit_log_offset} that was never written"
        problems = []
        if queue is not None and (m.topic, m.queue_id, m.queue_offset) != queue:
            problems.append(f"asked for {queue}, got {m.topic}-{m.queue_id} offset {m.queue_offset}")
        if topic is not None and m.topic != topic:
            problems.append(f"asked for topic {topic}, got {m.topic}")
        if (m.topic, m.queue_id, m.queue_offset) != (e["topic"], e["queueId"], e["queueOffset"]):
            problems.append(f"fields say {m.topic}-{m.queue_id}@{m.queue_offset}, golden "
                            f"{e['topic']}-{e['queueId']}@{e['queueOffset']}")
        tombstone = LOST_PROPERTY in m.properties and m.tags == LOST_TAG
        if tombstone and self.intact(e):
            problems.append("a verify --repair tombstone stands in for an intact record")
        if m.body is not None:
            if zlib.crc32(m.body) & 0x7FFFFFFF != m.body_crc & 0x7FFFFFFF:
                problems.append("body fails its CRC")
            if m.body != self.body(e) and not (tombstone and m.body.count(0) == len(m.body)):
                problems.append("body differs from the golden body")
        if key is not None:
            keys = (m.properties.get("KEYS") or "").split(" ") + [m.properties.get("UNIQ_KEY")]
            if key not in keys:
                problems.append(f"key {key!r} is not among its keys {keys}")
        if problems:
            return f"{where}: message at {m.commit_log_offset}: " + "; ".join(problems)
        return None


def store_error_problem(e: BaseException, where: str) -> str | None:
    """None for a refusal the project means (a StoreError with a message); a problem string otherwise."""
    if isinstance(e, StoreError) and str(e).strip():
        return None
    return f"{where}: {type(e).__name__}: {e!r} (not a StoreError with a message)"


def read_queue(store: MessageStore, golden: Golden, topic: str, qid: int, where: str) -> tuple[set, list[str]]:
    """Read one queue from min to max a message at a time: the (topic, queue, offset)s read, and problems."""
    problems: list[str] = []
    seen: set = set()
    lo, hi = store.min_offset_in_queue(topic, qid), store.max_offset_in_queue(topic, qid)
    off = lo
    while off < hi:
        try:
            r = store.get(topic, qid, off, 1)
        except Exception as e:  # noqa: BLE001 - the property under test is "no other exception"
            p = store_error_problem(e, f"{where} get({topic}, {qid}, {off})")
            if p:
                problems.append(p)
            off += 1
            continue
        if r.status is GetMessageStatus.FOUND and r.messages:
            at = r.next_begin_offset - 1  # one message asked for: it is the unit just before the next offset
            p = golden.check_message(r.messages[0], f"{where} get({topic}, {qid}, {off})", queue=(topic, qid, at))
            if p:
                problems.append(p)
            else:
                seen.add((topic, qid, at))
        off = max(off + 1, r.next_begin_offset)
    return seen, problems


def read_everything(store: MessageStore, golden: Golden, where: str) -> tuple[set, list[str]]:
    problems: list[str] = []
    seen: set = set()
    for topic, qid in sorted(set(store.queue_keys()) | set(golden.queues)):
        s, p = read_queue(store, golden, topic, qid, where)
        seen |= s
        problems += p
    return seen, problems


def query_sample(store: MessageStore, golden: Golden, rng: random.Random, n: int, where: str) -> list[str]:
    """Query keys and UNIQ_KEYs of sampled messages, plus each under another topic: nothing wrong comes back."""
    problems = []
    topics = sorted({t for t, _ in golden.queues})
    for e in rng.sample(golden.expected, min(n, len(golden.expected))):
        keys = [k for k in (e.get("keys") or "").split(" ") if k] + [e["properties"].get("UNIQ_KEY")]
        key = rng.choice([k for k in keys if k])
        other = rng.choice([t for t in topics if t != e["topic"]] or ["NoSuchTopic"])
        for topic in (e["topic"], other):
            try:
                r = store.query(topic, key, 64)
            except Exception as ex:  # noqa: BLE001
                p = store_error_problem(ex, f"{where} query({topic}, {key})")
                if p:
                    problems.append(p)
                continue
            for m in r.messages:
                p = golden.check_message(m, f"{where} query({topic}, {key!r})", topic=topic, key=key)
                if p:
                    problems.append(p)
    return problems


def unexplained_findings(result: dict, golden: Golden, mutation: Mutation) -> list[dict]:
    """verify's findings not explained by the damage itself.

    Explained: the damaged file itself moved to quarantine (verify names it for
    the operator); records at or after the start of the record holding the first
    damaged commitlog byte reported bad, and queue units or index entries
    pointing at them dangling.  Anything else means recover/repair left the
    store inconsistent.
    """
    damaged_from = mutation.damaged_from
    floor = None if damaged_from is None else golden.record_start(damaged_from)
    quarantined_name = mutation.rel.replace("/", "__")
    out = []
    for f in result["problems"]:
        if f["kind"] == "quarantined" and os.path.basename(f["file"]) == quarantined_name:
            continue
        if floor is not None:
            if f["kind"] in ("bad-record", "torn-tail") and f["offset"] >= floor:
                continue
            if f["kind"] in ("cq-dangling", "index-dangling"):
                nums = re.findall(r"\d+", f["detail"])
                if nums and int(nums[-1]) >= floor:
                    continue
        out.append(f)
    return out
