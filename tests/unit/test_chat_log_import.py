"""Importing OpenAI-style multi-turn chat logs with tool calls (``reef produce``, the HTTP
intake): assistant turns become POLICY segments with their token ids and logprobs, tool and user
turns ENVIRONMENT segments; bad input is an InvalidRecord naming the field. Also the SDK's
validation of a Generation's segments."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Segment, SegmentSource
from reef_stream.intake.formats import parse_generations, parse_record
from reef_stream.intake.validation import validate

POLICY, ENVIRONMENT = SegmentSource.POLICY, SegmentSource.ENVIRONMENT


def chat_log() -> dict:
    return {
        "reef": {"policy_version": 3, "replica_id": "agent-a", "group_id": "grp-1",
                 "group_size": 2, "sampling": {"max_tokens": 64, "temperature": 0.7}},
        "id": "conv-7", "model": "qwen-7b", "created": 1795000000, "finish_reason": "stop",
        "tools": [{"type": "function", "function": {"name": "add"}}],
        "messages": [
            {"role": "system", "content": "You add.", "token_ids": [100, 101]},
            {"role": "user", "content": "17+25?", "token_ids": [102, 103, 104]},
            {"role": "assistant", "content": None, "token_ids": [200, 201, 202],
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "add", "arguments": "{\"a\":17,\"b\":25}"}}],
             "logprobs": {"content": [{"token": "token_id:200", "logprob": -0.1},
                                      {"token": "token_id:201", "logprob": -0.2},
                                      {"token": "token_id:202", "logprob": -0.3}]}},
            {"role": "tool", "name": "add", "tool_call_id": "c1", "content": "42",
             "token_ids": [300, 301]},
            {"role": "assistant", "content": "42",
             "logprobs": {"content": [{"token": "token_id:400", "logprob": -0.4},
                                      {"token": "token_id:401", "logprob": 0.0}]}},
        ],
    }


def test_a_chat_log_becomes_one_generation_with_its_turns():
    (generation,) = parse_record("generations", chat_log())

    assert generation.generation_id == "conv-7" and generation.request_id == "conv-7"
    assert generation.prompt_token_ids.tolist() == [100, 101, 102, 103, 104]
    assert generation.completion_token_ids.tolist() == [200, 201, 202, 300, 301, 400, 401]
    assert generation.completion_logprobs.tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, 0, 0, -0.4, 0.0])
    assert generation.segments == (Segment(source=POLICY, length=3, role="assistant"),
                                   Segment(source=ENVIRONMENT, length=2, role="tool:add"),
                                   Segment(source=POLICY, length=2, role="assistant"))
    assert generation.policy_mask().tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert (generation.policy_version, generation.replica_id, generation.model) == (
        3, "agent-a", "qwen-7b")
    assert (generation.group_id, generation.group_size) == ("grp-1", 2)
    assert generation.sampling.temperature == 0.7 and generation.created_at == 1795000000000
    assert generation.prompt_id.startswith("sha256:")


def test_one_assistant_turn_is_an_ordinary_single_turn_generation():
    log = chat_log()
    log["messages"] = log["messages"][:3]
    log["messages"][2]["logprobs"] = [-0.1, -0.2, -0.3]   # a plain list is accepted too
    (generation,) = parse_generations(log)
    assert generation.segments == ()
    assert generation.completion_token_ids.tolist() == [200, 201, 202]


def test_a_user_turn_after_the_first_answer_is_an_environment_segment():
    log = chat_log()
    log["messages"].append({"role": "user", "content": "thanks", "token_ids": [500]})
    (generation,) = parse_generations(log)
    assert [(s.source, s.role) for s in generation.segments][-1] == (ENVIRONMENT, "user")
    assert generation.policy_mask().tolist()[-1] == 0


def test_the_envelopes_prompt_token_ids_stand_for_the_prompt_messages():
    log = chat_log()
    log["reef"]["prompt_token_ids"] = [9, 9]
    for message in log["messages"][:2]:
        del message["token_ids"]
    (generation,) = parse_generations(log)
    assert generation.prompt_token_ids.tolist() == [9, 9]


def broken(path: str, value=None, *, delete: bool = False) -> dict:
    log = copy.deepcopy(chat_log())
    *parents, last = path.split(".")
    node = log
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if delete:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return log


@pytest.mark.parametrize(("log", "field", "words"), [
    (broken("messages.3.token_ids", delete=True), "messages[3].token_ids", "missing"),
    (broken("messages.4.logprobs", delete=True), "messages[4].logprobs", "required"),
    (broken("messages.4.logprobs.content.0.token", "4"), "messages[4].logprobs.content[].token",
     "token strings"),
    (broken("messages.2.token_ids", [200, 201]), "messages[2].logprobs", "3 logprobs for 2"),
    (broken("messages.2.logprobs.content.1.logprob", 0.5), "messages[2].logprobs", "positive"),
    (broken("messages.1.token_ids", delete=True), "messages[1].token_ids", "missing"),
    (broken("messages.3.role", 7), "messages[3].role", "string"),
    (broken("messages", [{"role": "user", "token_ids": [1]}]), "messages", "no assistant"),
    (broken("id", delete=True), "id", "missing"),
    (broken("finish_reason", "tired"), "finish_reason", "accepted"),
    (broken("reef.policy_version", delete=True), "reef.policy_version", "--policy-version"),
    (broken("messsages", []), "messsages", "not a field"),
    (broken("messages.3.token_ids", [300, -1]), "messages[3].token_ids", "item 1"),
])
def test_bad_chat_logs_name_the_field(log, field, words):
    with pytest.raises(InvalidRecord) as error:
        parse_generations(log)
    assert error.value.field == field
    assert words in str(error.value)


def valid_multi_turn():
    (generation,) = parse_generations(chat_log())
    return generation


@pytest.mark.parametrize(("change", "field", "words"), [
    (dict(segments=(Segment(source=POLICY, length=3), Segment(source=ENVIRONMENT, length=2))),
     "segments", "add up to 5 tokens, but the completion has 7"),
    (dict(segments=(Segment(source=ENVIRONMENT, length=7),),
          completion_logprobs=np.zeros(7, dtype=np.float32)), "segments", "no POLICY segment"),
    (dict(segments=(Segment(source=POLICY, length=0), Segment(source=POLICY, length=7))),
     "segments", "segment 0's length is 0"),
    (dict(segments=(Segment(source="POLICY", length=7),)), "segments", "SegmentSource"),
    (dict(completion_logprobs=np.array([-0.1, -0.2, -0.3, -1, 0, -0.4, 0], dtype=np.float32)),
     "completion_logprobs", "environment segment 1"),
])
def test_validation_rejects_segments_that_do_not_fit(change, field, words):
    with pytest.raises(InvalidRecord) as error:
        validate(dataclasses.replace(valid_multi_turn(), **change))
    assert error.value.field == field
    assert words in str(error.value)
