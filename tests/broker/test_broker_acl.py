"""ACL 2.0 on the broker: signed requests, users and policies, namespaces, client ownership, sealed receipts.

The official client (``Credentials(ak, sk)``) for what it can show; raw gRPC for what it never sends
(skewed dates, forged handles, someone else's client id).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

grpc = pytest.importorskip("grpc")
if importlib.util.find_spec("rocketmq") is None:
    pytest.skip("rocketmq-python-client is not installed", allow_module_level=True)

from rocketstore.broker.acl import AccessControl, AclConfig, AuthenticationError, Resource, sign  # noqa: E402
from rocketstore.bench.broker_harness import BrokerProcess, run_client  # noqa: E402
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402
from rocketstore.errors import ConfigError  # noqa: E402

C = pb.Code

ACL = {
    "users": [
        {"username": "prod", "password": "psecret", "userType": "Normal"},
        {"username": "cons", "password": "csecret"},
        {"username": "admin", "password": "asecret", "userType": "Super"},
        {"username": "alice", "password": "alice-sk"},
        {"username": "bob", "password": "bob-sk"},
        {"username": "mallory", "password": "msecret"},
        {"username": "gone", "password": "gsecret", "userStatus": "disable"},
    ],
    "acls": [
        {"subject": "User:prod", "policies": [
            {"resource": ["Topic:Orders", "Topic:Mixed", "Topic:Txn"], "actions": ["Pub"], "decision": "Allow"},
            {"resource": "Topic:Mixed", "actions": ["Pub"], "decision": "Deny"},
        ]},
        {"subject": "User:cons", "policies": [
            {"policyType": "Custom", "entries": [
                {"resource": "Topic:Orders", "actions": ["Sub"], "decision": "Allow"},
                {"resource": "Group:Billing", "actions": ["Sub"], "decision": "Allow"},
            ]},
        ]},
        {"subject": "User:alice", "policies": [
            {"resource": ["Topic:tenantA%*", "Group:tenantA%*"], "actions": ["Pub", "Sub"], "decision": "Allow"}]},
        {"subject": "User:bob", "policies": [
            {"resource": ["Topic:tenantB%*", "Group:tenantB%*"], "actions": ["All"], "decision": "Allow"}]},
        {"subject": "User:mallory", "policies": [
            {"resource": ["Topic:*", "Group:*"], "actions": ["Pub", "Sub"], "decision": "Allow"}]},
    ],
}


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("acl")
    (root / "home").mkdir()
    path = root / "acl.json"
    path.write_text(json.dumps(ACL))
    b = BrokerProcess(str(root / "store"),
                      conf={"authConfigPath": str(path), "transactionTimeOut": 500, "transactionCheckInterval": 500,
                            "longPollingTimeout": 3000},
                      # (with ACL, auto-creation is off unless asked for; these tests use it)
                      args=["--acl", "--auto-create-topics", "--topic", "Txn:1:TRANSACTION"])
    b.start()
    b.home = str(root / "home")
    yield b
    assert b.stop() == 0, b.tail_log()


@pytest.fixture(scope="module")
def stub(acl_broker):
    ch = grpc.insecure_channel(acl_broker.endpoint)
    yield svc_grpc.MessagingServiceStub(ch)
    ch.close()


def client(b, body, timeout=90):
    try:
        # The Python client signs its local time marked 'Z': give it a UTC clock, as docs/broker.md advises.
        return run_client(b.endpoint, body, b.home, timeout=timeout, env={"TZ": "UTC"})
    except RuntimeError as e:
        raise AssertionError(f"{e}\n--- broker log ---\n{b.tail_log()}") from None


def md(ak: str | None, sk: str = "", *, client_id: str = "raw@1@1@x", when: datetime | None = None,
       namespace: str = "", upper: bool = False):
    """Metadata as the official clients send it, signed with ``sk`` at ``when`` (now)."""
    dt = (when or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out = [("x-mq-client-id", client_id), ("x-mq-date-time", dt), ("x-mq-namespace", namespace)]
    if ak is not None:
        sig = sign(sk, dt)
        out.append(("authorization", f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, "
                                     f"Signature={sig.upper() if upper else sig}"))
    return out


def route(stub, topic, meta, ns=""):
    req = svc.QueryRouteRequest()
    req.topic.name, req.topic.resource_namespace = topic, ns
    return stub.QueryRoute(req, metadata=meta, timeout=5).status.code


def send(stub, topic, body, meta, ns="", mtype=pb.MessageType.NORMAL):
    req = svc.SendMessageRequest()
    m = req.messages.add()
    m.topic.name, m.topic.resource_namespace, m.body = topic, ns, body
    m.system_properties.message_id = uuid.uuid4().hex.upper()[:34]
    m.system_properties.body_encoding = pb.Encoding.IDENTITY
    m.system_properties.message_type = mtype
    return stub.SendMessage(req, metadata=meta, timeout=5)


def receive(stub, topic, group, meta, ns="", auto_renew=False):
    req = svc.ReceiveMessageRequest()
    req.group.name, req.group.resource_namespace = group, ns
    req.message_queue.topic.name, req.message_queue.topic.resource_namespace = topic, ns
    req.message_queue.id = -1
    req.filter_expression.type, req.filter_expression.expression = pb.FilterType.TAG, "*"
    req.batch_size = 16
    req.auto_renew = auto_renew
    if not auto_renew:
        req.invisible_duration.seconds = 30
    req.long_polling_timeout.seconds = 1
    rs = list(stub.ReceiveMessage(req, metadata=meta, timeout=8))
    return rs[0].status.code, [r.message for r in rs if r.HasField("message")]


def ack(stub, topic, group, handle, meta):
    a = svc.AckMessageRequest()
    a.group.name, a.topic.name = group, topic
    a.entries.add(message_id="x", receipt_handle=handle)
    return stub.AckMessage(a, metadata=meta, timeout=5).status.code


# ---------------------------------------------------------------- the model, without a broker
def test_policy_evaluation_follows_rocketmq():
    acl = AclConfig.from_json(ACL)
    ac = AccessControl(acl)
    assert ac.allowed("prod", "Topic", "Orders", ["Pub"])
    assert not ac.allowed("prod", "Topic", "Orders", ["Sub"]), "no entry for Sub: default deny"
    assert not ac.allowed("prod", "Topic", "Mixed", ["Pub"]), "Deny beats Allow on the same resource"
    assert not ac.allowed("prod", "Topic", "Other", ["Pub"])
    assert ac.allowed("admin", "Topic", "Anything", ["Pub"]) and ac.allowed("admin", "Group", "G", ["Sub"])
    assert ac.allowed("alice", "Topic", "tenantA%Orders", ["Pub"])
    assert not ac.allowed("alice", "Topic", "tenantB%Orders", ["Pub"])
    assert not ac.allowed("alice", "Topic", "Orders", ["Pub"])
    assert ac.allowed("bob", "Group", "tenantB%G", ["Sub"]), "All covers Sub"
    assert ac.allowed("prod", "Topic", "Orders", ["Pub", "Sub"]), "QueryRoute needs Pub or Sub"
    assert not ac.allowed("gone", "Topic", "Orders", ["Pub"])
    # more specific first, and among equals Deny first; sourceIps narrow an entry
    ac2 = AccessControl(AclConfig.from_json({"users": [{"username": "u", "password": "p"}], "acls": [
        {"subject": "User:u", "policies": [
            {"resource": "Topic:*", "actions": ["Pub"], "decision": "Deny"},
            {"resource": "Topic:order-*", "actions": ["Pub"], "decision": "Allow"},
            {"resource": "Topic:order-secret", "actions": ["Pub"], "decision": "Deny"},
            {"resource": "Topic:lan", "actions": ["Pub"], "sourceIps": ["10.0.0.0/8"], "decision": "Allow"}]}]}))
    assert ac2.allowed("u", "Topic", "order-1", ["Pub"])
    assert not ac2.allowed("u", "Topic", "order-secret", ["Pub"])
    assert not ac2.allowed("u", "Topic", "misc", ["Pub"])
    assert ac2.allowed("u", "Topic", "lan", ["Pub"], "10.1.2.3")
    assert not ac2.allowed("u", "Topic", "lan", ["Pub"], "192.168.1.1")
    assert Resource.parse("Topic:order-*") == Resource("Topic", "order-", True)
    assert Resource.parse("*") == Resource(None, None)


def test_signature_and_skew():
    ac = AccessControl(AclConfig.from_json(ACL), skew_ms=60_000)
    now = datetime.now(timezone.utc)
    dt = now.strftime("%Y%m%dT%H%M%SZ")
    header = f"MQv2-HMAC-SHA1 Credential=prod, SignedHeaders=x-mq-date-time, Signature={sign('psecret', dt)}"
    assert ac.authenticate(header, dt) == "prod"
    assert ac.authenticate(header.upper().replace("MQV2-HMAC-SHA1 CREDENTIAL=PROD", "MQv2-HMAC-SHA1 Credential=prod")
                           .replace("SIGNEDHEADERS=X-MQ-DATE-TIME, SIGNATURE=", "SignedHeaders=x-mq-date-time, "
                                    "Signature="), dt) == "prod", "Java signs in uppercase hex"
    old = (now - timedelta(minutes=5)).strftime("%Y%m%dT%H%M%SZ")
    bad = [
        ("", dt), (header, ""), (header, "yesterday"),
        (f"MQv2-HMAC-SHA1 Credential=prod, SignedHeaders=x-mq-date-time, Signature={sign('psecret', old)}", old),
        (f"MQv2-HMAC-SHA1 Credential=prod, SignedHeaders=x-mq-date-time, Signature={sign('wrong', dt)}", dt),
        (f"MQv2-HMAC-SHA1 Credential=nobody, SignedHeaders=x-mq-date-time, Signature={sign('x', dt)}", dt),
        (f"MQv2-HMAC-SHA1 Credential=gone, SignedHeaders=x-mq-date-time, Signature={sign('gsecret', dt)}", dt),
        ("MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, Signature=", dt),
        ("Basic cHJvZDpwc2VjcmV0", dt),
    ]
    for h, d in bad:
        with pytest.raises(AuthenticationError):
            ac.authenticate(h, d)


@pytest.mark.parametrize("doc, problem", [
    ("{", "not valid JSON"),
    ('{"users": {}}', "users must be a list"),
    ('{"users": [{"username": "a"}]}', "users[0].password"),
    ('{"users": [{"username": "a", "password": "b", "userType": "Root"}]}', "userType"),
    ('{"users": [], "acls": [{"subject": "User:x", "policies": []}]}', "acls[0].subject"),
    ('{"users": [{"username": "a", "password": "b"}], "acls": [{"subject": "User:a", "policies": '
     '[{"resource": "Queue:x", "actions": ["Pub"], "decision": "Allow"}]}]}', "Queue:x"),
    ('{"users": [{"username": "a", "password": "b"}], "acls": [{"subject": "User:a", "policies": '
     '[{"resource": "Topic:x", "actions": ["Publish"], "decision": "Allow"}]}]}', "Publish"),
    ('{"users": [{"username": "a", "password": "b"}], "acls": [{"subject": "User:a", "policies": '
     '[{"resource": "Topic:x", "actions": ["Pub"], "decision": "Maybe"}]}]}', "decision"),
    ('{"users": [{"username": "a", "password": "b"}], "acls": [{"subject": "User:a", "policies": '
     '[{"resource": "Topic:x", "actions": ["Pub"], "sourceIps": ["lan"], "decision": "Allow"}]}]}', "sourceIps"),
])
def test_bad_acl_file_names_file_and_entry(tmp_path, doc, problem):
    p = tmp_path / "acl.json"
    p.write_text(doc)
    with pytest.raises(ConfigError) as e:
        AclConfig.load(str(p))
    assert str(p) in str(e.value) and problem in str(e.value)


# ---------------------------------------------------------------- the CLI
def _serve(args, tmp_path, timeout=30):
    return subprocess.run([sys.executable, "-m", "rocketstore", "serve", str(tmp_path / "store"), "--port", "0",
                           *args], capture_output=True, text=True, timeout=timeout)


def test_cli_bad_or_missing_acl_file_exits_2_with_one_line(tmp_path):
    r = _serve(["--acl"], tmp_path)
    missing = tmp_path / "store" / "config" / "acl.json"
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert str(missing) in r.stderr and "cannot read" in r.stderr
    assert not (tmp_path / "store").exists(), "a bad ACL file leaves the store untouched"
    bad = tmp_path / "bad.json"
    bad.write_text('{"users": [{"username": "a", "password": "b", "userType": "Root"}]}')
    conf = tmp_path / "broker.conf"
    conf.write_text(f"authenticationEnabled=true\nauthConfigPath={bad}\n")
    r = _serve(["--config", str(conf)], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert str(bad) in r.stderr and "userType" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- the official client
def test_official_client_credentials_and_permissions(acl_broker):
    out = client(acl_broker, '''
        codes = []
        class Grab(logging.Handler):
            def emit(self, record):
                codes.append(record.getMessage())
        lg = logging.getLogger("rocketmq-python-client"); lg.addHandler(Grab()); lg.setLevel(logging.INFO)
        def conf(ak, sk):
            return ClientConfiguration(ENDPOINT, Credentials(ak, sk), request_timeout=3)
        def attempt(label, ak, sk, topic):
            del codes[:]
            p = Producer(conf(ak, sk), (topic,))
            res = {"label": label}
            try:
                p.startup()
                r = p.send(msg(topic, label))
                res["ok"] = r.message_id
            except Exception as e:
                res["error"] = str(e)
            finally:
                p.shutdown()
            res["log"] = " | ".join(c for c in codes if "40100" in c or "40300" in c)
            emit(res)
        attempt("right", "prod", "psecret", "Orders")
        attempt("wrong-secret", "prod", "not-the-secret", "Orders")
        attempt("no-credentials", "", "", "Orders")
        attempt("no-policy", "prod", "psecret", "Secret")
        attempt("deny-beats-allow", "prod", "psecret", "Mixed")
        attempt("sub-only-user-sends", "cons", "csecret", "Orders")
        attempt("super", "admin", "asecret", "Secret")
        c = SimpleConsumer(conf("cons", "csecret"), "Billing", {"Orders": FilterExpression()}, await_duration=5)
        c.startup()
        got = []
        for _ in range(3):
            for m in c.receive(16, 15):
                got.append(m.body.decode()); c.ack(m)
            if got:
                break
        c.shutdown()
        emit({"received": got})
    ''')
    res = {r["label"]: r for r in out if "label" in r}
    assert "ok" in res["right"] and "ok" in res["super"], res
    for label, code in (("wrong-secret", "40100"), ("no-credentials", "40100"), ("no-policy", "40300"),
                        ("deny-beats-allow", "40300"), ("sub-only-user-sends", "40300")):
        assert "ok" not in res[label] and code in res[label]["log"], (label, res[label])
    assert "signature of user 'prod' does not match" in res["wrong-secret"]["log"]
    assert out[-1] == {"received": ["right"]}, out


def test_namespaces_are_isolated(acl_broker):
    out = client(acl_broker, '''
        def conf(ak, sk, ns):
            return ClientConfiguration(ENDPOINT, Credentials(ak, sk), namespace=ns, request_timeout=3)
        for ak, sk, ns in (("alice", "alice-sk", "tenantA"), ("bob", "bob-sk", "tenantB")):
            p = Producer(conf(ak, sk, ns), ("Orders",)); p.startup()
            p.send(msg("Orders", "from " + ns)); p.shutdown()
        for ak, sk, ns in (("alice", "alice-sk", "tenantA"), ("bob", "bob-sk", "tenantB")):
            c = SimpleConsumer(conf(ak, sk, ns), "Readers", {"Orders": FilterExpression()}, await_duration=5)
            c.startup()
            got = []
            for _ in range(2):
                ms = c.receive(16, 15)
                for m in ms:
                    got.append([m.body.decode(), m.topic, m.namespace]); c.ack(m)
                if got:
                    break
            c.shutdown()
            emit({"ns": ns, "got": got})
        # alice claims tenant B's namespace
        p = Producer(conf("alice", "alice-sk", "tenantB"), ("Orders",)); p.startup()
        try:
            p.send(msg("Orders", "intruder")); emit({"intruder": "sent"})
        except Exception as e:
            emit({"intruder": str(e)})
        p.shutdown()
    ''')
    got = {r["ns"]: r["got"] for r in out if "ns" in r}
    assert got == {"tenantA": [["from tenantA", "Orders", "tenantA"]],
                   "tenantB": [["from tenantB", "Orders", "tenantB"]]}, out
    assert out[-1]["intruder"] != "sent"
    with open(os.path.join(acl_broker.store, "config", "topics.json"), encoding="utf-8") as fh:
        table = json.load(fh)["topicConfigTable"]
    assert "tenantA%Orders" in table and "tenantB%Orders" in table


# ---------------------------------------------------------------- raw gRPC
def test_raw_signatures_dates_and_codes(stub):
    assert route(stub, "Orders", md("prod", "psecret")) == C.OK
    assert route(stub, "Orders", md("prod", "psecret", upper=True)) == C.OK, "Java's uppercase hex"
    skewed = datetime.now(timezone.utc) - timedelta(minutes=20)
    assert route(stub, "Orders", md("prod", "psecret", when=skewed)) == C.UNAUTHORIZED
    assert route(stub, "Orders", md("prod", "psecret", when=skewed + timedelta(minutes=30))) == C.OK
    assert route(stub, "Orders", md(None)) == C.UNAUTHORIZED
    assert route(stub, "Orders", md("gone", "gsecret")) == C.UNAUTHORIZED, "disabled user"
    assert route(stub, "Secret", md("prod", "psecret")) == C.FORBIDDEN
    r = send(stub, "Orders", b"x", md("cons", "csecret", client_id="raw-cons@1@1@x"))
    assert r.status.code == C.FORBIDDEN and r.entries[0].status.code == C.FORBIDDEN
    assert C.UNAUTHORIZED == 40100 and C.FORBIDDEN == 40300


def test_receipt_handles_carry_a_mac(stub):
    prod, cons = md("prod", "psecret"), md("cons", "csecret", client_id="cons@1@1@x")
    assert send(stub, "Orders", b"sealed", prod).status.code == C.OK
    msgs = []
    for _ in range(5):
        code, got = receive(stub, "Orders", "Billing", cons)
        msgs += got
        if any(m.body == b"sealed" for m in msgs):
            break
    m = next(m for m in msgs if m.body == b"sealed")
    handle = m.system_properties.receipt_handle
    inner, _, mac = handle.rpartition("_")
    assert len(mac) == 32 and int(mac, 16) >= 0 and inner.count("_") == 2, handle
    forged = [inner, f"{inner}_{'0' * 32}", f"{inner}_{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",
              handle.replace("_", "_1", 1), ""]
    for h in forged:
        assert ack(stub, "Orders", "Billing", h, cons) == C.INVALID_RECEIPT_HANDLE, h
        c = svc.ChangeInvisibleDurationRequest()
        c.group.name, c.topic.name, c.receipt_handle, c.message_id = "Billing", "Orders", h, "x"
        c.invisible_duration.seconds = 5
        assert stub.ChangeInvisibleDuration(c, metadata=cons, timeout=5).status.code == C.INVALID_RECEIPT_HANDLE
    c = svc.ChangeInvisibleDurationRequest()
    c.group.name, c.topic.name, c.receipt_handle, c.message_id = "Billing", "Orders", handle, "x"
    c.invisible_duration.seconds = 5
    r = stub.ChangeInvisibleDuration(c, metadata=cons, timeout=5)
    assert r.status.code == C.OK and r.receipt_handle != handle and len(r.receipt_handle.rpartition("_")[2]) == 32
    assert ack(stub, "Orders", "Billing", handle, cons) == C.INVALID_RECEIPT_HANDLE, "superseded"
    assert ack(stub, "Orders", "Billing", r.receipt_handle, cons) == C.OK
    for other in msgs:
        if other.body != b"sealed":
            ack(stub, "Orders", "Billing", other.system_properties.receipt_handle, cons)


def test_client_id_belongs_to_its_user(stub):
    victim = md("cons", "csecret", client_id="victim@1@1@x")
    thief = md("mallory", "msecret", client_id="victim@1@1@x")
    assert send(stub, "Orders", b"held", md("prod", "psecret")).status.code == C.OK
    held = []
    for _ in range(5):
        code, got = receive(stub, "Orders", "Billing", victim, auto_renew=True)
        held += got
        if any(m.body == b"held" for m in held):
            break
    assert any(m.body == b"held" for m in held)
    r = stub.NotifyClientTermination(svc.NotifyClientTerminationRequest(), metadata=thief, timeout=5)
    assert r.status.code == C.FORBIDDEN
    hb = svc.HeartbeatRequest(client_type=pb.ClientType.SIMPLE_CONSUMER)
    assert stub.Heartbeat(hb, metadata=thief, timeout=5).status.code == C.FORBIDDEN
    tel = list(stub.Telemetry(iter([]), metadata=thief, timeout=5))
    assert tel and tel[0].status.code == C.FORBIDDEN
    time.sleep(1.5)  # a release would make the held messages visible after 1 s
    code, stolen = receive(stub, "Orders", "Billing", md("mallory", "msecret", client_id="mallory@1@1@x"))
    assert not any(m.body == b"held" for m in stolen), "the victim's messages were released by another user"
    for m in held:
        assert ack(stub, "Orders", "Billing", m.system_properties.receipt_handle, victim) == C.OK
    r = stub.NotifyClientTermination(svc.NotifyClientTerminationRequest(), metadata=victim, timeout=5)
    assert r.status.code == C.OK, "the owner may end its own client"
    for m in stolen:
        ack(stub, "Orders", "Billing", m.system_properties.receipt_handle, md("mallory", "msecret",
                                                                               client_id="mallory@1@1@x"))


def _settings(*topics):
    cmd = svc.TelemetryCommand()
    cmd.settings.client_type = pb.ClientType.PRODUCER
    cmd.settings.publishing.SetInParent()
    for t in topics:
        cmd.settings.publishing.topics.add().name = t
    return cmd


def _open_producer_stream(stub, meta, *topics):
    """A Telemetry stream that sends producer settings; returns (call, replies list filled by a thread)."""
    import threading
    stop = threading.Event()

    def commands():
        yield _settings(*topics)
        stop.wait(30)

    call = stub.Telemetry(commands(), metadata=meta, timeout=30)
    replies: list = []

    def read():
        try:
            for r in call:
                replies.append(r)
        except grpc.RpcError:
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return call, replies, stop


def test_settings_need_permission_on_every_declared_topic(stub):
    call, replies, stop = _open_producer_stream(stub, md("prod", "psecret", client_id="decl@1@1@x"),
                                                "Orders", "Secret")
    try:
        deadline = time.time() + 5
        while not replies and time.time() < deadline:
            time.sleep(0.05)
        assert replies and replies[0].status.code == C.FORBIDDEN and "Topic:Secret" in replies[0].status.message
    finally:
        stop.set()
        call.cancel()


def test_authentication_only_from_broker_conf(tmp_path):
    conf = {"authenticationEnabled": "true", "authConfigPath": str(tmp_path / "acl.json")}
    (tmp_path / "acl.json").write_text(json.dumps(ACL))
    with BrokerProcess(str(tmp_path / "store"), conf=conf) as b:
        ch = grpc.insecure_channel(b.endpoint)
        s = svc_grpc.MessagingServiceStub(ch)
        assert route(s, "Anything", md(None)) == C.UNAUTHORIZED
        assert route(s, "Anything", md("cons", "csecret")) == C.OK, "signed, and permissions are not checked"
        ch.close()


def test_transaction_checks_go_only_to_authorised_producers(stub):
    prod = md("prod", "psecret", client_id="txprod@1@1@x")
    r = send(stub, "Txn", b"half", prod, mtype=pb.MessageType.TRANSACTION)
    assert r.status.code == C.OK and r.entries[0].transaction_id
    # A producer of another user, not allowed to publish to Txn (it declares no topic: no settings refused).
    call, replies, stop = _open_producer_stream(stub, md("cons", "csecret", client_id="other@1@1@x"))
    try:
        time.sleep(2.5)  # several check rounds (transactionCheckInterval 500 ms)
        assert replies and replies[0].status.code == C.OK
        assert not any(x.HasField("recover_orphaned_transaction_command") for x in replies), \
            "a half message of Txn was shown to a producer not allowed to publish to it"
        # and a producer that may: gets it
        call2, replies2, stop2 = _open_producer_stream(stub, prod, "Txn")
        try:
            deadline = time.time() + 10
            while time.time() < deadline and not any(
                    x.HasField("recover_orphaned_transaction_command") for x in replies2):
                time.sleep(0.1)
            checks = [x for x in replies2 if x.HasField("recover_orphaned_transaction_command")]
            assert checks and checks[0].recover_orphaned_transaction_command.message.body == b"half"
            rec = checks[0].recover_orphaned_transaction_command
            end = svc.EndTransactionRequest()
            end.topic.name, end.message_id = "Orders", rec.message.system_properties.message_id
            end.transaction_id, end.resolution = rec.transaction_id, pb.TransactionResolution.ROLLBACK
            assert stub.EndTransaction(end, metadata=prod, timeout=5).status.code == C.INVALID_TRANSACTION_ID, \
                "a transaction may only be ended through its own topic"
            end.topic.name = "Txn"
            assert stub.EndTransaction(end, metadata=prod, timeout=5).status.code == C.OK
        finally:
            stop2.set()
            call2.cancel()
    finally:
        stop.set()
        call.cancel()


# ---------------------------------------------------------------- without --acl
def test_without_acl_namespaces_and_sealed_handles(tmp_path):
    with BrokerProcess(str(tmp_path / "store"), conf={"longPollingTimeout": 3000}) as b:
        ch = grpc.insecure_channel(b.endpoint)
        s = svc_grpc.MessagingServiceStub(ch)
        plain = [("x-mq-client-id", "plain@1@1@x")]
        assert send(s, "Shared", b"A", plain, ns="tenantA").status.code == C.OK
        assert send(s, "Shared", b"B", plain, ns="tenantB").status.code == C.OK
        assert send(s, "Shared", b"none", plain).status.code == C.OK
        code, got = receive(s, "Shared", "G", plain, ns="tenantB")
        assert [(m.body, m.topic.name, m.topic.resource_namespace) for m in got] == [(b"B", "Shared", "tenantB")]
        code, got_plain = receive(s, "Shared", "G", plain)
        assert [m.body for m in got_plain] == [b"none"]
        assert send(s, "Shared", b"x", plain, ns="bad%ns").status.code == C.BAD_REQUEST
        h = got[0].system_properties.receipt_handle
        assert len(h.rpartition("_")[2]) == 32
        a = svc.AckMessageRequest()
        a.group.name, a.group.resource_namespace = "G", "tenantB"
        a.topic.name, a.topic.resource_namespace = "Shared", "tenantB"
        a.entries.add(message_id="x", receipt_handle=h[:-1] + ("0" if h[-1] != "0" else "1"))
        assert s.AckMessage(a, metadata=plain, timeout=5).status.code == C.INVALID_RECEIPT_HANDLE
        a.entries[0].receipt_handle = h
        assert s.AckMessage(a, metadata=plain, timeout=5).status.code == C.OK
        ch.close()
    secret = os.path.join(str(tmp_path / "store"), "config", "receiptSecret")
    assert os.stat(secret).st_mode & 0o777 == 0o600


def test_the_documented_acl_file_loads():
    import re
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "broker.md"), encoding="utf-8").read()
    block = next(b for b in re.findall(r"```json\n(.*?)```", doc, re.S) if '"acls"' in b)
    ac = AccessControl(AclConfig.from_json(json.loads(block)))
    assert ac.allowed("orders-app", "Topic", "order-1", ["Pub"])
    assert not ac.allowed("orders-app", "Topic", "order-audit", ["Pub"])
    assert ac.allowed("billing", "Topic", "Orders", ["Sub"], "10.2.3.4")
    assert not ac.allowed("billing", "Topic", "Orders", ["Sub"], "192.168.0.1")
    assert ac.allowed("ops", "Group", "Anything", ["Sub"]) and not ac.allowed("retired", "Topic", "Orders", ["Pub"])


def test_client_owners_keep_live_clients_bound():
    from rocketstore.broker.clients import ClientOwners, ClientRegistry
    reg = ClientRegistry(60000)
    owners = ClientOwners(reg, capacity=3)
    assert owners.claim("victim", "cons") is None
    reg.touch("victim")
    for i in range(10):  # another user floods ids to push the victim's binding out
        assert owners.claim(f"flood-{i}", "mallory") is None
    assert owners.claim("victim", "mallory") == "cons"
    assert owners.claim("victim", "cons") is None
    assert owners.claim("flood-0", "bob") is None, "an old id of a client that is gone may be forgotten"
