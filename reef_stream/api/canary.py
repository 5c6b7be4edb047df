"""Staged release: a canary gate after the offline one, a person when the recipe asks, a cadence.

    evaluator = Staged(HeldOutAccuracy(...),                  # the offline gate, first
                       canary=MeanDifference(share=0.5, min_samples=200, z=1.96),
                       require_approval=False, publish_every_s=None)
    recipe = factory(..., evaluator=evaluator)

``Staged`` is a ``CandidateEvaluator`` (it measures and selects with the offline evaluator it
wraps) that also says how a version the offline gate promoted is released:

- ``canary``: a ``CanaryEvaluator``. The version is first published as ``CANARY`` with the
  canary's ``share``: that fraction of replicas serves it, the rest the incumbent. The
  evaluator then folds live feedback (``<ns>.generations`` joined with ``<ns>.feedback``,
  reward per version, of ``source`` or every source) into one ``Arm`` per version and asks
  ``judge(candidate, incumbent)``: ``PROMOTE``, ``WAIT`` or ``ROLL_BACK``. A model's first
  version (no incumbent) is promoted without a canary: there is nothing to compare with.
- ``require_approval``: a version the gates passed waits (``CANARY``, awaiting ``approval``)
  until a person runs ``reef approve MODEL VERSION`` or ``reef reject MODEL VERSION --reason``.
- ``publish_every_s``: at most one promotion per that many seconds of the trainer's clock
  (a candidate whose checkpoint is younger than that after the incumbent's is REJECTED
  unmeasured, reason ``publication cadence: ...``); None promotes every candidate that passes.

Pure: no Kafka, no Redis here (``reef_stream.consumers.evaluator.canary`` runs it). ``judge`` must be a
function of the two arms only, so a restarted evaluator that read the same log decides the same.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from reef_stream.api.evaluator import (
    AcceptEverything, CandidateEvaluator, Incumbent, Measurement, Selection,
)
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Checkpoint

__all__ = ["Arm", "CanaryEvaluator", "MeanDifference", "Staged", "Verdict", "Action"]


@dataclass(frozen=True, slots=True)
class Arm:
    """The live rewards of one version during a canary: how many, their mean and their
    sample variance (0 for fewer than two)."""

    version: int
    count: int = 0
    mean: float = 0.0
    variance: float = 0.0

    @classmethod
    def of(cls, version: int, rewards: Iterable[float]) -> Arm:
        values = [float(r) for r in rewards]
        n = len(values)
        if n == 0:
            return cls(version)
        mean = math.fsum(values) / n
        variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
        return cls(version, n, mean, variance)


class Action(enum.Enum):
    PROMOTE = "promote"
    WAIT = "wait"
    ROLL_BACK = "roll back"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a ``CanaryEvaluator`` decided, why (words a person can act on), and the figures it
    decided on (they go into the decision's measurement)."""

    action: Action
    reason: str
    figures: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise ConfigurationError(f"Verdict.action must be an Action, not {self.action!r}")
        if self.action is not Action.WAIT and not self.reason.strip():
            raise ConfigurationError("a Verdict that decides must say why")


@runtime_checkable
class CanaryEvaluator(Protocol):
    """Compares a canary version with the incumbent on live feedback.

    ``name``: recorded in its decisions. ``share``: the fraction of replicas that serves the
    canary, in (0, 1]. ``source``: the feedback source whose rewards count (None: every
    source). ``judge`` is pure and sees only the two arms."""

    name: str
    share: float
    source: str | None

    def judge(self, candidate: Arm, incumbent: Arm) -> Verdict:
        ...


@dataclass(frozen=True, slots=True)
class MeanDifference:
    """Difference in mean reward with a normal confidence bound.

    Waits until each arm has ``min_samples`` rewards. Then with ``d`` = canary mean −
    incumbent mean and ``se`` its standard error: ROLL_BACK when ``d + z·se < -margin`` (worse
    beyond the margin, with confidence), PROMOTE when ``d - z·se >= -margin`` (not worse than
    the margin, with confidence), else WAIT; once both arms have ``max_samples`` (if set) the
    point estimate decides (PROMOTE when ``d >= -margin``)."""

    share: float = 0.5
    min_samples: int = 100
    z: float = 1.96
    margin: float = 0.0
    max_samples: int | None = 500
    source: str | None = None
    name: str = "canary mean difference"

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 < self.share <= 1.0:
            problems.append(f"canary share must be in (0, 1], not {self.share}")
        if self.min_samples < 2:
            problems.append(f"min_samples must be at least 2, not {self.min_samples}")
        if not self.z >= 0:
            problems.append(f"z must be 0 or more, not {self.z}")
        if not self.margin >= 0:
            problems.append(f"margin must be 0 or more, not {self.margin}")
        if self.max_samples is not None and self.max_samples < self.min_samples:
            problems.append(f"max_samples ({self.max_samples}) must be at least min_samples "
                            f"({self.min_samples})")
        if problems:
            raise ConfigurationError(problems)

    def judge(self, candidate: Arm, incumbent: Arm) -> Verdict:
        figures = {"canary_count": float(candidate.count), "canary_mean": candidate.mean,
                   "incumbent_count": float(incumbent.count), "incumbent_mean": incumbent.mean}
        fewest = min(candidate.count, incumbent.count)
        if fewest < self.min_samples:
            return Verdict(Action.WAIT, f"{fewest} of {self.min_samples} samples", figures)
        difference = candidate.mean - incumbent.mean
        se = math.sqrt(candidate.variance / candidate.count
                       + incumbent.variance / incumbent.count)
        low, high = difference - self.z * se, difference + self.z * se
        figures.update(difference=difference, lower=low, upper=high)
        versus = (f"canary v{candidate.version} mean {candidate.mean:.4f} (n={candidate.count}) "
                  f"vs incumbent v{incumbent.version} {incumbent.mean:.4f} "
                  f"(n={incumbent.count}): difference {difference:+.4f}, "
                  f"[{low:+.4f}, {high:+.4f}] at z={self.z}")
        if high < -self.margin:
            return Verdict(Action.ROLL_BACK, f"{versus}: worse beyond the margin "
                                             f"{self.margin}", figures)
        if low >= -self.margin:
            return Verdict(Action.PROMOTE, f"{versus}: not worse than the margin "
                                           f"{self.margin}", figures)
        if self.max_samples is not None and fewest >= self.max_samples:
            action = Action.PROMOTE if difference >= -self.margin else Action.ROLL_BACK
            return Verdict(action, f"{versus}: undecided at {self.max_samples} samples, the "
                                   "point estimate decides", figures)
        return Verdict(Action.WAIT, f"{versus}: undecided", figures)


@dataclass(frozen=True)
class Staged:
    """A ``CandidateEvaluator`` (``offline`` measures and selects) with a release policy:
    ``canary``, ``require_approval``, ``publish_every_s`` (see the module docstring)."""

    offline: CandidateEvaluator = field(default_factory=AcceptEverything)
    canary: CanaryEvaluator | None = None
    require_approval: bool = False
    publish_every_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.publish_every_s is not None and not self.publish_every_s > 0:
            problems.append(f"publish_every_s must be more than 0, not {self.publish_every_s}")
        if self.canary is not None and not isinstance(self.canary, CanaryEvaluator):
            problems.append(f"canary {type(self.canary).__name__} lacks name, share, source "
                            "or judge (see reef_stream.api.canary.CanaryEvaluator)")
        if problems:
            raise ConfigurationError(problems)

    @property
    def name(self) -> str:
        return self.offline.name

    @property
    def evaluates(self) -> bool:
        return bool(self.offline.evaluates)

    @property
    def warning(self) -> str | None:
        return getattr(self.offline, "warning", None)

    def measure(self, candidate: Checkpoint) -> Measurement:
        return self.offline.measure(candidate)

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        return self.offline.select(measurement, incumbent)
