"""StoreLock on its own: held, refused while another holder has it, free again once released."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rocketstore.errors import StoreLockedError
from rocketstore.storage.store_lock import StoreLock, held_here

# A child process that takes one of the two locks with plain fcntl and waits for its stdin to close.
_HOLDER = """
import fcntl, os, sys
root, kind = sys.argv[1], sys.argv[2]
if kind == "file":
    fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)  # as RocketMQ's FileChannel.tryLock
else:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""


def test_acquire_writes_lock_and_release_frees(tmp_path):
    lock = StoreLock(str(tmp_path))
    lock.acquire()
    try:
        assert (tmp_path / "lock").read_bytes()[:4] == b"lock"
        assert held_here(str(tmp_path))
        with pytest.raises(StoreLockedError, match="already open in this process"):
            StoreLock(str(tmp_path)).acquire()
    finally:
        lock.release()
    assert not held_here(str(tmp_path))
    with StoreLock(str(tmp_path)):  # free again
        assert held_here(str(tmp_path))
    lock.release()  # a second release is harmless


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_refused_while_another_process_holds_either_lock(tmp_path, kind):
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), kind], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"held\n"
        with pytest.raises(StoreLockedError, match="locked by another process"):
            StoreLock(str(tmp_path)).acquire()
        assert not held_here(str(tmp_path))  # a refused acquire leaves nothing held
    finally:
        child.stdin.close()
        child.wait(10)
    with StoreLock(str(tmp_path)):  # the holder's exit freed it
        pass


def test_deleting_the_lock_file_does_not_let_a_second_holder_in(tmp_path):
    with StoreLock(str(tmp_path)):
        (tmp_path / "lock").unlink()
        child = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path), "dir"], input=b"",
                               capture_output=True, timeout=10)
        assert child.returncode != 0 and b"BlockingIOError" in child.stderr  # the directory's flock holds
