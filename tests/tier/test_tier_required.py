"""A tiered store opened without its tier is refused (missing is not empty, design/data-safety.md rule 4).

A store whose ``config/tierStore.json`` says it published a manifest (and retention deleted the local copies
of the segments the tier holds) was opened, read, verified, repaired and read by the Spark source with no
``tieredStoreUri`` in its config as if the local segments were the whole log: ``dump`` started at the local
start, ``get`` answered OFFSET_TOO_SMALL for the tier's messages, ``verify`` said OK, and ``verify --repair``
rebuilt the index from the local records alone (3,815 index entries became 1,180: the keys of the tier's
records were gone).  Every path now refuses, naming the store, config/tierStore.json and the tieredStoreUri
to set, and touches nothing; a store whose tierStore.json says nothing was published opens as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import GOLDEN_CONF, copy_store, golden_expected, golden_store, run_cli
from rocketstore import MessageStore, StoreConfig
from rocketstore.errors import StoreLoadError
from rocketstore.recovery.load import loaded
from rocketstore.recovery.repair import repair_store
from rocketstore.tier.upload import upload_round

SEG = 1048576
EXPECTED = golden_expected("basic")


def _tiered(tmp_path: Path) -> tuple[Path, str]:
    """Golden basic with a file:// tier: its 3 sealed segments uploaded and deleted locally, then its
    broker.conf written again without tieredStoreUri (as an operator who dropped the line would)."""
    store = copy_store(golden_store("basic"), tmp_path / "store")
    uri = f"file://{tmp_path / 'tier'}"
    (store / "broker.conf").write_text(GOLDEN_CONF + f"tieredStoreUri={uri}\nfileReservedTime=0\n"
                                       "tieredStoreFileReservedTime=0\n")
    with MessageStore.open(str(store), start_services=False) as s:
        assert upload_round(s.files)["segments"] == 3
        for _ in range(10):
            s.clean_service.request_manual_delete()
            s.clean_service.clean_commitlog()
            s.clean_service.clean_consume_queues()
        assert s.min_phy_offset() == 3 * SEG
    (store / "broker.conf").write_text(GOLDEN_CONF)
    return store, uri


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _refusal(store: Path, uri: str | None) -> str:
    return (rf"{store}/config/tierStore.json says generation \d+ of its tier's manifest was published and local "
            rf"segments below commitlog offset {3 * SEG} were deleted, but tieredStoreUri is not set.*"
            rf"set tieredStoreUri={uri or '<its tier.s URI>'} in {store}/broker.conf .*nothing was changed")


def test_every_path_refuses_a_tiered_store_without_its_tier_and_touches_nothing(tmp_path):
    store, uri = _tiered(tmp_path)
    before = _snapshot(store)
    want = _refusal(store, uri)
    for read_only in (True, False):
        with pytest.raises(StoreLoadError, match=want):
            MessageStore.open(str(store), read_only=read_only, start_services=False)
    for read_only in (True, False):
        with pytest.raises(StoreLoadError, match=want):
            with loaded(str(store), StoreConfig(), read_only=read_only):
                pass
    for dry_run in (True, False):
        with pytest.raises(StoreLoadError, match=want):
            repair_store(str(store), dry_run=dry_run)
    for args in (["dump"], ["get", "--topic", "TopicA", "--queue-id", "0", "--offset", "0"], ["verify"],
                 ["verify", "--repair"], ["recover"], ["state"], ["retention"]):
        r = run_cli(*args, store)
        err = r.stderr.decode()
        assert r.returncode == 2 and r.stdout == b"", (args, r.stdout[:200], err)
        assert err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert f"set tieredStoreUri={uri} in {store}/broker.conf" in err and "config/tierStore.json" in err, err
    assert _snapshot(store) == before

    # With its tier named again (here on the command line) every message is there, from offset 0.
    conf = tmp_path / "tier.conf"
    conf.write_text(f"tieredStoreUri={uri}\n")
    r = run_cli("dump", "--config", conf, store)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line)["commitLogOffset"] for line in r.stdout.decode().splitlines()]
    assert got == [e["commitLogOffset"] for e in EXPECTED]


def test_a_tier_state_written_before_the_uri_was_recorded_says_what_to_set(tmp_path):
    """tierStore.json files written before it recorded the tier's URI: the error still names the key."""
    store, _uri = _tiered(tmp_path)
    state = store / "config" / "tierStore.json"
    d = json.loads(state.read_text())
    del d["tieredStoreUri"]
    state.write_text(json.dumps(d))
    with pytest.raises(StoreLoadError, match=_refusal(store, None)):
        MessageStore.open(str(store), read_only=True)


def test_a_damaged_tier_state_without_the_uri_is_refused(tmp_path):
    store, _uri = _tiered(tmp_path)
    for name in ("tierStore.json", "tierStore.json.bak"):
        (store / "config" / name).write_text("{not json")
    with pytest.raises(StoreLoadError, match=r"tierStore.json: unreadable tier identity.*tieredStoreUri is not set"):
        MessageStore.open(str(store), read_only=True)


def test_a_store_that_never_published_to_its_tier_opens_without_it(tmp_path):
    """tierStore.json with generation 0 and nothing deleted (a tier id was made, no manifest published):
    nothing is in the tier, so nothing is hidden."""
    store = copy_store(golden_store("basic"), tmp_path / "store")
    (store / "broker.conf").write_text(GOLDEN_CONF)
    (store / "config").mkdir(exist_ok=True)
    (store / "config" / "tierStore.json").write_text(json.dumps({"storeId": "abc", "generation": 0,
                                                                 "localDeletedEnd": 0}))
    with MessageStore.open(str(store), read_only=True) as s:
        assert s.min_phy_offset() == 0
        assert len(list(s.messages())) == len(EXPECTED)


def test_the_spark_source_refuses_a_tiered_store_without_its_tier(tmp_path):
    """The Spark source finds a store's tier in its read options or broker.conf (spark/remote.py tier_of):
    with neither, the store is refused on the driver; a tier given as read options alone serves the read and
    the read-only open its planner makes beside it."""
    pytest.importorskip("pyarrow")
    from rocketstore.spark import plan, remote
    store, uri = _tiered(tmp_path)
    with pytest.raises(StoreLoadError, match=_refusal(store, uri)):
        remote.tier_of(str(store), {})
    ref = remote.tier_of(str(store), {"tieredStoreUri": uri})
    assert ref is not None and ref.uri == uri
    with plan.open_read_only(str(store), ref) as s:
        assert s.min_readable_offset() == 0
    # a topic filter makes the planner open the store beside the read: with the read's tier
    tasks = plan.plan_scan(str(store), plan.RowFilter(topics=frozenset({"TopicA"})), tier=ref)
    assert sorted(t.base for t in tasks if t.key is not None) == [0, SEG, 2 * SEG]
