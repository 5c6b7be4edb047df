"""What a fault run checks after the fact, from the log alone.

``GenerationOutcomes`` counts, over the generations in ``<ns>.generations``:

- whether each ended in exactly one unit of the recipe or one of the processor's dead letters
  (expired, too stale, shed, invalid), and none in more than one (``update``, ``counts``);
- of the generation ids a producer saw acknowledged (the replicas' ``--acked-log`` files),
  those the topic does not hold (``missing``).

It reads the topics to their current end (``reef_stream.topics.reading``: committed records
only, no group, nothing committed) and keeps its place, so a caller waiting for the processor
to catch up reads each record once. The trainer's side, no unit trained twice or lost, is
``reef_stream.demo.run.unit_ledger``.

The decisions themselves take records, not topics, so that a test can hand them a log built
by hand: ``OutcomeTally`` (the generations' side), ``processor_letter_generation`` (which dead
letters are a generation's outcome), ``letter_unit`` (which are a unit the trainer dropped) and
``ledger_counts`` (the trainer's side), and ``checkpoint_chain`` (one lineage: no two
committed checkpoints of one step, each step's parent the step before). The readers
here and in ``run.unit_ledger`` only feed them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Checkpoint, DeadLetter, Generation, RolloutUnit
from reef_stream.core.metric_names import STAGE_PROCESSOR
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.training import unit_members
from reef_stream.topics import declarations
from reef_stream.topics.reading import TopicReader, read_to_end


class OutcomeTally:
    """The generations' side of a run, from records already decoded: every generation id the
    topic holds, and every outcome (a unit it is a member of, a processor's dead letter of it).
    Pure; the ``add_*`` methods may be called in any order and interleaved."""

    def __init__(self) -> None:
        #: Every generation id in the topic so far.
        self.ids: set[str] = set()
        #: Records of the generations topic that did not decode (no id to match).
        self.undecodable = 0
        self._in_units: set[str] = set()
        self._outcomes: Counter[str] = Counter()

    def add_generation(self, generation_id: str | None) -> None:
        """A record of the generations topic; ``None``: one that did not decode."""
        if generation_id is None:
            self.undecodable += 1
        else:
            self.ids.add(generation_id)

    def add_unit(self, member_ids: Iterable[str]) -> None:
        """A unit record: one outcome for each of its members."""
        members = set(member_ids)
        self._outcomes.update(members)
        self._in_units |= members

    def add_dead_letter(self, generation_id: str) -> None:
        """A processor's dead letter of a generation: its outcome."""
        self._outcomes[generation_id] += 1

    def counts(self) -> dict[str, int]:
        """``generations``, ``in_units``, ``dead_lettered``, ``no_outcome`` and ``more_than_one``
        (the last two must be 0 once the processor has caught up); ``undecodable`` records are
        the processor's invalid input (dead-lettered as such, with no id to match)."""
        ids, outcomes, in_units = self.ids, self._outcomes, self._in_units
        return {"generations": len(ids), "in_units": len(in_units & ids),
                "dead_lettered": len((set(outcomes) - in_units) & ids),
                "no_outcome": len(ids - set(outcomes)),
                "more_than_one": sum(1 for n in outcomes.values() if n > 1),
                "undecodable": self.undecodable}

    def missing(self, acknowledged: Iterable[str]) -> set[str]:
        """The ids in ``acknowledged`` that no record of the generations topic carries."""
        return set(acknowledged) - self.ids


def processor_letter_generation(letter: DeadLetter, generations_topic: str,
                                registry: SchemaRegistry) -> str | None:
    """The id of the generation ``letter`` carries when it is one of the processor's dead
    letters of ``generations_topic`` (an outcome: expired, too stale, shed, invalid; a unit too
    large to emit; a record that failed validation); ``None`` for any other letter, and for a
    record that does not decode (counted as ``undecodable`` on the generations' side)."""
    if letter.stage != STAGE_PROCESSOR or letter.source_topic != generations_topic \
            or letter.value is None:
        return None
    try:
        return registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                               Generation).generation_id
    except InvalidRecord:
        return None


def letter_unit(letter: DeadLetter, units_topic: str, registry: SchemaRegistry) -> str | None:
    """The id of the unit ``letter`` carries when it is a dead letter of ``units_topic`` (the
    trainer's: too stale, or untrainable); ``None`` for any other letter, and for a record that
    does not decode (no id to match)."""
    if letter.source_topic != units_topic or letter.value is None:
        return None
    try:
        return registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                               RolloutUnit).unit_id
    except InvalidRecord:
        return None


def ledger_counts(steps: Iterable[Iterable[str]], logged: Iterable[str],
                  dropped: Iterable[str]) -> dict[str, int]:
    """The unit ledger of a trainer: ``steps``, the unit ids each acknowledged step trained
    (its checkpoints' ``step_units``); ``logged``, the id of every record of the units topic
    before the newest checkpoint's offsets (repeated for a record logged twice); ``dropped``,
    the ids the trainer dead-lettered (too stale, or untrainable).

    ``trained``: distinct ids trained; ``trained_twice``: ids in more than one step, or twice
    in one (must be 0); ``lost``: logged ids neither trained nor dropped (must be 0);
    ``dropped``: the logged ids dropped and not trained; ``duplicates``: extra records of an id
    already logged (a processor re-emission)."""
    trained = Counter(u for step in steps for u in step)
    logged_ids = Counter(logged)
    untrained = set(logged_ids) - set(trained)
    dropped_ids = set(dropped)
    return {"trained": len(trained),
            "trained_twice": sum(1 for n in trained.values() if n > 1),
            "duplicates": sum(n - 1 for n in logged_ids.values()),
            "dropped": len(untrained & dropped_ids),
            "lost": len(untrained - dropped_ids)}


def checkpoint_chain(events: Iterable[Checkpoint]) -> dict[str, int]:
    """Whether a trainer group's committed ``Checkpoint`` events, in log order, form one chain.
    Pure. A step's parent is the step before it: each event's step must be the previous
    event's step + 1 (the first may be any step: a store resumed), and its offsets must not
    move back on any partition (a fork restarts from an older position).

    ``checkpoints``: events; ``steps``: distinct steps; ``forks``: steps with more than one
    event (must be 0); ``breaks``: events whose step is not the previous one's + 1, or whose
    offsets move back (must be 0); ``writers``: distinct writers (the ``.<writer>`` suffix of
    the checkpoint's directory), more than one after a trainer was replaced."""
    seen: Counter[int] = Counter()
    writers: set[str] = set()
    breaks = 0
    previous: Checkpoint | None = None
    for event in events:
        seen[event.step] += 1
        writers.add(event.uri.rstrip("/").rsplit("/", 1)[-1].partition(".")[2])
        if previous is not None:
            before = {(o.topic, o.partition): o.offset for o in previous.offsets}
            went_back = any(o.offset < before.get((o.topic, o.partition), -1)
                            for o in event.offsets)
            if event.step != previous.step + 1 or went_back:
                breaks += 1
        previous = event
    return {"checkpoints": sum(seen.values()), "steps": len(seen),
            "forks": sum(1 for n in seen.values() if n > 1), "breaks": breaks,
            "writers": len(writers)}


def committed_checkpoints(bootstrap: str, namespace: str, recipe: str,
                          group: str) -> list[Checkpoint]:
    """The committed ``Checkpoint`` events of ``recipe``'s trainer ``group`` in
    ``<ns>.checkpoints``, in log order (read_committed: an aborted transaction's are not
    seen). Blocks while it reads the topic to its end."""
    registry = SchemaRegistry.default()
    key = group.encode()
    events = []
    for message in read_to_end(bootstrap, declarations.checkpoints(namespace)):
        if message.key() != key:
            continue
        event = registry.decode(message.value(), message.headers(), Checkpoint)
        if event.recipe == recipe and event.trainer_group == group:
            events.append(event)
    return events


def take_records(tally: OutcomeTally, registry: SchemaRegistry, unit_type: type,
                 generations_topic: str, *, generations: Iterable[Any], units: Iterable[Any],
                 letters: Iterable[Any]) -> None:
    """Fold records (anything with ``value()`` and ``headers()``, as a consumed message) of
    the generations topic, the units topic and the dead-letters topic into ``tally``: a
    generation that does not decode counts as one without an id; a dead letter counts as an
    outcome only when the processor wrote it for a generation of ``generations_topic``."""
    for message in generations:
        try:
            tally.add_generation(registry.decode(message.value(), message.headers(),
                                                 Generation).generation_id)
        except InvalidRecord:
            tally.add_generation(None)
    for message in units:
        unit = registry.decode(message.value(), message.headers(), unit_type)
        tally.add_unit(m.generation_id for m in unit_members(unit))
    for message in letters:
        letter = registry.decode(message.value(), message.headers(), DeadLetter)
        generation_id = processor_letter_generation(letter, generations_topic, registry)
        if generation_id is not None:
            tally.add_dead_letter(generation_id)


class GenerationOutcomes:
    """An ``OutcomeTally`` fed from ``<ns>.generations``, the recipe's units topic and
    ``<ns>.dead-letters``, kept up to date by ``update`` (each call reads only what the three
    topics gained since the last): see ``counts``. ``close`` at the end. ``take_records``
    is the pure part: what records of the three topics mean for the tally."""

    def __init__(self, bootstrap: str, namespace: str, recipe: Any) -> None:
        self.namespace, self.unit_type = namespace, recipe.objective.unit_type
        self.generations_topic = declarations.generations(namespace)
        self._registry = SchemaRegistry.default()
        self._generations = TopicReader(bootstrap, self.generations_topic)
        self._units = TopicReader(bootstrap, declarations.units(namespace, recipe.name))
        self._letters = TopicReader(bootstrap, declarations.dead_letters(namespace))
        self.tally = OutcomeTally()

    @property
    def ids(self) -> set[str]:
        """Every generation id in the topic so far."""
        return self.tally.ids

    def update(self) -> dict[str, int]:
        """Read what arrived since the last call; returns ``counts()``."""
        take_records(self.tally, self._registry, self.unit_type, self.generations_topic,
                     generations=self._generations.to_end(), units=self._units.to_end(),
                     letters=self._letters.to_end())
        return self.counts()

    def counts(self) -> dict[str, int]:
        """``OutcomeTally.counts`` as of the last ``update``."""
        return self.tally.counts()

    def missing(self, acknowledged: Iterable[str]) -> set[str]:
        """The ids in ``acknowledged`` that no record of the generations topic carries (as of
        the last ``update``)."""
        return self.tally.missing(acknowledged)

    def close(self) -> None:
        for reader in (self._generations, self._units, self._letters):
            reader.close()
