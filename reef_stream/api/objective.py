"""``Objective``: a batch of typed units and the algorithm state in, a frozen result out.

An objective is the research logic of training: from the units of one step
(e.g. groups of scored samples) and the current algorithm state (e.g. running
reward statistics, a KL coefficient) it computes advantages, metrics and the
*proposed* next state, and names the loss family the backend must apply.
It imports no Kafka, no Redis, no optimizer; its arrays are numpy arrays or
torch tensors.

Objectives propose; the runtime applies: the trainer makes ``proposed_state``
the current state only when the step is acknowledged (its checkpoint durable,
its offsets committed). A step replayed after a crash calls ``compute`` again
with the same units and the same state and must get the same result.

Sample order: row ``i`` of the advantages is the ``i``-th sample of the batch
in the order the unit type lists them; for ``RolloutUnit`` that is units in
batch order, then each unit's ``members`` in order (``rollout_samples``).

Algorithm state is a frozen dataclass chosen by the method whose fields are
``int``, ``float``, ``str``, ``bool`` or tuples of those, so the trainer can
store it in a checkpoint (``state_record`` / ``state_from_record``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, Union, runtime_checkable

import numpy as np

from reef_stream.api.losses import LossFamily
from reef_stream.core.errors import FatalError
from reef_stream.core.events import RolloutUnit, Sample

if TYPE_CHECKING:
    import torch

UnitT = TypeVar("UnitT")
UnitT_contra = TypeVar("UnitT_contra", contravariant=True)
StateT = TypeVar("StateT")

#: A numpy array or a torch tensor (CPU or device).
Array = Union[np.ndarray, "torch.Tensor"]


@dataclass(frozen=True, slots=True, eq=False)
class PerSampleAdvantages:
    """One advantage per sample: ``values: float[num_samples]``.

    The backend broadcasts each value over the sample's completion tokens.
    """

    values: Array
    #: ``bool[num_samples]`` or None (all): the samples the loss trains on. A sample not kept
    #: has no loss token: it counts in neither the loss nor its normaliser (dynamic sampling,
    #: DAPO, drops the groups whose rewards are all equal).
    keep: Array | None = None

    def __post_init__(self) -> None:
        _require_ndim("PerSampleAdvantages.values", self.values, 1)
        _check_keep("PerSampleAdvantages", self.keep, self.values)

    @property
    def num_samples(self) -> int:
        return int(self.values.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class PerTokenAdvantages:
    """One advantage per completion token.

    Shapes: ``values: float[num_samples, max_completion_len]``,
    ``mask: bool[num_samples, max_completion_len]`` (True on a sample's real
    completion tokens, left-aligned; False on padding, whose values are
    ignored).
    """

    values: Array
    mask: Array
    #: ``bool[num_samples]`` or None (all): the samples the loss trains on (as
    #: ``PerSampleAdvantages.keep``).
    keep: Array | None = None

    def __post_init__(self) -> None:
        _check_keep("PerTokenAdvantages", self.keep, self.values)
        _require_ndim("PerTokenAdvantages.values", self.values, 2)
        _require_ndim("PerTokenAdvantages.mask", self.mask, 2)
        if tuple(self.values.shape) != tuple(self.mask.shape):
            raise FatalError(
                f"PerTokenAdvantages: values have shape {tuple(self.values.shape)}, mask "
                f"{tuple(self.mask.shape)}; they must be equal")

    @property
    def num_samples(self) -> int:
        return int(self.values.shape[0])


Advantages = Union[PerSampleAdvantages, PerTokenAdvantages]


@dataclass(frozen=True, slots=True, eq=False)
class ObjectiveResult(Generic[StateT]):
    """What an objective proposes for one step. Nothing in it has been applied yet.

    ``advantages``: per sample or per token (see their shapes); ``metrics``:
    finite floats named without a prefix (the runtime adds the stage);
    ``proposed_state``: the algorithm state after this step, applied only
    when the step is acknowledged; ``loss_family``: the family the backend
    must run on these advantages: the objective's declared one, which the recipe
    bound to the backend at load time (the trainer refuses a result naming another
    family with a ``FatalError`` rather than train it with the wrong loss).
    """

    advantages: Advantages
    metrics: Mapping[str, float]
    proposed_state: StateT
    loss_family: LossFamily[Any]

    def __post_init__(self) -> None:
        if not isinstance(self.advantages, (PerSampleAdvantages, PerTokenAdvantages)):
            raise FatalError(
                f"ObjectiveResult.advantages must be PerSampleAdvantages or PerTokenAdvantages, "
                f"got {type(self.advantages).__name__}")
        if not isinstance(self.loss_family, LossFamily):
            raise FatalError(f"ObjectiveResult.loss_family must be a LossFamily, "
                             f"got {self.loss_family!r}")
        bad = [name for name, value in self.metrics.items()
               if not isinstance(name, str) or not isinstance(value, (int, float))
               or isinstance(value, bool) or not math.isfinite(value)]
        if bad:
            raise FatalError(f"ObjectiveResult.metrics must map names to finite floats; "
                             f"bad entries: {bad}")
        object.__setattr__(self, "metrics", types.MappingProxyType(
            {name: float(value) for name, value in self.metrics.items()}))


@runtime_checkable
class Objective(Protocol[UnitT_contra, StateT]):
    """Units + algorithm state -> advantages, metrics, proposed state (an ``ObjectiveResult``).

    ``name``: for people and metrics. ``unit_type``: the event class of the
    units it consumes; a recipe's processor must emit exactly this type.
    ``loss_family``: the family its results need; the recipe's backend must
    support it.
    """

    name: str
    unit_type: type
    loss_family: LossFamily[Any]

    def initial_state(self) -> StateT:
        """The algorithm state before the first step. Pure; called once, when a trainer
        starts without a checkpoint. Idempotent."""
        ...

    def compute(self, units: Sequence[UnitT_contra], state: StateT) -> ObjectiveResult[StateT]:
        """The result of one step over ``units`` (at least one) given ``state``.

        Pure and deterministic: no side effects, no randomness beyond what
        ``state`` carries, so replaying a step gives the same result. Blocks
        for the computation only (no I/O). Called once per training step, in
        step order, after the step's units are fixed and before the forward
        pass. Raise ``FatalError`` only for a bug; bad units never reach it.
        """
        ...


def rollout_samples(units: Sequence[RolloutUnit]) -> tuple[Sample, ...]:
    """The samples of ``units`` in advantage-row order: units in order, then their members."""
    return tuple(sample for unit in units for sample in unit.members)


# --------------------------------------------------------------------------- algorithm state


_PRIMITIVES = (int, float, str, bool)


def state_record(state: Any) -> dict[str, Any]:
    """A frozen-dataclass algorithm state as a plain dict of primitives and lists (JSON-able).

    Raises ``FatalError`` for a state that is not a dataclass or holds other
    values: the objective cannot be checkpointed.
    """
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise FatalError(f"algorithm state must be a frozen dataclass, got {type(state).__name__}")
    record: dict[str, Any] = {}
    for item in dataclasses.fields(state):
        value = getattr(state, item.name)
        if isinstance(value, tuple) and all(isinstance(v, _PRIMITIVES) for v in value):
            record[item.name] = list(value)
        elif isinstance(value, _PRIMITIVES):
            record[item.name] = value
        else:
            raise FatalError(f"algorithm state field {item.name!r} holds {type(value).__name__}; "
                             "only int, float, str, bool and tuples of them can be checkpointed")
    return record


def state_from_record(cls: type[StateT], record: Mapping[str, Any]) -> StateT:
    """The ``cls`` state of a ``state_record``; lists become tuples again."""
    hints = typing.get_type_hints(cls)
    values = {}
    for item in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = record[item.name]
        if typing.get_origin(hints[item.name]) is tuple:
            value = tuple(value)
        values[item.name] = value
    return cls(**values)


def _require_ndim(name: str, value: Any, ndim: int) -> None:
    if not hasattr(value, "ndim") or not hasattr(value, "shape"):
        raise FatalError(f"{name} must be a numpy array or a torch tensor, got "
                         f"{type(value).__name__}")
    if value.ndim != ndim:
        raise FatalError(f"{name} must have {ndim} dims, got shape {tuple(value.shape)}")


def _check_keep(kind: str, keep: Any, values: Any) -> None:
    if keep is None:
        return
    _require_ndim(f"{kind}.keep", keep, 1)
    if keep.shape[0] != values.shape[0] or "bool" not in str(keep.dtype):
        raise FatalError(f"{kind}.keep must be bool[{values.shape[0]}] (one per sample), got "
                         f"{keep.dtype}{list(keep.shape)}")


def kept_rows(advantages: Advantages, rows: np.ndarray) -> np.ndarray:
    """``bool[len(rows)]``: whether each of the samples at ``rows`` is trained on."""
    if advantages.keep is None:
        return np.ones(len(rows), dtype=bool)
    return np.asarray(advantages.keep)[rows].astype(bool)
