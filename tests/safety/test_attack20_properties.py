"""attack20: a put whose properties hold RocketMQ's separators where a reader would split them differently.

The name check of f2817fe counted 0x01 against 0x02 and so missed a 0x02 that came with its own 0x01: a value
``"v\\x02x\\x01y"``, tags ``"a\\x02b\\x01c"`` or a name ``"a\\x01b\\x02c"`` kept the counts equal and the string in
the producers' shape, so the put was acknowledged and the record read back as other properties (another tag: a
tag filter then routed it to the wrong subscribers)."""

from __future__ import annotations

import pytest

from rocketstore import Message, MessageStore
from rocketstore.config import golden_config
from rocketstore.format.message import PutMessageStatus


@pytest.mark.parametrize("fields", [dict(properties={"k": "v\x02x\x01y"}),
                                    dict(properties={"a\x01b\x02c": "v"}),
                                    dict(tags="a\x02b\x01c"),
                                    dict(keys=["a\x02b\x01c"], properties={"z": "1"}),
                                    dict(tags="TagA", properties={"n": "1\x02TAGS\x01TagB"}),
                                    dict(properties={"k": "v\x02x\x01y", "none": None})])
def test_separators_that_keep_the_counts_even_are_refused(tmp_path, fields):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        before = store.max_phy_offset()
        r = store.put(Message("T", b"x", **fields))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "\\x0" in r.error, r
        r = store.put_batch([Message("T", b"ok"), Message("T", b"x", **fields)])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL, r
        assert store.max_phy_offset() == before


def test_values_with_the_name_separator_still_read_back_as_put(tmp_path):
    """What stays legal: 0x01 inside values (tags, keys and user properties), the TAGS/KEYS fields beside a
    properties map that names them too, a None value (skipped) beside them."""
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        for fields, want in ((dict(properties={"a": "b\x01c", "d": "e\x01\x01"}), {"a": "b\x01c", "d": "e\x01\x01"}),
                             (dict(tags="t\x01u", keys=["k\x01"]), {"TAGS": "t\x01u", "KEYS": "k\x01"}),
                             (dict(tags="T", properties={"TAGS": "T", "x": "1"}), {"TAGS": "T", "x": "1"}),
                             # None values are not written (Java's map skips nulls); other values as formatted
                             (dict(properties={"a": "1", "b": None}), {"a": "1"}),
                             (dict(properties={"a": "x\x01y", "b": None, "c": 5}), {"a": "x\x01y", "c": "5"})):
            r = store.put(Message("T", b"x", **fields))
            assert r.status is PutMessageStatus.PUT_OK, (fields, r)
            assert store.look(r.commit_log_offset).properties == want
