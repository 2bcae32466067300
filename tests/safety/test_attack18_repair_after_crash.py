"""verify --repair after a crash of the process alone, then a power cut (attack18).

A crashed writer leaves its last records in the page cache only (ASYNC_FLUSH acknowledges them before any
flush).  A normal open after the crash fdatasyncs them (recovery's _sync_written_before_crash) before the
checkpoint can count on them.  ``verify --repair`` moves the abort file into its quarantine directory and
rebuilds through a clean open, which syncs nothing: the next run's flushes start at the log's end, a segment
the crashed writer filled was never synced, and the clean shutdown's checkpoint said every record was
flushed.  A power cut then lost those records: the open refused (damage before intact records of a store
shut down cleanly) and the messages were gone from the disk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers.powerloss import SyncShadow, crash_image
from rocketstore import GetMessageStatus, Message, MessageStore, StoreConfig
from rocketstore.recovery.repair import repair_store

CFG = dict(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, maxHashSlotNum=32,
           maxIndexNum=128, warmAheadBytes=0, flushDiskType="ASYNC_FLUSH", flushIntervalCommitLog=600_000,
           flushCommitLogThoroughInterval=600_000, flushIntervalConsumeQueue=600_000)

_CRASHING_WRITER = textwrap.dedent("""
    import os, sys
    from rocketstore import Message, MessageStore, StoreConfig
    st = MessageStore.open(sys.argv[1], StoreConfig(**eval(sys.argv[2])))
    for i in range(1, 101):
        assert st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0)).ok
    os._exit(0)  # the process dies: no flush, no close; its records are in the page cache only
""")


def test_repair_after_a_process_crash_makes_the_crashed_writers_records_durable(tmp_path):
    root, shadow, image = tmp_path / "s", tmp_path / "shadow", tmp_path / "image"
    want = {}
    with SyncShadow(root, shadow):
        with MessageStore.open(str(root), StoreConfig(**CFG)) as st:
            assert st.put(Message("T", b"m0|" + bytes(400), queue_id=0)).ok
        want[0] = b"m0|" + bytes(400)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(root), repr(CFG)], check=True, env=env,
                       timeout=60)
        want.update((i, b"m%d|" % i + bytes(400)) for i in range(1, 101))
        assert (root / "abort").exists() and (root / "commitlog" / "00000000000000032768").exists()
        result = repair_store(str(root), StoreConfig(**CFG))
        assert not [m for s in result["lost"] for m in s["messages"]], result["lost"]  # (the zeros past the end)
        with MessageStore.open(str(root), StoreConfig(**CFG)) as st:  # the next run, shut down cleanly
            for i in range(101, 106):
                assert st.put(Message("T", b"m%d|" % i + bytes(400), queue_id=0)).ok
                want[i] = b"m%d|" % i + bytes(400)
        crash_image(root, shadow, image)  # then the power fails
    with MessageStore.open(str(image), StoreConfig(**CFG)) as st:
        got, off = {}, 0
        while off < 106:
            r = st.get("T", 0, off, 32)
            assert r.status is GetMessageStatus.FOUND, (off, r.status)
            got.update((m.queue_offset, m.body) for m in r.messages)
            off = r.next_begin_offset
        assert got == want
