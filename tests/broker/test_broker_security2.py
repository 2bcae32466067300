"""Broker security, second round (issue 26): EndTransaction through another topic, forged transaction ids,
request memory before authentication, acl.json hygiene and reload.

Raw gRPC: the official client never sends an empty topic, a guessed transaction id or an unsigned 9 MB frame.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone

import pytest

grpc = pytest.importorskip("grpc")

from rocketstore.bench.broker_harness import BrokerProcess  # noqa: E402
from rocketstore.broker.acl import sign  # noqa: E402
from rocketstore.broker.proto import pb, svc, svc_grpc  # noqa: E402

C = pb.Code

ACL = {
    "users": [
        {"username": "owner", "password": "osecret"},
        {"username": "mallory", "password": "msecret"},
    ],
    "acls": [
        {"subject": "User:owner", "policies": [
            {"resource": ["Topic:Secret"], "actions": ["Pub"], "decision": "Allow"}]},
        {"subject": "User:mallory", "policies": [
            {"resource": ["Topic:*"], "actions": ["Pub"], "decision": "Allow"},
            {"resource": ["Topic:Secret"], "actions": ["Pub"], "decision": "Deny"}]},
    ],
}


def md(ak: str | None, sk: str = "", client_id: str = "raw@1@1@x") -> list[tuple[str, str]]:
    dt = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = [("x-mq-client-id", client_id), ("x-mq-date-time", dt)]
    if ak is not None:
        out.append(("authorization", f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, "
                                     f"Signature={sign(sk, dt)}"))
    return out


def send_half(stub, topic: str, meta) -> tuple[str, str]:
    req = svc.SendMessageRequest()
    m = req.messages.add()
    m.topic.name, m.body = topic, b"owner's half"
    m.system_properties.message_id = uuid.uuid4().hex.upper()[:32]
    m.system_properties.body_encoding = pb.Encoding.IDENTITY
    m.system_properties.message_type = pb.MessageType.TRANSACTION
    r = stub.SendMessage(req, metadata=meta, timeout=5)
    assert r.status.code == C.OK, r.status
    return m.system_properties.message_id, r.entries[0].transaction_id


def end(stub, meta, topic: str, message_id: str, txid: str, resolution=pb.TransactionResolution.ROLLBACK):
    t = svc.EndTransactionRequest()
    t.topic.name, t.message_id, t.transaction_id, t.resolution = topic, message_id, txid, resolution
    return stub.EndTransaction(t, metadata=meta, timeout=5).status


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec2")
    path = root / "acl.json"
    path.write_text(json.dumps(ACL))
    os.chmod(path, 0o600)
    b = BrokerProcess(str(root / "store"), conf={"authConfigPath": str(path), "transactionTimeOut": 600000},
                      args=["--acl", "--topic", "Secret:1:TRANSACTION", "--topic", "Mine:1:TRANSACTION"])
    b.start()
    b.acl_path = str(path)
    yield b
    assert b.stop() == 0, b.tail_log()


@pytest.fixture(scope="module")
def stub(broker):
    ch = grpc.insecure_channel(broker.endpoint, options=[("grpc.max_send_message_length", -1)])
    yield svc_grpc.MessagingServiceStub(ch)
    ch.close()


# ---------------------------------------------------------------- point 1: EndTransaction
def test_end_transaction_cannot_bypass_the_topic_acl(stub):
    owner, mallory = md("owner", "osecret", "owner@1@1@x"), md("mallory", "msecret", "mal@1@1@x")
    msg_id, txid = send_half(stub, "Secret", owner)

    # Empty topic, empty message id: today the empty name matched Topic:* and nothing else was checked.
    for topic, mid in (("", ""), ("", msg_id), (" ", msg_id), ("bad name!", msg_id)):
        st = end(stub, mallory, topic, mid, txid)
        assert st.code == C.ILLEGAL_TOPIC, (topic, mid, st)
    st = end(stub, mallory, "Secret", msg_id, txid)
    assert st.code == C.FORBIDDEN, st
    plain = txid.split("_")[0]
    assert plain != txid and len(plain) in (32, 56), "the producer's transaction id carries a MAC"
    # A topic mallory may publish to: the id was sealed for Secret.
    for mid in ("", msg_id):
        st = end(stub, mallory, "Mine", mid, txid)
        assert st.code in (C.INVALID_TRANSACTION_ID,), st
    # Guessed / enumerated ids: the bare offset message id, or another MAC, of Mine or Secret.
    for forged in (plain, plain + "_" + "0" * 32, plain + "_", txid[:-1] + ("0" if txid[-1] != "0" else "1")):
        assert end(stub, mallory, "Mine", msg_id, forged).code == C.INVALID_TRANSACTION_ID, forged
        assert end(stub, owner, "Secret", msg_id, forged).code == C.INVALID_TRANSACTION_ID, forged
    # The owner with the wrong message id, or none, is refused too.
    assert end(stub, owner, "Secret", "", txid).code == C.INVALID_TRANSACTION_ID
    assert end(stub, owner, "Secret", "0" * 32, txid).code == C.INVALID_TRANSACTION_ID

    # Nothing above resolved it: the owner's commit does it now.
    st = end(stub, owner, "Secret", msg_id, txid, pb.TransactionResolution.COMMIT)
    assert st.code == C.OK and st.message == "committed", st
    assert end(stub, owner, "Secret", msg_id, txid).message == "already resolved"


def test_own_transaction_of_an_enumerating_user_still_works(stub):
    mallory = md("mallory", "msecret", "mal@1@1@x")
    msg_id, txid = send_half(stub, "Mine", mallory)
    st = end(stub, mallory, "Mine", msg_id, txid)
    assert st.code == C.OK and st.message == "rolled back", st
