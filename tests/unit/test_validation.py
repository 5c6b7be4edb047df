"""Validation at the edge: each kind of invalid record gets its own error naming the field."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Feedback, SamplingParams
from reef_stream.intake.validation import check_size, validate
from tests import factories

#: this file's generation and feedback: the factories' (tests/factories.py) with short ids, policy
#: version 3, top_k 0; feedback from ``exact_match`` with a ``correct`` component
generation = partial(factories.generation, generation_id="g1", request_id="r1", prompt_id="p1",
                     policy_version=3, sampling=SamplingParams(top_k=0, max_tokens=16))


def feedback(**overrides) -> Feedback:
    fields = dict(generation_id="g1", feedback_id="f1", source="exact_match",
                  components={"correct": 1.0})
    fields.update(overrides)
    return factories.feedback(**fields)


def test_valid_records_pass():
    validate(generation())
    validate(generation(group_id="grp", group_size=4))
    validate(feedback())
    validate(generation(completion_token_ids=np.array([], np.int32),
                        completion_logprobs=np.array([], np.float32)))


@pytest.mark.parametrize("overrides, field, words", [
    ({"generation_id": ""}, "generation_id", "is empty"),
    ({"model": None}, "model", "must be a string"),
    ({"policy_version": -1}, "policy_version", "at least 0"),
    ({"policy_version": 2.5}, "policy_version", "must be an integer"),
    ({"group_size": 4}, "group_id", "no group_id"),
    ({"group_size": 0, "group_id": "g"}, "group_size", "at least 1"),
    ({"completion_logprobs": np.array([-0.5], np.float32)}, "completion_logprobs",
     "1 values for 2 completion tokens"),
    ({"completion_logprobs": np.array([-0.5, np.nan], np.float32)}, "completion_logprobs",
     "NaN or infinite values (first at index 1)"),
    ({"completion_logprobs": np.array([-np.inf, -1], np.float32)}, "completion_logprobs", "infinite"),
    ({"completion_logprobs": np.array([0.5, -1], np.float32)}, "completion_logprobs", "positive"),
    ({"completion_token_ids": np.array([4, -5], np.int64)}, "completion_token_ids", "token ids are"),
    ({"completion_token_ids": np.array([4, 2**40], np.int64)}, "completion_token_ids", "token ids are"),
    ({"completion_token_ids": [4, 5]}, "completion_token_ids", "numpy array"),
    ({"completion_token_ids": np.array([[4, 5]], np.int32)}, "completion_token_ids", "one-dimensional"),
    ({"completion_token_ids": np.array([4.0, 5.0])}, "completion_token_ids", "dtype float64"),
    ({"prompt_token_ids": np.array([], np.int32)}, "prompt_token_ids", "at least one prompt token"),
    ({"finish_reason": "stop"}, "finish_reason", "FinishReason"),
    ({"sampling": SamplingParams(temperature=float("nan"), top_p=1.0, top_k=0, max_tokens=1)},
     "sampling.temperature", "finite number"),
    ({"sampling": SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=-1)},
     "sampling.max_tokens", "at least 0"),
    ({"metadata": {"k": 1}}, "metadata", "string to a string"),
])
def test_invalid_generations_name_the_field_and_the_problem(overrides, field, words):
    with pytest.raises(InvalidRecord) as caught:
        validate(generation(**overrides))
    assert caught.value.field == field
    assert words in caught.value.reason


@pytest.mark.parametrize("overrides, field, words", [
    ({"reward": float("nan")}, "reward", "must be finite"),
    ({"reward": float("inf")}, "reward", "must be finite"),
    ({"reward": "1.0"}, "reward", "must be a number"),
    ({"reward": True}, "reward", "must be a number"),
    ({"components": {"x": float("-inf")}}, "components.x", "must be finite"),
    ({"components": {"": 1.0}}, "components", "non-empty"),
    ({"source": " "}, "source", "is empty"),
    ({"generation_id": 7}, "generation_id", "must be a string"),
])
def test_invalid_feedback_names_the_field_and_the_problem(overrides, field, words):
    with pytest.raises(InvalidRecord) as caught:
        validate(feedback(**overrides))
    assert caught.value.field == field
    assert words in caught.value.reason


def test_records_over_the_topic_limit_are_refused_with_both_sizes():
    with pytest.raises(InvalidRecord, match=r"is 1\d\d\d bytes encoded; topic t accepts at most 1024"):
        check_size("t", b"key", b"v" * 1000, [("h", b"x")], limit=1024)
    check_size("t", b"key", b"v" * 100, [], limit=1024)


def test_other_event_types_are_refused():
    from reef_stream.core.events import Metric

    with pytest.raises(InvalidRecord, match="not Metric"):
        validate(Metric(stage="s", name="n", value=1.0, labels={}, created_at=0))


def test_validation_does_not_change_the_record():
    record = generation()
    copy = dataclasses.replace(record)
    validate(record)
    assert record.completion_token_ids is copy.completion_token_ids
