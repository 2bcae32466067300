"""Crashes and restarts with the official client: SIGKILL mid-run, delay and transaction state across restarts."""

from __future__ import annotations

import importlib.util
import os
import time
from collections import defaultdict

import pytest

pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:  # not imported here: the client writes to ~/logs on import
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.bench.broker_harness import BrokerProcess, collect, run_client, start_client  # noqa: E402

SYNC_CONF = {"flushDiskType": "SYNC_FLUSH", "transactionTimeOut": 1000, "transactionCheckInterval": 1000,
             "flushConsumerOffsetInterval": 200, "longPollingTimeout": 2000}


def _broker(tmp_path, **kw):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    b = BrokerProcess(str(tmp_path / "store"), conf=SYNC_CONF, **kw).start()
    b.home = str(home)
    return b


@pytest.mark.timeout(120)
def test_delay_and_half_messages_survive_sigkill(tmp_path):
    b = _broker(tmp_path, args=["--topic", "LaterK:2:DELAY", "--topic", "TxK:2:TRANSACTION"])
    try:
        out = run_client(b.endpoint, '''
            class Never(TransactionChecker):
                def check(self, message): return TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED
            p = Producer(cfg(), ("LaterK",)); p.startup()
            at = int(time.time()) + 4
            r = p.send(msg("LaterK", "after-crash", deliver_at=at))
            t = Producer(cfg(), ("TxK",), checker=Never()); t.startup()
            tx = t.begin_transaction(); h = t.send(msg("TxK", "half"), tx)
            emit({"at": at, "id": r.message_id, "half": h.message_id})
            os._exit(0)  # no goodbye: the broker is killed next
        ''', b.home, timeout=60)
        sent = out[0]
        b.kill()  # SIGKILL right after the acknowledged sends
        b.start()
        out = run_client(b.endpoint, '''
            class Commit(TransactionChecker):
                def check(self, message): return TransactionResolution.COMMIT
            t = Producer(cfg(), ("TxK",), checker=Commit()); t.startup()
            c = SimpleConsumer(cfg(), "LaterG", {"LaterK": FilterExpression()}, await_duration=1); c.startup()
            x = SimpleConsumer(cfg(), "TxG", {"TxK": FilterExpression()}, await_duration=1); x.startup()
            got, txs = [], []
            t0 = time.time()
            while (not got or not txs) and time.time() - t0 < 20:
                for m in c.receive(4, 10):
                    got.append({"id": m.message_id, "at": time.time()}); c.ack(m)
                for m in x.receive(4, 10):
                    txs.append(m.message_id); x.ack(m)
            emit({"got": got, "txs": txs})
            t.shutdown(); c.shutdown(); x.shutdown()
        ''', b.home, timeout=60)
        res = out[0]
        assert [g["id"] for g in res["got"]] == [sent["id"]]
        assert res["got"][0]["at"] >= sent["at"] - 0.05, "a delay message must not come early after a restart"
        assert res["txs"] == [sent["half"]], "the half message is checked and committed after the restart"
    finally:
        b.stop()


PRODUCER = '''
import sys
topic, n, fifo_groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p = Producer(cfg(), (topic,)); p.startup()
i = 0
while i < n:
    g = f"g{i % fifo_groups}" if fifo_groups else None
    try:
        r = p.send(msg(topic, f"{g}:{i}" if g else f"m{i}", group=g))
        emit({"acked": r.message_id, "body": f"{g}:{i}" if g else f"m{i}"})
        i += 1
    except Exception as e:
        time.sleep(0.2)  # the broker is down: send the same payload again (a new message id)
    time.sleep(0.004)
emit({"done": True})
p.shutdown()
'''

CONSUMER = '''
import sys
topic, group, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
c = SimpleConsumer(cfg(), group, {topic: FilterExpression()}, await_duration=1); c.startup()
last = time.time()
while not (os.path.exists(stop_file) and time.time() - last > 4):
    try:
        ms = c.receive(16, 5)
    except Exception:
        time.sleep(0.3); continue
    for m in ms:
        emit({"id": m.message_id, "body": m.body.decode(), "attempt": m.delivery_attempt})
        try:
            c.ack(m)
        except Exception:
            pass
    if ms:
        last = time.time()
c.shutdown()
'''


@pytest.mark.timeout(180)
def test_sigkill_mid_run_loses_no_acknowledged_message(tmp_path):
    b = _broker(tmp_path, args=["--topic", "KillN:4:NORMAL", "--topic", "KillF:4:FIFO",
                                "--group", "KillFG:orderly=true"])
    stop = os.path.join(b.home, "stop")
    try:
        consumers = {
            ("KillN", "KillG1"): start_client(b.endpoint, CONSUMER, b.home, args=["KillN", "KillG1", stop]),
            ("KillN", "KillG2"): start_client(b.endpoint, CONSUMER, b.home, args=["KillN", "KillG2", stop]),
            ("KillF", "KillFG"): start_client(b.endpoint, CONSUMER, b.home, args=["KillF", "KillFG", stop]),
        }
        producers = {
            "KillN": start_client(b.endpoint, PRODUCER, b.home, args=["KillN", 400, 0]),
            "KillF": start_client(b.endpoint, PRODUCER, b.home, args=["KillF", 240, 4]),
        }
        time.sleep(2.5)
        b.kill()
        time.sleep(0.5)
        b.start()
        acked = {}
        for topic, proc in producers.items():
            lines = collect(proc, 120)[0]
            assert lines[-1] == {"done": True}
            acked[topic] = {x["acked"]: x["body"] for x in lines if "acked" in x}
        open(stop, "w").close()
        seen = {key: collect(proc, 90)[0] for key, proc in consumers.items()}
    finally:
        b.stop()
    assert len(acked["KillN"]) == 400 and len(acked["KillF"]) == 240
    for (topic, group), lines in seen.items():
        ids = {x["id"] for x in lines}
        missing = set(acked[topic]) - ids
        assert not missing, f"{group} never got {len(missing)} acknowledged messages"
    # FIFO: per message group, first deliveries come in send order
    order = defaultdict(list)
    for x in seen[("KillF", "KillFG")]:
        g, i = x["body"].split(":")
        if int(i) not in order[g]:
            order[g].append(int(i))
    for g, seq in order.items():
        assert seq == sorted(seq), f"FIFO group {g} out of order: {seq[:50]}"


@pytest.mark.timeout(90)
def test_tls(tmp_path):
    import shutil
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {r.stderr.decode()[-300:]}")
    b = _broker(tmp_path, args=["--tls-cert", str(cert), "--tls-key", str(key)])
    try:
        out = run_client(b.endpoint, '''
            p = Producer(cfg(), ("Tls1",), tls_enable=True); p.startup()
            r = p.send(msg("Tls1", "secret"))
            c = SimpleConsumer(cfg(), "TlsG", {"Tls1": FilterExpression()}, await_duration=1, tls_enable=True)
            c.startup()
            got = []
            for _ in range(5):
                got += c.receive(4, 10)
                if got: break
            for m in got: c.ack(m)
            emit({"sent": r.message_id, "got": [m.message_id for m in got]})
            p.shutdown(); c.shutdown()
        ''', b.home, timeout=60, env={"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert)})
        assert out[0]["got"] == [out[0]["sent"]]
    finally:
        b.stop()
