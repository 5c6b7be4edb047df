"""What a fault run checks after the fact, from the log alone.

``GenerationOutcomes`` counts, over the generations in ``<ns>.generations``:

- whether each ended in exactly one unit of the recipe or one of the processor's dead letters
  (expired, too stale, shed, invalid), and none in more than one (``update``, ``counts``);
- of the generation ids a producer saw acknowledged (the replicas' ``--acked-log`` files),
  those the topic does not hold (``missing``).

It reads the topics to their current end (``reef_stream.topics.reading``: committed records
only, no group, nothing committed) and keeps its place, so a caller waiting for the processor
to catch up reads each record once. The trainer's side,
no unit trained twice or lost, is ``reef_stream.demo.run.unit_ledger``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from reef_stream.errors import InvalidRecord
from reef_stream.topics.events import DeadLetter, Generation
from reef_stream.ops.metrics import STAGE_PROCESSOR
from reef_stream.topics import declarations
from reef_stream.topics.reading import TopicReader
from reef_stream.topics.serde import SchemaRegistry
from reef_stream.engine.training import unit_members

class GenerationOutcomes:
    """Counts over the distinct generation ids of ``<ns>.generations``, kept up to date by
    ``update`` (each call reads only what the three topics gained since the last): see
    ``counts``. ``close`` at the end."""

    def __init__(self, bootstrap: str, namespace: str, recipe: Any) -> None:
        self.namespace, self.unit_type = namespace, recipe.objective.unit_type
        self._registry = SchemaRegistry.default()
        self._generations = TopicReader(bootstrap, declarations.generations(namespace))
        self._units = TopicReader(bootstrap, declarations.units(namespace, recipe.name))
        self._letters = TopicReader(bootstrap, declarations.dead_letters(namespace))
        #: Every generation id in the topic so far.
        self.ids: set[str] = set()
        self._undecodable = 0
        self._in_units: set[str] = set()
        self._outcomes: Counter[str] = Counter()

    def update(self) -> dict[str, int]:
        """Read what arrived since the last call; returns ``counts()``."""
        registry = self._registry
        for message in self._generations.to_end():
            try:
                self.ids.add(registry.decode(message.value(), message.headers(),
                                             Generation).generation_id)
            except InvalidRecord:
                self._undecodable += 1
        for message in self._units.to_end():
            unit = registry.decode(message.value(), message.headers(), self.unit_type)
            members = {m.generation_id for m in unit_members(unit)}
            self._outcomes.update(members)
            self._in_units |= members
        generations_topic = self._generations.topic
        for message in self._letters.to_end():
            # The processor's dead letters of generations: an outcome (expired, too stale, shed,
            # invalid), a unit too large to emit, or a record that failed validation; each
            # carries the record.
            letter = registry.decode(message.value(), message.headers(), DeadLetter)
            if letter.stage != STAGE_PROCESSOR or letter.source_topic != generations_topic \
                    or letter.value is None:
                continue
            try:
                generation = registry.decode(letter.value,
                                             [(h.key, h.value) for h in letter.headers], Generation)
            except InvalidRecord:
                continue  # an undecodable record: counted in ``undecodable``
            self._outcomes[generation.generation_id] += 1
        return self.counts()

    def counts(self) -> dict[str, int]:
        """``generations``, ``in_units``, ``dead_lettered``, ``no_outcome`` and ``more_than_one``
        (the last two must be 0 once the processor has caught up); ``undecodable`` records are
        the processor's invalid input (dead-lettered as such, with no id to match)."""
        ids, outcomes, in_units = self.ids, self._outcomes, self._in_units
        return {"generations": len(ids), "in_units": len(in_units & ids),
                "dead_lettered": len((set(outcomes) - in_units) & ids),
                "no_outcome": len(ids - set(outcomes)),
                "more_than_one": sum(1 for n in outcomes.values() if n > 1),
                "undecodable": self._undecodable}

    def missing(self, acknowledged: Iterable[str]) -> set[str]:
        """The ids in ``acknowledged`` that no record of the generations topic carries (as of
        the last ``update``)."""
        return set(acknowledged) - self.ids

    def close(self) -> None:
        for reader in (self._generations, self._units, self._letters):
            reader.close()
