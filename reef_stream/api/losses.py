"""Loss families: typed protocols with a fixed typed return, never strings.

A loss family names what a training backend must compute from an objective's
result and the model's forward pass:

- its ``inputs`` type, a frozen dataclass of tensors with documented shapes,
  checked once when it is built;
- its ``protocol``, the call signature of every loss of the family:
  ``loss(inputs) -> LossOutput``, always the same return (a scalar loss tensor
  and float metrics), never a string switch or a tuple of varying length;
- a ``reference`` implementation: minimal and correct, tested with values
  computed by hand. A backend may use its own implementation of the family.

Two families are built in: ``POLICY_GRADIENT`` (current and behaviour
log-probabilities per token, advantages, mask) and ``VALUE_REGRESSION``
(predictions, targets, mask). A method package registers its own with
``register_loss_family``; a recipe's objective declares the family it needs,
its backend the families it supports, and ``load_recipe`` checks the two
agree.

This module and ``reef_stream.api.variants`` (the typed options of the built-in losses) are
the only algorithm modules that import torch.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from reef_stream.api.variants import (
    LOG_RATIO_BOUND, Aggregation, BatchTotals, BehaviourWeightMode, DecoupledProximal,
    EntropyBonus, ExtraInput, KLPenalty, RatioLevel, TokenMean, check_aggregation, log_ratio,
)
from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.metric_names import (
    LOSS_BEHAVIOUR_MASKED_FRACTION, LOSS_BEHAVIOUR_TRUNCATED_FRACTION, LOSS_BEHAVIOUR_WEIGHT_MEAN,
    LOSS_CLIP_FRACTION, LOSS_CLIP_FRACTION_HIGH, LOSS_CLIP_FRACTION_LOW, LOSS_DUAL_CLIP_FRACTION,
    LOSS_ENTROPY, LOSS_KL_REFERENCE, LOSS_RATIO_MEAN,
)

InputsT = TypeVar("InputsT")
InputsT_contra = TypeVar("InputsT_contra", contravariant=True)


@dataclass(frozen=True, slots=True, eq=False)
class LossOutput:
    """What every loss returns.

    ``loss``: a 0-d tensor, differentiable with respect to the model's
    outputs; the backend calls ``backward`` on it. ``metrics``: plain floats
    (detached), named without the family prefix (e.g. ``clip_fraction``).
    """

    loss: torch.Tensor
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.loss, torch.Tensor) or self.loss.ndim != 0:
            raise FatalError(f"a loss must be a 0-d tensor, got {_shape_of(self.loss)}")


class LossFunction(Protocol[InputsT_contra]):
    """A loss of some family: ``loss(inputs) -> LossOutput``.

    Pure: no side effects, no optimizer step; called once per micro batch,
    after the forward pass, before ``backward``. Idempotent.
    """

    def __call__(self, inputs: InputsT_contra, /) -> LossOutput: ...


@dataclass(frozen=True, slots=True, eq=False)
class LossFamily(Generic[InputsT]):
    """One family of losses: its name, its input type and its reference implementation.

    Families compare by identity: a recipe binds the family object itself,
    so two families that happen to share a name are never confused (the
    registry refuses the second one).
    """

    name: str
    #: The frozen dataclass a loss of this family takes.
    inputs: type[InputsT]
    #: The protocol every loss of this family follows (for documentation and type checkers).
    protocol: type
    #: A minimal, correct implementation.
    reference: LossFunction[InputsT]
    description: str

    def __repr__(self) -> str:
        return f"LossFamily({self.name!r})"


# --------------------------------------------------------------------------- policy gradient


@dataclass(frozen=True, slots=True, eq=False)
class PolicyGradientInputs:
    """Inputs of a policy-gradient loss over a micro batch of B samples, T completion tokens.

    Shapes: ``logprobs: float[B, T]`` (current policy, differentiable),
    ``behaviour_logprobs: float[B, T]`` (the policy that sampled, from the
    generation events), ``advantages: float[B, T]`` (a per-sample advantage
    is broadcast over its tokens by the backend), ``mask: bool[B, T]`` (True
    on the tokens the loss trains, False on padding and on dropped samples).

    ``totals``: the optimizer batch's loss tokens and sequences over every
    micro batch and data-parallel rank (``BatchTotals``), what a loss divides
    by, so micro-batch size and rank count do not change the loss; None: this
    micro batch's own counts. Optional tensors, ``float[B, T]``, present when
    the loss asks for them (its ``extra_inputs``): ``reference_logprobs`` (a
    frozen reference policy), ``proximal_logprobs`` (the weights at the start
    of the step), ``entropy`` (the current policy's, differentiable).
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    totals: BatchTotals | None = None
    reference_logprobs: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        present = tuple(name for name in ("reference_logprobs", "proximal_logprobs", "entropy")
                        if getattr(self, name) is not None)
        _check_same_shape(self, ("logprobs", "behaviour_logprobs", "advantages", "mask")
                          + present, ndim=2)
        _check_totals(self)

    def needed(self, extra: ExtraInput, by: str) -> torch.Tensor:
        """The optional tensor ``extra``; ``FatalError`` naming the loss ``by`` when the backend
        did not provide it (it provides what a loss's ``extra_inputs`` lists)."""
        value = getattr(self, extra.value)
        if value is None:
            raise FatalError(f"{by} needs {extra.value} in its PolicyGradientInputs; list "
                             f"ExtraInput.{extra.name} in its extra_inputs")
        return value


class PolicyGradientLoss(Protocol):
    """A policy-gradient loss: ``loss(PolicyGradientInputs) -> LossOutput``. Pure, idempotent.

    Its loss is the micro batch's share of the optimizer batch's loss: it divides by
    ``inputs.totals`` (when given), so the backend sums micro batches and ranks."""

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput: ...


def _check_options(owner: str, aggregation: Any, log_ratio_bound: Any, kl: Any, entropy: Any
                   ) -> None:
    check_aggregation(owner, aggregation)
    if isinstance(log_ratio_bound, bool) or not isinstance(log_ratio_bound, (int, float)) \
            or not 0 < log_ratio_bound <= 80:
        raise ConfigurationError(f"{owner}.log_ratio_bound must be in (0, 80] (exp stays "
                                 f"finite in float32), got {log_ratio_bound!r}")
    if kl is not None and not isinstance(kl, KLPenalty):
        raise ConfigurationError(f"{owner}.kl must be a KLPenalty or None, got {kl!r}")
    if entropy is not None and not isinstance(entropy, EntropyBonus):
        raise ConfigurationError(f"{owner}.entropy must be an EntropyBonus or None, got {entropy!r}")


def _extras(kl: KLPenalty | None, entropy: EntropyBonus | None,
            proximal: DecoupledProximal | None = None) -> frozenset[ExtraInput]:
    return frozenset(
        ([ExtraInput.REFERENCE_LOGPROBS] if kl is not None else [])
        + ([ExtraInput.ENTROPY] if entropy is not None else [])
        + ([ExtraInput.PROXIMAL_LOGPROBS] if proximal is not None else []))


def _penalised(terms: torch.Tensor, inputs: PolicyGradientInputs, kl: KLPenalty | None,
               entropy: EntropyBonus | None, bound: float, by: str, metrics: dict[str, float],
               mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``terms`` plus the KL penalty and minus the entropy bonus per token (both aggregated
    like the surrogate); their token means go to ``metrics``."""
    if kl is not None:
        estimate = kl.estimate(
            inputs.logprobs, inputs.needed(ExtraInput.REFERENCE_LOGPROBS, by), bound)
        terms = terms + kl.coefficient * estimate
        metrics[LOSS_KL_REFERENCE] = float((estimate.detach() * mask).sum() / count)
    if entropy is not None:
        values = inputs.needed(ExtraInput.ENTROPY, by)
        terms = terms - entropy.coefficient * values
        metrics[LOSS_ENTROPY] = float((values.detach() * mask).sum() / count)
    return terms


@dataclass(frozen=True, slots=True)
class ClippedPolicyGradient:
    """The clipped importance-weighted surrogate (PPO, Schulman et al. 2017), with its variants.

    With the log-ratio ``l = clamp(logprobs - anchor, -log_ratio_bound, log_ratio_bound)``
    (``anchor``: the behaviour logprobs; the proximal ones under ``proximal``), per token
    (``RatioLevel.TOKEN``) or its sequence's token mean (``RatioLevel.SEQUENCE``, GSPO),
    ``r = exp(l)``, per loss token::

        surrogate = min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)
        surrogate = max(surrogate, dual_clip * A)      where A < 0, when dual_clip is set
        surrogate = w * surrogate                      under proximal: w the behaviour
                                                       weight, e.g. min(exp(proximal -
                                                       behaviour), weight_cap), no gradient
        term      = -surrogate + kl.coefficient * k(current, reference)
                    - entropy.coefficient * entropy
        term      = 0 on a token the behaviour weight drops (BehaviourWeightMode.MASK)
        loss      = aggregation(term)                  over the optimizer batch (``totals``,
                                                       dropped tokens counted)

    ``epsilon``: the low side (and the high one when ``epsilon_high`` is None, the default);
    ``epsilon_high``: DAPO's clip-higher (Yu et al. 2025; e.g. 0.28); ``dual_clip``: the bound
    ``c > 1`` on a negative advantage's loss (dual-clip PPO, Ye et al. 2020). Defaults: PPO's
    token-level clip at 0.2 with token-mean aggregation. Gradients flow through ``logprobs``
    (and ``entropy``) only. A batch without loss tokens has loss 0. Metrics over the micro
    batch's loss tokens: ``ratio_mean``, ``clip_fraction`` (the clipped term chosen and
    different), ``clip_fraction_low`` / ``clip_fraction_high`` (by side), and when on
    ``dual_clip_fraction``, ``kl_reference``, ``entropy``, ``behaviour_weight_mean`` and
    ``behaviour_truncated_fraction`` or ``behaviour_masked_fraction`` (the ratio's and the
    penalties' metrics leave dropped tokens out).
    ``ConfigurationError`` for a bad option.
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    dual_clip: float | None = None
    ratio_level: RatioLevel = RatioLevel.TOKEN
    aggregation: Aggregation = TokenMean()
    kl: KLPenalty | None = None
    entropy: EntropyBonus | None = None
    proximal: DecoupledProximal | None = None
    log_ratio_bound: float = LOG_RATIO_BOUND

    def __post_init__(self) -> None:
        owner = "ClippedPolicyGradient"
        _clip_range(owner, "epsilon", self.epsilon, upper=1.0)
        if self.epsilon_high is not None:
            _clip_range(owner, "epsilon_high", self.epsilon_high, upper=math.inf)
        if self.dual_clip is not None and (
                isinstance(self.dual_clip, bool) or not isinstance(self.dual_clip, (int, float))
                or not 1.0 < self.dual_clip < math.inf):
            raise ConfigurationError(f"{owner}.dual_clip must be a finite number > 1 or None, "
                                     f"got {self.dual_clip!r}")
        if not isinstance(self.ratio_level, RatioLevel):
            raise ConfigurationError(f"{owner}.ratio_level must be a RatioLevel (TOKEN, "
                                     f"SEQUENCE), got {self.ratio_level!r}")
        if self.proximal is not None and not isinstance(self.proximal, DecoupledProximal):
            raise ConfigurationError(f"{owner}.proximal must be a DecoupledProximal or None, "
                                     f"got {self.proximal!r}")
        _check_options(owner, self.aggregation, self.log_ratio_bound, self.kl, self.entropy)

    @property
    def extra_inputs(self) -> frozenset[ExtraInput]:
        """What the backend must add to the inputs for this loss's options."""
        return _extras(self.kl, self.entropy, self.proximal)

    def describe(self) -> tuple[str, ...]:
        """The chosen variant of each part, one ``part: choice`` a line (``reef check``)."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return (
            f"clip: ratio in [1 - {self.epsilon:g}, 1 + {high:g}]"
            + (" (clip-higher, DAPO)" if high != self.epsilon else " (PPO)")
            + (f", dual clip {self.dual_clip:g} (dual-clip PPO)" if self.dual_clip else
               ", no dual clip"),
            f"ratio: {self.ratio_level.value}-level"
            + (" (GSPO)" if self.ratio_level is RatioLevel.SEQUENCE else " (PPO)"),
            f"aggregation: {self.aggregation.describe()}",
            f"kl: {self.kl.describe() if self.kl else 'none'}",
            f"entropy: {self.entropy.describe() if self.entropy else 'none'}",
            "anchor: " + (self.proximal.describe() if self.proximal
                          else "the behaviour policy (no proximal policy)"),
            f"log-ratio: clamped to +-{self.log_ratio_bound:g} before exp",
        )

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput:
        name = type(self).__name__
        totals = inputs.totals or BatchTotals.of(inputs.mask)
        kept = inputs.mask
        metrics: dict[str, float] = {}
        if self.proximal is not None:
            anchor = inputs.needed(ExtraInput.PROXIMAL_LOGPROBS, name)
            weight, kept, truncated = self.proximal.weights(
                anchor, inputs.behaviour_logprobs, inputs.mask, self.log_ratio_bound)
            # Over the tokens it weights; the shares over the loss tokens (the mask).
            shares = inputs.mask.sum().clamp(min=1)
            metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] = float(weight.sum() / kept.sum().clamp(min=1))
            if self.proximal.weight_mode is BehaviourWeightMode.MASK:
                metrics[LOSS_BEHAVIOUR_MASKED_FRACTION] = float((inputs.mask & ~kept).sum()
                                                                / shares)
            elif self.proximal.weight_cap is not None or self.proximal.weight_floor is not None:
                metrics[LOSS_BEHAVIOUR_TRUNCATED_FRACTION] = float(truncated.sum() / shares)
        else:
            anchor = inputs.behaviour_logprobs
        # The tokens the loss trains: the mask, but for those the behaviour weight drops; the
        # normaliser stays the mask's (totals), and so do the sequences' lengths.
        mask = kept.to(inputs.logprobs.dtype)
        count = mask.sum().clamp(min=1.0)
        ratio = torch.exp(log_ratio(inputs.logprobs, anchor, kept, self.ratio_level,
                                    self.log_ratio_bound))
        advantages = inputs.advantages.detach()
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + high) * advantages
        surrogate = torch.minimum(unclipped, clipped)
        if self.dual_clip is not None:
            floor = self.dual_clip * advantages
            dual = (advantages < 0) & (floor > surrogate)
            surrogate = torch.where(dual, floor, surrogate)
            metrics[LOSS_DUAL_CLIP_FRACTION] = float((dual * mask).sum() / count)
        if self.proximal is not None:
            surrogate = weight * surrogate
        terms = _penalised(-surrogate, inputs, self.kl, self.entropy, self.log_ratio_bound,
                           name, metrics, mask, count)
        loss = self.aggregation.reduce(torch.where(kept, terms, 0.0),
                                       inputs.mask.to(mask.dtype), totals)
        with torch.no_grad():
            was_clipped = (clipped < unclipped).to(mask.dtype) * mask
            metrics.update({
                LOSS_RATIO_MEAN: float((ratio * mask).sum() / count),
                LOSS_CLIP_FRACTION: float(was_clipped.sum() / count),
                LOSS_CLIP_FRACTION_LOW: float((was_clipped * (ratio < 1.0)).sum() / count),
                LOSS_CLIP_FRACTION_HIGH: float((was_clipped * (ratio > 1.0)).sum() / count),
            })
        return LossOutput(loss=loss, metrics=metrics)


@dataclass(frozen=True, slots=True)
class ClippedWeightPolicyGradient:
    """CISPO (MiniMax-M1, 2025): clip the importance *weight*, not the update, so every token
    keeps a gradient. Per loss token, with ``r = exp(clamp(logprobs - behaviour, +-bound))``::

        w    = clip(r, 1 - epsilon_low, 1 + epsilon_high)      (no gradient)
        term = -w * A * logprobs + kl and entropy terms as in ClippedPolicyGradient
        loss = aggregation(term)

    ``epsilon_low``: the lower bound's distance below 1 (None: no lower bound, weights down
    to 0); ``epsilon_high``: above 1. The loss value is a surrogate whose gradient matters.
    Metrics: ``ratio_mean``, ``clip_fraction`` and its sides (weights clipped), and the
    penalties' when on. ``ConfigurationError`` for a bad option.
    """

    epsilon_high: float = 0.2
    epsilon_low: float | None = None
    aggregation: Aggregation = TokenMean()
    kl: KLPenalty | None = None
    entropy: EntropyBonus | None = None
    log_ratio_bound: float = LOG_RATIO_BOUND

    def __post_init__(self) -> None:
        owner = "ClippedWeightPolicyGradient"
        _clip_range(owner, "epsilon_high", self.epsilon_high, upper=math.inf)
        if self.epsilon_low is not None:
            _clip_range(owner, "epsilon_low", self.epsilon_low, upper=1.0)
        _check_options(owner, self.aggregation, self.log_ratio_bound, self.kl, self.entropy)

    @property
    def extra_inputs(self) -> frozenset[ExtraInput]:
        return _extras(self.kl, self.entropy)

    def describe(self) -> tuple[str, ...]:
        """The chosen variant of each part, one ``part: choice`` a line (``reef check``)."""
        low = "0" if self.epsilon_low is None else f"1 - {self.epsilon_low:g}"
        return (f"weights: clip(ratio, {low}, 1 + {self.epsilon_high:g}), no gradient (CISPO)",
                "ratio: token-level",
                f"aggregation: {self.aggregation.describe()}",
                f"kl: {self.kl.describe() if self.kl else 'none'}",
                f"entropy: {self.entropy.describe() if self.entropy else 'none'}",
                f"log-ratio: clamped to +-{self.log_ratio_bound:g} before exp")

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput:
        mask = inputs.mask.to(inputs.logprobs.dtype)
        totals = inputs.totals or BatchTotals.of(inputs.mask)
        count = mask.sum().clamp(min=1.0)
        with torch.no_grad():
            ratio = torch.exp(log_ratio(inputs.logprobs, inputs.behaviour_logprobs, inputs.mask,
                                        RatioLevel.TOKEN, self.log_ratio_bound))
            low = 0.0 if self.epsilon_low is None else 1.0 - self.epsilon_low
            weight = ratio.clamp(low, 1.0 + self.epsilon_high)
            below, above = (ratio < low) * mask, (ratio > 1.0 + self.epsilon_high) * mask
        metrics: dict[str, float] = {}
        terms = _penalised(-(weight * inputs.advantages.detach()) * inputs.logprobs, inputs,
                           self.kl, self.entropy, self.log_ratio_bound,
                           type(self).__name__, metrics, mask, count)
        loss = self.aggregation.reduce(terms, mask, totals)
        metrics.update({
            LOSS_RATIO_MEAN: float((ratio * mask).sum() / count),
            LOSS_CLIP_FRACTION: float((below + above).sum() / count),
            LOSS_CLIP_FRACTION_LOW: float(below.sum() / count),
            LOSS_CLIP_FRACTION_HIGH: float(above.sum() / count),
        })
        return LossOutput(loss=loss, metrics=metrics)


def _clip_range(owner: str, name: str, value: Any, *, upper: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 < value <= upper or not math.isfinite(value):
        raise ConfigurationError(f"{owner}.{name} must be a finite number in (0, {upper:g}], "
                                 f"got {value!r}")


POLICY_GRADIENT: LossFamily[PolicyGradientInputs] = LossFamily(
    name="policy_gradient",
    inputs=PolicyGradientInputs,
    protocol=PolicyGradientLoss,
    reference=ClippedPolicyGradient(),
    description="current and behaviour logprobs per token, advantages, mask -> clipped "
                "importance-weighted surrogate",
)


# --------------------------------------------------------------------------- value regression


@dataclass(frozen=True, slots=True, eq=False)
class ValueRegressionInputs:
    """Inputs of a value-regression loss.

    Shapes (all the same): ``predictions: float[B]`` or ``float[B, T]``
    (differentiable), ``targets`` (e.g. returns or rewards), ``mask: bool``
    (True where the target counts).
    """

    predictions: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    #: The optimizer batch's unmasked entries (``tokens``) over every micro batch and rank;
    #: None: this micro batch's own.
    totals: BatchTotals | None = None

    def __post_init__(self) -> None:
        _check_same_shape(self, ("predictions", "targets", "mask"), ndim=(1, 2))
        _check_totals(self)


class ValueRegressionLoss(Protocol):
    """A value-regression loss: ``loss(ValueRegressionInputs) -> LossOutput``. Pure, idempotent."""

    def __call__(self, inputs: ValueRegressionInputs, /) -> LossOutput: ...


@dataclass(frozen=True, slots=True)
class MaskedSquaredError:
    """Mean squared error over unmasked entries.

    ``loss = sum(mask * (predictions - targets) ** 2) / max(totals.tokens, 1)``
    (``totals``: the optimizer batch's unmasked entries; this micro batch's when None);
    gradients flow through ``predictions`` only. Metrics: ``mse`` (the loss)
    and ``prediction_mean`` (over unmasked entries).
    """

    def __call__(self, inputs: ValueRegressionInputs, /) -> LossOutput:
        mask = inputs.mask.to(inputs.predictions.dtype)
        count = mask.sum().clamp(min=1.0)
        totals = inputs.totals or BatchTotals.of(inputs.mask)
        error = inputs.predictions - inputs.targets.detach()
        loss = (error.square() * mask).sum() / max(totals.tokens, 1.0)
        with torch.no_grad():
            metrics = {
                "mse": float((error.square() * mask).sum() / count),
                "prediction_mean": float((inputs.predictions * mask).sum() / count),
            }
        return LossOutput(loss=loss, metrics=metrics)


VALUE_REGRESSION: LossFamily[ValueRegressionInputs] = LossFamily(
    name="value_regression",
    inputs=ValueRegressionInputs,
    protocol=ValueRegressionLoss,
    reference=MaskedSquaredError(),
    description="predictions, targets, mask -> masked mean squared error",
)


# --------------------------------------------------------------------------- the registry

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_registry: dict[str, LossFamily[Any]] = {}
_registry_lock = threading.Lock()


def register_loss_family(family: LossFamily[Any]) -> LossFamily[Any]:
    """Make ``family`` known by its name; returns it, so a module can write
    ``MY_LOSS = register_loss_family(LossFamily(...))``.

    Called at import time of a method package. Idempotent for the same
    object. Raises ``ConfigurationError`` when the name is not lower_snake_case
    or another family already has it.
    """
    if not isinstance(family, LossFamily):
        raise ConfigurationError(f"{family!r} is not a LossFamily")
    if not _NAME.match(family.name):
        raise ConfigurationError(
            f"loss family name {family.name!r} must be lower_snake_case (e.g. 'policy_gradient')")
    with _registry_lock:
        known = _registry.get(family.name)
        if known is not None and known is not family:
            if _defined_in(known) == _defined_in(family):
                raise ConfigurationError(
                    f"loss family {family.name!r} is registered twice from {_defined_in(family)}: "
                    f"its module was imported under two names (e.g. methods.sao and "
                    f"reef_stream.methods.sao); import a method under one name in a process")
            raise ConfigurationError(
                f"a different loss family is already registered as {family.name!r}; "
                "choose another name")
        _registry[family.name] = family
    return family


def _defined_in(family: LossFamily[Any]) -> str:
    """Where a family's reference loss is written (file:line): the same for one module imported
    under two names, different for two families that merely share a name."""
    code = getattr(family.reference, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(family)


def loss_family(name: str) -> LossFamily[Any]:
    """The registered family named ``name``; ``ConfigurationError`` listing the known ones if none."""
    with _registry_lock:
        family = _registry.get(name)
        known = sorted(_registry)
    if family is None:
        raise ConfigurationError(f"no loss family named {name!r}; registered: {known}")
    return family


def loss_families() -> tuple[LossFamily[Any], ...]:
    """Every registered family, by name."""
    with _registry_lock:
        return tuple(_registry[name] for name in sorted(_registry))


def is_registered(family: LossFamily[Any]) -> bool:
    """Whether this very family object is the one registered under its name."""
    with _registry_lock:
        return _registry.get(family.name) is family


register_loss_family(POLICY_GRADIENT)
register_loss_family(VALUE_REGRESSION)


# --------------------------------------------------------------------------- shape checks


def _shape_of(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)


def _check_same_shape(inputs: Any, names: tuple[str, ...], *, ndim: int | tuple[int, ...]) -> None:
    """Every named field is a tensor of the first one's shape with ``ndim`` dims; mask is bool.

    A mismatch is a bug in the objective or the backend, not bad data: FatalError.
    """
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    kind = type(inputs).__name__
    problems = []
    tensors = {name: getattr(inputs, name) for name in names}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            problems.append(f"{name} must be a torch.Tensor, got {_shape_of(value)}")
    if problems:
        raise FatalError(f"{kind}: " + "; ".join(problems))
    first = names[0]
    shape = tensors[first].shape
    if len(shape) not in allowed:
        problems.append(f"{first} must have {' or '.join(map(str, allowed))} dims, got {tuple(shape)}")
    for name in names[1:]:
        if tensors[name].shape != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, {first} {tuple(shape)}")
    if "mask" in tensors and tensors["mask"].dtype != torch.bool:
        problems.append(f"mask must be a bool tensor, got {tensors['mask'].dtype}")
    if problems:
        raise FatalError(f"{kind}: " + "; ".join(problems))


def _check_totals(inputs: Any) -> None:
    if inputs.totals is not None and not isinstance(inputs.totals, BatchTotals):
        raise FatalError(f"{type(inputs).__name__}.totals must be a BatchTotals or None, got "
                         f"{inputs.totals!r}")
