"""Offline rebuild of the consume queues, the index and the checkpoint from the CommitLog.

The CommitLog is the source of truth; everything else can be derived from it
by dispatching its records in order, exactly as the live ReputMessageService
does; opening a store whose consume queues are gone makes recovery do that.  The old files are moved aside first and compared afterwards, so the
report says what the rebuild changed, and deleted only once the rebuild is done.
"""

from __future__ import annotations

import filecmp
import logging
import os
import shutil
import time
from typing import Any

from .config import StoreConfig
from .store import MessageStore, StorePaths, infer_config
from .verify import verify_store

log = logging.getLogger(__name__)


def _files(root: str) -> dict[str, str]:
    out = {}
    if os.path.isdir(root):
        for d, _dirs, names in os.walk(root):
            for name in names:
                p = os.path.join(d, name)
                out[os.path.relpath(p, root)] = p
    return out


def repair_store(path: str, config: StoreConfig | None = None) -> dict[str, Any]:
    """Rebuild consume queues, index and checkpoint; return verify's result plus ``repaired``."""
    paths = StorePaths(path)
    if not os.path.isdir(paths.commitlog):
        from .errors import StoreLoadError
        raise StoreLoadError(f"{path}: no commitlog directory; not a store")
    config = infer_config(path, config)  # before the files it is inferred from are moved aside
    backup = os.path.join(path, f".repair-backup-{int(time.time() * 1000)}")
    os.makedirs(backup)
    old = {}
    for name in ("consumequeue", "index"):
        src = os.path.join(path, name)
        if os.path.isdir(src):
            os.replace(src, os.path.join(backup, name))
        old[name] = _files(os.path.join(backup, name))
    store = MessageStore.open(path, config, start_services=False)
    try:
        # With no consume queue on disk, recovery re-dispatches every record (max CQ offset is -1).
        for cq in store.consume_queues():
            cq.flush(0)
        store.index_service.flush()
        store.checkpoint.confirmPhyOffset = store.recovery_report.confirm_offset if store.recovery_report else 0
        store.flush_checkpoint()
        store.recover_topic_queue_table()
        repaired = []
        for name in ("consumequeue", "index"):
            new = _files(os.path.join(path, name))
            if name == "index":
                same = len(new) == len(old[name]) and all(
                    filecmp.cmp(a, b, shallow=False) for a, b in zip(sorted(new.values()), sorted(old[name].values())))
                if not same:
                    repaired.append(f"index: {len(old[name])} file(s) rebuilt as {len(new)}")
                continue
            changed = sorted(k for k in new if k not in old[name] or not filecmp.cmp(new[k], old[name][k], shallow=False))
            gone = sorted(k for k in old[name] if k not in new)
            if changed or gone:
                repaired.append(f"consumequeue: {len(changed)} file(s) rewritten, {len(gone)} removed")
        result = verify_store(store)
    finally:
        store.close()
    shutil.rmtree(backup)
    result["repaired"] = repaired
    return result
