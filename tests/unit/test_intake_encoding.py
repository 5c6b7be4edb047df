"""The producer SDK's compiled Avro writer writes exactly the registry's bytes, or lets the
registry write them: every field kind, edge values, random events, and values it must hand on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reef_stream.errors import InvalidRecord
from reef_stream.intake.encoding import EventEncoder, _large_varint, _varint
from reef_stream.topics.events import (
    DeadLetter, Feedback, FinishReason, Generation, MessageHeader, SamplingParams,
)
from reef_stream.topics.serde import SchemaRegistry, decode
from tests.faults.records import generation

REGISTRY = SchemaRegistry.default()
ENCODER = EventEncoder(REGISTRY, (Generation, Feedback, DeadLetter))


def _same(event) -> None:
    assert ENCODER.encode(event) == REGISTRY.encode(event)


def test_generation_and_feedback_are_compiled_and_dead_letters_are_not():
    assert ENCODER.compiled(Generation) and ENCODER.compiled(Feedback)
    assert not ENCODER.compiled(DeadLetter)  # an array of records: the registry writes it
    assert ENCODER.source(Generation).startswith("def write_Generation(event, a):")
    assert ENCODER.source(DeadLetter) is None
    _same(DeadLetter(reason="r", error_type="E", source_topic="t", value=b"v",
                     headers=(MessageHeader(key="k", value=b"x"),), stage="s", created_at=1))


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
        value, headers = ENCODER.encode(event)
        assert (value, headers) == REGISTRY.encode(event)
        assert decode(value, headers, Generation).policy_version == event.policy_version


def test_values_that_do_not_fit_get_the_registrys_error():
    with pytest.raises(InvalidRecord, match="Generation"):
        ENCODER.encode(dataclasses.replace(generation(1), model="\ud800"))   # not UTF-8
    with pytest.raises(InvalidRecord):
        ENCODER.encode(dataclasses.replace(generation(1), policy_version=2**64))
    with pytest.raises(InvalidRecord):
        ENCODER.encode(dataclasses.replace(generation(1), finish_reason="STOP"))


def test_the_two_level_varint_table_matches_the_plain_loop():
    rng = np.random.default_rng(1)
    for zigzag in [*range(0, 1 << 17), 2**64 - 1, 2**63, *map(int, rng.integers(0, 2**63, 10_000))]:
        assert _large_varint(zigzag) == _varint(zigzag)


def test_ordinary_records_do_not_go_through_the_registry():
    class Refusing(SchemaRegistry):
        def encode(self, event):
            raise AssertionError("the registry was asked to encode an ordinary record")

    encoder = EventEncoder(Refusing(), (Generation, Feedback))
    assert encoder.encode(generation(5)) == REGISTRY.encode(generation(5))
    feedback = Feedback(feedback_id="f", generation_id="g", source="s", reward=0.5,
                        components={"a": 1.0}, created_at=1_795_000_000_000)
    assert encoder.encode(feedback) == REGISTRY.encode(feedback)
