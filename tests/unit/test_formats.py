"""The intake's wire formats: native events and OpenAI-style responses, and every way to get them wrong."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import FinishReason, SamplingParams
from reef_stream.intake.formats import (
    OpenAIDefaults, parse_feedback, parse_generations, parse_record, parse_sampling,
)

DEFAULTS = OpenAIDefaults(policy_version=7, replica_id="old-fleet",
                          sampling=SamplingParams(temperature=0.7, max_tokens=64))


def native_generation(**overrides) -> dict:
    record = {
        "generation_id": "g-1", "request_id": "r-1", "prompt_id": "p-1", "model": "tiny",
        "policy_version": 3, "replica_id": "replica-a", "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5], "completion_logprobs": [-0.5, -1.25],
        "finish_reason": "stop", "sampling": {"temperature": 0.8, "max_tokens": 16},
    }
    record.update(overrides)
    return record


def completion_response(n: int = 1) -> dict:
    """A vLLM /v1/completions response: ids in choices[].token_ids and choices[].prompt_token_ids."""
    return {
        "id": "cmpl-abc", "object": "text_completion", "created": 1_795_000_000, "model": "Qwen",
        "choices": [{
            "index": i, "text": " four", "finish_reason": "length" if i else "stop",
            "prompt_token_ids": [10, 11, 12], "token_ids": [20 + i, 30 + i],
            "logprobs": {"tokens": [" fo", "ur"], "token_logprobs": [-0.25, -0.5 - i],
                         "top_logprobs": None, "text_offset": [0, 3]},
        } for i in range(n)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n},
    }


def chat_response() -> dict:
    """A vLLM chat completion with return_tokens_as_token_ids: tokens read "token_id:N"."""
    return {
        "id": "chatcmpl-xyz", "object": "chat.completion", "created": 1_795_000_001,
        "model": "Qwen", "prompt_token_ids": [1, 2],
        "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Hi!"},
            "logprobs": {"content": [
                {"token": "token_id:9707", "logprob": -0.125, "bytes": [72, 105], "top_logprobs": []},
                {"token": "token_id:0", "logprob": -0.75, "bytes": [33], "top_logprobs": []},
            ]},
        }],
    }


def field_of(error: pytest.ExceptionInfo) -> str | None:
    return error.value.field


# --------------------------------------------------------------------------- valid input


def test_a_native_generation_becomes_the_event_with_its_defaults():
    (generation,) = parse_generations(native_generation(finish_reason="LENGTH",
                                                        created_at=1_795_000_000_000))
    assert generation.generation_id == "g-1" and generation.policy_version == 3
    assert generation.group_id is None and generation.group_size == 1 and generation.metadata == {}
    assert generation.prompt_token_ids.dtype == np.int32
    assert generation.prompt_token_ids.tolist() == [1, 2, 3]
    assert generation.completion_logprobs.dtype == np.float32
    assert generation.completion_logprobs.tolist() == [-0.5, -1.25]
    assert generation.finish_reason is FinishReason.LENGTH
    assert generation.sampling == SamplingParams(temperature=0.8, top_p=1.0, top_k=-1,
                                                 max_tokens=16, seed=None)
    assert generation.created_at == 1_795_000_000_000


def test_a_native_generation_without_created_at_is_stamped_now():
    (generation,) = parse_generations(native_generation(group_id="grp", group_size=4,
                                                        metadata={"dataset": "gsm8k"}))
    assert generation.created_at > 1_700_000_000_000
    assert (generation.group_id, generation.group_size) == ("grp", 4)
    assert generation.metadata == {"dataset": "gsm8k"}


def test_native_feedback_gets_a_deterministic_id():
    record = {"generation_id": "g-1", "group_id": "grp", "source": "exact_match", "reward": 1,
              "components": {"format": 0.25}}
    first, second = parse_feedback(record), parse_feedback(dict(record))
    assert first.feedback_id == second.feedback_id == "g-1:exact_match"
    assert first.reward == 1.0 and isinstance(first.reward, float)
    assert first.components == {"format": 0.25} and first.group_id == "grp"
    assert parse_feedback({**record, "feedback_id": "mine"}).feedback_id == "mine"
    assert parse_record("feedback", record)[0].feedback_id == "g-1:exact_match"


def test_a_completion_response_with_token_ids_becomes_one_generation():
    (generation,) = parse_generations(completion_response(), DEFAULTS)
    assert generation.generation_id == "cmpl-abc:0" and generation.request_id == "cmpl-abc"
    assert generation.group_id is None and generation.group_size == 1
    assert generation.model == "Qwen"  # no --model: the response's
    assert (generation.policy_version, generation.replica_id) == (7, "old-fleet")
    assert generation.sampling == DEFAULTS.sampling
    assert generation.prompt_token_ids.tolist() == [10, 11, 12]
    assert generation.completion_token_ids.tolist() == [20, 30]
    assert generation.completion_logprobs.tolist() == [-0.25, -0.5]
    assert generation.finish_reason is FinishReason.STOP
    assert generation.created_at == 1_795_000_000_000
    assert generation.prompt_id.startswith("sha256:")


def test_token_id_strings_stand_in_for_token_ids():
    response = completion_response()
    choice = response["choices"][0]
    del choice["token_ids"]
    choice["logprobs"]["tokens"] = ["token_id:20", "token_id:30"]
    (generation,) = parse_generations(response, DEFAULTS)
    assert generation.completion_token_ids.tolist() == [20, 30]


def test_a_chat_completion_with_token_ids_becomes_a_generation():
    (generation,) = parse_generations(chat_response(), DEFAULTS)
    assert generation.generation_id == "chatcmpl-xyz:0"
    assert generation.prompt_token_ids.tolist() == [1, 2]  # the response's prompt_token_ids
    assert generation.completion_token_ids.tolist() == [9707, 0]
    assert generation.completion_logprobs.tolist() == [-0.125, -0.75]


def test_n_choices_become_n_generations_of_one_group():
    generations = parse_generations(completion_response(n=3), DEFAULTS)
    assert [g.generation_id for g in generations] == ["cmpl-abc:0", "cmpl-abc:1", "cmpl-abc:2"]
    assert {(g.group_id, g.group_size) for g in generations} == {("cmpl-abc", 3)}
    assert [g.finish_reason for g in generations] == [FinishReason.STOP, FinishReason.LENGTH,
                                                      FinishReason.LENGTH]
    assert len({g.prompt_id for g in generations}) == 1


def test_the_envelope_wins_over_defaults_and_the_response():
    envelope = {"policy_version": 12, "replica_id": "replica-b", "model": "family",
                "prompt_id": "p-9", "request_id": "req-9", "group_id": "grp-9", "group_size": 8,
                "prompt_token_ids": [5, 6], "sampling": {"max_tokens": 128, "seed": 3},
                "metadata": {"k": "v"}}
    (generation,) = parse_generations({"reef": envelope, "response": completion_response()},
                                      OpenAIDefaults(model="cli-model"))
    assert (generation.policy_version, generation.replica_id, generation.model) == (
        12, "replica-b", "family")
    assert (generation.prompt_id, generation.request_id) == ("p-9", "req-9")
    assert (generation.group_id, generation.group_size) == ("grp-9", 8)
    assert generation.prompt_token_ids.tolist() == [5, 6]
    assert generation.sampling == SamplingParams(max_tokens=128, seed=3)
    assert generation.metadata == {"k": "v"}


def test_json_nan_is_parsed_by_python_and_rejected_as_a_reward():
    record = json.loads('{"generation_id": "g", "source": "s", "reward": NaN}')
    with pytest.raises(InvalidRecord) as error:
        parse_feedback(record)
    assert field_of(error) == "reward" and "finite" in str(error.value)


# --------------------------------------------------------------------------- invalid input


def without(record: dict, name: str) -> dict:
    return {key: value for key, value in record.items() if key != name}


@pytest.mark.parametrize("record, field, words", [
    (without(native_generation(), "policy_version"), "policy_version", "is missing"),
    (without(native_generation(), "sampling"), "sampling", "is missing"),
    (native_generation(sampling={"temperature": 1.0}), "sampling.max_tokens", "is missing"),
    (native_generation(policy_version="3"), "policy_version", "must be an integer"),
    (native_generation(policy_version=True), "policy_version", "must be an integer"),
    (native_generation(generation_id=17), "generation_id", "must be a string"),
    (native_generation(prompt_token_ids="1 2 3"), "prompt_token_ids", "must be a JSON list"),
    (native_generation(completion_token_ids=[4, 5.5]), "completion_token_ids", "item 1 is 5.5"),
    (native_generation(completion_token_ids=[4, -1]), "completion_token_ids", "item 1 is -1"),
    (native_generation(completion_token_ids=[4, 2**31]), "completion_token_ids", "item 1"),
    (native_generation(completion_token_ids=[4, True]), "completion_token_ids", "item 1 is True"),
    (native_generation(completion_logprobs=[-0.5, 10**400]), "completion_logprobs", "item 1"),
    (native_generation(completion_logprobs=[-0.5, None]), "completion_logprobs", "item 1 is None"),
    (native_generation(completion_logprobs=[-0.5, float("nan")]), "completion_logprobs",
     "finite"),
    (native_generation(completion_logprobs=[-0.5]), "completion_logprobs",
     "1 values for 2 completion tokens"),
    (native_generation(completion_logprobs=[-0.5, 0.5]), "completion_logprobs", "positive"),
    (native_generation(finish_reason="done"), "finish_reason", "use one of stop"),
    (native_generation(group_size=4), "group_id", "no group_id"),
    (native_generation(metadata={"n": 1}), "metadata.n", "must be a string"),
    (native_generation(created_at=1.5e12), "created_at", "must be an integer"),
    (native_generation(polciy_version=3), "polciy_version", "not a field here"),
    (native_generation(sampling={"max_tokens": 4, "temp": 1}), "sampling.temp", "not a field"),
])
def test_an_invalid_native_generation_names_its_field(record, field, words):
    with pytest.raises(InvalidRecord) as error:
        parse_generations(record)
    assert field_of(error) == field
    assert words in str(error.value)


@pytest.mark.parametrize("record, field, words", [
    ({"source": "s", "reward": 1.0}, "generation_id", "is missing"),
    ({"generation_id": "g", "source": "s", "reward": "high"}, "reward", "must be a number"),
    ({"generation_id": "g", "source": "s", "reward": float("inf")}, "reward", "finite"),
    ({"generation_id": "g", "source": "s", "reward": 1.0, "components": {"a": float("nan")}},
     "components.a", "finite"),
    ({"generation_id": "g", "source": "s", "reward": 1.0, "components": [1]}, "components",
     "must be a JSON object"),
    ({"generation_id": "g", "source": "", "reward": 1.0}, "source", "is empty"),
    ({"generation_id": "g", "source": "s", "reward": 1.0, "score": 2}, "score", "not a field"),
])
def test_invalid_feedback_names_its_field(record, field, words):
    with pytest.raises(InvalidRecord) as error:
        parse_feedback(record)
    assert field_of(error) == field
    assert words in str(error.value)


def test_a_record_that_is_not_an_object_is_invalid():
    with pytest.raises(InvalidRecord, match="must be a JSON object, not a list"):
        parse_generations([native_generation()])
    with pytest.raises(InvalidRecord, match="must be a JSON object"):
        parse_feedback("reward: 1")


def openai_case(change) -> dict:
    response = completion_response(n=2)
    change(response)
    return response


def strings_only(response: dict) -> None:
    del response["choices"][1]["token_ids"]  # tokens are " fo", "ur": strings, as OpenAI sends


@pytest.mark.parametrize("response, field, words", [
    (openai_case(strings_only), "choices[1].logprobs.tokens", "enable return_tokens_as_token_ids"),
    (openai_case(lambda r: r["choices"][0].update(logprobs=None)), "choices[0].logprobs",
     "logprobs are required"),
    (openai_case(lambda r: r["choices"][0]["logprobs"].update(token_logprobs=[-0.1])),
     "choices[0].logprobs", "1 logprobs for 2 completion token ids"),
    (openai_case(lambda r: r["choices"][0]["logprobs"].update(token_logprobs=[None, -0.1])),
     "choices[0].logprobs.token_logprobs", "item 0 is None"),
    (openai_case(lambda r: [c.pop("prompt_token_ids") for c in r["choices"]]),
     "choices[0].prompt_token_ids", "prompt token ids are required"),
    (openai_case(lambda r: r["choices"][1].update(finish_reason=None)),
     "choices[1].finish_reason", "stream chunk"),
    (openai_case(lambda r: r["choices"][1].update(index=0)), "choices[1].index", "earlier choice"),
    (openai_case(lambda r: r.update(object="text_completion.chunk")), "object", "accepted"),
    (openai_case(lambda r: r.update(choices=[])), "choices", "at least one choice"),
    (openai_case(lambda r: r.pop("id")), "id", "is missing"),
])
def test_an_invalid_openai_response_names_its_field(response, field, words):
    with pytest.raises(InvalidRecord) as error:
        parse_generations(response, DEFAULTS)
    assert field_of(error) == field
    assert words in str(error.value)


def test_a_chat_response_with_token_strings_is_refused_with_what_to_enable():
    response = chat_response()
    response["choices"][0]["logprobs"]["content"][1]["token"] = "!"
    with pytest.raises(InvalidRecord) as error:
        parse_generations(response, DEFAULTS)
    assert field_of(error) == "choices[0].logprobs.content[].token"
    assert "token ids are required" in str(error.value)


@pytest.mark.parametrize("missing, option", [
    ("policy_version", "--policy-version"), ("replica_id", "--replica-id"),
    ("sampling", "--sampling")])
def test_what_a_response_lacks_is_required_from_envelope_or_defaults(missing, option):
    defaults = dataclasses.replace(DEFAULTS, **{missing: None})
    with pytest.raises(InvalidRecord) as error:
        parse_generations(completion_response(), defaults)
    assert field_of(error) == f"reef.{missing}"
    assert option in str(error.value)


def test_the_envelope_is_checked_too():
    with pytest.raises(InvalidRecord) as error:
        parse_generations({"reef": {"policy_versoin": 1}, "response": completion_response()})
    assert field_of(error) == "reef.policy_versoin"
    with pytest.raises(InvalidRecord) as error:
        parse_generations({"reef": {"policy_version": -1}, "response": completion_response()},
                          DEFAULTS)
    assert field_of(error) == "policy_version"  # validation names the event's field
    with pytest.raises(InvalidRecord) as error:
        parse_generations({"reef": {}, "response": completion_response(), "extra": 1}, DEFAULTS)
    assert field_of(error) == "extra"
    with pytest.raises(InvalidRecord) as error:
        parse_generations({"response": {"id": "x", "object": "text_completion", "choices": [7]}})
    assert field_of(error) == "response.choices[0]"


def test_sampling_options_are_parsed_like_the_native_field():
    assert parse_sampling({"max_tokens": 3}, "--sampling") == SamplingParams(max_tokens=3)
    with pytest.raises(InvalidRecord) as error:
        parse_sampling({"temperature": 0.5}, "--sampling")
    assert field_of(error) == "--sampling.max_tokens"
