"""The record codec: Java hash, hosts, msgId, properties order, and encode/decode round trips."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import codec
from conftest import GOLDEN_NAMES, golden_expected


def test_java_hash_matches_golden_tags_codes():
    for name in GOLDEN_NAMES:
        for e in golden_expected(name):
            if e["cqUnit"]:
                assert codec.tags_code(e["tags"]) == e["cqUnit"]["tagsCode"]


@pytest.mark.parametrize("s, h", [("", 0), ("a", 97), ("TagA", 2598919), ("hello world", 1794106052),
                                  ("订单", 1129459), ("😀", 1772899)])
def test_java_hash_known_values(s, h):
    # Values printed by Java 17's String.hashCode; the emoji is a surrogate pair (two UTF-16 units).
    assert codec.java_hash(s) == h


def test_index_key_hash_min_value_maps_to_zero():
    # "polygenelubricants" hashes to Integer.MIN_VALUE in Java.
    assert codec.java_hash("polygenelubricants") == -2 ** 31
    assert codec.index_key_hash("polygenelubricants") == 0


def test_hosts_and_msg_id():
    assert codec.format_host(*codec.parse_host("127.0.0.1:10911")) == "127.0.0.1:10911"
    addr, port = codec.parse_host("[fe80:0:0:0:0:0:0:1]:50001")
    assert len(addr) == 16 and codec.format_host(addr, port) == "[fe80:0:0:0:0:0:0:1]:50001"
    assert codec.offset_msg_id(*codec.parse_host("127.0.0.1:10911"), 696) == "7F00000100002A9F00000000000002B8"
    assert len(codec.offset_msg_id(addr, port, 0)) == 56
    with pytest.raises(ValueError, match="bad host"):
        codec.parse_host("not-a-host")


def test_hashmap_order_reproduces_golden_property_strings():
    """Stored property order is Java HashMap(16) order: re-serialising the parsed map gives the same string."""
    checked = 0
    for name in GOLDEN_NAMES:
        for e in golden_expected(name):
            if e.get("note") == "batch" or e.get("batchSize"):
                continue
            props = codec.parse_properties(e["propertiesString"])
            assert codec.properties_to_string(props) == e["propertiesString"]
            checked += 1
    assert checked > 3000


def test_parse_properties_is_tolerant_like_java():
    assert codec.parse_properties("a\x01b\x02\x01x\x02c\x01\x02dd\x02e\x01f\x02a\x01z\x02") == {"a": "z", "e": "f"}


hosts = st.one_of(
    st.tuples(st.binary(min_size=4, max_size=4), st.integers(0, 65535)),
    st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 65535)))
prop_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02"),
                    min_size=1, max_size=20)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(topic=st.text(alphabet="abcXYZ_-%|0123456789", min_size=1, max_size=300),
       body=st.binary(max_size=2048), born=hosts, store=hosts,
       props=st.dictionaries(prop_text, prop_text, max_size=6),
       flag=st.integers(-2 ** 31, 2 ** 31 - 1), txn=st.sampled_from([0, 4, 8, 12]),
       qoff=st.integers(0, 2 ** 62), phy=st.integers(0, 2 ** 62), ts=st.integers(0, 2 ** 62))
def test_encode_decode_round_trip(topic, body, born, store, props, flag, txn, qoff, phy, ts):
    s = codec.properties_to_string(props)
    data = codec.encode_bytes(topic, body, queue_id=3, flag=flag, sys_flag=txn, born_timestamp=ts, born_host=born,
                              store_host=store, reconsume_times=2, prepared_transaction_offset=phy, properties=s,
                              queue_offset=qoff, physical_offset=phy, store_timestamp=ts + 1)
    size, msg, reason = codec.check(data, 0, len(data), check_crc=True, read_body=True)
    assert reason is None and size == len(data)
    assert msg.topic == topic and msg.body == body and msg.flag == flag
    assert msg.magic == (codec.MAGIC_V2 if len(topic) > 127 else codec.MAGIC_V1)
    assert (msg.born_addr, msg.born_port) == born and (msg.store_addr, msg.store_port) == store
    assert msg.sys_flag & 0xC == txn
    assert bool(msg.sys_flag & 0x10) == (len(born[0]) == 16) and bool(msg.sys_flag & 0x20) == (len(store[0]) == 16)
    assert (msg.queue_offset, msg.commit_log_offset, msg.store_timestamp) == (qoff, phy, ts + 1)
    assert msg.properties == props and msg.properties_string == s
    assert msg.body_crc == zlib.crc32(body) & 0x7FFFFFFF


@pytest.mark.parametrize("size", [0, 4 * 1024 * 1024])
def test_empty_and_4mib_bodies(size):
    body = bytes(range(256)) * (size // 256)
    data = codec.encode_bytes("T", body, properties="UNIQ_KEY\x01x\x02")
    msg = codec.decode(data, 0, len(data), check_crc=True)
    assert msg.body == body and msg.body_crc == (zlib.crc32(body) & 0x7FFFFFFF if body else 0)


def test_oversize_body_and_properties_refused():
    with pytest.raises(codec.MessageTooLarge):
        codec.encode("T", b"x" * 11, max_message_size=10)
    with pytest.raises(codec.PropertiesTooLarge):
        codec.encode("T", b"x", properties="k\x01" + "v" * 40000 + "\x02")


def test_corrupt_records_are_refused_with_reason():
    rec = codec.encode_bytes("T", b"hello", properties="a\x01b\x02")
    data = bytearray(rec)
    data[-2] ^= 0x20  # inside the properties: CRC does not cover them, length still fine
    assert codec.check(data, 0, len(data), check_crc=True)[0] == len(data)
    bad = bytearray(rec)
    bad[90] ^= 0xFF  # inside the body
    size, msg, reason = codec.check(bad, 0, len(bad), check_crc=True)
    assert size == -1 and msg is None and "CRC" in reason
    assert codec.check(bytes(8), 0, 8, check_crc=False)[2].startswith("bad magic")
    short = bytes(rec[:40])
    assert codec.check(short, 0, len(short), check_crc=False)[0] == -1
    blank = codec.blank_record(100)
    assert codec.check(blank + bytes(92), 0, 100, check_crc=False)[0] == 0
