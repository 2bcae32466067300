"""A throw-away redis-server on 127.0.0.1 for the Redis streams peer.

Debian's redis-server is installed when missing (``apt-get update`` then
``apt-get install -y redis-server``, as root only), started on a random free
port with no persistence (no RDB, no AOF) in the suite's work directory, and
stopped afterwards.  Anything going wrong leaves ``port`` None and a reason in
``why_not``: the Redis peer is then reported as skipped, never as a failure.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time

log = logging.getLogger("rocketstore.bench")

CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    return next((p for p in CANDIDATES if os.access(p, os.X_OK)), None)


def install_redis_server(timeout: float = 600) -> tuple[str | None, str | None]:
    """apt-get install redis-server; returns (path, None) or (None, reason)."""
    if os.geteuid() != 0:
        return None, "redis-server is not installed and installing it needs root"
    if shutil.which("apt-get") is None:
        return None, "redis-server is not installed and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    t0 = time.monotonic()
    try:
        log.warning("installing Debian's redis-server (apt-get update; apt-get install -y redis-server)")
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"], env=env,
                       check=True, timeout=max(60.0, timeout - (time.monotonic() - t0)),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        return None, f"apt-get failed: {err[-1] if err else e}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"apt-get failed: {e}"
    path = find_redis_server()
    return (path, None) if path else (None, "apt-get install redis-server left no redis-server binary")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Context manager: ``with RedisServer(workdir, install=True) as srv: srv.port``."""

    def __init__(self, workdir: str, *, install: bool) -> None:
        self.workdir = workdir
        self.install = install
        self.port: int | None = None
        self.why_not: str | None = None
        self.version: str | None = None
        self.installed_by_suite = False
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "RedisServer":
        try:
            self.start()
        except Exception as e:  # never fail the suite for Redis
            self.why_not = f"redis-server could not be started: {e}"
            self.stop()
        if self.why_not:
            log.warning("Redis peer skipped: %s", self.why_not)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        exe = find_redis_server()
        if exe is None:
            if not self.install:
                self.why_not = "redis-server is not installed (this mode does not install it)"
                return
            exe, why = install_redis_server()
            if exe is None:
                self.why_not = why
                return
            self.installed_by_suite = True
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
            self.version = next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())
        except (OSError, subprocess.SubprocessError):
            self.version = None
        rdir = os.path.join(self.workdir, "redis")
        os.makedirs(rdir, exist_ok=True)
        for attempt in range(3):
            port = free_port()
            self.proc = subprocess.Popen(
                [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", rdir, "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                 "--logfile", os.path.join(rdir, "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(port, 10.0):
                self.port = port
                return
            self.stop()
        self.why_not = "redis-server did not answer PING on 127.0.0.1"

    def _wait_ready(self, port: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
