"""The one DeadLetter builder: every field of a letter, computed by hand for each way a stage
calls it (a consumed message kept whole, a record the stage re-encoded, an intake line)."""

from __future__ import annotations

import pytest

from reef_stream.core.events import DeadLetter, MessageHeader
from reef_stream.topics.dead_letters import dead_letter, headers_of


class _Message:
    """What confluent-kafka's Message offers a dead letter (the accessors, nothing else)."""

    def __init__(self, topic, partition, offset, key, value, headers):
        self._fields = (topic, partition, offset, key, value, headers)

    def topic(self): return self._fields[0]
    def partition(self): return self._fields[1]
    def offset(self): return self._fields[2]
    def key(self): return self._fields[3]
    def value(self): return self._fields[4]
    def headers(self): return self._fields[5]


def test_a_consumed_message_is_kept_whole():
    message = _Message("ns.units.sao", 3, 41, b"u-1", b"\x00\x01", [("reef.fp", b"ab"), ("x", None)])
    letter = dead_letter("undecodable unit: boom", "InvalidRecord", stage="trainer",
                         message=message, created_at=1_700_000_000_000)
    assert letter == DeadLetter(
        reason="undecodable unit: boom", error_type="InvalidRecord", source_topic="ns.units.sao",
        source_partition=3, source_offset=41, key=b"u-1", value=b"\x00\x01",
        headers=(MessageHeader(key="reef.fp", value=b"ab"), MessageHeader(key="x", value=None)),
        stage="trainer", created_at=1_700_000_000_000)


def test_a_message_without_headers_or_value_a_tombstone():
    letter = dead_letter("r", "E", stage="evaluator", message=_Message("t", 0, 0, None, None, None))
    assert (letter.key, letter.value, letter.headers) == (None, None, ())
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("t", 0, 0)
    assert letter.created_at > 1_600_000_000_000  # now, in epoch milliseconds


def test_the_caller_overrides_what_the_message_carries():
    message = _Message("ns.generations", 1, 7, b"old", b"old-value", [("h", b"1")])
    letter = dead_letter("r", "processor.expired", stage="processor", message=message,
                         key=b"g-9", value=b"re-encoded", headers=[("reef.fp", b"cd")],
                         created_at=5)
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == \
        ("ns.generations", 1, 7)
    assert (letter.key, letter.value) == (b"g-9", b"re-encoded")
    assert letter.headers == (MessageHeader(key="reef.fp", value=b"cd"),)
    # a None override is kept as None, not replaced by the message's own bytes
    assert dead_letter("r", "E", stage="s", message=message, value=None).value is None


def test_a_record_by_its_coordinates():
    letter = dead_letter("generation g-1 expired: no feedback", "processor.expired",
                         stage="processor", topic="ns.generations", partition=2, offset=99,
                         key=b"g-1", value=b"v", headers=[MessageHeader(key="a", value=b"b")],
                         created_at=12)
    assert letter == DeadLetter(
        reason="generation g-1 expired: no feedback", error_type="processor.expired",
        source_topic="ns.generations", source_partition=2, source_offset=99, key=b"g-1",
        value=b"v", headers=(MessageHeader(key="a", value=b"b"),), stage="processor",
        created_at=12)


def test_an_intake_line_has_no_partition_and_its_line_number_as_offset():
    letter = dead_letter("line 4: not JSON: x", "JSONDecodeError", stage="import",
                         topic="records.jsonl", offset=4, value=b"{oops", created_at=3)
    assert letter == DeadLetter(
        reason="line 4: not JSON: x", error_type="JSONDecodeError", source_topic="records.jsonl",
        source_partition=None, source_offset=4, key=None, value=b"{oops", headers=(),
        stage="import", created_at=3)


def test_a_letter_needs_a_source():
    with pytest.raises(ValueError, match="source"):
        dead_letter("r", "E", stage="s")


def test_headers_of_takes_pairs_records_or_nothing():
    assert headers_of(None) == ()
    assert headers_of([("a", b"1"), MessageHeader(key="b", value=None)]) == (
        MessageHeader(key="a", value=b"1"), MessageHeader(key="b", value=None))
