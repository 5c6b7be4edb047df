"""The demo's second toy task: a tool call, the tool's output, then the answer (multi-turn).

The prompt is the arithmetic task's ``<bos>a+b=`` (``reef_stream.demo.task``). A trajectory has
three turns after it, one completion of four tokens:

1. the policy calls a tool: one token, ``add`` (the tool adds the prompt's two operands); any
   other token is not a tool this environment has;
2. the environment answers with the tool's output, two tokens: the sum's two digits
   (``7+5=`` -> ``12``, ``3+4=`` -> ``07``), or ``??`` when the call was not ``add``. These are
   ENVIRONMENT tokens: in the model's input, never trained (their logprobs are 0 and the
   ``Generation``'s ``segments`` mask them);
3. the policy answers: one token, the last digit of the sum.

``<bos>7+5=`` ``add`` | ``1`` ``2`` | ``2``. The reward (``tool_answer``) is 0.5 for calling the
tool and 0.5 more for then answering right (an answer without the call scores 0: the task is to
use the tool). The candidate evaluator measures held-out accuracy: the share of the 100 problems
a greedy rollout (call, tool, answer) answers right after calling the tool. A policy that
guesses scores about 0.004; one that has learned to call and to read the tool's output 1.0.

    completions = sample_tool(policy, prompt_tensor(batch), temperature=1.0, generator=g)
    generation = make_generation(..., token_ids=completions.token_ids[0],
                                 logprobs=completions.logprobs[0], segments=TOOL_SEGMENTS, ...)
    tool_reward(generation)                           # Reward(1.0), (0.5) or (0.0)
    tool_accuracy(policy)                             # greedy rollouts, in [0, 1]

The vocabulary is the arithmetic task's plus ``add`` and ``?``, so the policy
(``tool_policy_model``) is the same small transformer with two more token ids. Pure and
deterministic on a CPU, like ``reef_stream.demo.task``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from reef_stream.api.recipe import Reward
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import FinishReason, Generation, Segment, SegmentSource
from reef_stream.demo.task import (
    DIGIT_TOKENS, VOCABULARY, Completions, Problem, TinyTransformer, held_out_problems,
    parse_prompt, prompt_tensor,
)

__all__ = ["ADD", "COMPLETION_TOKENS", "TOOL_GENERATION", "TOOL_SEGMENTS", "TOOL_VOCABULARY", "TOOL_VOCAB_SIZE",
           "UNKNOWN", "ToolAnswer", "greedy_tool", "sample_tool", "tool_accuracy",
           "tool_output", "tool_policy_model", "tool_reward"]

#: The arithmetic task's tokens, then the tool's name and the unknown-tool mark.
TOOL_VOCABULARY: tuple[str, ...] = (*VOCABULARY, "add", "?")
TOOL_VOCAB_SIZE = len(TOOL_VOCABULARY)
ADD, UNKNOWN = TOOL_VOCAB_SIZE - 2, TOOL_VOCAB_SIZE - 1
#: call (1) + tool output (2) + answer (1).
COMPLETION_TOKENS = 4
#: The turns of every trajectory of this task, as a Generation's ``segments``.
TOOL_SEGMENTS: tuple[Segment, ...] = (
    Segment(source=SegmentSource.POLICY, length=1, role="assistant"),
    Segment(source=SegmentSource.ENVIRONMENT, length=2, role="tool:add"),
    Segment(source=SegmentSource.POLICY, length=1, role="assistant"),
)


def tool_policy_model() -> TinyTransformer:
    """The demo's transformer (``reef_stream.demo.task.policy_model``'s sizes) over this task's
    vocabulary. Seed torch first for reproducible weights."""
    return TinyTransformer(vocab_size=TOOL_VOCAB_SIZE, dim=64, layers=2, heads=4, max_len=16,
                           init_std=0.1, logit_cap=3.0)


def tool_output(problem: Problem, call: int) -> np.ndarray:
    """``int32[2]``: what the environment returns for the policy's ``call`` token: the digits of
    ``a + b`` for ``add``, ``??`` for anything else."""
    if call != ADD:
        return np.array([UNKNOWN, UNKNOWN], dtype=np.int32)
    total = problem.a + problem.b
    return np.array([DIGIT_TOKENS[total // 10], DIGIT_TOKENS[total % 10]], dtype=np.int32)


def _last_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        return model(ids, torch.ones_like(ids, dtype=torch.bool))[:, -1].float().cpu()


def _rollout(model: nn.Module, prompts: torch.Tensor, pick) -> Completions:
    """Call, run the tool, answer: ``pick(logits) -> (tokens long[B], logprobs float[B])``."""
    problems = [parse_prompt(row) for row in prompts.tolist()]
    calls, call_logprobs = pick(_last_logits(model, prompts))
    outputs = np.stack([tool_output(p, int(c)) for p, c in zip(problems, calls.tolist())])
    so_far = torch.cat([prompts, calls[:, None], torch.from_numpy(outputs).long()], dim=1)
    answers, answer_logprobs = pick(_last_logits(model, so_far))
    zeros = np.zeros(len(problems), dtype=np.float32)
    token_ids = np.column_stack([calls.numpy(), outputs, answers.numpy()]).astype(np.int32)
    logprobs = np.column_stack([call_logprobs.numpy(), zeros, zeros,
                                answer_logprobs.numpy()]).astype(np.float32)
    return Completions(token_ids=token_ids, logprobs=logprobs)


def sample_tool(model: nn.Module, prompts: torch.Tensor, *, temperature: float = 1.0,
                generator: torch.Generator) -> Completions:
    """One trajectory per row of ``prompts`` (``long[B, PROMPT_LEN]``): sample the call from
    ``model`` at ``temperature``, append the tool's output, sample the answer.
    ``token_ids: int32[B, 4]``, ``logprobs: float32[B, 4]`` (0 on the tool's two tokens); the
    turns are ``TOOL_SEGMENTS``. The same generator state gives the same trajectories. Blocks
    for two forward passes; no gradients."""
    if not temperature > 0:
        raise ConfigurationError(f"sample_tool needs a temperature > 0, not {temperature}")

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)
        return tokens[:, 0], logprobs.gather(1, tokens)[:, 0]

    return _rollout(model, prompts, pick)


def greedy_tool(model: nn.Module, prompts: torch.Tensor) -> np.ndarray:
    """``int32[B, 4]``: the greedy trajectory of each row (call, tool output, answer)."""
    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0])

    return _rollout(model, prompts, pick).token_ids


def _scores(problem: Problem, completion: Sequence[int]) -> tuple[float, float]:
    """(called the tool, answered right after calling it) of one completion."""
    called = len(completion) == COMPLETION_TOKENS and completion[0] == ADD
    right = called and completion[3] == problem.answer_token
    return float(called), float(right)


def tool_accuracy(model: nn.Module, problems: Sequence[Problem] | None = None) -> float:
    """The share of ``problems`` (default: the held-out set) whose greedy rollout calls the tool
    and then answers right. Puts ``model`` in eval mode."""
    problems = held_out_problems() if problems is None else problems
    model.eval()
    trajectories = greedy_tool(model, prompt_tensor(problems))
    return sum(_scores(p, row.tolist())[1] for p, row in zip(problems, trajectories)) / len(
        problems)


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """The task's ``RewardFunction``: 0.5 for calling the tool (``add`` as the first token), 0.5
    more for then answering the last digit of the sum; components ``tool_call`` and ``answer``
    (each 0 or 1). Reads the whole completion, environment tokens included, as sampled. Pure,
    quick; raises ``ValueError`` for a prompt not of this task (the worker dead-letters it)."""

    source: str = "tool_answer"

    def __call__(self, generation: Generation) -> Reward:
        problem = parse_prompt(generation.prompt_token_ids)
        called, right = _scores(problem, generation.completion_token_ids.tolist())
        return Reward(reward=0.5 * called + 0.5 * right,
                      components={"tool_call": called, "answer": right})


#: The reward function to give a recipe.
tool_reward = ToolAnswer()


#: ``make_generation``'s keyword arguments for a trajectory of this task (``sample_tool``'s rows).
TOOL_GENERATION = {"segments": TOOL_SEGMENTS, "max_tokens": COMPLETION_TOKENS,
                   "finish_reason": FinishReason.STOP}
