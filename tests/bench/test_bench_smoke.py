"""The benchmark harness stays alive: ``rocketstore bench --smoke`` writes well-formed JSON, Markdown and PNGs.

No time or throughput is asserted: only that every workload ran (or was skipped with a reason)
and that the reports hold every target.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from rocketstore.bench import profiling, report
from rocketstore.bench.targets import TARGETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_ok(path: Path) -> bool:
    """A PNG whose chunks all have good CRCs, with an IHDR of non-zero size and an IEND."""
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        return False
    pos, seen = 8, []
    while pos < len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        chunk = data[pos + 4:pos + 8 + length]
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        if zlib.crc32(chunk) != crc:
            return False
        if kind == b"IHDR":
            w, h = struct.unpack_from(">II", data, pos + 8)
            if not (w and h):
                return False
        seen.append(kind)
        pos += 12 + length
    return seen[0] == b"IHDR" and seen[-1] == b"IEND"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    work = tmp_path_factory.mktemp("bench-work")
    proc = subprocess.run([sys.executable, "-m", "rocketstore", "bench", "--smoke", "--out", str(out),
                           "--workdir", str(work), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    return out, proc


@pytest.mark.timeout(150)
def test_smoke_writes_reports(smoke_run):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    jsons = list(out.glob("*.json"))
    assert len(jsons) == 1
    doc = json.loads(jsons[0].read_text())
    assert doc["schema"] == "rocketstore-bench/1"
    meta = doc["meta"]
    for key in ("date", "host", "uname", "nproc", "memory_gib", "mode", "duration_s"):
        assert key in meta
    assert meta["mode"] == "smoke"
    assert meta["failures"] == []

    ms = {m["id"]: m for m in doc["measurements"]}
    for m in ms.values():
        assert m["status"] in ("ok", "skipped", "failed")
        if m["status"] == "ok":
            assert isinstance(m["value"], (int, float)) and m["value"] > 0, m
        else:
            assert m["note"], m
    # Every rocketstore workload and the floors ran (peers that need a server may be skipped).
    for id in ("rs.put.async.t1.1024", "rs.batch32.async.t1.1024", "rs.put.sync.t1.1024", "rs.put.sync.t16.1024",
               "rs.put.async.t16.1024", "rs.consume32", "rs.lookup", "rs.recovery", "rs.memory",
               "floor.append.1024", "floor.read.1024", "floor.fdatasync", "crc32.recovery",
               "sqlite.txn.normal", "sqlite.txn.off", "sqlite.txn.full", "sqlite.batch32.off",
               "sqlite.consume32", "sqlite.lookup"):
        assert ms[id]["status"] == "ok", (id, ms[id]["note"])
    for peer in ("persist-queue", "diskcache", "litequeue", "redis"):
        assert f"{peer}.put" in ms and f"{peer}.consume" in ms
    # The queue workloads (put + receive + ack, 1 and 4 processes): the peers ran and were verified; rocketstore's
    # row is skipped only in a build without the SimpleConsumer.
    for procs in (1, 4):
        for system in ("persist-queue", "litequeue", "diskcache", "rs"):
            q = ms[f"queue.{system}.p{procs}"]
            if system == "rs" and q["status"] == "skipped":
                assert "simple_consumer is not in this build" in q["note"], q
                continue
            assert q["status"] == "ok", q
            assert q["params"]["missing"] == 0, q
            if system != "persist-queue":  # its SQLiteAckQueue hands a message to two processes at times
                assert q["params"]["duplicates"] == 0, q
    # Every ratio shown refers to a measurement of the same run.
    for m in ms.values():
        if m["ref"]:
            assert m["ref"] in ms, m["id"]

    targets = {t["id"]: t for t in doc["targets"]}
    assert set(targets) == {t.id for t in TARGETS}
    for t in targets.values():
        assert t["met"] in (True, False, None)
        if t["met"] is None:
            assert t["why_not_measured"]

    md = (out / jsons[0].name.replace(".json", ".md")).read_text()
    assert md.startswith("# rocketstore benchmarks")
    assert "| workload | target | rocketstore | reference | ratio | result |" in md
    for t in TARGETS:
        assert t.text in md
    for line in md.splitlines():
        if line.startswith("| ") and "---" not in line:
            assert line.rstrip().endswith("|")

    pngs = sorted(out.glob("*.png"))
    assert {p.name.rsplit("-", 1)[1] for p in pngs} >= {"targets.png", "put.png", "peers.png", "threads.png",
                                                         "memory.png"}
    assert set(doc["plots"]) == {p.name for p in pngs}
    for p in pngs:
        assert _png_ok(p), p
    assert "| workload | target |" in proc.stdout


def test_doc_block_replaced_between_markers(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text(f"intro\n{report.DOC_START}\nold\n{report.DOC_END}\noutro\n")
    assert report.update_doc(str(doc), f"{report.DOC_START}\nnew\n{report.DOC_END}")
    assert doc.read_text() == f"intro\n{report.DOC_START}\nnew\n{report.DOC_END}\noutro\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not report.update_doc(str(plain), "x")
    assert plain.read_text() == "no markers\n"


def test_profile_summary_of_collapsed_stacks():
    raw = ("<module> (run.py:1);put (/x/src/rocketstore/store.py:10);encode (/x/src/rocketstore/codec.py:5) 30\n"
           "<module> (run.py:1);put (/x/src/rocketstore/store.py:10) 10\n")
    text = profiling.summarize_raw(raw)
    assert "samples: 40" in text
    assert " 75.0%  encode (rocketstore/codec.py:5)" in text
    assert " 75.0%  encode (rocketstore/codec.py)" in text
    assert "100.0%  put (rocketstore/store.py)" in text
    assert profiling.summarize_raw("") == "no samples\n"


def test_bench_subcommand_is_registered():
    from rocketstore.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--quick", "--only", "put", "consume", "--out", os.devnull])
    assert args.quick and args.only == ["put", "consume"] and callable(args.handler)
