"""attack20: the Spark source's pieces of one segment (plan.split_task, now one per core) where the queue
units do not tile the log: a topic whose consume queues are gone, a queue behind its records (units zeroed),
transaction halves.  Every record is read exactly once across the pieces, as ``dump`` lists them (no JVM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import copy_store, golden_store, run_cli

from rocketstore.spark import plan, segment
from rocketstore.spark.segment import RowFilter

NAMES = ["commitLogOffset", "topic", "queueId", "queueOffset"]


def _rows(tasks):
    return [r["commitLogOffset"] for t in tasks
            for b in segment.read_range(t.path, t.start, t.end, NAMES, t.filter, boundary_known=t.boundary_known,
                                        queues=t.queues) for r in b.to_pylist()]


@pytest.mark.parametrize("name", ["basic", "txn"])
def test_pieces_read_every_record_once_where_the_units_do_not_tile(tmp_path: Path, name: str) -> None:
    root = copy_store(golden_store(name), tmp_path / "s")
    if name == "basic":
        for cq_dir in (root / "consumequeue" / "TopicB" / "1",):  # a queue behind: its newest units never written
            cq = max(cq_dir.iterdir())
            data = bytearray(cq.read_bytes())
            for i in [i for i in range(0, len(data), 20) if any(data[i:i + 20])][-40:]:
                data[i:i + 20] = bytes(20)
            cq.write_bytes(bytes(data))
        for d in (root / "consumequeue" / "TopicA").iterdir():  # a topic in no queue at all
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        (root / "consumequeue" / "TopicA").rmdir()
    dump = run_cli("dump", str(golden_store(name)))
    assert dump.returncode == 0, dump.stderr
    want = [json.loads(line)["commitLogOffset"] for line in dump.stdout.splitlines()]
    tasks = plan.plan_scan(str(root), RowFilter())
    assert _rows(tasks) == want
    for k in (2, 3, 8):
        pieces = [p for t in tasks for p in plan.split_task(t, k)]
        assert len(pieces) > len(tasks)
        assert _rows(pieces) == want, k
