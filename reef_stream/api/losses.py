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

This is the only algorithm module that imports torch.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from reef_stream.errors import ConfigurationError, FatalError

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
    on real completion tokens, False on padding).
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        _check_same_shape(self, ("logprobs", "behaviour_logprobs", "advantages", "mask"), ndim=2)


class PolicyGradientLoss(Protocol):
    """A policy-gradient loss: ``loss(PolicyGradientInputs) -> LossOutput``. Pure, idempotent."""

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput: ...


@dataclass(frozen=True, slots=True)
class ClippedPolicyGradient:
    """The clipped importance-weighted surrogate (PPO's), averaged over unmasked tokens.

    With ``r = exp(logprobs - behaviour_logprobs)`` per token:
    ``loss = -sum(mask * min(r * A, clip(r, 1 - epsilon, 1 + epsilon) * A)) / max(sum(mask), 1)``.
    Gradients flow through ``logprobs`` only. A micro batch without unmasked
    tokens has loss 0. Metrics: ``ratio_mean`` (over unmasked tokens),
    ``clip_fraction`` (share of unmasked tokens whose clipped term was chosen
    and differs from the unclipped one).
    """

    epsilon: float = 0.2

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput:
        mask = inputs.mask.to(inputs.logprobs.dtype)
        count = mask.sum().clamp(min=1.0)
        ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs.detach())
        advantages = inputs.advantages.detach()
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon) * advantages
        surrogate = torch.minimum(unclipped, clipped)
        loss = -(surrogate * mask).sum() / count
        with torch.no_grad():
            was_clipped = (clipped < unclipped).to(mask.dtype) * mask
            metrics = {
                "ratio_mean": float((ratio * mask).sum() / count),
                "clip_fraction": float(was_clipped.sum() / count),
            }
        return LossOutput(loss=loss, metrics=metrics)


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

    def __post_init__(self) -> None:
        _check_same_shape(self, ("predictions", "targets", "mask"), ndim=(1, 2))


class ValueRegressionLoss(Protocol):
    """A value-regression loss: ``loss(ValueRegressionInputs) -> LossOutput``. Pure, idempotent."""

    def __call__(self, inputs: ValueRegressionInputs, /) -> LossOutput: ...


@dataclass(frozen=True, slots=True)
class MaskedSquaredError:
    """Mean squared error over unmasked entries.

    ``loss = sum(mask * (predictions - targets) ** 2) / max(sum(mask), 1)``;
    gradients flow through ``predictions`` only. Metrics: ``mse`` (the loss)
    and ``prediction_mean`` (over unmasked entries).
    """

    def __call__(self, inputs: ValueRegressionInputs, /) -> LossOutput:
        mask = inputs.mask.to(inputs.predictions.dtype)
        count = mask.sum().clamp(min=1.0)
        error = inputs.predictions - inputs.targets.detach()
        loss = (error.square() * mask).sum() / count
        with torch.no_grad():
            metrics = {
                "mse": float(loss),
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
