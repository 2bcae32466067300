"""What a new user passes wrong through the Python API: refused with the package's errors, naming what."""

from __future__ import annotations

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.config import golden_config
from rocketstore.errors import ConfigError, StoreLoadError
from rocketstore.format.message import PutMessageStatus


@pytest.mark.parametrize("read_only", [False, True])
def test_opening_a_file_as_a_store_says_it_is_not_a_directory(tmp_path, read_only):
    f = tmp_path / "store"
    f.write_bytes(b"not a store")
    with pytest.raises(StoreLoadError, match="not a directory") as e:
        MessageStore.open(str(f), read_only=read_only)
    assert str(f) in str(e.value) and f.read_bytes() == b"not a store"


@pytest.mark.parametrize("key,value,want", [("mappedFileSizeCommitLog", "1048576", "int"),
                                            ("maxMessageSize", True, "int"),
                                            ("messageIndexEnable", "false", "bool"),
                                            ("flushDiskType", 1, "str")])
def test_a_storeconfig_field_of_the_wrong_type_is_a_config_error_naming_it(key, value, want):
    with pytest.raises(ConfigError, match=f"{key}=.*expected {want}"):
        StoreConfig(**{key: value})


def test_a_property_name_holding_the_name_value_separator_is_refused(tmp_path):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        before = store.max_phy_offset()
        for m in (Message("T", b"x", properties={"a\x01": "b"}),
                  Message("T", b"x", tags="TagA", keys=["k"], properties={"city\x01x": "Berlin"})):
            r = store.put(m)
            assert r.status is PutMessageStatus.MESSAGE_ILLEGAL and "\\x01" in r.error, r
            r = store.put_batch([Message("T", b"ok"), m])
            assert r.status is PutMessageStatus.MESSAGE_ILLEGAL, r
        assert store.max_phy_offset() == before
        r = store.put(Message("T", b"x", properties={"a": "b\x01c", "d": "e"}))  # a value may hold it
        assert r.status is PutMessageStatus.PUT_OK
        assert store.look(r.commit_log_offset).properties == {"a": "b\x01c", "d": "e"}


def test_reads_of_a_closed_store_say_it_is_closed(tmp_path):
    from rocketstore.errors import StoreClosedError
    store = MessageStore.open(str(tmp_path / "s"), golden_config())
    r = store.put(Message("T", b"x", keys=["k"]))
    store.wait_dispatched()
    store.close()
    for read in (lambda: store.look(r.commit_log_offset), lambda: store.query("T", "k"),
                 lambda: store.offset_by_time("T", 0, 0), lambda: store.get("T", 0, 0)):
        with pytest.raises(StoreClosedError, match="closed"):
            read()


def test_offset_by_time_refuses_an_unknown_boundary():
    from conftest import golden_store
    from rocketstore.errors import StoreError
    with MessageStore.open(str(golden_store("basic")), read_only=True) as store:
        assert store.offset_by_time("TopicA", 0, 0, "lower") == 0
        with pytest.raises(StoreError, match="boundary 'middle'"):
            store.offset_by_time("TopicA", 0, 0, "middle")


@pytest.mark.parametrize("field,value", [("flag", 2 ** 40), ("sys_flag", 2 ** 33), ("reconsume_times", -2 ** 40),
                                         ("born_timestamp", 2 ** 70), ("store_timestamp", 2 ** 64),
                                         ("prepared_transaction_offset", 2 ** 63), ("flag", "3"),
                                         ("born_host", "1.2.3.4:99999999999")])
def test_a_header_field_out_of_its_range_is_message_illegal_naming_it(tmp_path, field, value):
    with MessageStore.open(str(tmp_path / "s"), golden_config()) as store:
        r = store.put(Message("T", b"x", **{field: value}))
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL, r
        assert (field if field != "born_host" else "born_port") in r.error, r.error
        r = store.put_batch([Message("T", b"a"), Message("T", b"x", **{field: value})])
        assert r.status is PutMessageStatus.MESSAGE_ILLEGAL, r
        r = store.put(Message("T", b"ok", flag=-1, prepared_transaction_offset=2 ** 63 - 1))  # in range: stored
        assert r.status is PutMessageStatus.PUT_OK and r.queue_offset == 0 and r.commit_log_offset == 0


@pytest.mark.parametrize("field,value", [("from_time", "2026-11-22T00:00:00Z"), ("to_time", 1.5e12),
                                         ("from_offset", "0"), ("max_messages", True)])
def test_a_selection_field_that_is_not_an_int_is_refused_naming_it(field, value):
    from rocketstore.errors import StoreError
    from rocketstore.selection import Selection
    with pytest.raises(StoreError, match=f"Selection {field}="):
        Selection(topic="TopicA", **{field: value})
    assert Selection(topic="TopicA", from_time=0, to_time=2 ** 62, max_messages=1).max_messages == 1
