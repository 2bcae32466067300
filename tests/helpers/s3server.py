"""A real S3 API server for tests: moto's server mode in a child process, bound to 127.0.0.1.

A child process (not a thread of the test process) so that other processes (a Spark executor, a CLI run) reach
it as they would reach S3, and the test process's GIL does not slow it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

ACCESS_KEY = "rocketstore-test"
SECRET_KEY = "rocketstore-test-secret"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def new_bucket(self) -> str:
        name = f"rs-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def conf(self, uri: str) -> dict[str, str]:
        """The store config keys that point a store at ``uri`` on this server."""
        return {"tieredStoreUri": uri, "objectStoreEndpoint": self.endpoint, "objectStoreRegion": REGION,
                "objectStoreAccessKey": ACCESS_KEY, "objectStoreSecretKey": SECRET_KEY}

    def keys(self, bucket: str) -> list[str]:
        out = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(log_path: str) -> S3Server:
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return S3Server(f"http://127.0.0.1:{port}", proc)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto server did not listen on 127.0.0.1:{port} within 60 s; see {log_path}")
