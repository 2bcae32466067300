"""StorePaths: the name of every file and directory of a store, in one place (RocketMQ's StorePathConfigHelper).

Every layer above ``errors`` may import it: the CLI, repair and the Spark planner need paths without
opening the store.
"""

from __future__ import annotations

import os


class StorePaths:
    """Where each file of a store lives (RocketMQ's StorePathConfigHelper)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.commitlog = os.path.join(root, "commitlog")
        self.consumequeue = os.path.join(root, "consumequeue")
        self.index = os.path.join(root, "index")
        self.checkpoint = os.path.join(root, "checkpoint")
        self.lock = os.path.join(root, "lock")
        self.abort = os.path.join(root, "abort")
        self.abort_bak = os.path.join(root, "abort.bak")
        self.abort_boot = os.path.join(root, "abort.bootid")  # rocketstore: the OS boot the abort file is from
        self.config = os.path.join(root, "config")
        self.quarantine = os.path.join(root, "quarantine")
        self.cq_rebuild = os.path.join(root, "consumequeue.rebuild")  # rocketstore: queues being rebuilt
        self.repair_marker = os.path.join(root, "repair.json")  # rocketstore: a repair under way (repair.py)
        self.index_rebuild = os.path.join(root, "index.rebuild")  # rocketstore: index entries being rebuilt
        # rocketstore: every queue the store ever created, "topic/queueId" a line (missing is not empty)
        self.queue_registry = os.path.join(root, "config", "consumeQueues.registry")
