"""ConsumerOffsetManager on its own: commit, write, reopen; fastjson's unquoted keys read; bad entries
skipped (lenient) or refused (strict)."""

from __future__ import annotations

import json

import pytest

from rocketstore.errors import StoreLoadError
from rocketstore.storage.consumer_offsets import ConsumerOffsetManager, lowest_committed_offsets


def test_commit_write_reopen(tmp_path):
    m = ConsumerOffsetManager(str(tmp_path))
    assert m.table == {} and m.snapshot() is None
    m.commit("TopicA", "g1", 0, 12)
    m.commit("TopicA", "g1", 1, 7)
    m.commit("TopicA", "g2", 0, 3)
    snap = m.snapshot()
    assert snap["offsetTable"] == {"TopicA@g1": {"0": 12, "1": 7}, "TopicA@g2": {"0": 3}}
    assert snap["dataVersion"]["counter"] == 1
    m.write(snap)
    assert m.snapshot() is None  # nothing changed since
    m.commit("TopicA", "g1", 0, 12)
    assert m.snapshot() is None  # the same offset again is no change

    again = ConsumerOffsetManager(str(tmp_path))
    assert again.get("TopicA", "g1", 0) == 12 and again.get("TopicA", "g1", 1) == 7
    assert again.get("TopicA", "g1", 2) is None and again.version == 1
    assert lowest_committed_offsets(str(tmp_path)) == {("TopicA", 0): 3, ("TopicA", 1): 7}


def test_fastjson_unquoted_keys_are_read_and_kept_as_bak(tmp_path):
    text = '{"offsetTable":{"TopicA@g":{0:12,1:7}},"dataVersion":{"counter":4,"timestamp":1}}'
    (tmp_path / "consumerOffset.json").write_text(text)
    m = ConsumerOffsetManager(str(tmp_path))
    assert m.table == {"TopicA@g": {0: 12, 1: 7}} and m.version == 4
    m.commit("TopicA", "g", 0, 13)
    m.write(m.snapshot())
    assert (tmp_path / "consumerOffset.json.bak").read_text() == text  # RocketMQ's own file kept
    assert json.loads((tmp_path / "consumerOffset.json").read_text())["offsetTable"] == {"TopicA@g": {"0": 13, "1": 7}}


def test_bad_entries_skipped_leniently_and_refused_strictly(tmp_path):
    (tmp_path / "consumerOffset.json").write_text(json.dumps(
        {"offsetTable": {"TopicA@g": {"0": 5, "x": 1, "2": "7"}, "nogroup": {"0": 1}}}))
    problems: list[str] = []
    m = ConsumerOffsetManager(str(tmp_path), problems=problems)
    assert m.table == {"TopicA@g": {0: 5}}
    assert len(problems) == 3 and all("consumerOffset.json" in p for p in problems)
    with pytest.raises(StoreLoadError, match="nogroup|'x'"):
        ConsumerOffsetManager(str(tmp_path), strict=True)


def test_a_corrupt_file_falls_back_to_the_previous_write(tmp_path):
    m = ConsumerOffsetManager(str(tmp_path))
    m.commit("TopicA", "g", 0, 1)
    m.write(m.snapshot())
    m.commit("TopicA", "g", 0, 2)
    m.write(m.snapshot())  # the first write is now the .bak
    (tmp_path / "consumerOffset.json").write_bytes(b'{"offsetTable": {"TopicA@g": {"0"')  # torn
    assert ConsumerOffsetManager(str(tmp_path)).get("TopicA", "g", 0) == 1
