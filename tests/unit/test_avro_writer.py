"""SchemaRegistry.encode's compiled Avro writers (reef_stream.core.avro_writer) write exactly
fastavro's bytes, or let fastavro write them: every event type, every field kind, edge values,
random events, and values they must hand on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reef_stream.core.avro_writer import _large_varint, _varint, compile_writer
from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import (
    EVENT_TYPES, DeadLetter, Feedback, FinishReason, Generation, MessageHeader, SamplingParams,
)
from reef_stream.core.serde import SchemaRegistry, decode
from tests.faults.records import generation
from tests.unit.random_events import RandomEvents

REGISTRY = SchemaRegistry.default()
#: The reference: to_avro and fastavro's schemaless_writer for every event.
REFERENCE = SchemaRegistry(compiled=False)


def _outcome(registry: SchemaRegistry, event):
    try:
        return registry.encode(event)
    except Exception as error:  # noqa: BLE001 - the error is part of the outcome
        return type(error), str(error)


def _same(event) -> None:
    """The compiled path gives what the reference gives: the same bytes, or the same error."""
    assert _outcome(REGISTRY, event) == _outcome(REFERENCE, event)


def test_every_event_type_is_compiled():
    for cls in EVENT_TYPES.values():
        assert REGISTRY.writer_source(cls).startswith(f"def write_{cls.__name__}(event, a):")
        assert REFERENCE.writer_source(cls) is None
    _same(DeadLetter(reason="r", error_type="E", source_topic="t", value=b"v",
                     headers=(MessageHeader(key="k", value=b"x"),), stage="s", created_at=1))


def test_a_schema_construct_it_does_not_know_is_not_compiled():
    known = REGISTRY.current(Generation.SCHEMA).parsed
    other_union = {**known, "fields": [{"name": "group_id", "type": ["null", "string", "long"]}]}
    assert compile_writer(other_union, Generation) is None
    assert compile_writer(REGISTRY.current(Feedback.SCHEMA).parsed, Generation) is None


@pytest.mark.parametrize("cls", list(EVENT_TYPES.values()), ids=lambda cls: cls.__name__)
def test_random_events_of_every_type_are_written_as_fastavro_writes_them(cls):
    events = RandomEvents(hash(cls.__name__) % 1000)
    for _ in range(200):
        _same(events.of(cls))


def test_units_and_dead_letters_with_lists_or_foreign_items_are_handed_on():
    unit = RandomEvents(3).unit()
    _same(dataclasses.replace(unit, members=list(unit.members)))   # a list: to_avro converts it
    _same(dataclasses.replace(unit, members=("not a sample",)))     # to_avro's TypeError
    letter = RandomEvents(4).dead_letter()
    _same(dataclasses.replace(letter, headers=[MessageHeader(key="k", value=None)]))
    _same(dataclasses.replace(letter, source_partition=2**31))      # past int: InvalidRecord


@pytest.mark.parametrize("overrides", [
    {},
    {"group_id": "grp-1", "group_size": 8},
    {"metadata": {"dataset": "gsm8k", "clé": "välue ✓", "": ""}},
    {"model": "模型-7b", "replica_id": "r" * 20_000},                  # length beyond the table
    {"policy_version": 0}, {"policy_version": 2**63 - 1}, {"created_at": 0},
    {"created_at": 253_402_300_799_999},
    {"completion_token_ids": np.array([], np.int32), "completion_logprobs": np.array([], np.float32)},
    {"completion_token_ids": np.arange(5_000, dtype=np.int32),         # 20 KB: a long length
     "completion_logprobs": -np.ones(5_000, np.float32)},
    {"completion_token_ids": np.arange(20, dtype=np.int32)[::2],      # not contiguous
     "completion_logprobs": -np.ones(20, np.float32)[::2]},
    {"completion_token_ids": np.array([1, 2], ">i4"),                  # other byte order: handed on
     "completion_logprobs": np.array([-1, -2], np.float64)},          # other dtype: handed on
    {"prompt_token_ids": np.array([7, 8], np.int64)},
    {"finish_reason": FinishReason.UNKNOWN},
    {"sampling": SamplingParams(temperature=0, top_p=0.5, top_k=-1, max_tokens=2**31 - 1,
                                seed=-(2**63))},
    {"sampling": SamplingParams(temperature=np.float64(0.7), max_tokens=np.int64(5), seed=2**40)},
    {"policy_version": np.int64(12), "group_size": True, "group_id": "g"},   # handed on
])
def test_generations_are_written_as_the_registry_writes_them(overrides):
    _same(dataclasses.replace(generation(3), **overrides))


@pytest.mark.parametrize("overrides", [
    {}, {"group_id": "grp"}, {"reward": 0}, {"reward": -1e300}, {"reward": np.float32(0.25)},
    {"components": {"format": 0.2, "correct": 1, "ünï": -0.0}},
    {"created_at": 2**40}, {"source": "judge:gpt ✓"},
])
def test_feedback_is_written_as_the_registry_writes_it(overrides):
    fields = dict(feedback_id="f1", generation_id="g1", source="exact_match", reward=1.0,
                  created_at=1_795_000_000_000)
    _same(Feedback(**{**fields, **overrides}))


def test_random_generations_round_trip_byte_for_byte():
    rng = np.random.default_rng(7)
    for i in range(300):
        completion = int(rng.integers(0, 3_000))
        event = dataclasses.replace(
            generation(i),
            policy_version=int(rng.integers(0, 2**62)),
            created_at=int(rng.integers(0, 2**47)),
            group_id=None if i % 3 else f"grp-{i}", group_size=1 if i % 3 else int(rng.integers(1, 64)),
            completion_token_ids=rng.integers(0, 2**31 - 1, completion, dtype=np.int32),
            completion_logprobs=-rng.random(completion, dtype=np.float32),
            sampling=SamplingParams(temperature=float(rng.random()), top_k=int(rng.integers(-1, 100)),
                                    max_tokens=int(rng.integers(0, 2**31 - 1)),
                                    seed=None if i % 2 else int(rng.integers(-(2**63), 2**63 - 1))))
        value, headers = REGISTRY.encode(event)
        assert (value, headers) == REFERENCE.encode(event)
        assert decode(value, headers, Generation).policy_version == event.policy_version


def test_values_that_do_not_fit_get_the_registrys_error():
    with pytest.raises(InvalidRecord, match="Generation"):
        REGISTRY.encode(dataclasses.replace(generation(1), model="\ud800"))   # not UTF-8
    with pytest.raises(InvalidRecord):
        REGISTRY.encode(dataclasses.replace(generation(1), policy_version=2**64))
    with pytest.raises(InvalidRecord):
        REGISTRY.encode(dataclasses.replace(generation(1), finish_reason="STOP"))


def test_the_two_level_varint_table_matches_the_plain_loop():
    rng = np.random.default_rng(1)
    for zigzag in [*range(0, 1 << 17), 2**64 - 1, 2**63, *map(int, rng.integers(0, 2**63, 10_000))]:
        assert _large_varint(zigzag) == _varint(zigzag)


def test_ordinary_records_do_not_go_through_fastavro(monkeypatch):
    from reef_stream.core import serde

    def refuse(*args, **kwargs):
        raise AssertionError("fastavro was asked to encode an ordinary record")

    expected = [REFERENCE.encode(generation(5)), REFERENCE.encode(RandomEvents(5).unit())]
    monkeypatch.setattr(serde, "schemaless_writer", refuse)
    assert [REGISTRY.encode(generation(5)), REGISTRY.encode(RandomEvents(5).unit())] == expected
