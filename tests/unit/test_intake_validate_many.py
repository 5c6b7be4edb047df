"""A batch is validated as each of its records is: the batch's vectorised array checks never
let through a record ``validate`` refuses, and the error names the record's index and field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Feedback
from reef_stream.intake.validation import InvalidRecordInBatch, validate, validate_many
from tests.faults.records import generation

FEEDBACK = Feedback(feedback_id="f1", generation_id="g1", source="judge", reward=1.0,
                    created_at=1_795_000_000_000)


def test_a_valid_batch_passes():
    validate_many([generation(i) for i in range(50)] + [FEEDBACK])
    validate_many([])
    validate_many([dataclasses.replace(generation(1), completion_token_ids=np.array([], np.int32),
                                       completion_logprobs=np.array([], np.float32)),
                   dataclasses.replace(generation(2), prompt_token_ids=np.array([5], np.int64),
                                       completion_logprobs=np.zeros(100, np.float64))])


@pytest.mark.parametrize("overrides, field", [
    ({"prompt_token_ids": np.array([1, -2], np.int32)}, "prompt_token_ids"),
    ({"completion_token_ids": np.full(100, -1, np.int32)}, "completion_token_ids"),
    ({"completion_token_ids": np.full(100, -2**31, np.int32)}, "completion_token_ids"),
    ({"completion_token_ids": np.r_[np.zeros(99, np.int32), np.int32(-1)]}, "completion_token_ids"),
    ({"completion_token_ids": np.full(100, 2**40, np.int64)}, "completion_token_ids"),
    ({"completion_logprobs": np.full(100, np.nan, np.float32)}, "completion_logprobs"),
    ({"completion_logprobs": np.full(100, -np.inf, np.float32)}, "completion_logprobs"),
    ({"completion_logprobs": np.full(100, np.inf, np.float32)}, "completion_logprobs"),
    ({"completion_logprobs": np.full(100, 0.5, np.float32)}, "completion_logprobs"),
    ({"completion_logprobs": np.full(100, np.nan, np.float64)}, "completion_logprobs"),
    ({"completion_logprobs": np.zeros(99, np.float32)}, "completion_logprobs"),
    ({"policy_version": -1}, "policy_version"),
    ({"model": ""}, "model"),
])
@pytest.mark.parametrize("index", [0, 7, 19])
def test_a_bad_record_is_named_by_its_index_and_field(overrides, field, index):
    batch = [generation(i) for i in range(20)]
    batch[index] = dataclasses.replace(batch[index], **overrides)
    with pytest.raises(InvalidRecord) as alone:
        validate(batch[index])
    with pytest.raises(InvalidRecordInBatch) as raised:
        validate_many(batch)
    error = raised.value
    assert (error.index, error.field) == (index, field)
    assert str(error) == f"field {field!r}: record {index} of the batch: {alone.value.reason}"
    assert isinstance(error, InvalidRecord) and error.error.reason == alone.value.reason


def test_the_first_bad_record_is_the_one_named():
    batch = [generation(i) for i in range(10)]
    batch[6] = dataclasses.replace(batch[6], model="")              # a field check
    batch[2] = dataclasses.replace(batch[2], completion_logprobs=np.full(100, 1.0, np.float32))
    with pytest.raises(InvalidRecordInBatch) as raised:
        validate_many(batch)
    assert raised.value.index == 2


def test_feedback_and_other_types_in_a_batch_are_checked():
    with pytest.raises(InvalidRecordInBatch, match="record 1 of the batch") as raised:
        validate_many([FEEDBACK, dataclasses.replace(FEEDBACK, reward=float("nan"))])
    assert raised.value.field == "reward"
    with pytest.raises(InvalidRecordInBatch, match="record 0 .*not str"):
        validate_many(["not a record"])


@pytest.mark.parametrize("size", [1, 4, 511, 512, 513, 5_000])
def test_int32_token_signs_are_checked_at_every_length(size):
    # Short arrays are checked on their sign bytes, long ones by a reduction: both see one
    # negative id anywhere, and pass every id from 0 to 2**31 - 1.
    rng = np.random.default_rng(size)
    ids = rng.integers(0, 2**31 - 1, size, dtype=np.int32)
    ids[0], ids[-1] = 0, 2**31 - 1
    validate(dataclasses.replace(generation(1), prompt_token_ids=ids))
    validate(dataclasses.replace(generation(1), prompt_token_ids=ids[::-1]))  # not contiguous
    for at in {0, size // 2, size - 1}:
        bad = ids.copy()
        bad[at] = -1 - int(rng.integers(0, 2**31 - 1))
        with pytest.raises(InvalidRecord, match="token ids are between 0"):
            validate(dataclasses.replace(generation(1), prompt_token_ids=bad))
