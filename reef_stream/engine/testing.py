"""``run_processor``: test a processor in milliseconds, without a broker.

It feeds records through ``reef_stream.engine.join.ProcessorState``, the same
state machine the processor runtime runs, on a simulated clock::

    from reef_stream.engine.testing import Advance, run_processor

    out = run_processor(recipe, [gen_a, fb_a, gen_b, Advance(60_000), fb_b])
    assert out.outcome("a").outcome is Outcome.UNIT
    assert out.fate(fb_b).fate is FeedbackFate.LATE

The clock starts at ``start``. Each record arrives at the current time, then
the clock moves ``tick`` ms forward and the state machine is ticked. Markers
in ``records`` steer the run:

- ``Advance(ms)``: the clock moves ``ms`` forward (then a tick), e.g. past a
  feedback timeout;
- ``NewCheckpoint(version)``: a checkpoint of that policy version appeared
  (staleness is measured against the newest one);
- ``Restart()``: the run goes on with a fresh state machine restored from a
  simulated table, as the runtime does after a crash: after every step, the
  snapshot of each key the step touched was written there as bytes (or the
  key deleted), exactly as the runtime writes its changelog-backed table.

``finish=True`` advances the clock past every deadline at the end, so every
generation has its outcome.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reef_stream.api.processor import Processor
from reef_stream.api.schedule import REJECT
from reef_stream.core.errors import FatalError
from reef_stream.core.events import Feedback, Generation
from reef_stream.engine.join import (
    DroppedGeneration, EmittedUnit, FeedbackOutcome, GenerationOutcome, ProcessorState, Step,
)
from reef_stream.engine.snapshots import dumps_snapshot, loads_snapshot


@dataclass(frozen=True, slots=True)
class Advance:
    """Move the simulated clock ``ms`` forward, then tick."""

    ms: int


@dataclass(frozen=True, slots=True)
class NewCheckpoint:
    """A checkpoint of ``policy_version`` appeared."""

    policy_version: int


@dataclass(frozen=True, slots=True)
class Restart:
    """Go on with a fresh state machine restored from the snapshots written so far."""


Record = Generation | Feedback | Advance | NewCheckpoint | Restart


@dataclass(frozen=True, slots=True, eq=False)
class Outcomes:
    """What a run decided.

    ``units``: in emission order. ``generations``: the one outcome of each
    generation, by id. ``feedback``: the fate of each feedback record, in
    decision order. ``duplicates``: dropped duplicate generation records.
    ``pending``: ids of generations still waiting at the end. ``counts``: as
    ``Step.counts`` over the whole run. ``state``: the state machine as it
    ended (for snapshots and further offers).
    """

    units: tuple[EmittedUnit[Any], ...]
    generations: Mapping[str, GenerationOutcome]
    feedback: tuple[FeedbackOutcome, ...]
    duplicates: tuple[DroppedGeneration, ...]
    pending: tuple[str, ...]
    counts: Mapping[str, int]
    state: ProcessorState[Any]

    def outcome(self, generation_id: str) -> GenerationOutcome:
        """The outcome of ``generation_id``; KeyError if it has none (yet)."""
        return self.generations[generation_id]

    def fate(self, feedback: Feedback) -> FeedbackOutcome:
        """The first fate of ``feedback``, this very object (a record restored after a
        ``Restart`` is another object, and one object offered twice has two fates: use
        ``fates_of``)."""
        for outcome in self.feedback:
            if outcome.feedback is feedback:
                return outcome
        raise KeyError(f"feedback {feedback.feedback_id} has no fate (yet)")

    def fates_of(self, feedback_id: str) -> list[FeedbackOutcome]:
        """The fates of every record with this ``feedback_id`` (duplicates included), in order."""
        return [o for o in self.feedback if o.feedback.feedback_id == feedback_id]

    def unit_of(self, generation_id: str) -> EmittedUnit[Any]:
        """The unit holding ``generation_id``; KeyError if none."""
        for unit in self.units:
            if generation_id in unit.member_ids:
                return unit
        raise KeyError(f"generation {generation_id} is in no unit")


def run_processor(
    subject: Any,
    records: Iterable[Record],
    *,
    recipe_name: str | None = None,
    max_staleness: int | None = None,
    newest_checkpoint_version: int | None = None,
    start: int = 0,
    tick: int = 1,
    finish: bool = False,
    retention_ms: int | None = None,
    unknown_version: str | None = None,
) -> Outcomes:
    """Feed ``records`` (in order) through the processor of ``subject`` and return what it decided.

    ``subject`` is a ``Recipe`` (its name and its schedule's max staleness and
    ``unknown_version`` apply unless ``recipe_name`` / ``max_staleness`` /
    ``unknown_version`` are given) or a bare ``Processor`` (recipe name "test", no
    staleness limit, unknown versions rejected, unless given).
    ``newest_checkpoint_version`` is observed before the first record.
    Raises ``FatalError`` if the state machine ever gives a generation id two
    outcomes (within ``retention_ms``: None, the processor's own, else
    ``DEFAULT_RETENTION_MS``), or loses count of a record: every
    generation offered must have an outcome, be a duplicate or be pending,
    and every feedback record offered a fate or be waiting (it must not fail).
    """
    processor: Processor[Any] = getattr(subject, "processor", subject)
    if recipe_name is None:
        recipe_name = getattr(subject, "name", "test")
    if max_staleness is None and hasattr(subject, "schedule"):
        max_staleness = subject.schedule.max_staleness
    if unknown_version is None:
        unknown_version = subject.schedule.unknown_version if hasattr(subject, "schedule") \
            else REJECT

    def fresh() -> ProcessorState[Any]:
        return ProcessorState(processor, recipe=recipe_name, max_staleness=max_staleness,
                              retention_ms=retention_ms, unknown_version=unknown_version)

    state = fresh()
    steps: list[Step] = []
    table: dict[str, bytes] = {}  # what the runtime's changelog-backed table would hold

    def record_step(step: Step) -> None:
        steps.append(step)
        for key in step.touched:
            snapshot = state.snapshot(key)
            if snapshot is None:
                table.pop(key, None)
            else:
                table[key] = dumps_snapshot(snapshot)

    offered: Counter[type] = Counter()
    if newest_checkpoint_version is not None:
        record_step(state.observe_checkpoint(newest_checkpoint_version))
    now = start
    for record in records:
        if isinstance(record, Advance):
            now += record.ms
        elif isinstance(record, NewCheckpoint):
            record_step(state.observe_checkpoint(record.policy_version))
        elif isinstance(record, Restart):
            newest, state = state.newest_checkpoint_version, fresh()
            for key, data in table.items():
                state.restore(key, loads_snapshot(data))
            if newest is not None:
                record_step(state.observe_checkpoint(newest))
        elif isinstance(record, (Generation, Feedback)):
            offered[type(record)] += 1
            record_step(state.offer(record, at=now))
            now += tick
        else:
            raise TypeError(f"run_processor takes Generation, Feedback, Advance, NewCheckpoint "
                            f"and Restart, not {type(record).__name__}")
        record_step(state.tick(now))
    if finish:  # every deadline is at most one timeout after the last arrival
        record_step(state.tick(now + processor.feedback.timeout_ms))
    outcomes = _collect(steps, state)
    decided = len(outcomes.generations) + len(outcomes.duplicates) + len(outcomes.pending)
    if decided != offered[Generation]:
        raise FatalError(f"{offered[Generation]} generations offered, {decided} accounted for")
    if len(outcomes.feedback) + state.waiting_feedback() != offered[Feedback]:
        raise FatalError(f"{offered[Feedback]} feedback records offered, "
                         f"{len(outcomes.feedback) + state.waiting_feedback()} accounted for")
    return outcomes


def _collect(steps: list[Step], state: ProcessorState[Any]) -> Outcomes:
    generations: dict[str, GenerationOutcome] = {}
    feedback: list[FeedbackOutcome] = []
    counts: Counter[str] = Counter()
    for step in steps:
        counts.update(step.counts())
        for outcome in step.generations:
            if outcome.generation_id in generations:
                raise FatalError(f"generation {outcome.generation_id} got two outcomes: "
                                 f"{generations[outcome.generation_id].outcome.name} and "
                                 f"{outcome.outcome.name}")
            generations[outcome.generation_id] = outcome
        feedback.extend(step.feedback)
    return Outcomes(
        units=tuple(unit for step in steps for unit in step.units),
        generations=generations,
        feedback=tuple(feedback),
        duplicates=tuple(d for step in steps for d in step.duplicates),
        pending=tuple(state.pending_generations()),
        counts=dict(counts),
        state=state,
    )
