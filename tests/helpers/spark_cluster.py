"""A Spark standalone cluster (one master, one worker) on 127.0.0.1, from the pyspark package's jars.

    with spark_cluster(tmp_dir) as cluster:
        spark = SparkSession.builder.master(cluster.master_url).config(cluster.driver_conf(zip_path))...

Issue 19: the tests must run rocketstore's source and jobs on a real cluster, where executors are separate
JVMs with their own Python workers, not local mode's threads.  Tiered-storage tests (S3) reuse this fixture.

What executors may import.  The venv has rocketstore installed editable: a ``.pth`` file in its
site-packages appends a source tree (the main checkout's ``src``) to ``sys.path``.  An executor Python
started as the venv's python would silently import *that* rocketstore whenever the shipped zip is
missing, so a test could pass with code that never travelled.  The executors here therefore run
:attr:`SparkCluster.executor_python`, a two-line wrapper around ``sys.executable`` that adds ``-S`` (no
``site`` module: no ``.pth`` files, so no editable path) and puts the venv's site-packages back on
``PYTHONPATH`` (a ``PYTHONPATH`` directory is searched but its ``.pth`` files are not run).  pyarrow,
numpy, isal and pyspark stay importable; rocketstore is importable only from the zip the job ships
(``spark.submit.pyFiles`` / ``SparkContext.addPyFile``).  The worker itself, and so every executor it
forks, starts from a clean environment: no ``PYTHONPATH`` (the test process has ``src`` on it), no
``PYSPARK_*``, no ``VIRTUAL_ENV``.

Spark's driver picks the Python of every Python worker, executors' included, from its own
``PYSPARK_PYTHON`` at SparkContext creation: a driver that talks to this cluster sets it to
:attr:`SparkCluster.executor_python` (:meth:`SparkCluster.driver_env`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# The daemons' own heaps: a master and a worker need little; executors get their own (--memory below).
# C1 only and the serial collector: master + worker up and down took 5.5 s of CPU instead of 9.6-11.3 s
# (3.6-3.8 s wall instead of 6-12 s on a loaded 2-core machine); C2 and G1's threads buy nothing here.
DAEMON_JVM = ["-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
              # The master's REST submission server listens on a fixed port (6066): off, so parallel runs
              # do not collide; nothing here submits through it.
              "-Dspark.master.rest.enabled=false"]
WORKER_CORES = 2
WORKER_MEMORY = "1g"
EXECUTOR_MEMORY = "512m"


class ClusterError(RuntimeError):
    """The cluster did not come up (the message names the daemon and the log to read)."""


def java_executable() -> str | None:
    """The ``java`` Spark's launcher would use: $JAVA_HOME/bin/java, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def spark_home() -> Path:
    """The pyspark package directory: it holds ``jars/`` and is SPARK_HOME for pip-installed Spark."""
    import pyspark
    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _site_packages() -> str:
    paths = sysconfig.get_paths()
    return ":".join(dict.fromkeys([paths["purelib"], paths["platlib"]]))


EXECUTOR_MARK = "ROCKETSTORE_TEST_EXECUTOR"  # set in the worker's environment only: executors inherit it


def write_executor_python(path: Path) -> Path:
    """The Python every Spark worker process runs (see the module docstring).

    Spark gives one ``PYSPARK_PYTHON`` path to the executors and to the Python runners the driver's JVM
    starts (planning, a streaming source).  On a real cluster that path is the driver host's Python, with
    rocketstore installed, and on executor hosts a Python without it.  On one machine the wrapper tells
    them apart by :data:`EXECUTOR_MARK`: executors get the venv's python without ``site`` (no ``.pth``
    files, so rocketstore comes only from the zip a job ships; site-packages itself stays on the path),
    the driver side the venv's python as installed.
    """
    path.write_text("#!/bin/sh\n"
                    f'if [ -n "${EXECUTOR_MARK}" ]; then\n'
                    f'  PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{_site_packages()}" exec {sys.executable} -S "$@"\n'
                    "fi\n"
                    f'exec {sys.executable} "$@"\n',
                    encoding="utf-8")
    path.chmod(0o755)
    return path


def _scala_version(home: Path) -> str:
    """The Scala version of the pyspark jars (``spark-core_2.13-4.x.jar`` -> ``2.13``)."""
    for jar in (home / "jars").glob("spark-core_*.jar"):
        return jar.name.split("_", 1)[1].split("-", 1)[0]
    raise ClusterError(f"no spark-core jar in {home / 'jars'}: is pyspark installed whole?")


def _clean_env(home: Path, base: Path) -> dict[str, str]:
    """The daemons' environment: the machine's basics, Spark's settings, nothing of the test process's Python."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "JAVA_HOME", "USER", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(SPARK_HOME=str(home), SPARK_LOCAL_IP=HOST, SPARK_LOCAL_HOSTNAME="localhost",
               SPARK_LOG_DIR=str(base / "logs"), SPARK_WORKER_DIR=str(base / "work"),
               SPARK_LOCAL_DIRS=str(base / "local"), SPARK_NO_DAEMONIZE="1",
               # The worker builds executor command lines with Spark's launcher, which needs the Scala
               # version (bin/load-spark-env.sh sets it; started with plain java, it is ours to set).
               SPARK_SCALA_VERSION=_scala_version(home))
    env[EXECUTOR_MARK] = "1"
    return env


@dataclass
class SparkCluster:
    master_url: str
    master_ui: str
    base: Path
    executor_python: Path
    started_in: float  # seconds from launch to a registered worker
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def state(self) -> dict:
        """The master's JSON status page (workers, apps)."""
        with urllib.request.urlopen(self.master_ui + "/json/", timeout=5) as r:
            return json.load(r)

    def driver_env(self) -> dict[str, str]:
        """Variables a driver process (this one or a CLI subprocess) needs to use the cluster."""
        return {"PYSPARK_PYTHON": str(self.executor_python), "SPARK_LOCAL_IP": HOST}

    def driver_conf(self, py_files: str) -> dict[str, str]:
        """Spark settings of a driver: loopback networking, a small executor, the zip shipped."""
        return {"spark.driver.host": HOST, "spark.driver.bindAddress": HOST, "spark.ui.enabled": "false",
                "spark.executor.memory": EXECUTOR_MEMORY, "spark.cores.max": str(WORKER_CORES),
                "spark.submit.pyFiles": py_files, "spark.sql.shuffle.partitions": "4",
                # Executors live for one test: the daemons' quick-start JVM flags suit them too.
                "spark.executor.extraJavaOptions": " ".join(DAEMON_JVM[1:3])}

    def logs(self) -> str:
        """The daemons' logs, for an assertion message."""
        out = []
        for p in sorted((self.base / "logs").glob("*.log")):
            out.append(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)


def _launch(java: str, home: Path, env: dict[str, str], log_path: Path, main: str, *args: str) -> subprocess.Popen:
    cmd = [java, *DAEMON_JVM, "-cp", str(home / "jars" / "*"), main, *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        # Own process group: the worker's executors are its children, one killpg stops them all.
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=env["SPARK_WORKER_DIR"], start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


def _wait_for_worker(ui: str, procs: list[tuple[str, subprocess.Popen, Path]], deadline: float) -> None:
    last = "no answer"
    while time.monotonic() < deadline:
        for name, p, log_path in procs:
            if p.poll() is not None:
                raise ClusterError(f"Spark {name} exited with {p.returncode} while starting; see {log_path}")
        try:
            with urllib.request.urlopen(ui + "/json/", timeout=2) as r:
                state = json.load(r)
            alive = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
            if alive:
                return
            last = f"{len(state.get('workers', []))} workers, none ALIVE"
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = str(e)
        time.sleep(0.2)
    raise ClusterError(f"no Spark worker registered with the master at {ui} in time ({last}); "
                       f"logs in {procs[0][2].parent}")


@contextlib.contextmanager
def spark_cluster(base: Path, *, start_timeout: float = 60) -> Iterator[SparkCluster]:
    """Start a master and one worker (2 cores, 1g) on 127.0.0.1 under ``base``; stop both at exit."""
    java = java_executable()
    if java is None:
        raise ClusterError("java not found (JAVA_HOME or PATH): a Spark cluster needs Java 17+")
    home = spark_home()
    for d in ("logs", "work", "local"):
        (base / d).mkdir(parents=True, exist_ok=True)
    env = _clean_env(home, base)
    executor_python = write_executor_python(base / "executor-python")
    t0 = time.monotonic()
    for attempt in range(3):  # a free port can be taken between asking and binding: retry with new ones
        port, ui, wui = free_port(), free_port(), free_port()
        master_log, worker_log = base / "logs" / "master.log", base / "logs" / "worker.log"
        master = _launch(java, home, env, master_log, "org.apache.spark.deploy.master.Master",
                         "--host", HOST, "--port", str(port), "--webui-port", str(ui))
        worker = _launch(java, home, env, worker_log, "org.apache.spark.deploy.worker.Worker",
                         f"spark://{HOST}:{port}", "--host", HOST, "--cores", str(WORKER_CORES),
                         "--memory", WORKER_MEMORY, "--webui-port", str(wui), "--work-dir", str(base / "work"))
        procs = [master, worker]
        master_ui = f"http://{HOST}:{ui}"
        try:
            _wait_for_worker(master_ui, [("master", master, master_log), ("worker", worker, worker_log)],
                             time.monotonic() + start_timeout)
            break
        except ClusterError:
            for p in reversed(procs):
                _stop(p)
            if attempt == 2:
                raise
            log.warning("Spark cluster did not start (attempt %d), retrying with other ports", attempt + 1)
    cluster = SparkCluster(f"spark://{HOST}:{port}", master_ui, base, executor_python,
                           time.monotonic() - t0, procs)
    log.info("Spark cluster %s up in %.1f s", cluster.master_url, cluster.started_in)
    try:
        yield cluster
    finally:
        for p in reversed(procs):  # the worker (and its executors) first, then the master
            _stop(p)
