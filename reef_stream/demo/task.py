"""The demo's toy task: the last digit of a + b, learned from reward alone.

A prompt is ``<bos>a+b=`` with ``a`` and ``b`` single digits; the answer is one token, the
last digit of ``a + b`` (``<bos>7+5=`` -> ``2``). There are 100 problems and each of the ten
answers is the answer to exactly ten of them, so a policy that guesses scores 10 % and one that
knows the task 100 %. The policy learns it from an exact-match reward alone.

    problems = ProblemStream(seed=1)                  # training prompts, seeded, endless
    batch = problems.take(32)                         # list[Problem]
    policy = initial_policy(seed=7)                   # what the trainer starts from
    completions = sample(policy, prompt_tensor(batch), temperature=1.0, generator=g)
    generation = make_generation(model="demo", policy_version=0, replica_id="r0",
                                 problem=batch[0], token_ids=completions.token_ids[0],
                                 logprobs=completions.logprobs[0], temperature=1.0)
    exact_match(generation)                           # Reward(1.0) or Reward(0.0)
    accuracy(policy, held_out_problems())             # greedy decoding, in [0, 1]

Parts, for the demo (``reef_stream.demo.recipes`` binds the task-agnostic methods to this
task's model, reward and evaluator):

- the vocabulary (``VOCABULARY``, ``encode``, ``decode``) and the problems (``Problem``,
  ``ProblemStream``: seeded training prompts, ``held_out_problems()``: the fixed evaluation
  set, balanced over the ten answers);
- the policy ``TinyTransformer``, a small causal transformer that follows the trainer's model
  contract (``reef_stream.engine.training.CausalLM``), built by ``policy_model()`` at the demo's sizes;
  ``initial_policy(seed)`` builds it exactly as the trainer does (``torch.manual_seed(seed)``
  then ``policy_model()``), so a replica serving version 0 serves the trainer's initial weights;
- ``sample`` / ``greedy`` decoding and ``make_generation`` (the ``Generation`` event);
- the reward ``exact_match`` (a ``RewardFunction`` of source ``"exact_match"``);
- the candidate evaluator ``HeldOutAccuracy``.

Everything here is pure (no Kafka, no Redis) and deterministic on a CPU: the same seeds give
the same prompts, weights and samples.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.events import (
    Checkpoint, Decision, EpochMillis, FinishReason, Generation, SamplingParams, Segment, now_ms,
)
from reef_stream.demo.arithmetic import (  # noqa: F401 - exported here too (__all__)
    BOS,
    DIGIT_TOKENS,
    EOS,
    PAD,
    PROMPT_LEN,
    VOCAB_SIZE,
    VOCABULARY,
    ExactMatch,
    Problem,
    decode,
    encode,
    exact_match,
    parse_prompt,
)
from reef_stream.engine.checkpoints import load_weights

__all__ = [
    "ALL_PROBLEMS", "ANSWER_TOKENS", "BOS", "DEMO_SEED", "DIGIT_TOKENS", "EOS", "PAD",
    "PROMPT_LEN", "VOCABULARY", "VOCAB_SIZE", "Completions", "ExactMatch", "HeldOutAccuracy",
    "Problem", "ProblemStream", "TinyTransformer", "accuracy", "decode", "encode", "exact_match",
    "greedy", "held_out_problems", "initial_policy", "make_generation", "parse_prompt",
    "policy_model", "prompt_tensor", "sample",
]

# --------------------------------------------------------------------------- vocabulary

# The vocabulary, the problems and the reward are in reef_stream.demo.arithmetic (no torch: a
# sandbox worker imports the reward alone); imported above, still importable from here.

#: Tokens in an answer (and in every completion: the sampling budget).
ANSWER_TOKENS = 1
#: A seed whose untrained policy is below chance (``initial_policy(DEMO_SEED)`` scores 0.04):
#: the default of the replica and of the learning check. In a run, the recipe's
#: ``schedule.seed`` decides the weights of version 0, and replicas must be given it.
DEMO_SEED = 7


#: Every problem, in a fixed order: ``a`` major, ``b`` minor.
ALL_PROBLEMS: tuple[Problem, ...] = tuple(Problem(a, b) for a in range(10) for b in range(10))


def held_out_problems() -> tuple[Problem, ...]:
    """The fixed evaluation set: all 100 problems, each answer exactly ten times (so any
    constant guess scores exactly 0.1). The task has only 100 prompts, so these are the
    prompts training samples too; "held out" means never sampled at a temperature, only
    decoded greedily from a candidate's weights."""
    return ALL_PROBLEMS


class ProblemStream:
    """Training problems drawn uniformly (with replacement) from all 100 by a numpy generator
    seeded with ``seed``: the same seed, the same stream. Not thread-safe; one per sampling
    thread."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def take(self, n: int) -> list[Problem]:
        """The next ``n`` problems. Does not block."""
        return [ALL_PROBLEMS[i] for i in self._rng.integers(0, len(ALL_PROBLEMS), n)]


def prompt_tensor(problems: Sequence[Problem]) -> torch.Tensor:
    """``long[B, PROMPT_LEN]``: the prompts of ``problems`` (all the same length, no padding)."""
    return torch.from_numpy(np.stack([p.token_ids for p in problems]).astype(np.int64))


# --------------------------------------------------------------------------- the policy


class _Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, dim // self.heads
                                               ).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (dim // self.heads) ** 0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, length, dim)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A small causal transformer (learned positions, pre-norm blocks) with a value head.

    Follows ``reef_stream.engine.training.CausalLM``: ``input_ids: long[B, L]``, ``attention_mask:
    bool[B, L]`` (True on real tokens) -> next-token logits ``float[B, L, vocab_size]``
    (position ``i`` predicts token ``i + 1``; position ``i`` attends to positions ``<= i``
    that are real tokens). ``value`` -> ``float[B]``, read at each row's last real token.
    ``L`` is at most ``max_len``. Deterministic on a CPU.

    Two choices are tuned for learning from reward alone (``tests/unit/test_demo_task.py``):

    - weights are initialised normal with std ``init_std`` (biases zero). With GPT's 0.02 an
      untrained policy's outputs hardly depend on the prompt, so early policy gradients push
      the same answer up for every prompt and sampling collapses onto one answer before it
      learns anything;
    - logits are soft-capped, ``logit_cap * tanh(z / logit_cap)`` (Gemma 2's soft-capping, far
      tighter), so no answer's probability runs away: without it, prompts whose sampling
      collapsed onto a wrong answer stop producing any correct sample, group-normalised
      advantages are then all zero, and held-out accuracy plateaus in the 0.8s. With a cap of
      3 the most likely token keeps at most ~99.8 % (15 tokens). ``logit_cap=None``: no cap.
    """

    def __init__(self, *, vocab_size: int = VOCAB_SIZE, dim: int = 64, layers: int = 2,
                 heads: int = 4, max_len: int = 16, init_std: float = 0.1,
                 logit_cap: float | None = 3.0) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigurationError(f"TinyTransformer: dim ({dim}) must be a multiple of heads "
                                     f"({heads})")
        self.vocab_size, self.max_len, self.logit_cap = vocab_size, max_len, logit_cap
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.value_head = nn.Linear(dim, 1)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=init_std)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.max_len:
            raise FatalError(f"TinyTransformer takes at most {self.max_len} tokens, got {length}")
        x = self.embed(input_ids.clamp(0, self.vocab_size - 1)) + self.position.weight[:length]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        # Every position may attend to itself, so no row is all masked (padding included).
        allowed = causal & (attention_mask.bool()[:, None, :]
                            | torch.eye(length, dtype=torch.bool, device=input_ids.device))
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(self._hidden(input_ids, attention_mask))
        if self.logit_cap is None:
            return logits
        return self.logit_cap * torch.tanh(logits / self.logit_cap)

    def value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._hidden(input_ids, attention_mask)
        last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
        return self.value_head(hidden[torch.arange(hidden.shape[0]), last]).squeeze(-1)


def policy_model() -> TinyTransformer:
    """The demo's policy at its fixed sizes: 2 layers, width 64, 4 heads (103k parameters),
    init std 0.1, logit cap 3. Give it to a recipe as ``Backend(model=policy_model)``; seed
    torch first for reproducible weights (``initial_policy``)."""
    return TinyTransformer(dim=64, layers=2, heads=4, max_len=16, init_std=0.1, logit_cap=3.0)


def initial_policy(seed: int) -> TinyTransformer:
    """The weights a trainer whose ``schedule.seed`` is ``seed`` starts from: built as
    ``TorchBackend`` builds them (``torch.manual_seed(seed)``, then ``policy_model()``), without
    disturbing the caller's global torch RNG. What a replica serves as version 0."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return policy_model()


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True, eq=False)
class Completions:
    """What ``sample`` drew for B prompts: ``token_ids: int32[B, ANSWER_TOKENS]`` and
    ``logprobs: float32[B, ANSWER_TOKENS]``, the behaviour log-probability of each token under
    the distribution it was drawn from (the policy's, at the sampling temperature)."""

    token_ids: np.ndarray
    logprobs: np.ndarray


def _next_token_logits(model: nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    """``float[B, V]`` on the CPU, whatever device ``model`` is on."""
    prompts = prompts.to(next(model.parameters()).device)
    with torch.no_grad():
        return model(prompts, torch.ones_like(prompts, dtype=torch.bool))[:, -1].float().cpu()


def sample(model: nn.Module, prompts: torch.Tensor, *, temperature: float = 1.0,
           generator: torch.Generator) -> Completions:
    """Draw one completion per row of ``prompts`` (``long[B, PROMPT_LEN]``) from ``model`` at
    ``temperature`` (> 0) with ``generator`` (the only randomness: the same generator state
    gives the same completions; drawn on the CPU). Over the whole vocabulary: the policy may
    answer with a non-digit, which scores 0. Blocks for one forward pass; no gradients."""
    if not temperature > 0:
        raise ConfigurationError(f"sample needs a temperature > 0 (use greedy for 0), not "
                                 f"{temperature}")
    logprobs = torch.log_softmax(_next_token_logits(model, prompts) / temperature, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)
    chosen = logprobs.gather(1, tokens)
    return Completions(token_ids=tokens.numpy().astype(np.int32),
                       logprobs=chosen.numpy().astype(np.float32))


def greedy(model: nn.Module, prompts: torch.Tensor) -> np.ndarray:
    """``int32[B, ANSWER_TOKENS]``: the most likely completion of each row of ``prompts``
    (``long[B, PROMPT_LEN]``). Blocks for one forward pass; no gradients."""
    return _next_token_logits(model, prompts).argmax(dim=-1, keepdim=True).numpy().astype(
        np.int32)


def accuracy(model: nn.Module, problems: Sequence[Problem] | None = None, *,
             batch_size: int = 500) -> float:
    """The share of ``problems`` (default: the held-out set) that ``model`` answers exactly with
    greedy decoding. Puts ``model`` in eval mode. Blocks for the forward passes."""
    problems = held_out_problems() if problems is None else problems
    model.eval()
    correct = 0
    for first in range(0, len(problems), batch_size):
        chunk = problems[first:first + batch_size]
        answers = greedy(model, prompt_tensor(chunk))[:, 0]
        correct += int((answers == np.array([p.answer_token for p in chunk])).sum())
    return correct / len(problems)


def make_generation(*, model: str, policy_version: int, replica_id: str, problem: Problem,
                    token_ids: np.ndarray, logprobs: np.ndarray, temperature: float,
                    group_id: str | None = None, group_size: int = 1,
                    generation_id: str | None = None, request_id: str | None = None,
                    created_at: EpochMillis | None = None,
                    segments: tuple[Segment, ...] = (), max_tokens: int = ANSWER_TOKENS,
                    finish_reason: FinishReason = FinishReason.LENGTH) -> Generation:
    """The ``Generation`` event of one completion (``token_ids: int32[ANSWER_TOKENS]``,
    ``logprobs: float32[ANSWER_TOKENS]``, one row of ``Completions``) of ``problem``.

    Ungrouped sampling: ``group_id=None``, ``group_size=1``; grouped: the id and size the
    group's generations share. ``generation_id`` defaults to a fresh random id (unique across
    restarts); ``request_id`` to the generation id; ``prompt_id`` is the prompt's text. The
    finish reason is LENGTH: every completion uses the whole one-token budget. A multi-turn
    trajectory (``reef_stream.demo.tool_task``) gives its ``segments``, its token budget
    ``max_tokens`` and its ``finish_reason``.
    """
    generation_id = generation_id or uuid.uuid4().hex
    return Generation(
        generation_id=generation_id, request_id=request_id or generation_id,
        prompt_id=problem.prompt_id, group_id=group_id, group_size=group_size, model=model,
        policy_version=policy_version, replica_id=replica_id,
        prompt_token_ids=problem.token_ids,
        completion_token_ids=np.asarray(token_ids, dtype=np.int32).reshape(-1),
        completion_logprobs=np.asarray(logprobs, dtype=np.float32).reshape(-1),
        finish_reason=finish_reason,
        sampling=SamplingParams(temperature=float(temperature), top_p=1.0, top_k=-1,
                                max_tokens=max_tokens),
        created_at=created_at if created_at is not None else now_ms(), segments=segments)


# --------------------------------------------------------------------------- evaluator


@dataclass(frozen=True, slots=True)
class HeldOutAccuracy:
    """The demo's ``CandidateEvaluator``: held-out accuracy with greedy decoding; a candidate is
    promoted unless its accuracy is more than ``tolerance`` below the incumbent's.

    ``measure`` builds ``model()`` (the recipe's model factory; default ``policy_model``),
    loads the candidate's weights verified against its sha256, and returns
    ``{"accuracy": measure_with(model)}`` (default ``accuracy``: on ``held_out_problems()``;
    the tool task's ``tool_accuracy`` rolls out the tool call).
    """

    tolerance: float = 0.02
    model: Callable[[], nn.Module] = policy_model
    measure_with: Callable[[nn.Module], float] = accuracy
    name: str = "held-out-accuracy"
    evaluates: bool = True
    warning: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance <= 1:
            raise ConfigurationError(f"HeldOutAccuracy tolerance must be within [0, 1], not "
                                     f"{self.tolerance}")

    def measure(self, candidate: Checkpoint) -> Measurement:
        """Held-out greedy accuracy of ``candidate``'s weights. Blocks for the load (raises
        ``CheckpointError`` when they do not match ``candidate.sha256``) and a few forward
        passes (milliseconds). No side effects; the same candidate measures the same."""
        with torch.random.fork_rng(devices=[]):  # building it draws from the global RNG
            model = self.model()
        model.load_state_dict(load_weights(candidate.uri, candidate.sha256))
        return Measurement({"accuracy": self.measure_with(model)})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """PROMOTED unless the accuracy is more than ``tolerance`` below the incumbent's;
        the reason gives the numbers. Pure, idempotent, does not block."""
        if "accuracy" not in measurement.values:
            raise FatalError("HeldOutAccuracy.select needs a measurement with an accuracy")
        mine = measurement.values["accuracy"]
        theirs = None if incumbent is None else incumbent.measurement.values.get("accuracy")
        if theirs is None:
            what = ("no version is promoted yet" if incumbent is None else
                    f"the incumbent version {incumbent.policy_version} has no measured accuracy")
            return Selection(Decision.PROMOTED,
                             f"held-out accuracy {mine:.3f}; promoted because {what}")
        floor = theirs - self.tolerance
        versus = (f"held-out accuracy {mine:.3f} against {theirs:.3f} of the incumbent version "
                  f"{incumbent.policy_version} (tolerance {self.tolerance:.3f})")
        if mine < floor - 1e-12:
            return Selection(Decision.REJECTED,
                             f"{versus}: a regression of {theirs - mine:.3f}, beyond the tolerance")
        return Selection(Decision.PROMOTED, f"{versus}: no regression beyond the tolerance")
