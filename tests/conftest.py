"""Shared fixtures: the golden stores (vendored in tests/golden, never opened for writing) and writable copies of them."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
GOLDEN_NAMES = ["basic", "ipv6", "batch", "v2", "txn"]


def golden_store(name: str) -> Path:
    return GOLDEN / name / "store"


def golden_expected(name: str) -> list[dict]:
    with open(GOLDEN / name / "expected.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def golden_queries(name: str) -> dict:
    with open(GOLDEN / name / "queries.json", encoding="utf-8") as fh:
        return json.load(fh)


def copy_store(src: Path, dst: Path) -> Path:
    """A writable copy (the golden files are read-only on disk)."""
    shutil.copytree(src, dst)
    for d, dirs, files in os.walk(dst):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    return dst


@pytest.fixture
def basic_copy(tmp_path: Path) -> Path:
    return copy_store(golden_store("basic"), tmp_path / "store")


def local_spark(app_name: str, shuffle_partitions: int = 4):
    """A local[2] SparkSession for a test module (workers run this Python); the caller stops it."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from rocketstore.spark import jobs
    s = jobs.session("local[2]", {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": str(shuffle_partitions),
                                  "spark.default.parallelism": "2"}, app_name=app_name)
    s.sparkContext.setLogLevel("ERROR")
    return s


def run_cli(*args: str, input: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess (exit codes and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "rocketstore", *map(str, args)], input=input,
                          capture_output=True, timeout=timeout)


GOLDEN_CONF = "mappedFileSizeCommitLog=1048576\nmappedFileSizeConsumeQueue=6000\nmaxHashSlotNum=1000\nmaxIndexNum=4000\n"


@pytest.fixture
def golden_conf(tmp_path: Path) -> Path:
    p = tmp_path / "broker.conf"
    p.write_text(GOLDEN_CONF)
    return p


def flip_body_bit(store: Path, offset: int, segment: str = "commitlog/00000000000000000000") -> None:
    """Flip one bit of the body of the record at ``offset`` of a (copied) segment; its header stays intact."""
    from rocketstore.format import codec
    path = store / segment
    data = path.read_bytes()
    pos = offset - int(os.path.basename(segment))
    m = codec.decode(data, pos, len(data))
    assert m.body_length > 4
    at = pos + m.size - m.body_length - len(m.topic.encode()) - 1 - 2 - len(m.properties_string.encode()) + 3
    assert data[at - 3:at - 3 + m.body_length] == m.body
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([data[at] ^ 0x10]))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An S3 API server (moto, a child process) on 127.0.0.1 for the tiered-storage tests."""
    from helpers import s3server
    server = s3server.start(str(tmp_path_factory.mktemp("s3") / "moto.log"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A Spark standalone master and one worker on 127.0.0.1 for the whole run (tests/helpers/spark_cluster.py).

    Skips when Java or pyspark is missing (the cluster is made of pyspark's jars run by ``java``).
    """
    pytest.importorskip("pyspark")
    from helpers.spark_cluster import java_executable, spark_cluster as start
    if java_executable() is None:
        pytest.skip("java not found (JAVA_HOME or PATH): the Spark cluster tests need Java 17+")
    with start(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        yield cluster


def short_pwritev(calls: list):
    """A stand-in for ``os.pwritev`` that writes only a third of what it is given (ending mid-record) and notes
    each call's offset in ``calls``: pwritev may write less than asked, and the rest must follow."""
    def short(fd, buffers, offset):
        calls.append(offset)
        data = b"".join(buffers)
        return os.pwrite(fd, data[:len(data) // 3], offset)
    return short
