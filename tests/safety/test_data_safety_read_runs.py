"""Session 12's read fast path (format/codec.py decode_run: _contiguous_run, _units_before_run, _record_run, the
lazy _RunMessage header) attacked at the codec level, against decode_unit one unit at a time as the reference.

The log holds back-to-back batches of one size for two queues of a topic and for another topic of the same name
length, so a damaged unit can name a record of the right size that is another queue's or topic's.  Each trial
damages the units (swapped, shifted by a record, pointed at a same-size record of another queue or topic, cut
short by the segment's written end) or the records (a torn span of zeros, a flipped byte inside a run).  Whatever
decode_run returns must be a prefix of what decode_unit accepts unit by unit, message for message, header
included: a run may stop early (the caller reads on one at a time), never read on past a unit decode_unit
refuses, nor return another message than the unit's."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.format import codec

TOPIC, OTHER = "RunT", "RunU"  # same length: a record of OTHER has the same size as TOPIC's
SEG_SIZE = 64 * 1024
UNIT = struct.Struct(">qiq")


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """(segment bytes, written end, units of TOPIC-0 flattened, {(size): [(phy, topic, qid)]})."""
    root = str(tmp_path_factory.mktemp("runs") / "s")
    cfg = StoreConfig(mappedFileSizeCommitLog=SEG_SIZE, mappedFileSizeConsumeQueue=400 * 20, maxHashSlotNum=64,
                      maxIndexNum=512, warmAheadBytes=0)
    rng = random.Random(5)
    with MessageStore.open(root, cfg) as store:
        n = 0
        while store.max_phy_offset() < SEG_SIZE - 6000:
            topic, qid = rng.choice([(TOPIC, 0), (TOPIC, 0), (TOPIC, 1), (OTHER, 0)])
            body_len = rng.choice([40, 40, 41, 0])  # mostly one size: runs, and same-size records elsewhere
            batch = [Message(topic, bytes([65 + (n + i) % 26]) * body_len, queue_id=qid, tags="t")
                     for i in range(rng.choice([1, 4, 8, 8]))]
            n += len(batch)
            r = store.put_batch(batch) if len(batch) > 1 else store.put(batch[0])
            assert r.ok
        assert store.wait_dispatched(10)
        wrote = store.max_phy_offset()
    data = Path(root, "commitlog", "%020d" % 0).read_bytes()
    cq = Path(root, "consumequeue", TOPIC, "0", "%020d" % 0).read_bytes()
    units = []
    for i in range(0, len(cq), 20):
        phy, size, tags = UNIT.unpack_from(cq, i)
        if size == 0:
            break
        units += [phy, size, tags]
    by_size: dict[int, list[tuple[int, str, int]]] = {}
    pos = 0
    while pos < wrote:
        m = codec.decode(data, pos, wrote)
        by_size.setdefault(m.size, []).append((pos, m.topic, m.queue_id))
        pos += m.size
    return data, wrote, units, by_size


def _reference(buf, units, wrote, qoff, read_body, count, budget) -> list:
    out, total = [], 0
    tb = TOPIC.encode()
    for j in range(0, len(units), 3):
        phy, size = units[j], units[j + 1]
        if len(out) >= count or total + size > budget or phy < 0 or phy + size > wrote:
            break
        m = codec.decode_unit(buf, phy, size, read_body, TOPIC, tb, 0, qoff + len(out))
        if m is None:
            break
        out.append(m)
        total += size
    return out


def _damage(rng: random.Random, data: bytes, wrote: int, units: list[int], by_size) -> tuple[bytes, int, list, str]:
    units = list(units)
    buf = bytearray(data)
    n = len(units) // 3
    i = rng.randrange(n)
    kind = rng.choice(["swap", "shift", "other", "wrote", "torn", "flip", "none"])
    if kind == "swap":
        k = min(n - 1, i + rng.randint(1, 3))
        units[3 * i], units[3 * k] = units[3 * k], units[3 * i]
        units[3 * i + 1], units[3 * k + 1] = units[3 * k + 1], units[3 * i + 1]
    elif kind == "shift":
        units[3 * i] += rng.choice([-1, 1]) * units[3 * i + 1]
    elif kind == "other":
        size = units[3 * i + 1]
        others = [p for p, t, q in by_size.get(size, []) if (t, q) != (TOPIC, 0)]
        if others:
            units[3 * i] = rng.choice(others)
    elif kind == "wrote":
        wrote = units[3 * i] + rng.randrange(units[3 * i + 1])  # the written end inside the unit's record
    elif kind == "torn":
        start = units[3 * i] + rng.randrange(units[3 * i + 1])
        length = min(len(buf) - start, rng.randint(1, 600))
        buf[start:start + length] = bytes(length)
    elif kind == "flip":
        at = units[3 * i] + rng.randrange(units[3 * i + 1])
        buf[at] ^= 1 << rng.randrange(8)
    return bytes(buf), wrote, units, f"{kind} at unit {i}"


@pytest.mark.parametrize("read_body", [True, False])
def test_a_run_never_reads_past_what_unit_at_a_time_refuses(log, read_body):
    data, wrote0, units0, by_size = log
    head = codec.unit_run_head(TOPIC.encode())
    rng = random.Random(11 + read_body)
    stopped_early = fast = 0
    for trial in range(1500):
        buf, wrote, units, what = _damage(rng, data, wrote0, units0, by_size)
        j = 3 * rng.randrange(min(20, len(units) // 3))  # start at a random unit (its queue offset is j // 3)
        count = rng.choice([32, 32, 5, 1000])
        budget = rng.choice([1 << 20, 1 << 20, 700])
        qoff = j // 3
        ref = _reference(buf, units[j:], wrote, qoff, read_body, count, budget)
        out: list = []
        nj, k, total = codec.decode_run(buf, tuple(units), j, 0, wrote, count, budget, read_body, TOPIC, head, 0,
                                        qoff, out)
        assert k == len(out) and nj == j + 3 * k and total == sum(m.size for m in out), (trial, what)
        assert k <= len(ref), f"trial {trial} ({what}, from unit {j // 3}): the run read {k} messages, " \
                              f"unit at a time accepts {len(ref)}"
        for a, b in zip(out, ref):
            assert a == b and a.queue_offset == b.queue_offset and a.commit_log_offset == b.commit_log_offset, \
                f"trial {trial} ({what}): run message {a.to_json(False)} != unit message {b.to_json(False)}"
            assert a.properties == b.properties and a.tags == b.tags
        stopped_early += k < len(ref)
        fast += k > 0
    assert fast > 500, "the runs were hardly used: the attack did not reach the fast path"
