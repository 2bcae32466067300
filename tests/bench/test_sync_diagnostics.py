"""The SYNC_FLUSH put rows carry what a put cost besides its wall time (issue 29 point 1): CPU per put, fdatasync
calls, write rounds and producer wake-ups per put, context switches per put (producers apart from the
services).  No time is asserted; the counts are exact where the
design fixes them (a lone producer: one write and one fdatasync per put)."""

from __future__ import annotations

import pytest

from rocketstore.bench import rs
from rocketstore.bench.harness import Results


def test_a_lone_sync_producer_row_counts_one_write_and_one_fdatasync_per_put(tmp_path):
    res = Results()
    m = rs.put(res, str(tmp_path), body_size=128, threads=1, flush="SYNC_FLUSH", seconds=0.3)
    e = m.extra
    assert m.status == "ok" and m.n > 0
    assert e["flushes_per_msg"] == 1.0 and e["writes_per_msg"] == 1.0 and e["wakeups_per_msg"] == 0.0
    producers, services = e["producer_switches_per_msg"], e["service_switches_per_msg"]
    assert e["voluntary_switches_per_msg"] == pytest.approx(producers[0] + services[0], abs=0.02)
    assert e["cpu_us_per_msg"] > 0 and e["voluntary_switches_per_msg"] >= 0
    assert any(n.startswith("rs.put.sync.t1.128: ") and "fdatasync" in n for n in res.notes)


def test_sixteen_sync_producers_row_shows_puts_sharing_writes_and_flushes(tmp_path):
    res = Results()
    m = rs.put(res, str(tmp_path), body_size=128, threads=16, flush="SYNC_FLUSH", seconds=0.5)
    e = m.extra
    assert m.status == "ok" and m.n > 0
    assert 0 < e["flushes_per_msg"] < 1 and 0 < e["writes_per_msg"] < 1  # grouped
    assert e["cpu_us_per_msg"] > 0
    # A put that sleeps is woken once (a producer taking over the writing may sleep once more per round).
    assert 0 < e["wakeups_per_msg"] <= 1 + e["writes_per_msg"]
    producers, services = e["producer_switches_per_msg"], e["service_switches_per_msg"]
    assert e["voluntary_switches_per_msg"] == pytest.approx(producers[0] + services[0], abs=0.02)
    assert producers[0] >= services[0]  # the producers sleep per put; the services poll
    assert any(n.startswith("rs.put.sync.t16.128: ") and "producer wake-ups per put" in n for n in res.notes)


def test_async_rows_carry_no_sync_diagnostics(tmp_path):
    res = Results()
    m = rs.put(res, str(tmp_path), body_size=128, threads=1, flush="ASYNC_FLUSH", seconds=0.1)
    assert "flushes_per_msg" not in m.extra and not res.notes


def test_a_row_measured_in_several_rounds_keeps_one_note_for_the_kept_round(tmp_path):
    res = Results()
    for _ in range(3):
        kept = rs.put(res, str(tmp_path), body_size=128, threads=1, flush="SYNC_FLUSH", seconds=0.1)
    notes = [n for n in res.notes if n.startswith("rs.put.sync.t1.128: ")]
    assert len(notes) == 1 and len(kept.extra["rounds"]) == 3
    assert f"{kept.extra['cpu_us_per_msg']:.1f} µs of CPU per put" in notes[0]
