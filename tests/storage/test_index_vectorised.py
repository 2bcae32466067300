"""IndexFile.put_keys writes many keys at once with numpy (a Spark append's puts); the bytes must be those the
one-by-one loop writes, hash chains, stale slots a crash left and the header included."""

from __future__ import annotations

import random

import pytest

from rocketstore.storage import index
from rocketstore.storage.index import IndexFile


def _file(path, slots: int, entries: int, stale: dict[int, int]) -> IndexFile:
    f = IndexFile(str(path), slots, entries, create=True)
    for slot, value in stale.items():  # slot heads past the entry count, as a crash can leave them
        index._SLOT.pack_into(f.mm, index.HEADER_SIZE + slot * index.SLOT_SIZE, value)
    return f


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_put_keys_writes_the_loops_bytes(tmp_path, monkeypatch, seed):
    rnd = random.Random(seed)
    slots, entries = rnd.choice([7, 64, 1000]), 900
    stale = {rnd.randrange(slots): rnd.choice([5, 50, 10 ** 6, -3]) for _ in range(slots // 3 + 1)}
    puts = []
    phy, ts = 1000, 1_700_000_000_000
    for _ in range(rnd.randrange(3, 9)):
        keys = [(rnd.randrange(2 ** 31) if rnd.random() < 0.7 else rnd.randrange(40), phy + j // 3)
                for j in range(rnd.choice([1, 5, 80, 300]))]
        puts.append((keys, ts))
        phy += 1000
        ts += rnd.randrange(0, 5000)
    files = {}
    for name, threshold in (("loop", 10 ** 9), ("numpy", 1)):
        monkeypatch.setattr(index, "VECTOR_MIN_KEYS", threshold)
        f = _file(tmp_path / name, slots, entries, stale)
        stops = []
        for keys, when in puts:
            stops.append(f.put_keys(keys, 0, when))
            f._write_header()
        files[name] = (bytes(f.mm), stops, f.index_count, f.hash_slot_count, f.begin_timestamp, f.end_phy_offset)
        f.close()
    assert files["numpy"] == files["loop"]
    assert any(len(k) >= 80 for k, _ in puts) or seed  # the vectorised path ran on most seeds


def test_a_full_file_stops_the_vectorised_put_where_the_loop_does(tmp_path, monkeypatch):
    keys = [(i * 7919 % 100, 5000 + i) for i in range(300)]
    out = {}
    for name, threshold in (("loop", 10 ** 9), ("numpy", 1)):
        monkeypatch.setattr(index, "VECTOR_MIN_KEYS", threshold)
        f = _file(tmp_path / name, 16, 200, {})
        assert f.put_keys(keys, 0, 1_700_000_000_000) == 199  # entry 0 is never used
        assert f.put_keys(keys, 199, 1_700_000_000_000) == 199
        f._write_header()
        out[name] = bytes(f.mm)
        f.close()
    assert out["numpy"] == out["loop"]
