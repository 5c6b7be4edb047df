"""The processor an author writes: recorded generations + feedback -> typed units.

A ``Processor`` is three small protocols composed: ``Grouping`` (a
generation's group and its size), ``FeedbackPolicy`` (which feedback it
wants, when it is complete, how it combines into a ``Score``, how long to
wait, what to do when it is missing) and ``UnitBuilder`` (the unit event type
and how to build one). Built-in parts are in ``reef_stream.api.parts``. The
state machine that drives a processor (``reef_stream.engine.join``) is the
same in the runtime and in ``reef_stream.engine.testing.run_processor``. Pure:
nothing here touches Kafka.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from reef_stream.core.events import EpochMillis, Feedback, Generation

UnitT_co = TypeVar("UnitT_co", covariant=True)

#: How long a concluded generation (and a closed group) is remembered to recognise
#: duplicates and late feedback: 1 hour of the caller's clock, unless the processor sets its
#: own ``retention_ms`` (see ``Processor``). Memory grows with it: ~100 bytes per generation
#: that concluded within it (``reef_stream.engine.ledger``).
DEFAULT_RETENTION_MS = 3_600_000
class MissingFeedback(enum.Enum):
    """What happens to a generation whose feedback is not ready by its deadline."""

    #: It expires (a dead letter), with whatever feedback arrived.
    EXPIRE = "expire"
    #: It is scored from the feedback that did arrive; it expires if none did.
    COMBINE_RECEIVED = "combine what arrived"


@dataclass(frozen=True, slots=True)
class Score:
    """A generation's combined reward: ``reward``, its named ``components``, and the
    ``sources`` whose feedback went into it (a non-empty subset of those received)."""

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Scored:
    """A generation with its score: one member of a unit being built."""

    generation: Generation
    score: Score


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a record was read from, carried through the state to its outcome (the
    runtime's dead letters need it). ``offset`` is the record's own offset."""

    topic: str
    partition: int
    offset: int


@runtime_checkable
class Grouping(Protocol):
    """Which group a generation belongs to and when a group is complete. Pure.

    ``description`` says it in words (``reef check`` prints it).
    """

    description: str

    def key(self, generation: Generation) -> str:
        """The group key of ``generation`` (a non-empty string). Pure, idempotent; called
        once per generation on arrival. Raise ``InvalidRecord`` for a generation that
        cannot be grouped (it becomes INVALID)."""
        ...

    def size(self, generation: Generation) -> int:
        """How many scored members complete its group (at least 1). Pure, idempotent;
        called once per generation on arrival, after ``key``. Raise ``InvalidRecord``
        as for ``key``."""
        ...

    def accept_incomplete(self, scored: int, size: int) -> bool:
        """Whether ``scored`` (at least 1) of ``size`` members may still be emitted as a unit
        when the group cannot complete. Pure; called once per group that does not complete."""
        ...


@runtime_checkable
class FeedbackPolicy(Protocol):
    """Which feedback a generation needs, how it combines, and how long to wait for it. Pure.

    ``timeout_ms``: how long after a generation arrives its feedback may
    complete (and how long feedback waits for its generation).
    ``missing``: what happens at that deadline. ``description`` says it all in words.
    Optionally ``sources``: the tuple of sources it waits for (``RequireSources`` has it);
    ``reef check`` then checks each is produced by the recipe's reward function or declared
    external, as it always checks that the reward function's source is wanted.
    """

    timeout_ms: int
    missing: MissingFeedback
    description: str

    def wants(self, source: str) -> bool:
        """Whether feedback from ``source`` is any use to it; other sources are IGNORED.
        Pure; called once per feedback record on arrival, before anything else."""
        ...

    def ready(self, received: Mapping[str, Feedback]) -> bool:
        """Whether the feedback received so far (by source) completes the generation. Pure;
        called after each new wanted feedback record, until it returns True."""
        ...

    def combine(self, generation: Generation, received: Mapping[str, Feedback]) -> Score:
        """The generation's score from ``received`` (by source; non-empty). Pure, idempotent;
        called once per generation, when ``ready`` or at its deadline under
        ``COMBINE_RECEIVED``. Raise ``InvalidRecord`` when the feedback cannot be
        combined (the generation becomes INVALID)."""
        ...


@runtime_checkable
class UnitBuilder(Protocol[UnitT_co]):
    """The unit type a processor emits and how to build one. Pure.

    ``unit_type`` is an event class of ``reef_stream.core.events`` style (a frozen
    dataclass naming its Avro schema in ``SCHEMA``).
    """

    unit_type: type

    def build(self, *, unit_id: str, recipe: str, group_key: str, members: tuple[Scored, ...],
              created_at: EpochMillis) -> UnitT_co:
        """The unit of ``members`` (ordered by generation id). Pure, deterministic in its
        arguments; called once per emitted unit. Must return a ``unit_type``."""
        ...


@runtime_checkable
class Processor(Protocol[UnitT_co]):
    """Recorded generations + feedback -> typed units: a grouping, a feedback policy and a
    unit builder. ``ProcessorState`` drives it; it never touches Kafka. It may set
    ``retention_ms`` (else ``DEFAULT_RETENTION_MS``; above the feedback timeout)."""

    grouping: Grouping
    feedback: FeedbackPolicy
    units: UnitBuilder[UnitT_co]


def processor_problems(processor: Any) -> list[str]:
    """Every way ``processor`` falls short of the ``Processor`` protocol (empty if none)."""
    if processor is None:
        return ["no processor"]
    problems = []
    parts = {"grouping": ("description", "key", "size", "accept_incomplete"),
             "feedback": ("timeout_ms", "missing", "description", "wants", "ready", "combine"),
             "units": ("unit_type", "build")}
    for part, members in parts.items():
        value = getattr(processor, part, None)
        if value is None:
            problems.append(f"processor {type(processor).__name__} has no {part!r}")
            continue
        missing = [name for name in members if not hasattr(value, name)]
        if missing:
            problems.append(f"processor.{part} ({type(value).__name__}) lacks {missing}")
    if problems:
        return problems
    timeout = processor.feedback.timeout_ms
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1:
        problems.append(f"processor.feedback.timeout_ms must be a positive integer, got {timeout!r}")
    if not isinstance(processor.feedback.missing, MissingFeedback):
        problems.append(f"processor.feedback.missing must be a MissingFeedback, "
                        f"got {processor.feedback.missing!r}")
    retention = getattr(processor, "retention_ms", DEFAULT_RETENTION_MS)
    if not isinstance(retention, int) or isinstance(retention, bool) or not problems \
            and retention <= timeout:
        problems.append(f"processor.retention_ms must be an integer above the feedback timeout "
                        f"({timeout!r} ms), got {retention!r}")
    unit_type = processor.units.unit_type
    if not (isinstance(unit_type, type) and dataclasses.is_dataclass(unit_type)
            and isinstance(getattr(unit_type, "SCHEMA", None), str)):
        problems.append(f"processor.units.unit_type must be an event dataclass naming its Avro "
                        f"schema in SCHEMA, got {unit_type!r}")
    return problems


def unit_id(recipe: str, member_ids: Iterable[str]) -> str:
    """The id of the unit of ``recipe`` with these members: 32 hex digits of a SHA-256 of the
    recipe name and the sorted member generation ids. The same for the same members in any
    order."""
    payload = json.dumps([recipe, sorted(member_ids)], separators=(",", ":")).encode()
    return hashlib.sha256(payload).hexdigest()[:32]
