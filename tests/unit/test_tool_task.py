"""The demo's tool task, pure: rollouts call the tool, get its output as environment tokens and
answer; the reward and the held-out accuracy read them; the Generation masks the tool's tokens."""

from __future__ import annotations

import numpy as np
import torch

from reef_stream.core.events import SegmentSource
from reef_stream.demo.task import Problem, make_generation, prompt_tensor
from reef_stream.demo.tool_task import (
    ADD, TOOL_GENERATION, UNKNOWN, sample_tool, tool_accuracy, tool_output, tool_policy_model,
    tool_reward,
)
from reef_stream.intake.validation import validate
from reef_stream.ops.trace import turn_links


def digits(text: str) -> list[int]:
    return [3 + int(d) for d in text]


def generation(problem: Problem, completion, logprobs=(-1.0, 0.0, 0.0, -1.0)):
    return make_generation(model="m", policy_version=0, replica_id="r", problem=problem,
                           token_ids=np.array(completion), logprobs=np.array(logprobs),
                           temperature=1.0, **TOOL_GENERATION)


def test_the_tool_adds_and_refuses_anything_else():
    assert tool_output(Problem(7, 5), ADD).tolist() == digits("12")
    assert tool_output(Problem(3, 4), ADD).tolist() == digits("07")
    assert tool_output(Problem(3, 4), 5).tolist() == [UNKNOWN, UNKNOWN]


def test_sampled_trajectories_carry_the_tools_output_with_no_logprob():
    torch.manual_seed(0)
    model = tool_policy_model()
    problems = [Problem(a, b) for a in range(10) for b in range(10)]
    completions = sample_tool(model, prompt_tensor(problems), temperature=1.0,
                              generator=torch.Generator().manual_seed(1))
    assert completions.token_ids.shape == completions.logprobs.shape == (100, 4)
    for problem, row in zip(problems, completions.token_ids):
        assert row[1:3].tolist() == tool_output(problem, int(row[0])).tolist()
    assert (completions.logprobs[:, 1:3] == 0).all()
    assert (completions.logprobs[:, [0, 3]] < 0).all()
    again = sample_tool(model, prompt_tensor(problems), temperature=1.0,
                        generator=torch.Generator().manual_seed(1))
    assert np.array_equal(again.token_ids, completions.token_ids)   # seeded


def test_the_reward_pays_for_the_call_and_for_the_answer_after_it():
    problem = Problem(7, 5)
    right = generation(problem, [ADD, *digits("12"), digits("2")[0]])
    wrong = generation(problem, [ADD, *digits("12"), digits("3")[0]])
    no_call = generation(problem, [5, UNKNOWN, UNKNOWN, digits("2")[0]])
    assert tool_reward(right).reward == 1.0
    assert tool_reward(right).components == {"tool_call": 1.0, "answer": 1.0}
    assert tool_reward(wrong).reward == 0.5
    assert tool_reward(no_call).reward == 0.0   # a right answer without the tool scores 0


def test_a_tool_trajectory_is_a_valid_multi_turn_generation_and_trace_shows_its_turns():
    g = generation(Problem(7, 5), [ADD, *digits("12"), digits("2")[0]], (-0.5, 0, 0, -0.25))
    validate(g)
    assert [s.source for s in g.segments] == [SegmentSource.POLICY, SegmentSource.ENVIRONMENT,
                                              SegmentSource.POLICY]
    assert g.policy_mask().tolist() == [1, 0, 0, 1]
    lines = [link.line() for link in turn_links(g)]
    assert lines[0].startswith("turn         1/3 assistant (policy, trained, mean logprob -0.500)")
    assert "2/3 tool:add (environment, masked): 2 tokens [4 5]" in lines[1]
    assert "3/3 assistant (policy, trained" in lines[2]


def test_untrained_the_policy_never_answers_through_the_tool():
    torch.manual_seed(0)
    assert tool_accuracy(tool_policy_model()) <= 0.01
