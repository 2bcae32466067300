"""Run a broker and official-client scripts in subprocesses (for tests, the benchmark and demos).

The server and the clients never share a process: the client registers the
same protobuf files, and a client blocks in ways a test must be able to kill.
Everything listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Iterable, Mapping

CLIENT_PRELUDE = '''
import json, os, sys, time, threading, logging
from rocketmq import (ClientConfiguration, Credentials, Producer, SimpleConsumer, PushConsumer, Message,
                      FilterExpression, TransactionChecker, TransactionResolution, ConsumeResult, MessageListener)
ENDPOINT = os.environ["RS_ENDPOINT"]
if os.environ.get("RS_CLIENT_LOG"):
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("client %(asctime)s %(levelname)s %(message)s"))
    lg = logging.getLogger("rocketmq-python-client"); lg.addHandler(h); lg.setLevel(logging.DEBUG)
def cfg(timeout=3):
    return ClientConfiguration(ENDPOINT, Credentials(), request_timeout=timeout)
def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
def msg(topic, body, tag=None, keys=None, props=None, group=None, deliver_at=None):
    m = Message(); m.topic = topic; m.body = body if isinstance(body, bytes) else body.encode()
    if tag: m.tag = tag
    for k in (keys or []): m.keys = k
    for k, v in (props or {}).items(): m.add_property(k, v)
    if group: m.message_group = group
    if deliver_at: m.delivery_timestamp = deliver_at
    return m
def info(m):
    return {"id": m.message_id, "body": m.body.decode("utf-8", "replace"), "tag": m.tag, "keys": sorted(m.keys),
            "props": dict(m.properties), "attempt": m.delivery_attempt, "group": m.message_group,
            "topic": m.topic, "deliver_at": m.delivery_timestamp}
'''


def client_env(endpoint: str, home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")}
    env.update({"RS_ENDPOINT": endpoint, "HOME": home, "GRPC_VERBOSITY": "ERROR",
                "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


class BrokerProcess:
    """``rocketstore serve`` in a subprocess on 127.0.0.1."""

    def __init__(self, store: str, *, conf: Mapping[str, Any] | None = None, args: Iterable[str] = (),
                 port: int = 0, log_path: str | None = None) -> None:
        self.store = store
        self.conf = dict(conf or {})
        self.args = list(args)
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path or os.path.join(os.path.dirname(os.path.abspath(store)), "broker.log")
        self.conf_path = os.path.join(os.path.dirname(os.path.abspath(store)), "broker.conf")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "rocketstore", "-v", "serve", self.store, "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        if self.conf:
            with open(self.conf_path, "w", encoding="utf-8") as fh:
                fh.writelines(f"{k}={v}\n" for k, v in self.conf.items())
            cmd += ["--config", self.conf_path]
        return cmd

    def cpu_seconds(self) -> float:
        """User plus system CPU time the server process has used so far (Linux /proc; 0.0 elsewhere)."""
        if self.proc is None:
            return 0.0
        try:
            with open(f"/proc/{self.proc.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def start(self, timeout: float = 30.0) -> "BrokerProcess":
        cmd = self.command()
        log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        line = b""
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                line += chunk
                if line.endswith(b"\n"):
                    break
            elif self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.tail_log()}")
            else:
                time.sleep(0.02)
        else:
            self.kill()
            raise RuntimeError(f"broker did not start within {timeout}s: {self.tail_log()}")
        self.port = int(json.loads(line)["port"])
        return self

    def tail_log(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> "BrokerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class BareProcess(BrokerProcess):
    """The bare reference server (:mod:`rocketstore.bench.broker_bare`) in a subprocess; ``store`` only places its log."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "rocketstore.bench.broker_bare", "--host", "127.0.0.1", "--port", str(self.port)]


def client_script(body: str) -> str:
    return CLIENT_PRELUDE + "\n" + textwrap.dedent(body)


def start_client(endpoint: str, body: str, home: str, *, args: Iterable[str] = (),
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start an official-client script; its JSON lines come on stdout."""
    fd, path = tempfile.mkstemp(suffix=".py", prefix="client_", dir=home)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(client_script(body))
    return subprocess.Popen([sys.executable, path, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=client_env(endpoint, home, env))


def collect(proc: subprocess.Popen, timeout: float) -> tuple[list[Any], str]:
    """Wait for a client script; its JSON lines and stderr (killed on timeout)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"client script timed out after {timeout}s; stderr: "
                           f"{err.decode('utf-8', 'replace')[-3000:]}") from None
    lines = []
    for line in out.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    if proc.returncode != 0:
        raise RuntimeError(f"client script exited with {proc.returncode}; stderr: "
                           f"{err.decode('utf-8', 'replace')[-3000:]}")
    return lines, err.decode("utf-8", "replace")


def run_client(endpoint: str, body: str, home: str, *, timeout: float = 60.0, args: Iterable[str] = (),
               env: Mapping[str, str] | None = None) -> list[Any]:
    proc = start_client(endpoint, body, home, args=args, env=env)
    return collect(proc, timeout)[0]
