"""The torch backend of the trainer: a step's units and an objective's result -> optimizer updates.

``TorchBackend`` builds the recipe's model and optimizer (seeded: every trainer of a group
starts from the same weights), prepares them with ``accelerate`` and runs one step as the
``Schedule`` says: ``epochs`` passes over the step's units (reshuffled per epoch, seeded by
``(schedule.seed, step, epoch)``), one optimizer update per optimizer batch, its loss
normalised by the batch's totals all-reduced before any forward pass, so micro-batch size
and rank count change memory and speed only, never the loss (``api.variants.BatchTotals``).
The same units from the same checkpoint give bitwise the same weights (same hardware and
torch build). A step also measures the behaviour gap and the update ratio, changing nothing.

The model contract is ``CausalLM`` (logits, ``vocab_size``, optional ``max_len``; ``value``
for ``value_regression``); ``INPUT_BUILDERS`` builds each loss family's inputs.
``untrainable`` names a unit the backend cannot train (the trainer dead-letters it); a
non-finite advantage, loss or gradient norm raises ``NonFiniteStep`` before the update, on
every rank. ``sharding="fsdp"``: ``reef_stream.engine.sharding``. The long form:
``docs/design-notes.md`` ("The torch backend").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from reef_stream.api.losses import LossFamily, PolicyGradientInputs, ValueRegressionInputs
from reef_stream.api.objective import (
    Advantages, ObjectiveResult, PerSampleAdvantages, PerTokenAdvantages, kept_rows,
)
from reef_stream.api.variants import BatchTotals, ExtraInput
from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.events import Sample, mask_problem
from reef_stream.core.metric_names import (
    TRAINER_GRAD_NORM, TRAINER_KL_BEHAVIOUR, TRAINER_LOGPROB_GAP_OLDER,
    TRAINER_LOGPROB_GAP_OLDER_TOKENS, TRAINER_LOGPROB_GAP_SAME_VERSION,
    TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS, TRAINER_SKIPPED_UPDATES,
)
from reef_stream.engine.loss_inputs import (
    completion_entropy, completion_logprobs, load_reference, local_totals, proximal_logprobs,
    proximal_rows, restricted,
)
from reef_stream.engine.sharding import FullySharded, trained_copy, trained_parameters, update_ratio

__all__ = ["CausalLM", "INPUT_BUILDERS", "NonFiniteStep", "SampleBatch", "TorchBackend",
           "UnitLimits", "collate", "completion_entropy", "completion_logprobs",
           "inputs_builder", "model_limits", "select_rows", "unit_members", "untrainable"]


class NonFiniteStep(FatalError):
    """A step's advantages, loss or gradient norm are NaN or infinite, although every unit
    passed ``untrainable``: the objective or the optimisation diverged (a learning rate too
    high, an objective dividing by zero). Raised before the offending update reaches the
    weights, so no checkpoint holds it; the backend's weights may hold the step's earlier
    updates, so restore the newest checkpoint before training again. Replaying the step
    gives the same result: change the recipe, do not retry."""


class CausalLM(Protocol):
    """What the trainer needs of a model.

    ``__call__(input_ids: long[B, L], attention_mask: bool[B, L]) -> float[B, L, V]``:
    next-token logits at every position (position ``i`` predicts token ``i + 1``).
    ``vocab_size: int``: ``V``, the number of token ids (a Hugging Face model's
    ``config.vocab_size`` serves too). ``max_len: int`` (optional): the most tokens a row
    may hold. For ``value_regression``: ``value(input_ids, attention_mask) -> float[B]``.
    """

    vocab_size: int

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, eq=False)
class SampleBatch:
    """A micro batch of B samples: prompt then completion per row, right-padded.

    Shapes: ``input_ids: long[B, L]``, ``attention_mask: bool[B, L]``;
    ``completion_ids: long[B, T]``, ``completion_mask: bool[B, T]``,
    ``behaviour_logprobs: float[B, T]`` (T: the longest completion);
    ``completion_start: long[B]`` (index in ``input_ids`` of each first
    completion token).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    completion_start: torch.Tensor

    def to(self, device: torch.device) -> SampleBatch:
        """The same batch on ``device`` (the trainer's accelerator): ``collate`` builds it on
        the CPU, and every tensor a loss compares with the model's logits must be beside
        them."""
        return SampleBatch(*(getattr(self, name).to(device) for name in self.__slots__))


def collate(samples: Sequence[Sample]) -> SampleBatch:
    """The padded tensors of ``samples`` (read without copying the token arrays twice).

    ``completion_mask`` is False on padding and on the environment and tool tokens of a
    multi-turn sample (its ``policy_mask``), so every loss, the logprob gap and the KL to
    behaviour count only the tokens the policy generated. Raises ``FatalError`` for a
    ``policy_mask`` that does not fit its tokens (``reef_stream.core.events.mask_problem``
    says why)."""
    if not samples:
        raise FatalError("collate needs at least one sample")
    prompt_lens = np.array([len(s.prompt_token_ids) for s in samples])
    completion_lens = np.array([len(s.completion_token_ids) for s in samples])
    width, t = int((prompt_lens + completion_lens).max()), max(int(completion_lens.max()), 1)
    input_ids = np.zeros((len(samples), width), dtype=np.int64)
    completion_ids = np.zeros((len(samples), t), dtype=np.int64)
    behaviour = np.zeros((len(samples), t), dtype=np.float32)
    policy = np.ones((len(samples), t), dtype=bool)
    for row, sample in enumerate(samples):
        p, c = prompt_lens[row], completion_lens[row]
        input_ids[row, :p] = sample.prompt_token_ids
        input_ids[row, p:p + c] = sample.completion_token_ids
        completion_ids[row, :c] = sample.completion_token_ids
        behaviour[row, :c] = sample.completion_logprobs
        if sample.policy_mask.size:
            if (problem := mask_problem(sample.policy_mask, int(c))) is not None:
                raise FatalError(f"generation {sample.generation_id}: {problem}")
            policy[row, :c] = sample.policy_mask.astype(bool)
    positions = np.arange(width)[None, :]
    return SampleBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(positions < (prompt_lens + completion_lens)[:, None]),
        completion_ids=torch.from_numpy(completion_ids),
        # A completion token at position 0 (no prompt) has nothing predicting it.
        completion_mask=torch.from_numpy((np.arange(t)[None, :] < completion_lens[:, None])
                                         & ((prompt_lens[:, None] + np.arange(t)[None, :]) > 0)
                                         & policy),
        behaviour_logprobs=torch.from_numpy(behaviour),
        completion_start=torch.from_numpy(prompt_lens.astype(np.int64)),
    )




# --------------------------------------------------------------------------- family inputs

#: Builds a family's loss inputs from the model, a micro batch, the step's advantages and the
#: advantage rows of the micro batch's samples.
InputsBuilder = Callable[[Any, SampleBatch, Advantages, np.ndarray], Any]


def _advantage_rows(advantages: Advantages, rows: np.ndarray, batch: SampleBatch) -> torch.Tensor:
    t, device = batch.completion_ids.shape[1], batch.completion_mask.device
    if isinstance(advantages, PerSampleAdvantages):
        values = torch.as_tensor(np.asarray(advantages.values)[rows], dtype=torch.float32,
                                 device=device)
        return values[:, None].expand(-1, t) * batch.completion_mask
    values = torch.as_tensor(np.asarray(advantages.values)[rows][:, :t], dtype=torch.float32,
                             device=device)
    mask = torch.as_tensor(np.asarray(advantages.mask)[rows][:, :t], dtype=torch.bool,
                           device=device)
    if values.shape[1] < t:
        raise FatalError(f"per-token advantages are {values.shape[1]} tokens wide, but a "
                         f"completion has {t} tokens")
    # where, not a product: a padding value is ignored even when it is NaN.
    return torch.where(mask & batch.completion_mask, values, 0.0)


def policy_gradient_inputs(model: Any, batch: SampleBatch, advantages: Advantages,
                           rows: np.ndarray, *, entropy: bool = False, reference: Any = None,
                           proximal: torch.Tensor | None = None) -> PolicyGradientInputs:
    """Current logprobs from a forward pass; behaviour logprobs as the generations recorded.

    The backend adds what its loss asks for (``extra_inputs``): ``entropy`` (from the same
    forward pass), the logprobs of a frozen ``reference`` model (a forward pass without
    gradient), the ``proximal`` logprobs recomputed at the start of the step (``float[B, T]``).
    """
    logits = model(batch.input_ids, batch.attention_mask)
    reference_logprobs = None
    if reference is not None:
        with torch.no_grad():
            reference_logprobs = completion_logprobs(
                reference(batch.input_ids, batch.attention_mask), batch)
    return PolicyGradientInputs(
        logprobs=completion_logprobs(logits, batch),
        behaviour_logprobs=batch.behaviour_logprobs,
        advantages=_advantage_rows(advantages, rows, batch),
        mask=batch.completion_mask,
        reference_logprobs=reference_logprobs,
        proximal_logprobs=proximal,
        entropy=completion_entropy(logits, batch) if entropy else None)


def value_regression_inputs(model: Any, batch: SampleBatch, advantages: Advantages,
                            rows: np.ndarray) -> ValueRegressionInputs:
    """One prediction per sample (``model.value``); the objective's per-sample advantages are
    the regression targets."""
    if not isinstance(advantages, PerSampleAdvantages):
        raise FatalError("value_regression takes PerSampleAdvantages as its targets")
    if not hasattr(model, "value"):
        raise ConfigurationError("the value_regression family needs a model with "
                                 "value(input_ids, attention_mask) -> float[B]")
    predictions = model.value(batch.input_ids, batch.attention_mask)
    return ValueRegressionInputs(
        predictions=predictions,
        targets=torch.as_tensor(np.asarray(advantages.values)[rows], dtype=torch.float32,
                                device=predictions.device),
        mask=torch.ones_like(predictions, dtype=torch.bool))


#: How the backend builds a family's inputs, by the family's ``inputs`` type: a method's own
#: family taking ``PolicyGradientInputs`` (e.g. a truncated importance-weighted loss) is
#: trained like the built-in one.
INPUT_BUILDERS: Mapping[type, InputsBuilder] = {
    PolicyGradientInputs: policy_gradient_inputs,
    ValueRegressionInputs: value_regression_inputs,
}


def inputs_builder(family: LossFamily[Any]) -> InputsBuilder:
    """The builder of ``family``'s inputs; ConfigurationError if the backend has none."""
    builder = INPUT_BUILDERS.get(family.inputs)
    if builder is None:
        known = ", ".join(t.__name__ for t in INPUT_BUILDERS)
        raise ConfigurationError(f"the torch backend cannot build {family.inputs.__name__} for "
                                 f"loss family {family.name!r}; it builds: {known}")
    return builder


# --------------------------------------------------------------------------- trainable units


@dataclass(frozen=True, slots=True)
class UnitLimits:
    """What the backend's model takes: token ids in ``0 .. vocab_size - 1``; at most
    ``max_length`` tokens a sample, prompt and completion together (None: no limit)."""

    vocab_size: int
    max_length: int | None = None


def model_limits(model: Any) -> UnitLimits:
    """The ``UnitLimits`` of a ``CausalLM``: its ``vocab_size`` (else ``config.vocab_size``)
    and its ``max_len`` if it has one. ``ConfigurationError`` when it says no vocabulary
    size: without one, a unit's token ids cannot be checked before they index the logits."""
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConfigurationError(
            f"the model {type(model).__name__} says no vocabulary size (vocab_size: "
            f"{vocab!r}): give it a positive int attribute `vocab_size`; the trainer checks "
            "every unit's token ids against it (reef_stream.engine.training.CausalLM)")
    max_len = getattr(model, "max_len", None)
    return UnitLimits(vocab_size=vocab,
                      max_length=max_len if isinstance(max_len, int) and max_len > 0 else None)


def untrainable(unit: Any, limits: UnitLimits) -> str | None:
    """Why the torch backend cannot train ``unit`` (a sentence naming the unit, the
    generation and what is wrong), or None when it can. Pure; called by the trainer for
    every unit (a few numpy reductions over the unit's arrays), after ``unit_members``
    accepted it.

    What must hold, and why (what training would do otherwise):

    - the unit has samples: ``collate`` of a micro batch of empty units raises;
    - one behaviour logprob per completion token: ``collate`` copies them into the
      completion's row (a mismatch raises, or a single value broadcasts over the row);
    - a sample has a token (prompt and completion are not both empty): a micro batch of
      such samples is a sequence of length 0, which the model cannot run;
    - at most ``limits.max_length`` tokens, prompt and completion together, when the model
      has a limit (``TinyTransformer`` raises beyond it);
    - every token id is in ``0 .. vocab_size - 1``: completion ids index the logits
      (``completion_logprobs``; an error on a CPU, a device-side assert that kills the
      process on a GPU), prompt and completion ids the embedding (an error, or a model that
      clamps ids trains on tokens nobody generated);
    - every behaviour logprob is finite: the importance ratio ``exp(current - behaviour)``
      of a NaN or infinite one is NaN or infinite, and so are the loss and every weight
      after the update;
    - the reward and its components are finite: the objective makes advantages of them
      (NaN in, NaN out) and reports their mean as a metric.

    The first problem is named; when other samples have problems too, their count.
    """
    members = unit_members(unit)
    name = f"unit {getattr(unit, 'unit_id', '?')} cannot be trained"
    if not members:
        return f"{name}: it has no samples"
    if _fits(members, limits):
        return None
    problems = [problem for sample in members
                if (problem := _sample_problem(sample, limits)) is not None]
    if not problems:
        return None
    more = (f"; {len(problems) - 1} more of its {len(members)} samples cannot be trained either"
            if len(problems) > 1 else "")
    return f"{name}: {problems[0]}{more}"


def _fits(members: Sequence[Sample], limits: UnitLimits) -> bool:
    """True when ``_sample_problem`` finds nothing in any of ``members``: the same
    conditions over the whole unit at once (one pass over all its token ids, one over all its
    logprobs), the common case. False sends ``untrainable`` to the samples to say which."""
    longest = limits.max_length if limits.max_length is not None else math.inf
    for sample in members:
        completion = len(sample.completion_token_ids)
        if (len(sample.completion_logprobs) != completion
                or not 0 < len(sample.prompt_token_ids) + completion <= longest
                or not math.isfinite(sample.reward)
                or not all(map(math.isfinite, sample.reward_components.values()))
                or (sample.policy_mask.size
                    and mask_problem(sample.policy_mask, completion) is not None)):
            return False
    ids = np.concatenate([a for s in members for a in (s.prompt_token_ids,
                                                       s.completion_token_ids)])
    logprobs = np.concatenate([s.completion_logprobs for s in members])
    # A NaN or an infinity makes the sum non-finite (float32 values cannot overflow a
    # float64 sum).
    return (bool(ids.min() >= 0 and ids.max() < limits.vocab_size)
            and (not logprobs.size or math.isfinite(logprobs.sum(dtype=np.float64))))


def _sample_problem(sample: Sample, limits: UnitLimits) -> str | None:
    """The first reason ``untrainable`` finds in one sample, or None."""
    generation = sample.generation_id
    prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
    logprobs = sample.completion_logprobs
    if len(logprobs) != len(completion):
        return (f"generation {generation} has {len(completion)} completion tokens but "
                f"{len(logprobs)} completion logprobs (the loss needs one per token)")
    if (problem := mask_problem(sample.policy_mask, len(completion))) is not None:
        return f"generation {generation}: {problem}"
    length = len(prompt) + len(completion)
    if length == 0:
        return f"generation {generation} has no tokens (its prompt and completion are empty)"
    if limits.max_length is not None and length > limits.max_length:
        return (f"generation {generation} has {length} tokens ({len(prompt)} prompt + "
                f"{len(completion)} completion); the model takes at most {limits.max_length}")
    for part, ids in (("prompt", prompt), ("completion", completion)):
        if ids.size and (ids.min() < 0 or ids.max() >= limits.vocab_size):
            at = int(np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))[0])
            return (f"{part} token id {int(ids[at])} at position {at} of generation "
                    f"{generation} is outside the model's vocabulary "
                    f"(0..{limits.vocab_size - 1})")
    if not np.isfinite(logprobs).all():
        at = int(np.flatnonzero(~np.isfinite(logprobs))[0])
        return (f"completion logprob at position {at} of generation {generation} is "
                f"{_number(logprobs[at])}")
    if not math.isfinite(sample.reward):
        return f"reward of generation {generation} is {_number(sample.reward)}"
    for component, value in sorted(sample.reward_components.items()):
        if not math.isfinite(value):
            return f"reward component {component!r} of generation {generation} is {_number(value)}"
    return None


def _number(value: float) -> str:
    """``NaN``, ``inf``, ``-inf`` or the value."""
    return "NaN" if math.isnan(value) else repr(float(value))


def select_rows(advantages: Advantages, rows: np.ndarray) -> Advantages:
    """The advantages of the samples at ``rows`` only (a data-parallel rank's share)."""
    keep = None if advantages.keep is None else advantages.keep[rows]
    if isinstance(advantages, PerSampleAdvantages):
        return PerSampleAdvantages(advantages.values[rows], keep)
    return PerTokenAdvantages(advantages.values[rows], advantages.mask[rows], keep)


def unit_members(unit: Any) -> tuple[Sample, ...]:
    """The samples of a unit, in advantage-row order (a unit type lists them as ``members``)."""
    members = getattr(unit, "members", None)
    if members is None:
        raise ConfigurationError(f"unit type {type(unit).__name__} has no `members`; the torch "
                                 "backend trains units whose members are Sample records")
    return tuple(members)


# --------------------------------------------------------------------------- the backend


class TorchBackend:
    """The recipe's model and optimizer, prepared with accelerate, and one step of training.

    Built once per trainer process. ``train_step`` blocks for the step's
    computation; ``state`` / ``restore`` move everything a checkpoint holds.
    ``between_micro_batches`` (optional) is called after every micro batch
    (the trainer's fault-injection point).
    """

    def __init__(self, recipe: Any, *, between_micro_batches: Callable[[int], None] | None = None,
                 rank: int = 0, ranks: int = 1) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs

        backend, schedule = recipe.backend, recipe.schedule
        if backend.model is None:
            raise ConfigurationError(
                f"recipe {recipe.name!r}: its backend has no model; give "
                "Backend(model=<callable building a torch module>) to train it")
        family = recipe.objective.loss_family
        #: The family bound at load time; every step's ``ObjectiveResult`` must name it.
        self.family = family
        self.builder = inputs_builder(family)
        self.loss = dict(backend.losses).get(family, family.reference)
        #: The optional inputs the loss asks for (``reef_stream.api.variants.ExtraInput``).
        self.extras: frozenset[ExtraInput] = frozenset(getattr(self.loss, "extra_inputs", ()))
        if self.extras and family.inputs is not PolicyGradientInputs:
            raise ConfigurationError(
                f"the loss {self.loss!r} asks for {sorted(e.value for e in self.extras)}, which "
                f"the torch backend adds to PolicyGradientInputs only, not to "
                f"{family.inputs.__name__}")
        self.schedule = schedule
        # Data parallel: this rank trains units_per_step / ranks units of every step, in
        # optimizer batches of optimizer_batch_size / ranks; DDP averages the gradients.
        self.rank, self.ranks = rank, ranks
        self.optimizer_batch = schedule.optimizer_batch_size // ranks
        torch.manual_seed(schedule.seed)
        model = backend.model()
        #: What a unit must fit (``untrainable``).
        self.limits = model_limits(model)
        #: A frozen copy of the initial policy, for a KL penalty (``KLPenalty``): the seeded
        #: model as built, before any update (so the same after a restore); one more copy of
        #: the weights in memory, never trained, never checkpointed.
        self.reference: Any = None
        if ExtraInput.REFERENCE_LOGPROBS in self.extras:
            self.reference = copy.deepcopy(model).requires_grad_(False)
            if (chosen := getattr(getattr(self.loss, "kl", None), "reference", None)) is not None:
                load_reference(self.reference, chosen)
        # A model may have parameters a family does not use (a value head under
        # policy_gradient): DDP must not wait for their gradients.
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        #: The model sharded in place with FSDP when it asks for it (``sharding``), else None.
        self.sharded = FullySharded.of(model, backend.model, device=self.accelerator.device,
                                       rank=rank, ranks=ranks)
        # Only what requires a gradient is trained (a LoRA model's base is frozen): the
        # optimizer, the update ratio and its copy of the weights see nothing else.
        trained = trained_parameters(model)
        optimizer = (backend.optimizer(trained) if backend.optimizer
                     else torch.optim.AdamW(trained, lr=1e-3))
        self.model, self.optimizer = ((model, self.sharded.bind(optimizer)) if self.sharded
                                      else self.accelerator.prepare(model, optimizer))
        if self.reference is not None:
            self.reference = self.reference.to(self.accelerator.device).eval()
        self.max_grad_norm = backend.max_grad_norm
        self.between_micro_batches = between_micro_batches

    # Under data parallelism a rank that finds its advantages or a micro batch's loss NaN or
    # infinite must not simply raise: the other ranks would wait for it in the next gradient
    # all-reduce until the process group's timeout. So every rank says, at each of those two
    # checks, whether it diverged (one all-reduce of a flag, MIN over ranks), and all raise.

    def _diverged_everywhere(self) -> None:
        """This rank diverged: tell the others (they raise in ``_unless_diverged_elsewhere``)."""
        self._agree(False)

    def _unless_diverged_elsewhere(self, step: int, what: str) -> None:
        """Raise ``NonFiniteStep`` if another rank found ``what`` non-finite at this check."""
        if not self._agree(True):
            raise NonFiniteStep(
                f"step {step}: another data-parallel rank found {what} NaN or infinite (that "
                f"rank's error names its units; this is rank {self.rank}): the step was "
                "abandoned on every rank before this update reached the weights, and no "
                "checkpoint holds it")

    def _agree(self, finite: bool) -> bool:
        """Whether every rank is finite at this check (this rank's ``finite`` alone when it is
        the only one)."""
        if self.ranks == 1:
            return finite
        import torch.distributed as dist

        flag = torch.tensor([1.0 if finite else 0.0], dtype=torch.float64,
                            device=self.accelerator.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def _clip_gradients(self) -> float:
        """The gradient's global norm before clipping; clipped to ``max_grad_norm`` when set.
        Under data parallelism the gradients are already averaged, so every rank agrees."""
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not parameters:
            return 0.0
        if self.sharded:
            return self.sharded.clip_gradients(parameters, self.max_grad_norm)
        if self.max_grad_norm is not None:
            return float(self.accelerator.clip_grad_norm_(parameters, self.max_grad_norm))
        with torch.no_grad():
            return float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in parameters])))

    # ----------------------------------------------------------------- normalisation

    def _sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over every data-parallel rank (one all-reduce; every rank must
        call it at the same point); ``values`` themselves on one rank."""
        if self.ranks == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        summed = torch.tensor(list(values), dtype=torch.float64, device=self.accelerator.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.tolist()

    def _inputs(self, batch: SampleBatch, rows: np.ndarray, advantages: Advantages,
                proximal: Mapping[int, torch.Tensor] | None) -> Any:
        """The family's inputs for one micro batch, with the extras the loss asks for."""
        if not self.extras:
            return self.builder(self.model, batch, advantages, rows)
        return policy_gradient_inputs(
            self.model, batch, advantages, rows, entropy=ExtraInput.ENTROPY in self.extras,
            reference=self.reference,
            proximal=None if proximal is None else proximal_rows(proximal, rows, batch))

    # ----------------------------------------------------------------- policy health

    def _behaviour_gap(self, inputs: Any, samples: Sequence[Sample], step: int,
                       sums: torch.Tensor) -> None:
        """Add one micro batch to ``sums`` (float64[6], on the accelerator's device): how far
        the weights held before step ``step`` (version ``step - 1``) are from the behaviour
        policies that generated ``samples``.

        ``train_step`` calls it for the micro batches of its first optimizer batch, whose
        forward passes run before any update (so every sample of a step that is one update,
        as in methods/sao and methods/grpo; a shuffled share otherwise), when the family is
        trained from behaviour logprobs (``PolicyGradientInputs``): no extra forward pass. The
        current logprobs are the training forward's, in train mode (a model with dropout adds
        its noise). Per real completion token (padding masked), ``r = current - behaviour``
        (the logprob recorded at generation); sums: |r| and tokens of samples whose
        ``policy_version`` is ``step - 1``, |r| and tokens of older samples, ``exp(r) - 1 - r``
        and tokens of all (a sample of unknown version, ``Sample.policy_version_known`` False,
        counts in the last only). Changes nothing but ``sums``.
        """
        if not isinstance(inputs, PolicyGradientInputs):
            return
        with torch.no_grad():
            mask = inputs.mask
            r = torch.where(mask, inputs.logprobs.detach() - inputs.behaviour_logprobs, 0.0
                            ).double()
            versions = torch.tensor([s.policy_version if s.policy_version_known else step
                                     for s in samples], device=r.device)
            same = mask & (versions == step - 1)[:, None]
            older = mask & (versions < step - 1)[:, None]
            sums += torch.stack([
                (r.abs() * same).sum(), same.sum().double(),
                (r.abs() * older).sum(), older.sum().double(),
                (torch.expm1(r) - r).sum(), mask.sum().double(),
            ]).to(sums.device)

    def _gap_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """The step's gap metrics from ``_behaviour_gap``'s sums, summed over ranks (one
        ``accelerator.reduce``; every rank calls it once a step):

        - ``logprob_gap.same_version``: mean ``|r|`` over the tokens of samples of the trainer's
          own version (inference vs training numerics), ``logprob_gap.same_version_tokens``;
        - ``logprob_gap.older`` / ``logprob_gap.older_tokens``: the same over older samples
          (staleness on top of the numerics);
        - ``kl_behaviour``: KL(behaviour || current) by the k3 estimator, the mean over every
          token of ``exp(r) - 1 - r`` (unbiased for tokens drawn from the behaviour policy,
          never negative, lower variance than ``-r``).

        A bucket without tokens is left out (no 0, no NaN), as is ``kl_behaviour`` when no
        sample has a token. A sample of a version newer than the trainer's counts in
        ``kl_behaviour`` only.
        """
        same_gap, same_tokens, older_gap, older_tokens, kl, tokens = (
            self.accelerator.reduce(sums, "sum").tolist())
        metrics: dict[str, float] = {}
        if same_tokens:
            metrics[TRAINER_LOGPROB_GAP_SAME_VERSION] = same_gap / same_tokens
            metrics[TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS] = same_tokens
        if older_tokens:
            metrics[TRAINER_LOGPROB_GAP_OLDER] = older_gap / older_tokens
            metrics[TRAINER_LOGPROB_GAP_OLDER_TOKENS] = older_tokens
        if tokens:
            metrics[TRAINER_KL_BEHAVIOUR] = kl / tokens
        return metrics

    def _parameters(self) -> list[torch.Tensor]:
        """A copy of every trained parameter (this rank's shard of it, when sharded), for
        ``_update_ratio``. Called by ``train_step`` before its first update."""
        return trained_copy(self.model)

    def _update_ratio(self, before: Sequence[torch.Tensor]) -> dict[str, float]:
        """``update_ratio`` (``reef_stream.engine.sharding.update_ratio``: the relative size
        of the step's update over every trained parameter; a collective when sharded). Called
        by ``train_step`` after its last update."""
        return update_ratio(self.model, before)

    # ----------------------------------------------------------------- state

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
        """Weights, optimizer state and this rank's RNG states (named ``rank<r>.<generator>``),
        as a checkpoint stores them. Sharded, a collective: rank 0 gets the full weights and
        optimizer state, gathered, and the other ranks empty ones (``FullySharded.state``)."""
        if self.sharded:
            weights, optimizer = self.sharded.state()
        else:
            weights = self.accelerator.unwrap_model(self.model).state_dict()
            optimizer = self.optimizer.state_dict()
        rng = {f"rank{self.rank}.torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"rank{self.rank}.cuda.{i}": s
                        for i, s in enumerate(torch.cuda.get_rng_state_all())})
        return weights, optimizer, rng

    def restore(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any],
                rng: Mapping[str, torch.Tensor]) -> None:
        """Put a checkpoint's weights, optimizer state and this rank's RNG states back (sharded:
        every rank gives the whole checkpoint, and keeps its shard)."""
        if self.sharded:
            self.sharded.restore(weights, optimizer)
        else:
            self.accelerator.unwrap_model(self.model).load_state_dict(dict(weights))
            self.optimizer.load_state_dict(dict(optimizer))
        prefix = f"rank{self.rank}."
        torch.set_rng_state(rng[prefix + "torch"])
        cuda = [rng[k] for k in sorted(rng) if k.startswith(prefix + "cuda.")]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)

    def held(self) -> dict[str, torch.Tensor] | None:
        """This rank's shards of the weights (``FullySharded.held``); None: unsharded."""
        return self.sharded.held() if self.sharded else None

    # ----------------------------------------------------------------- one step

    def train_step(self, units: Sequence[Any], result: ObjectiveResult[Any], step: int
                   ) -> dict[str, float]:
        """Train on ``units`` (exactly ``schedule.units_per_step``) with ``result``'s advantages.

        Returns the step's metrics: the loss (each optimizer batch's, its micro
        batches and ranks normalised by the batch's ``BatchTotals``; mean over
        batches), the loss's own metrics (averaged over micro batches, then
        ranks), the objective's (prefixed
        ``objective.``), the policy's health against the behaviour policies
        before the first update (``_gap_metrics``: a policy-gradient family's
        only) and the update's relative size (``_update_ratio``).
        Deterministic given the units, the result, ``step`` and the
        backend's state. Under data parallelism every rank must call it for
        the same step (it all-reduces).

        ``NonFiniteStep`` when an advantage of a real token, a micro batch's
        loss or an optimizer batch's gradient norm is NaN or infinite: raised
        before that update reaches the weights, naming the step and units.
        ``FatalError`` when ``result.loss_family`` is not the family the recipe bound (the
        objective's declared one, which the backend's loss and inputs were built for).
        """
        if result.loss_family is not self.family:
            raise FatalError(
                f"step {step}: the objective's result asks for the loss family "
                f"{result.loss_family.name!r} but the recipe bound {self.family.name!r} (its "
                "objective's declared loss_family, checked against the backend at load time): "
                "an objective returns results for the family it declares")
        schedule = self.schedule
        members = [unit_members(u) for u in units]
        starts = np.cumsum([0] + [len(m) for m in members])
        if result.advantages.num_samples != starts[-1]:
            raise FatalError(f"the objective returned {result.advantages.num_samples} advantage "
                             f"rows for {starts[-1]} samples")
        bad = _non_finite_rows(result.advantages)
        if bad.size:
            owners = sorted({int(i) for i in np.searchsorted(starts, bad, side="right") - 1})
            self._diverged_everywhere()
            raise NonFiniteStep(_diverged(step, [units[i] for i in owners], (
                f"the objective returned NaN or infinite advantages for {bad.size} of "
                f"{starts[-1]} samples (first: row {int(bad[0])})")))
        self._unless_diverged_elsewhere(step, "the objective's advantages")
        gap = torch.zeros(6, dtype=torch.float64, device=self.accelerator.device)
        before = self._parameters()
        self.model.train()
        proximal = None
        device = self.accelerator.device
        if ExtraInput.PROXIMAL_LOGPROBS in self.extras:   # the weights of step - 1, no grad
            size = schedule.micro_batch_size
            proximal = proximal_logprobs(self.model, [
                (collate([s for i in chunk for s in members[i]]).to(device),
                 np.concatenate([np.arange(starts[i], starts[i + 1]) for i in chunk]))
                for chunk in (range(f, min(f + size, len(members)))
                              for f in range(0, len(members), size))])
        totals: dict[str, float] = {}
        micro_batches = updates = skipped = 0
        batch_losses = 0.0
        for epoch in range(schedule.epochs):
            order = np.arange(len(units))
            if schedule.shuffle:
                order = np.random.default_rng([schedule.seed, step, epoch, self.rank]).permutation(
                    len(units))
            for first in range(0, len(order), self.optimizer_batch):
                batch_units = order[first:first + self.optimizer_batch]
                self.optimizer.zero_grad(set_to_none=True)
                micros = []
                for micro in range(0, len(batch_units), schedule.micro_batch_size):
                    chosen = batch_units[micro:micro + schedule.micro_batch_size]
                    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in chosen])
                    samples = [s for i in chosen for s in members[i]]
                    micros.append((chosen, rows, samples, collate(samples).to(device),
                                   torch.from_numpy(kept_rows(result.advantages, rows)).to(
                                       device)))
                # The normaliser of every micro batch's loss: the optimizer batch's totals over
                # every micro batch and rank, agreed before any backward pass.
                batch_totals = BatchTotals(*self._sum_over_ranks(local_totals(
                    [(batch.completion_mask, keep) for _, _, _, batch, keep in micros],
                    per_sample=self.family.inputs is ValueRegressionInputs)))
                if batch_totals.tokens == 0:  # every sample dropped (dynamic sampling), on
                    skipped += 1              # every rank: no update, or AdamW's momentum and
                    continue                  # weight decay would move the weights on nothing
                for chosen, rows, samples, batch, keep in micros:
                    inputs = self._inputs(batch, rows, result.advantages, proximal)
                    if epoch == 0 and first == 0:  # no update yet: the weights of step - 1
                        self._behaviour_gap(inputs, samples, step, gap)
                    inputs = restricted(inputs, keep, batch_totals)
                    output = self.loss(inputs)
                    loss = float(output.loss.detach())
                    if not math.isfinite(loss):
                        self._diverged_everywhere()
                        raise NonFiniteStep(_diverged(step, [units[i] for i in chosen], (
                            f"the loss of a micro batch (epoch {epoch + 1}) is {_number(loss)}")))
                    self._unless_diverged_elsewhere(
                        step, f"a micro batch's loss (epoch {epoch + 1})")
                    # Each loss is its micro batch's share of the optimizer batch's loss, whole
                    # ranks included; DDP averages the ranks' gradients, so times ranks.
                    self.accelerator.backward(output.loss * self.ranks)
                    micro_batches += 1
                    batch_losses += loss
                    for name, value in output.metrics.items():
                        totals[name] = totals.get(name, 0.0) + float(value)
                    if self.between_micro_batches:
                        self.between_micro_batches(micro_batches)
                grad_norm = self._clip_gradients()
                if not math.isfinite(grad_norm):
                    raise NonFiniteStep(_diverged(step, [units[i] for i in batch_units], (
                        f"the gradient norm of an optimizer batch (epoch {epoch + 1}) is "
                        f"{_number(grad_norm)}")))
                totals[TRAINER_GRAD_NORM] = totals.get(TRAINER_GRAD_NORM, 0.0) + grad_norm
                updates += 1
                self.optimizer.step()
        grad_norm = totals.pop(TRAINER_GRAD_NORM, 0.0) / max(updates, 1)
        # The loss's metrics: the mean over micro batches, then over ranks; the step's loss: its
        # optimizer batches' (their micro batches' and ranks' shares summed), mean. One
        # all-reduce (every rank has the same loss, so the same metric names).
        names = sorted(totals)
        summed = self._sum_over_ranks([totals[n] / max(micro_batches, 1) for n in names]
                                      + [batch_losses])
        metrics = {name: value / self.ranks for name, value in zip(names, summed)}
        metrics["loss"] = summed[-1] / max(updates, 1)
        metrics[TRAINER_GRAD_NORM] = grad_norm
        if skipped:
            metrics[TRAINER_SKIPPED_UPDATES] = float(skipped)
        metrics.update(self._gap_metrics(gap))
        metrics.update(self._update_ratio(before))
        metrics.update({f"objective.{k}": v for k, v in result.metrics.items()})
        return metrics


def _non_finite_rows(advantages: Advantages) -> np.ndarray:
    """Rows (samples) with a NaN or infinite advantage; per token, on real tokens only."""
    values = np.asarray(advantages.values)
    if isinstance(advantages, PerTokenAdvantages):
        return np.flatnonzero((~np.isfinite(values) & np.asarray(advantages.mask)).any(axis=1))
    return np.flatnonzero(~np.isfinite(values))


def _diverged(step: int, units: Sequence[Any], what: str) -> str:
    """The message of a ``NonFiniteStep``: what, where, and what to do."""
    ids = [getattr(u, "unit_id", "?") for u in units]
    named = ", ".join(ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
    return (f"step {step}, units {named}: {what}. The trainer checks every unit "
            "before training it (reef_stream.engine.training.untrainable), so the objective or the "
            "optimisation diverged: the step was abandoned before this update reached the "
            "weights and no checkpoint holds it. Replaying it gives the same result: fix the "
            "objective or lower the learning rate, then start the trainer again")
