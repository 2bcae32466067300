"""The record codec: Java hash, hosts, msgId, properties order, and encode/decode round trips."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore.format import codec
from conftest import GOLDEN_NAMES, golden_expected, golden_store


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
# (no zero byte: the put path refuses one, as recovery after a power loss would take it for a torn write)
prop_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\x01\x02"),
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


def unit_of(buf: bytes, pos: int, size: int, read_body: bool = True) -> codec.MessageExt | None:
    """decode_unit with the claims a consume-queue unit of the record at ``pos`` makes (topic, queue id and
    queue offset as decode reads them; a record that does not decode gets topic T, queue 0, offset 0)."""
    try:
        m = codec.decode(buf, pos, len(buf), read_body=False)
        topic, qid, qoff = m.topic, m.queue_id, m.queue_offset
    except codec.RecordError:
        topic, qid, qoff = "T", 0, 0
    return codec.decode_unit(buf, pos, size, read_body, topic, topic.encode(), qid, qoff)


def test_decode_unit_equals_decode_on_every_golden_record():
    """The consume path's inline decoder builds exactly what decode builds: V1 and V2, IPv4 and IPv6 hosts,
    batches and transaction halves, with and without the body; a unit of the wrong size is refused."""
    seen = 0
    for name in GOLDEN_NAMES:
        for seg in sorted((golden_store(name) / "commitlog").iterdir()):
            data = seg.read_bytes()
            for pos, size, parsed, _ in codec.walk(data, 0, len(data), check_crc=False, parsed=True):
                if parsed is None:
                    continue
                for read_body in (True, False):
                    want = codec.decode(data, pos, pos + size, read_body=read_body)
                    got = unit_of(data, pos, size, read_body)
                    assert got == want and got.to_json() == want.to_json()
                    assert type(got.body) is (bytes if read_body else type(None))
                assert unit_of(data, pos, size - 1) is None
                assert unit_of(data, pos, size + 1) is None
                seen += 1
    assert seen > 3000


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(topic=st.text(alphabet="abcXYZ_-", min_size=1, max_size=200), body=st.binary(max_size=300),
       born=hosts, props=st.dictionaries(prop_text, prop_text, max_size=3), data=st.data())
def test_decode_unit_agrees_with_decode_on_damaged_records(topic, body, born, props, data):
    """Whatever the bytes, decode_unit returns decode's message (body CRC checked), or None where decode raises
    or the record is not the one the unit claims."""
    rec = bytearray(codec.encode_bytes(topic, body, born_host=born, properties=codec.properties_to_string(props)))
    n = len(rec)
    msg = codec.decode(bytes(rec), 0, n)
    hs = n - len(body) - (2 if msg.magic == codec.MAGIC_V2 else 1) - len(topic.encode()) - 2 \
        - len(msg.properties_string.encode())
    tail = hs + len(body)  # topic length, topic, properties length, properties
    fields = [*range(8), *range(36, 40), *range(hs - 4, hs), *range(tail, n)]
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.sampled_from(fields) | st.integers(0, n - 1))
        rec[at] = data.draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]) | st.integers(0, 255))
    buf = bytes(rec) + bytes(data.draw(st.integers(0, 4)))
    size = n + data.draw(st.integers(-3, 3))
    try:
        want = codec.decode(buf, 0, size, check_crc=True)
        if (want.size, want.topic, want.queue_id, want.queue_offset) != (size, topic, 0, 0):
            want = None  # not the record the unit claims
    except codec.RecordError:
        want = None
    assert codec.decode_unit(buf, 0, size, True, topic, topic.encode(), 0, 0) == want


def _crafted_v1(body: bytes, tail: bytes, *, body_len: int | None = None, prepared: int = 0) -> bytes:
    """A V1 IPv4 record with a raw tail (topic length, topic, properties length, properties) and an optional
    BODYLENGTH that lies; TOTALSIZE is the real length, so only the field checks can refuse it."""
    rec = bytearray(codec.encode_bytes("T", body, prepared_transaction_offset=prepared))
    hs = len(rec) - len(body) - 4  # the tail of topic "T" without properties is 4 bytes
    out = rec[:hs] + body + tail
    out[0:4] = struct.pack(">i", len(out))
    if body_len is not None:
        out[hs - 4:hs] = struct.pack(">i", body_len)
    return bytes(out)


def test_decode_unit_refuses_negative_lengths_that_add_up():
    """Lengths with the sign bit set that still sum to TOTALSIZE: decode refuses them, so must decode_unit;
    text that is not UTF-8 it decodes as decode does."""
    topic_200 = _crafted_v1(b"body", bytes([200]) + b"t" * 200 + b"\x00\x04a\x01b\x02")  # topic length -56
    props_neg = _crafted_v1(b"body", b"\x01T" + b"\x80\x00" + b"p" * 0x8000)  # properties length -32768
    # BODYLENGTH -8 puts the "topic length" inside PREPARED TRANSACTION OFFSET, which spells a consistent tail
    props_len = 8 + 4 - 3  # from the fake properties length field to the record's end
    neg_body = _crafted_v1(b"", b"\x01T\x00\x00", body_len=-8, prepared=int.from_bytes(
        bytes([0, 0, 0, 0, 0, props_len >> 8, props_len & 0xFF, 0]), "big"))
    bad_total = bytearray(_crafted_v1(b"body", b"\x01T\x00\x00"))
    bad_total[3] -= 1  # TOTALSIZE one short of the fields (and of the unit's size)
    for rec in (topic_200, props_neg, neg_body, bytes(bad_total)):
        with pytest.raises(codec.RecordError):
            codec.decode(rec, 0, len(rec))
        assert unit_of(rec, 0, len(rec)) is None
    # a BODYLENGTH so negative that the topic length's index wraps to the buffer's end, where a consistent
    # tail waits (the bytes past a record are another record's, or zeros)
    rec = _crafted_v1(b"body", b"\x01T\x00\x00")
    size, k = len(rec), 10
    hs = size - 8
    pl = size + k - 3
    buf = bytearray(rec + bytes(200))
    buf[-k:-k + 3] = bytes([0, pl >> 8, pl & 0xFF])
    buf[hs - 4:hs] = struct.pack(">i", -k - hs)  # the topic length byte at buf[-k]
    with pytest.raises(codec.RecordError):
        codec.decode(bytes(buf), 0, size)
    assert unit_of(bytes(buf), 0, size) is None
    # a V2 record whose topic length (0x0001), topic ("A") and properties length read as a V1 tail add up
    v2 = bytearray(_crafted_v1(b"body", b"\x00\x01A" + struct.pack(">h", 319) + b"p" * 319))
    v2[4:8] = struct.pack(">I", codec.MAGIC_V2)
    want = codec.decode(bytes(v2), 0, len(v2))
    assert want.topic == "A" and want.properties_string == "p" * 319
    assert unit_of(bytes(v2), 0, len(v2)) == want
    # invalid UTF-8 (a lone byte, a surrogate) is not an error: both decoders put in replacement characters
    for tail in (b"\x02\xffT\x00\x04a\x01b\x02", b"\x01T\x00\x06a\x01\xed\xa0\x80\x02"):
        bad_utf8 = _crafted_v1(b"body", tail)
        want = codec.decode(bad_utf8, 0, len(bad_utf8))
        assert "\ufffd" in want.topic + want.properties_string
        assert unit_of(bad_utf8, 0, len(bad_utf8)) == want


def test_decode_unit_reads_an_ipv6_record_as_ipv6_even_when_ipv4_offsets_look_consistent():
    """Read with the IPv4 layout, RECONSUMETIMES of an IPv6-born record sits where BODYLENGTH would be; a value
    that points at the real tail must still not make decode_unit take the record for an IPv4 one."""
    widen = codec.record_length(0, 0, 0, codec.SYSFLAG_BORNHOST_V6, False) - codec.record_length(0, 0, 0, 0, False)
    body = b"body"
    rec = codec.encode_bytes("T", body, born_host=(bytes(range(16)), 7), reconsume_times=widen + len(body),
                             properties="a\x01b\x02")
    want = codec.decode(rec, 0, len(rec))
    assert want.body == body and want.born_host.startswith("[")
    assert unit_of(rec, 0, len(rec)) == want
