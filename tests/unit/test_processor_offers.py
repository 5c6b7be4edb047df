"""``decode_offers``: the records a pair lets through, decoded and validated as a batch, with
each bad one set aside in order, exactly as validating record by record would."""

from __future__ import annotations

import dataclasses

import numpy as np

from reef_stream.consumers.processor.offers import decode_offers
from reef_stream.core.errors import InvalidRecord
from reef_stream.core.serde import SchemaRegistry
from tests.integration.test_processor_runtime import feedback, generation

REGISTRY = SchemaRegistry.default()


class Message:
    def __init__(self, topic: str, offset: int, value: bytes, headers):
        self._topic, self._offset, self._value, self._headers = topic, offset, value, headers

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def headers(self):
        return self._headers


def _read(topic: str, offset: int, event) -> tuple[str, Message, int]:
    return topic, Message(topic, offset, *REGISTRY.encode(event)), 1_000 + offset


def test_valid_records_become_offers_in_order_with_their_bytes_and_origin():
    ready = [_read("g", 0, generation("a", "G", 2)), _read("f", 5, feedback("a", "G", 1.0)),
             _read("g", 1, generation("b", "G", 2))]
    positions, bad = {}, []
    offers = decode_offers(REGISTRY, "g", 3, ready, positions, bad)
    assert bad == [] and positions == {("g", 3): 2, ("f", 3): 6}
    assert [(type(r).__name__, at, origin.offset) for r, at, origin, _ in offers] == [
        ("Generation", 1_000, 0), ("Feedback", 1_005, 5), ("Generation", 1_001, 1)]
    assert offers[0][3].value == ready[0][1].value()


def test_an_invalid_and_an_undecodable_record_are_set_aside_in_order():
    nan = dataclasses.replace(generation("b", "G", 2),
                              completion_logprobs=np.full(200, np.nan, np.float32))
    topic, garbled, at = _read("g", 2, generation("c", "G", 2))
    garbled._value = garbled._value[:7]
    ready = [_read("g", 0, generation("a", "G", 2)), _read("g", 1, nan), (topic, garbled, at),
             _read("f", 0, feedback("a", "G", 1.0))]
    for only_invalid in (False, True):  # without the undecodable one: validate_many finds it
        records = [r for r in ready if not (only_invalid and r[1] is garbled)]
        positions, bad = {}, []
        offers = decode_offers(REGISTRY, "g", 0, records, positions, bad)
        assert [r.generation_id for r, *_ in offers] == ["a", "a"]
        assert [m.offset() for m, _ in bad] == ([1] if only_invalid else [1, 2])
        assert all(isinstance(error, InvalidRecord) for _, error in bad)
        assert "completion_logprobs" in str(bad[0][1]) or bad[0][1].field == "completion_logprobs"
        assert positions == {("g", 0): 3 if not only_invalid else 2, ("f", 0): 1}
