"""``CandidateEvaluator``: measure a candidate checkpoint, then promote or reject it, with a reason.

Two steps, kept apart so the decision is reproducible:

- ``measure(candidate)`` runs whatever evaluation the method wants (held-out
  prompts, a judge, ...) and returns a ``Measurement``. It may block for a
  long time; it has no side effects (it publishes nothing, writes nothing
  the pipeline reads).
- ``select(measurement, incumbent)`` is pure: from the candidate's
  measurement and the currently promoted version's (if any) it decides
  ``PROMOTED`` or ``REJECTED`` and says why.

The runtime emits the decision as a ``Publication`` event naming the
evaluator (``name``) and whether it evaluated anything (``evaluates``); only
promoted checkpoints are followed by serving replicas.

``AcceptEverything`` is the default: it promotes every candidate without
measuring. The runtime must print its ``warning`` when it starts and mark
every publication it decides as unevaluated (``evaluates`` is False).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from reef_stream.core.errors import FatalError
from reef_stream.core.events import Checkpoint, Decision, Publication


@dataclass(frozen=True, slots=True)
class Measurement:
    """What ``measure`` found: named finite floats (e.g. ``{"accuracy": 0.61}``); empty when
    nothing was measured."""

    values: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [name for name, value in self.values.items()
               if not isinstance(name, str) or isinstance(value, bool)
               or not isinstance(value, (int, float)) or not math.isfinite(value)]
        if bad:
            raise FatalError(f"Measurement values must be finite floats by name; bad: {bad}")
        object.__setattr__(self, "values", types.MappingProxyType(
            {name: float(value) for name, value in self.values.items()}))


@dataclass(frozen=True, slots=True)
class Incumbent:
    """The currently promoted version of the model and how it measured."""

    policy_version: int
    measurement: Measurement

    @classmethod
    def from_publication(cls, publication: Publication) -> Incumbent:
        """The incumbent a PROMOTED publication describes; FatalError for a REJECTED one."""
        if publication.decision is not Decision.PROMOTED:
            raise FatalError(f"publication of version {publication.policy_version} was "
                             f"{publication.decision.value}; only a promoted one is an incumbent")
        return cls(policy_version=publication.policy_version,
                   measurement=Measurement(dict(publication.measurement)))


@dataclass(frozen=True, slots=True)
class Selection:
    """A decision and the reason for it (both go into the ``Publication`` event)."""

    decision: Decision
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.decision, Decision):
            raise FatalError(f"Selection.decision must be a Decision, got {self.decision!r}")
        if not self.reason.strip():
            raise FatalError("Selection.reason must say why")

    @property
    def promoted(self) -> bool:
        return self.decision is Decision.PROMOTED


@runtime_checkable
class CandidateEvaluator(Protocol):
    """Measures a candidate checkpoint and decides whether to promote it.

    ``name`` is recorded in every publication it decides. ``evaluates`` is
    False for an evaluator that measures nothing: its publications are
    marked unevaluated. ``warning`` is None, or a text the runtime prints
    prominently when it starts with this evaluator.
    """

    name: str
    evaluates: bool
    warning: str | None

    def measure(self, candidate: Checkpoint) -> Measurement:
        """Measure ``candidate``. May block (it runs an evaluation); no side effects.

        Called once per candidate checkpoint, in checkpoint order, before
        ``select``. Safe to call again for the same candidate (a restarted
        evaluator does); it should then measure the same within its noise.
        """
        ...

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """Promote or reject the candidate measured as ``measurement``. Pure and idempotent.

        ``incumbent`` is the version currently promoted, None before the first
        promotion. Does not block.
        """
        ...


@dataclass(frozen=True, slots=True)
class AcceptEverything:
    """The default evaluator: promotes every candidate without measuring it. Says so loudly."""

    name: str = "accept-everything (unevaluated)"
    evaluates: bool = False
    warning: str | None = (
        "WARNING: the candidate evaluator is AcceptEverything: every checkpoint is promoted "
        "and served WITHOUT evaluation, and its publications are marked unevaluated. Give the "
        "recipe a CandidateEvaluator that measures candidates before training on live traffic."
    )

    def measure(self, candidate: Checkpoint) -> Measurement:
        """Measures nothing: an empty measurement. No side effects; does not block."""
        return Measurement()

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """Always PROMOTED, with a reason that says nothing was evaluated. Pure."""
        return Selection(
            decision=Decision.PROMOTED,
            reason="promoted without evaluation: the recipe uses AcceptEverything",
        )
