"""Fuzz: seeded damage to every file kind of golden store copies; reads, recover and verify must stay safe.

Each case copies a golden store, damages one file (see helpers/store_fuzz.py), then:
opens it read-only and writable (recovery), reads every queue from min to max and
queries a sample of keys, checking each message against expected.jsonl; reopens the
recovered store and runs verify, and ``verify --repair`` if verify is not clean.

The properties, each a test per file kind:
- no traceback: every error is a StoreError subclass with a message;
- nothing wrong: no message of another topic/queue/offset, no CRC-failing or altered body
  (verify --repair's tombstone, a zero-body record tagged ROCKETSTORE_LOST at the lost
  message's own queue offset, may stand in for a record the damage reached, never for an
  intact one);
- nothing intact lost: records ending before the first damaged commitlog byte (all
  records when no commitlog byte is damaged) are readable at their queue offset and
  found by key after recover (and repair); a refused open changes no commitlog byte,
  and a writable open refused for commitlog damage (CommitLogDamagedError) is followed
  by the ``verify --repair`` it asks for;
- verify clean after recover or ``verify --repair`` (findings about the damaged
  commitlog bytes themselves excepted, and so is the repair's quarantine of them,
  which verify names until the operator removes it).

Every problem names the case's seed and mutation (seed = ROCKETSTORE_FUZZ_SEED * 100000
+ kind index * 1000 + case number, so a case replays with the same base seed and enough
cases).  ROCKETSTORE_FUZZ_CASES (per kind) and ROCKETSTORE_FUZZ_SEED widen or move the
search; the defaults keep the whole file under a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from conftest import copy_store, golden_expected, golden_store
from helpers.store_fuzz import (KINDS, Golden, Mutation, mutate, query_sample, read_everything, store_error_problem,
                                unexplained_findings)
from rocketstore import MessageStore
from rocketstore.config import golden_config
from rocketstore.errors import CommitLogDamagedError, StoreError
from rocketstore.recovery.repair import repair_store
from rocketstore.recovery.verify import verify_store

CASES = int(os.environ.get("ROCKETSTORE_FUZZ_CASES", "24"))
BASE_SEED = int(os.environ.get("ROCKETSTORE_FUZZ_SEED", "16"))
# basic has every structure (several segments, rolled queue and index files); the small ones add batches,
# IPv6 hosts, V2 topics and transactions.
STORES = ["basic", "basic", "ipv6", "batch", "v2", "txn"]
CATEGORIES = ("traceback", "wrong", "lost", "verify")

_GOLDEN: dict[str, Golden] = {}


def golden(name: str) -> Golden:
    if name not in _GOLDEN:
        _GOLDEN[name] = Golden(golden_expected(name))
    return _GOLDEN[name]


def _commitlog_digest(root: Path) -> dict[str, str]:
    d = root / "commitlog"
    return {n: hashlib.sha1((d / n).read_bytes()).hexdigest() for n in sorted(os.listdir(d))} if d.is_dir() else {}


def _open(root: Path, **kw) -> MessageStore:
    return MessageStore.open(str(root), **kw)


def run_case(tmp: Path, kind: str, i: int) -> tuple[Mutation, dict[str, list[str]]]:
    """One damaged copy through every check; problems by category, each naming the mutation."""
    seed = BASE_SEED * 100_000 + KINDS.index(kind) * 1000 + i
    rng = random.Random(seed)
    name = rng.choice(STORES)
    g = golden(name)
    root = copy_store(golden_store(name), tmp / f"{kind}-{i}")
    mut = mutate(root, name, kind, seed, g.max_offset)
    g.damaged_from = mut.damaged_from  # check_message accepts repair's tombstones only for damaged records
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}

    def refused(e: BaseException, where: str) -> None:
        p = store_error_problem(e, where)
        if p:
            out["traceback"].append(p)

    def reads(store: MessageStore, where: str) -> set:
        seen, problems = read_everything(store, g, where)
        problems += query_sample(store, g, random.Random(seed), 12, where)
        try:
            store.consumer_offsets()  # reads config/consumerOffset.json
        except Exception as e:  # noqa: BLE001
            problems += [p for p in [store_error_problem(e, f"{where} consumer_offsets()")] if p]
        for p in problems:
            out["wrong" if "not a StoreError" not in p else "traceback"].append(p)
        return seen

    # Read-only, as the CLI tools open it (geometry inferred from the files).
    try:
        with _open(root, read_only=True) as store:
            reads(store, "read-only")
    except Exception as e:  # noqa: BLE001 - the property is "only StoreErrors"
        refused(e, "read-only open")

    # Writable with the store's config: this open is the recovery (as `rocketstore recover`).
    before = _commitlog_digest(root)
    refusal = None
    try:
        with _open(root, config=golden_config(), start_services=False) as store:
            reads(store, "writable")
    except Exception as e:  # noqa: BLE001
        refused(e, "writable open")
        if _commitlog_digest(root) != before:
            out["lost"].append("the writable open refused the store but changed commitlog files")
        if not isinstance(e, CommitLogDamagedError):  # other refusals ask for a config or --allow-quarantine
            return mut, out
        refusal = f"the writable open refused: {e}"  # what it asks the operator to do next: verify --repair

    intact = g.intact_before(mut.damaged_from)

    def unreadable(store: MessageStore, when: str) -> None:
        """Every intact record readable at its queue offset; a sample of them found by UNIQ_KEY."""
        seen = reads(store, when)
        lost = [e for e in intact if (e["topic"], e["queueId"], e["queueOffset"]) not in seen]
        if lost:
            e = lost[0]
            out["lost"].append(f"{len(lost)} of {len(intact)} intact records unreadable {when}, e.g. "
                               f"{e['topic']}-{e['queueId']}@{e['queueOffset']} (commitlog {e['commitLogOffset']})")

    def unfindable(store: MessageStore, when: str) -> None:
        for e in random.Random(seed).sample(intact, min(10, len(intact))):
            uniq = e["properties"]["UNIQ_KEY"]
            try:
                found = [m.commit_log_offset for m in store.query(e["topic"], uniq, 64, read_body=False).messages]
            except StoreError as ex:
                found = [f"{type(ex).__name__}: {ex}"]
            if e["commitLogOffset"] not in found:
                out["lost"].append(f"intact record {e['commitLogOffset']} not found by UNIQ_KEY {uniq} {when} "
                                   f"(got {found})")

    # After recover: every intact record readable; then verify, and verify --repair when it is not clean
    # (or when the writable open refused the store).
    first: list = [refusal]
    if refusal is None:
        try:
            store = _open(root, config=golden_config(), read_only=True)
        except Exception as e:  # noqa: BLE001
            out["verify" if isinstance(e, StoreError) else "traceback"].append(
                f"cannot open the recovered store read-only: {type(e).__name__}: {e}")
            return mut, out
        with store:
            unreadable(store, "after recover")
            first = unexplained_findings(verify_store(store.files), g, mut)
            if not first:
                unfindable(store, "after recover (verify clean)")
                return mut, out
    try:
        result = repair_store(str(root), golden_config())
    except Exception as e:  # noqa: BLE001
        out["verify" if isinstance(e, StoreError) else "traceback"].append(
            f"verify --repair failed: {type(e).__name__}: {e} (verify after recover found {first[:3]})")
        return mut, out
    left = unexplained_findings(result, g, mut)
    if left:
        out["verify"].append(f"verify after recover found {len(first)} problem(s) ({first[:2]}); "
                             f"after verify --repair still {len(left)}: {left[:3]}")
    with _open(root, config=golden_config(), read_only=True) as store:
        unreadable(store, "after verify --repair")
        unfindable(store, "after verify --repair")
    return mut, out


_RESULTS: dict[str, list[tuple[Mutation, dict[str, list[str]]]]] = {}


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    """Run the cases of a file kind once; the four property tests of that kind read the same results."""
    def run(kind: str) -> list[tuple[Mutation, dict[str, list[str]]]]:
        if kind not in _RESULTS:
            tmp = tmp_path_factory.mktemp(f"fuzz-{kind}")
            level = logging.getLogger("rocketstore").level
            logging.getLogger("rocketstore").setLevel(logging.CRITICAL)  # damaged stores log a lot, on purpose
            t0 = time.monotonic()
            try:
                results = []
                for i in range(CASES):
                    results.append(run_case(tmp, kind, i))
                    shutil.rmtree(tmp / f"{kind}-{i}", ignore_errors=True)  # replayable from its seed
                _RESULTS[kind] = results
            finally:
                logging.getLogger("rocketstore").setLevel(level)
            logging.getLogger(__name__).info("fuzz %s: %d cases in %.1f s", kind, CASES, time.monotonic() - t0)
        return _RESULTS[kind]
    return run


def _report(results, category: str) -> str:
    lines = []
    for mut, out in results:
        for p in out[category][:3]:
            lines.append(f"[{mut}] {p}")
    return f"{len(lines)} problem(s):\n" + "\n".join(lines[:20])


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_no_traceback(fuzz, kind):
    results = fuzz(kind)
    assert not any(out["traceback"] for _, out in results), _report(results, "traceback")


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_nothing_wrong_returned(fuzz, kind):
    results = fuzz(kind)
    assert not any(out["wrong"] for _, out in results), _report(results, "wrong")


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_no_intact_record_lost(fuzz, kind):
    results = fuzz(kind)
    assert not any(out["lost"] for _, out in results), _report(results, "lost")


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_verify_clean_after_recover_or_repair(fuzz, kind):
    results = fuzz(kind)
    assert not any(out["verify"] for _, out in results), _report(results, "verify")


@pytest.mark.parametrize("doc", ['{"offsetTable": {"TopicV6@g": {"x": 1}}}', '{"offsetTable": {"TopicV6@g": {"0": "7"}}}',
                                 '{"offsetTable": [1, 2]}', '{"offsetTable": {"TopicV6@g": [1]}}', '[1]'])
def test_consumer_offsets_of_the_wrong_shape_are_a_store_error(tmp_path, doc):
    """Valid JSON of the wrong shape in config/consumerOffset.json: a StoreError naming the file, no traceback."""
    root = copy_store(golden_store("ipv6"), tmp_path / "store")
    (root / "config").mkdir()
    (root / "config" / "consumerOffset.json").write_text(doc)
    with _open(root, read_only=True) as store:
        with pytest.raises(StoreError, match="consumerOffset.json"):
            store.consumer_offsets()


def test_consumer_offsets_read_the_lowest_offset_of_each_queue(tmp_path):
    root = copy_store(golden_store("ipv6"), tmp_path / "store")
    (root / "config").mkdir()
    (root / "config" / "consumerOffset.json").write_text(
        '{"offsetTable": {"TopicV6@g1": {"0": 3, "1": 5}, "TopicV6@g2": {"0": 2}}}')
    with _open(root, read_only=True) as store:
        assert store.consumer_offsets() == {("TopicV6", 0): 2, ("TopicV6", 1): 5}


def test_consumer_offsets_read_rocketmq_fastjson_output(tmp_path):
    """RocketMQ's fastjson writes the queue ids as bare integer keys; the store reads them (retention warns
    about consumers from them)."""
    root = copy_store(golden_store("ipv6"), tmp_path / "store")
    (root / "config").mkdir()
    (root / "config" / "consumerOffset.json").write_text('{"offsetTable":{"TopicV6@g1":{0:12,1:7}}}')
    with _open(root, read_only=True) as store:
        assert store.consumer_offsets() == {("TopicV6", 0): 12, ("TopicV6", 1): 7}
