"""A second small task, written in the tests, to which both example methods bind unchanged.

The successor task: a prompt is ``<bos> d`` for a digit ``d`` in 0-7 (token ``d + 3``); the
answer is one token, the next digit modulo 8. Its own vocabulary (16 tokens), model
(``TinyCausalLM``), reward (``Successor``, source ``"successor"``) and candidate evaluator
(``GreedySuccessor``). Nothing of the demo task is used: ``methods/`` knows no task.

    sao = methods.sao.recipe(model=successor_model, reward=successor, evaluator=GreedySuccessor())

``sao`` / ``grpo`` are the two methods bound to it, their batch geometry overridden by
``apply_overrides`` (``--set``) to fit a unit test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from methods.grpo import recipe as grpo_recipe
from methods.sao import recipe as sao_recipe
from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.api.recipe import Reward, apply_overrides
from reef_stream.core.events import Checkpoint, Decision, FinishReason, Generation, SamplingParams
from reef_stream.engine.checkpoints import load_weights
from reef_stream.engine.models import TinyCausalLM

VOCAB, BOS, FIRST_DIGIT, DIGITS = 16, 1, 3, 8
PROMPTS: tuple[int, ...] = tuple(range(DIGITS))


def prompt_tokens(digit: int) -> np.ndarray:
    return np.array([BOS, FIRST_DIGIT + digit], np.int32)


def answer_token(digit: int) -> int:
    return FIRST_DIGIT + (digit + 1) % DIGITS


def successor_model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=VOCAB, dim=16)


@dataclass(frozen=True, slots=True)
class Successor:
    """The task's reward: 1.0 when the completion is the successor of the prompt's digit."""

    source: str = "successor"

    def __call__(self, generation: Generation) -> Reward:
        digit = int(generation.prompt_token_ids[1]) - FIRST_DIGIT
        right = list(generation.completion_token_ids) == [answer_token(digit)]
        return Reward(reward=1.0 if right else 0.0)


successor = Successor()


def accuracy(model: torch.nn.Module) -> float:
    """Greedy accuracy over the eight prompts."""
    prompts = torch.from_numpy(np.stack([prompt_tokens(d) for d in PROMPTS]).astype(np.int64))
    with torch.no_grad():
        logits = model(prompts, torch.ones_like(prompts, dtype=torch.bool))[:, -1]
    return float(np.mean([int(t) == answer_token(d) for d, t in zip(PROMPTS, logits.argmax(-1))]))


@dataclass(frozen=True, slots=True)
class GreedySuccessor:
    """The task's evaluator: greedy accuracy; promotes unless it regresses."""

    name: str = "greedy-successor"
    evaluates: bool = True
    warning: str | None = None

    def measure(self, candidate: Checkpoint) -> Measurement:
        model = successor_model()
        model.load_state_dict(load_weights(candidate.uri, candidate.sha256))
        return Measurement({"accuracy": accuracy(model)})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        mine = measurement.values["accuracy"]
        theirs = 0.0 if incumbent is None else incumbent.measurement.values["accuracy"]
        if mine < theirs:
            return Selection(Decision.REJECTED, f"accuracy {mine:.2f} below {theirs:.2f}")
        return Selection(Decision.PROMOTED, f"accuracy {mine:.2f}, at least {theirs:.2f}")


def generation(gid: str, digit: int, token: int, logprob: float, *, version: int = 0,
               group: str | None = None, size: int = 1, temperature: float = 1.0,
               finish: FinishReason = FinishReason.STOP) -> Generation:
    return Generation(
        generation_id=gid, request_id=gid, prompt_id=f"succ-{digit}", group_id=group,
        group_size=size, model="successor", policy_version=version, replica_id="test",
        prompt_token_ids=prompt_tokens(digit), completion_token_ids=np.array([token], np.int32),
        completion_logprobs=np.array([logprob], np.float32), finish_reason=finish,
        sampling=SamplingParams(temperature=temperature, max_tokens=1), created_at=1_000)


#: Small steps for a unit test, set as a user would on the command line (``--set``).
SMALL = ("schedule.units_per_step=8", "schedule.optimizer_batch_size=8",
         "schedule.micro_batch_size=8", "backend.optimizer.lr=0.01")

sao = apply_overrides(sao_recipe(model=successor_model, reward=successor,
                                 evaluator=GreedySuccessor(), name="sao-successor"), SMALL)
grpo = apply_overrides(grpo_recipe(model=successor_model, reward=successor,
                                   evaluator=GreedySuccessor(), group_size=4,
                                   name="grpo-successor"),
                       ("schedule.units_per_step=4", "schedule.optimizer_batch_size=4",
                        "schedule.micro_batch_size=4", "backend.optimizer.lr=0.01"))
recipe = sao
