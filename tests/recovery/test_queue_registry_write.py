"""The queue registry (config/consumeQueues.registry) is rewritten whole or not at all: store model seed 61036 found
it with a line of zeros after a power cut during an in-place rewrite, and the next open refused the store."""

from __future__ import annotations

import os

from helpers.powerloss import fd_path
from rocketstore import Message, MessageStore, StoreConfig


def test_a_power_cut_while_the_queue_registry_is_rewritten_leaves_the_old_one_whole(tmp_path, monkeypatch):
    root = tmp_path / "s"
    cfg = StoreConfig(mappedFileSizeCommitLog=32 * 1024, mappedFileSizeConsumeQueue=10 * 20, warmAheadBytes=0)
    with MessageStore.open(str(root), cfg) as st:
        assert st.put(Message("T", b"a", queue_id=0)).ok
    registry = root / "config" / "consumeQueues.registry"
    real_fsync = os.fsync

    class PowerCut(BaseException):
        """The machine stopped before this sync: nothing written since the last one is durable."""

    def fsync(fd: int) -> None:
        if os.path.basename(fd_path(fd)).startswith("consumeQueues.registry"):
            raise PowerCut()
        real_fsync(fd)

    st = MessageStore.open(str(root), cfg)
    before = registry.read_bytes()  # (the open wrote each queue's next offset)
    assert before == b"T/0 1\n"
    try:
        monkeypatch.setattr(os, "fsync", fsync)
        try:
            st.files.find_consume_queue("U", 3)  # a new queue (as dispatch makes it): the registry is written again
        except PowerCut:
            pass
        else:
            raise AssertionError("the registry was not synced")
        # Not synced yet: the registry's name must still hold the old registry whole (a rename publishes the
        # new one only once it is durable); an in-place rewrite would leave bytes a power cut may tear.
        assert registry.read_bytes() == before
    finally:
        monkeypatch.setattr(os, "fsync", real_fsync)
        st.close()
    with MessageStore.open(str(root), cfg) as st:  # the registry reads back whole
        assert st.get("T", 0, 0).status.name == "FOUND"
    assert registry.read_bytes().startswith(b"T/0 1\n")
