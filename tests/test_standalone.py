"""Issue 17: the test suite needs nothing outside the repository.

The repository is cloned into an empty temporary directory (so no ``../shared``
or other sibling can be reached) and the golden tests run there against the
clone's own ``src``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_golden_tests_pass_in_a_bare_clone(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "rocketstore"
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(REPO), str(clone)], check=True, timeout=120)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", head], check=True, timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rocketstore"]  # nothing beside it

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
    env["PYTHONPATH"] = str(clone / "src")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/store/test_read_golden.py", "tests/format/test_codec.py"],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=280)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], tail
    # and it was the clone's code that ran, not this checkout's
    probe = subprocess.run([sys.executable, "-c", "import rocketstore; print(rocketstore.__file__)"], cwd=clone,
                           env=env, capture_output=True, text=True, check=True)
    assert Path(probe.stdout.strip()).resolve().is_relative_to(clone.resolve())
