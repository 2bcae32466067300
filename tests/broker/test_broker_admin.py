"""Issue 26 (4): operating a live broker through its admin endpoint, and its Prometheus /metrics.

A real ``rocketstore serve`` in a subprocess, the real CLI in subprocesses, the official client to produce
and consume; /metrics is parsed with prometheus_client's own text parser.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pytest

grpc = pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rocketstore.bench.broker_harness import BrokerProcess, run_client, start_client  # noqa: E402
from rocketstore.broker.acl import sign  # noqa: E402
from rocketstore.broker.metrics import BrokerMetrics  # noqa: E402
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402

# Offsets are written to consumerOffset.json only at stop: what `lag` shows while serving is the memory's.
CONF = {"longPollingTimeout": 2000, "flushConsumerOffsetInterval": 600000, "autoCreateTopicEnable": "false"}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROCKETSTORE_ADMIN")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "rocketstore", *map(str, args)], capture_output=True,
                          timeout=60, env=full)


def ok(*args: str, env: dict[str, str] | None = None) -> dict:
    r = cli(*args, env=env)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def refused(*args: str, match: str, env: dict[str, str] | None = None) -> str:
    r = cli(*args, env=env)
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert match in err, err
    return err


def admin_url(store: str) -> str:
    with open(os.path.join(store, "config", "admin.json"), encoding="utf-8") as fh:
        return json.load(fh)["url"]


def scrape(store: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(admin_url(store) + "/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def client(b, body, timeout=90):
    try:
        return run_client(b.endpoint, body, b.home, timeout=timeout)
    except RuntimeError as e:
        raise AssertionError(f"{e}\n--- broker log ---\n{b.tail_log()}") from None


def file_offsets(store: str) -> dict:
    try:
        with open(os.path.join(store, "config", "consumerOffset.json"), encoding="utf-8") as fh:
            return json.load(fh).get("offsetTable", {})
    except FileNotFoundError:
        return {}


CONSUME = '''
    c = SimpleConsumer(cfg(), "LiveG", {"Live1": FilterExpression("*")}, await_duration=2); c.startup()
    got = []
    deadline = time.time() + 30
    while len(got) < 10 and time.time() < deadline:
        for m in c.receive(16, 20):
            got.append(m.body.decode()); c.ack(m)
    emit({"got": sorted(got)})
    c.shutdown()
'''


@pytest.mark.timeout(240)
def test_live_topics_lag_reset_and_metrics(tmp_path):
    store = str(tmp_path / "store")
    (tmp_path / "home").mkdir()
    b = BrokerProcess(store, conf=CONF)
    b.start()
    b.home = str(tmp_path / "home")
    try:
        assert oct(os.stat(os.path.join(store, "config", "admin.json")).st_mode & 0o777) == "0o600"
        # Topics: created while the broker serves (auto-creation is off, so the send below needs it).
        created = ok("topics", store, "create", "Live1", "--queues", "2", "--json")
        assert created["topic"] == {"topic": "Live1", "readQueueNums": 2, "writeQueueNums": 2, "perm": "RW",
                                    "type": ""}
        refused("topics", store, "create", "Live1", match="exists")
        ok("topics", store, "create", "Gone1", "--json")
        ok("topics", store, "update", "Gone1", "--perm", "r", "--write-queues", "1", "--json")
        listed = {t["topic"]: t for t in ok("topics", store, "--json")["topics"]}
        assert listed["Gone1"]["perm"] == "R-" and listed["Gone1"]["writeQueueNums"] == 1
        ok("topics", store, "delete", "Gone1", "--json")
        assert "Gone1" not in {t["topic"] for t in ok("topics", store, "--json")["topics"]}
        refused("topics", store, "delete", "RMQ_SYS_TRANS_HALF_TOPIC", match="system")
        ok("groups", store, "create", "LiveG", "--retry-max-times", "3", "--json")

        bodies = [f"m{i}" for i in range(10)]
        out = client(b, textwrap.dedent('''
            p = Producer(cfg(), ("Live1",)); p.startup()
            for i in range(10):
                p.send(msg("Live1", f"m{i}"))
            try:
                p.send(msg("Unmade", "x")); emit({"unmade": "sent"})
            except Exception as e:
                emit({"unmade": type(e).__name__})
            p.shutdown()
        ''') + textwrap.dedent(CONSUME))
        assert out[0]["unmade"] != "sent"  # no auto-creation: Live1 took only because the CLI created it
        assert out[1]["got"] == bodies

        # Lag: the broker's memory (all acked) while the file has not been written since.
        lag = ok("lag", store, "--group", "LiveG", "--json")
        assert lag["source"] == "broker" and lag["totalLag"] == 0
        assert sorted(r["queueId"] for r in lag["lag"]) == [0, 1]
        assert sum(r["brokerOffset"] for r in lag["lag"]) == 10
        assert all(r["consumerOffset"] == r["brokerOffset"] and r["inflight"] == 0 for r in lag["lag"])
        assert "Live1@LiveG" not in file_offsets(store)  # the file would not know the group yet
        groups = {g["group"]: g for g in ok("groups", store, "--json")["groups"]}
        assert groups["LiveG"]["retryMaxTimes"] == 3 and groups["LiveG"]["topics"] == "Live1"

        m = scrape(store)
        assert m[("rocketstore_put_messages_total", ())] == 10
        assert m[("rocketstore_put_bytes_total", ())] == sum(len(x) for x in bodies)
        assert m[("rocketstore_get_messages_total", ())] == 10
        assert m[("rocketstore_get_bytes_total", ())] == sum(len(x) for x in bodies)
        assert m[("rocketstore_consumer_lag_messages", (("group", "LiveG"), ("queue_id", "0"),
                                                        ("topic", "Live1")))] == 0
        assert ("rocketstore_flush_lag_bytes", ()) in m and ("rocketstore_dispatch_lag_bytes", ()) in m
        assert 0 <= m[("rocketstore_disk_used_ratio", ())] <= 1

        # reset-offset: a dry run by default changes nothing.
        plan = ok("reset-offset", store, "--group", "LiveG", "--topic", "Live1", "--to-earliest", "--json")
        assert plan["executed"] is False
        assert all(r["newOffset"] == 0 and r["oldOffset"] == r["maxOffset"] for r in plan["reset"])
        shift = ok("reset-offset", store, "--group", "LiveG", "--topic", "Live1", "--shift-by", "-2", "--json")
        assert [r["newOffset"] for r in shift["reset"]] == [max(0, r["oldOffset"] - 2) for r in shift["reset"]]
        assert ok("lag", store, "--group", "LiveG", "--json")["totalLag"] == 0
        assert "Live1@LiveG" not in file_offsets(store)

        # --execute moves the group (memory and file), and a consumer receives from there again.
        done = ok("reset-offset", store, "--group", "LiveG", "--topic", "Live1", "--to-earliest", "--execute",
                  "--json")
        assert done["executed"] is True
        assert ok("lag", store, "--group", "LiveG", "--json")["totalLag"] == 10
        assert file_offsets(store)["Live1@LiveG"] == {"0": 0, "1": 0}
        lag_gauge = sum(v for (name, labels), v in scrape(store).items()
                        if name == "rocketstore_consumer_lag_messages" and ("group", "LiveG") in labels)
        assert lag_gauge == 10
        assert client(b, CONSUME)[0]["got"] == bodies
        assert scrape(store)[("rocketstore_get_messages_total", ())] == 20
        assert ok("lag", store, "--group", "LiveG", "--json")["totalLag"] == 0

        # Connected clients per group, while a consumer is connected.
        proc = start_client(b.endpoint, textwrap.dedent('''
            c = SimpleConsumer(cfg(), "LiveG", {"Live1": FilterExpression("*")}, await_duration=1); c.startup()
            emit({"ready": True})
            time.sleep(60)  # killed once the test has looked
        '''), b.home)
        try:
            assert json.loads(proc.stdout.readline()) == {"ready": True}
            clients = ok("groups", store, "clients", "LiveG", "--json")["clients"]
            assert len(clients) == 1 and clients[0]["topics"] == ["Live1"] and clients[0]["alive"] is True
            assert {g["group"]: g for g in ok("groups", store, "--json")["groups"]}["LiveG"]["clients"] == 1
        finally:
            proc.kill()
            proc.wait()

        # By time, past the last message: every queue's end.
        future = datetime.fromtimestamp(4_000_000_000, timezone.utc).isoformat()
        by_time = ok("reset-offset", store, "--group", "LiveG", "--topic", "Live1", "--to-time", future, "--json")
        assert all(r["newOffset"] == r["maxOffset"] for r in by_time["reset"])
        refused("reset-offset", store, "--group", "LiveG", "--topic", "Nope", "--to-earliest", match="'Nope'")
    finally:
        assert b.stop() == 0, b.tail_log()
    assert not os.path.exists(os.path.join(store, "config", "admin.json"))  # removed on a clean stop
    # Offline again: reading works from the files, changing needs a broker.
    assert "Live1" in {t["topic"] for t in ok("topics", store, "--json")["topics"]}
    refused("topics", store, "create", "Later", match="no broker serves")


@pytest.mark.timeout(120)
def test_stale_endpoint_file_is_ignored_and_token_is_required(tmp_path):
    store = str(tmp_path / "store")
    b = BrokerProcess(store, conf=CONF)
    b.start()
    try:
        url = admin_url(store)
        req = urllib.request.Request(url + "/admin/topics.list", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
    finally:
        b.kill()  # kill -9: admin.json stays behind
    assert os.path.exists(os.path.join(store, "config", "admin.json"))
    assert ok("lag", store, "--json")["source"] == "file"  # the store's lock is free: offline
    refused("groups", store, "create", "G", match="no broker serves")


@pytest.mark.timeout(60)
def test_admin_port_off_keeps_the_offline_refusal(tmp_path):
    store = str(tmp_path / "store")
    b = BrokerProcess(store, conf=CONF, args=["--admin-port", "-1", "--topic", "T:1"])
    b.start()
    try:
        assert not os.path.exists(os.path.join(store, "config", "admin.json"))
        refused("reset-offset", store, "--group", "g", "--topic", "T", "--to-earliest", match="open by a running")
    finally:
        assert b.stop() == 0, b.tail_log()


ACL = {"users": [{"username": "admin", "password": "asecret", "userType": "Super"},
                 {"username": "prod", "password": "psecret"}],
       "acls": [{"subject": "User:prod", "policies": [
           {"resource": ["Topic:*"], "actions": ["Pub"], "decision": "Allow"}]}]}


@pytest.mark.timeout(120)
def test_acl_on_only_super_users_may_administer(tmp_path):
    store = str(tmp_path / "store")
    acl = tmp_path / "acl.json"
    acl.write_text(json.dumps(ACL))
    acl.chmod(0o600)
    b = BrokerProcess(store, conf={**CONF, "authConfigPath": str(acl)}, args=["--acl"])
    b.start()
    try:
        with open(os.path.join(store, "config", "admin.json"), encoding="utf-8") as fh:
            assert "token" not in json.load(fh)  # with ACL on the credentials are the Super user's
        refused("topics", store, "create", "T1", match="--admin-user")
        refused("topics", store, "create", "T1", match="not a Super user",
                env={"ROCKETSTORE_ADMIN_USER": "prod", "ROCKETSTORE_ADMIN_SECRET": "psecret"})
        refused("topics", store, "create", "T1", match="signature does not match",
                env={"ROCKETSTORE_ADMIN_USER": "admin", "ROCKETSTORE_ADMIN_SECRET": "wrong"})
        refused("lag", store, match="not a Super user",
                env={"ROCKETSTORE_ADMIN_USER": "prod", "ROCKETSTORE_ADMIN_SECRET": "psecret"})
        secret = tmp_path / "admin.secret"
        secret.write_text("asecret\n")
        out = ok("topics", store, "create", "T1", "--queues", "1", "--admin-user", "admin",
                 "--admin-secret-file", str(secret), "--json")
        assert out["topic"]["readQueueNums"] == 1
        assert "T1" in {t["topic"] for t in ok("topics", store, "--json", env={
            "ROCKETSTORE_ADMIN_USER": "admin", "ROCKETSTORE_ADMIN_SECRET": "asecret"})["topics"]}

        # A gRPC request without a signature, and one the user may not make, count as refusals too.
        with grpc.insecure_channel(b.endpoint) as ch:
            stub = svc_grpc.MessagingServiceStub(ch)
            req = svc.QueryRouteRequest()
            req.topic.name = "T1"
            assert stub.QueryRoute(req, metadata=[("x-mq-client-id", "raw@1")], timeout=5).status.code == \
                pb.Code.UNAUTHORIZED
            dt = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            signed = [("x-mq-client-id", "raw@2"), ("x-mq-date-time", dt),
                      ("authorization", f"MQv2-HMAC-SHA1 Credential=prod, SignedHeaders=x-mq-date-time, "
                                        f"Signature={sign('psecret', dt)}")]
            rreq = svc.ReceiveMessageRequest()
            rreq.group.name = "G"
            rreq.message_queue.topic.name = "T1"
            rreq.batch_size = 1
            rreq.invisible_duration.seconds = 30
            codes = [r.status.code for r in stub.ReceiveMessage(rreq, metadata=signed, timeout=5)
                     if r.WhichOneof("content") == "status"]
            assert codes == [pb.Code.FORBIDDEN]
        m = scrape(store)
        # Admin: no user, wrong secret (x2 with lag's) -> unauthenticated 2; prod twice -> forbidden 2; plus gRPC.
        assert m[("rocketstore_acl_refusals_total", (("reason", "unauthenticated"),))] == 1 + 1
        assert m[("rocketstore_acl_refusals_total", (("reason", "forbidden"),))] == 2 + 1
    finally:
        assert b.stop() == 0, b.tail_log()


def test_brokers_in_one_process_have_their_own_registries():
    a, b = BrokerMetrics(), BrokerMetrics()  # the global registry would refuse the second set of names
    a.stored(True, 5)
    text = b.render(lambda: {})
    assert b"rocketstore_put_messages_total 0.0" in text
    assert b"rocketstore_put_messages_total 1.0" in a.render(lambda: {})


def test_offline_shift_by_and_dry_run(basic_copy):
    """Offline (no broker): --shift-by moves from the committed offset, --dry-run writes nothing."""
    cfg = basic_copy / "config"
    cfg.mkdir(exist_ok=True)
    (cfg / "consumerOffset.json").write_text(json.dumps({"offsetTable": {"TopicA@billing": {"0": 7}}}))
    before = (cfg / "consumerOffset.json").read_bytes()
    plan = ok("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--queue-id", "0",
              "--shift-by", "-3", "--dry-run", "--json")
    assert plan["executed"] is False and plan["reset"][0]["oldOffset"] == 7 and plan["reset"][0]["newOffset"] == 4
    assert (cfg / "consumerOffset.json").read_bytes() == before
    done = ok("reset-offset", basic_copy, "--group", "billing", "--topic", "TopicA", "--queue-id", "0",
              "--shift-by", "-100", "--json")
    assert done["executed"] is True and done["reset"][0]["newOffset"] == done["reset"][0]["minOffset"]  # clamped
    assert json.loads((cfg / "consumerOffset.json").read_text())["offsetTable"]["TopicA@billing"]["0"] == \
        done["reset"][0]["minOffset"]
