"""attack20: a read-only receiver beside a writable open that rebuilds a lost queue and a damaged one at once.

abf7666 names the lost queue in consumequeue.rebuild before recovery (which makes its directory again with
part of its units), so a read-only view never takes it back half filled.  But when another queue also needs
a rebuild (a zero-filled file), the quarantine step rewrote the marker with that queue alone, in
place (truncate, then write): from then until the lost queue's refill the marker no longer named it while its
directory was back, and the reader took it back and delivered it half filled."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import CorruptRecordError
from rocketstore.recovery.load import StoreLoader


def test_the_lost_queue_stays_named_while_another_queue_is_rebuilt_too(tmp_path: Path, monkeypatch) -> None:
    root = str(tmp_path / "s")
    with MessageStore.open(root, StoreConfig()) as w:
        for i in range(3):
            w.put(Message("T", f"old{i}".encode(), queue_id=0))
            w.put(Message("U", f"u{i}".encode(), queue_id=0))
        w.wait_dispatched()
        with w.simple_consumer("G", "T", invisible_duration=60) as first:
            assert [m.body for m in first.receive(1)] == [b"old0"]  # in flight: the group's state has the queue
    shutil.rmtree(tmp_path / "s" / "consumequeue" / "T")  # T lost whole
    u_file = tmp_path / "s" / "consumequeue" / "U" / "0" / "00000000000000000000"
    with open(u_file, "r+b") as fh:  # U: zero-filled where the registry says units were: rebuilt too
        fh.write(bytes(os.path.getsize(u_file)))
    with MessageStore.open(root, read_only=True) as r, r.simple_consumer("G", "T", invisible_duration=60) as c:
        with pytest.raises(CorruptRecordError, match="a lost consume queue"):
            c.receive(8)
        t_dir = tmp_path / "s" / "consumequeue" / "T" / "0"
        marker = tmp_path / "s" / "consumequeue.rebuild"
        refill, seen = StoreLoader._refill_lost_queues, []

        def look_first(self, loaded):  # recovery has run; the lost queue's refill has not
            seen.append((t_dir.is_dir(), marker.read_text().split()))
            with pytest.raises(CorruptRecordError, match="a lost consume queue"):
                c.receive(8)
            return refill(self, loaded)
        monkeypatch.setattr(StoreLoader, "_refill_lost_queues", look_first)
        with MessageStore.open(root, StoreConfig()) as w:
            assert len(seen) == 1 and seen[0][0] and "T/0" in seen[0][1] and "U/0" in seen[0][1], seen
            assert [m.body for m in w.get("U", 0, 0).messages] == [b"u0", b"u1", b"u2"]
            got = c.receive(8)
            assert sorted(m.body for m in got) == [b"old1", b"old2"]
            for m in got:
                c.ack(m)
            c.flush()
            with w.simple_consumer("G", "T", invisible_duration=60) as other:
                assert other.receive(8) == [], "acked messages delivered again"
