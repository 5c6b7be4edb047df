"""The generic event converter: nested records, enums, packed arrays, timestamps."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone

import numpy as np
import pytest

from reef_stream.core.errors import CorruptRecordError, InvalidRecord
from reef_stream.core.events import (
    Checkpoint, Decision, Generation, Metric, Publication, RolloutUnit, Sample,
    SamplingParams, TopicOffset, events_equal, from_avro, now_ms, to_avro,
)
from tests import factories

T0 = 1_732_885_200_123


def sample(**overrides) -> Sample:
    """The factory's sample (tests/factories.py) at policy version 3 with other tokens."""
    fields = dict(generation_id="gen-1", policy_version=3, prompt_token_ids=factories.ids([10, 11]),
                  completion_token_ids=factories.ids([12, 13, 14]),
                  completion_logprobs=factories.logprobs([-0.5, -0.25, -2.0]))
    fields.update(overrides)
    return factories.sample(**fields)


def generation(**overrides) -> Generation:
    """The factory's generation (tests/factories.py) at policy version 3 with other tokens."""
    fields = dict(generation_id="gen-1", request_id="req-1", policy_version=3, replica_id="r-0",
                  prompt_token_ids=factories.ids([10, 11]),
                  completion_token_ids=factories.ids([12]),
                  completion_logprobs=factories.logprobs([-0.5]),
                  sampling=SamplingParams(temperature=0.5, max_tokens=8), created_at=T0)
    fields.update(overrides)
    return factories.generation(**fields)


def test_nested_records_become_dicts_and_lists_and_come_back_as_dataclasses_and_tuples():
    checkpoint = Checkpoint(
        checkpoint_id="c-1",
        recipe="sao",
        trainer_group="trainer.sao",
        step=10,
        model="tiny",
        policy_version=4,
        uri="file:///tmp/c-1",
        sha256="ab" * 32,
        offsets=(TopicOffset(topic="u", partition=0, offset=7), TopicOffset(topic="u", partition=1, offset=9)),
        trained_unit_count=80,
        created_at=T0,
    )

    record = to_avro(checkpoint)

    assert record["offsets"] == [
        {"topic": "u", "partition": 0, "offset": 7},
        {"topic": "u", "partition": 1, "offset": 9},
    ]
    assert record["metrics"] == {}
    assert from_avro(Checkpoint, record) == checkpoint


def test_nested_records_holding_arrays_round_trip():
    unit = RolloutUnit(unit_id="u-1", recipe="sao", group_key="g", members=(sample(), sample(reward=0.0)), created_at=T0)

    record = to_avro(unit)

    assert record["members"][0]["completion_logprobs"] == np.array([-0.5, -0.25, -2.0], "<f4").tobytes()
    assert events_equal(from_avro(RolloutUnit, record), unit)


def test_enums_become_their_symbol_and_nullables_stay_null():
    publication = Publication(
        model="tiny",
        policy_version=2,
        checkpoint_id="c-2",
        uri="file:///tmp/c-2",
        sha256="00" * 32,
        decision=Decision.PROMOTED,
        reason="NOT EVALUATED: accept-everything default",
        evaluator="accept_all",
        evaluated=False,
        created_at=T0,
    )

    record = to_avro(publication)

    assert record["decision"] == "PROMOTED"
    assert record["incumbent_version"] is None
    assert from_avro(Publication, record).decision is Decision.PROMOTED
    assert to_avro(generation())["sampling"] == {
        "temperature": 0.5, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None,
    }
    assert to_avro(generation())["finish_reason"] == "STOP"


def test_an_enum_field_given_a_string_is_an_invalid_record():
    with pytest.raises(InvalidRecord) as raised:
        to_avro(generation(finish_reason="STOP"))
    assert raised.value.field == "finish_reason"


@pytest.mark.parametrize("length", [1, 2, 3, 5, 7])
def test_a_packed_field_of_partial_items_is_corrupt(length):
    record = to_avro(generation()) | {"prompt_token_ids": b"\x01" * length}

    with pytest.raises(CorruptRecordError, match=f"{length} bytes is not a whole number") as raised:
        from_avro(Generation, record)
    assert raised.value.field == "prompt_token_ids"


def test_a_packed_field_of_partial_items_is_corrupt_in_a_nested_record_too():
    record = to_avro(RolloutUnit(unit_id="u", recipe="r", group_key="g", members=(sample(),), created_at=T0))
    record["members"][0]["completion_logprobs"] += b"\x00"

    with pytest.raises(CorruptRecordError) as raised:
        from_avro(RolloutUnit, record)
    assert raised.value.field == "completion_logprobs"


def test_packed_fields_decode_as_read_only_views_of_the_record_bytes():
    record = to_avro(generation())

    decoded = from_avro(Generation, record)

    assert decoded.prompt_token_ids.base is record["prompt_token_ids"]
    assert decoded.prompt_token_ids.dtype == np.dtype("<i4")
    assert not decoded.prompt_token_ids.flags.writeable


@pytest.mark.parametrize(
    "token_ids, expected",
    [
        (np.array([1, 2, 3], dtype=np.int64), [1, 2, 3]),
        (np.array([1, 2, 3], dtype=">i4"), [1, 2, 3]),
        ([7, 8], [7, 8]),
        ([], []),
        (np.array([], dtype=np.float64), []),
    ],
)
def test_arrays_of_a_compatible_dtype_are_packed_as_the_field_dtype(token_ids, expected):
    record = to_avro(generation(completion_token_ids=token_ids))

    assert record["completion_token_ids"] == np.array(expected, dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "token_ids, problem",
    [
        (np.array([1.0, 2.0]), "cannot store float64 values as int32"),
        (np.array([[1, 2], [3, 4]], dtype=np.int32), "expected a 1-D array"),
        (np.int32(5), "expected a 1-D array"),
    ],
)
def test_arrays_that_cannot_be_packed_are_invalid_records(token_ids, problem):
    with pytest.raises(InvalidRecord, match=problem) as raised:
        to_avro(generation(completion_token_ids=token_ids))
    assert raised.value.field == "completion_token_ids"


def test_timestamps_come_back_as_integer_milliseconds():
    record = to_avro(Metric(stage="s", name="n", value=1.0, created_at=T0))
    assert record["created_at"] == T0

    as_fastavro_reads_it = record | {"created_at": datetime.fromtimestamp(T0 / 1000, tz=timezone.utc)}

    assert from_avro(Metric, as_fastavro_reads_it).created_at == T0
    assert from_avro(Metric, record).created_at == T0


def test_now_ms_is_the_current_time_in_milliseconds():
    assert abs(now_ms() - time.time() * 1000) < 1000


def test_maps_are_copied_so_events_never_share_one():
    shared = {}
    record = to_avro(Metric(stage="s", name="n", value=1.0, created_at=T0)) | {"labels": shared}

    assert from_avro(Metric, record).labels is not shared


def test_events_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        generation().policy_version = 4  # type: ignore[misc]


def test_events_equal_compares_arrays_by_dtype_and_content():
    assert events_equal(generation(), generation())
    assert not events_equal(generation(), generation(completion_logprobs=np.array([-0.25], dtype=np.float32)))
    assert not events_equal(generation(), generation(prompt_token_ids=np.array([10, 11], dtype=np.int64)))
    assert not events_equal(sample(), sample(reward=0.5))
    # Events holding arrays compare by identity with ==; events_equal is the way to compare them.
    assert generation() != generation()
