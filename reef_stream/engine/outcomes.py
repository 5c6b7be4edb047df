"""What one call to the processor's state machine decided (``reef_stream.engine.join``): each
generation's one ``Outcome``, each feedback record's one ``FeedbackFate``, the units to
produce, and the ``Step`` that carries them all in a deterministic order.

Pure data; ``join`` re-exports every name.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from reef_stream.api.processor import Origin
from reef_stream.core.events import Feedback, Generation

__all__ = ["DroppedGeneration", "EmittedUnit", "FeedbackFate", "FeedbackOutcome",
           "GenerationOutcome", "Outcome", "Step"]

UnitT = TypeVar("UnitT")


class Outcome(enum.Enum):
    """How a generation ended. Every generation (duplicates aside) gets exactly one.
    ``UNKNOWN_VERSION``: its producer could not tell its policy version
    (``Generation.policy_version_known``) and the schedule's ``unknown_version`` is
    ``reject``."""

    UNIT = "unit"
    EXPIRED = "expired"
    TOO_STALE = "too_stale"
    SHED = "shed"
    INVALID = "invalid"
    UNKNOWN_VERSION = "unknown_version"

    @property
    def dead_letter(self) -> bool:
        return self is not Outcome.UNIT


class FeedbackFate(enum.Enum):
    """How a feedback record ended. Every feedback record gets exactly one."""

    USED = "used"
    IGNORED = "ignored"
    DUPLICATE = "duplicate"
    LATE = "late"
    UNUSED = "unused"
    ORPHANED = "orphaned"

    @property
    def dead_letter(self) -> bool:
        return self in (FeedbackFate.LATE, FeedbackFate.UNUSED, FeedbackFate.ORPHANED)


@dataclass(frozen=True, slots=True, eq=False)
class EmittedUnit(Generic[UnitT]):
    """A unit to produce to ``<ns>.units.<recipe>`` with key ``unit_id``; ``member_ids`` sorted."""

    unit_id: str
    group_key: str
    unit: UnitT
    member_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class GenerationOutcome:
    """The one outcome of one generation, decided at ``at`` (the caller's time). ``reason``
    says why (for UNIT: which unit); ``origin`` is the one given with the generation."""

    generation: Generation
    outcome: Outcome
    reason: str
    group_key: str
    unit_id: str | None
    origin: Origin | None
    at: int

    @property
    def generation_id(self) -> str:
        return self.generation.generation_id


@dataclass(frozen=True, slots=True, eq=False)
class FeedbackOutcome:
    """The one fate of one feedback record, with the reason; ``policy_version``: the behaviour
    version of the generation it was matched with, where it reached one (USED, UNUSED), and
    ``version_known`` False when that generation's version is unknown (its ``policy_version``
    then names none)."""

    feedback: Feedback
    fate: FeedbackFate
    reason: str
    origin: Origin | None
    at: int
    policy_version: int | None = None
    version_known: bool = True


@dataclass(frozen=True, slots=True, eq=False)
class DroppedGeneration:
    """A duplicate generation record: dropped (counted, not dead-lettered)."""

    generation: Generation
    reason: str
    origin: Origin | None
    at: int


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """Everything one call to ``ProcessorState`` decided, in a deterministic order.

    The runtime produces ``units``, dead-letters each outcome whose kind has
    ``dead_letter``, counts everything (``counts``) and writes the snapshot of
    each key in ``touched`` (deleting it where ``snapshot`` is None), all in
    the same transaction as the input's offset.
    """

    units: tuple[EmittedUnit[Any], ...] = ()
    generations: tuple[GenerationOutcome, ...] = ()
    feedback: tuple[FeedbackOutcome, ...] = ()
    duplicates: tuple[DroppedGeneration, ...] = ()
    touched: tuple[str, ...] = ()

    def counts(self) -> Counter[str]:
        """By ``generations.<outcome>``, ``generations.duplicate``, ``feedback.<fate>``,
        ``units``, and ``unknown_version.<outcome>`` for the generations among them whose
        version is unknown."""
        counts: Counter[str] = Counter()
        self.count_into(counts)
        return counts

    def count_into(self, counts: Counter[str]) -> None:
        """Add ``counts()`` to ``counts`` (without building a ``Counter`` of its own)."""
        for outcome in self.generations:
            counts[_GENERATION_COUNT[outcome.outcome]] += 1
            if not outcome.generation.policy_version_known:
                counts[_UNKNOWN_VERSION_COUNT[outcome.outcome]] += 1
        for outcome in self.feedback:
            counts[_FEEDBACK_COUNT[outcome.fate]] += 1
        if self.duplicates:
            counts["generations.duplicate"] += len(self.duplicates)
        if self.units:
            counts["units"] += len(self.units)


_GENERATION_COUNT = {o: f"generations.{o.value}" for o in Outcome}
_UNKNOWN_VERSION_COUNT = {o: f"unknown_version.{o.value}" for o in Outcome}
_FEEDBACK_COUNT = {f: f"feedback.{f.value}" for f in FeedbackFate}
