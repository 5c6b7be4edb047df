"""The records a processor step writes, encoded: its units and the dead letters of its outcomes.

A step of ``engine.join.ProcessorState`` (``Step``) becomes, in this order:

1. each unit, to ``<ns>.units.<recipe>`` (key: unit id); a unit whose encoding is larger
   than the units topic takes (``max_unit_bytes``) is not written, and each of its member
   generations is dead-lettered ``unit_too_large`` instead (below), so that one oversized
   unit cannot fail every transaction;
2. a dead letter for every outcome whose kind has ``dead_letter`` (expired, too stale, shed,
   invalid generations; late, unused, orphaned feedback), to ``<ns>.dead-letters`` (key: the
   record's group id, else its generation id), with the reason and the original record, at
   the topic, partition and offset it came from (``Origin``).

A consumed record that does not decode or validate is dead-lettered whole (``of_invalid``).
Pure: nothing here produces. ``ProcessorRuntime._commit`` writes the records inside its
transaction, with the state snapshots and the consumed offsets.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import DeadLetter, Generation
from reef_stream.core.metric_names import STAGE_PROCESSOR
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.join import FeedbackOutcome, GenerationOutcome, Step
from reef_stream.topics.dead_letters import dead_letter


@dataclass(frozen=True, slots=True)
class Record:
    """One record to produce: its topic, key, encoded value and headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Any


@dataclass(frozen=True)
class StepRecords:
    """Encodes the records of steps for one recipe's processor (see the module docstring):
    ``units`` and ``dead_letters`` are the topics written, ``generations`` and ``feedback``
    the source topics named by a dead letter whose outcome has no ``Origin``."""

    registry: SchemaRegistry
    units: str
    dead_letters: str
    generations: str
    feedback: str
    max_unit_bytes: int

    def of_step(self, step: Step, counts: Counter[str]) -> list[Record]:
        """The step's units, then its dead letters, in the step's order; each unit too large
        is counted in ``counts["oversized_units"]``."""
        records, oversized = [], {}  # member generation id -> why its unit was not written
        for emitted in step.units:
            value, headers = self.registry.encode(emitted.unit)
            if len(value) > self.max_unit_bytes:
                counts["oversized_units"] += 1
                oversized.update(dict.fromkeys(
                    (m.generation_id for m in emitted.unit.members),
                    f"its unit {emitted.unit_id} is {len(value)} bytes encoded, over the "
                    f"{self.max_unit_bytes} the units topic takes (the unit was not "
                    "emitted; shorten completions or groups, or raise the topic's "
                    "max.message.bytes)"))
                continue
            records.append(Record(self.units, emitted.unit_id.encode(), value, headers))
        for outcome in (*step.generations, *step.feedback):
            if isinstance(outcome, GenerationOutcome) and outcome.generation_id in oversized:
                records.append(self._letter(outcome, oversized[outcome.generation_id],
                                            kind="unit_too_large"))
            elif (outcome.outcome if isinstance(outcome, GenerationOutcome)
                    else outcome.fate).dead_letter:
                records.append(self._letter(outcome))
        return records

    def of_invalid(self, message: Any, error: InvalidRecord) -> Record:
        """The dead letter of a consumed record that does not decode or validate, kept whole."""
        return self._encode(dead_letter(str(error), type(error).__name__, stage=STAGE_PROCESSOR,
                                        message=message), message.key())

    def _letter(self, outcome: GenerationOutcome | FeedbackOutcome, why: str | None = None,
                *, kind: str | None = None) -> Record:
        """The dead letter of a non-unit outcome (or, with ``why`` and ``kind``, of a generation
        whose unit could not be emitted), carrying the original record."""
        if isinstance(outcome, GenerationOutcome):
            event, where = outcome.generation, outcome.origin
            kind = kind or outcome.outcome.value
            reason = f"generation {outcome.generation_id} {kind}: {why or outcome.reason}"
        else:
            event, kind, where = outcome.feedback, kind or outcome.fate.value, outcome.origin
            reason = (f"feedback {outcome.feedback.feedback_id} ({outcome.feedback.source!r} for "
                      f"{outcome.feedback.generation_id}) {kind}: {outcome.reason}")
        value, headers = self.registry.encode(event)
        key = (event.group_id or event.generation_id).encode()
        return self._encode(dead_letter(
            reason, f"processor.{kind}", stage=STAGE_PROCESSOR,
            topic=where.topic if where else (
                self.generations if isinstance(event, Generation) else self.feedback),
            partition=where and where.partition, offset=where and where.offset,
            key=key, value=value, headers=headers), key)

    def _encode(self, letter: DeadLetter, key: bytes | None) -> Record:
        value, headers = self.registry.encode(letter)
        return Record(self.dead_letters, key, value, headers)
