"""Built-in parts for processors: groupings, a feedback policy, the default unit builder.

A processor is three small parts composed (``reef_stream.engine.join``): a
``Grouping``, a ``FeedbackPolicy`` and a ``UnitBuilder``. These cover the
common methods; a method package writes its own part where they do not fit
and composes it with the others (no subclassing needed)::

    processor = ComposedProcessor(
        grouping=ByGroupId(),                                  # n completions of one prompt
        feedback=RequireSources(("exact_match",), timeout_ms=60_000),
    )                                                          # units: RolloutUnit
    recipe = Recipe(..., processor=processor, reward=exact_match, group_size=8)

A recipe checks its parts against each other: the reward function's source must be one
the feedback policy wants, and a grouping by group id needs the recipe's ``group_size``
(what replicas sample per prompt) for ``reef check``.

All pure: no Kafka, no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from reef_stream.api.processor import (
    DEFAULT_RETENTION_MS, FeedbackPolicy, Grouping, MissingFeedback, Score, Scored, UnitBuilder,
)
from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import EpochMillis, Feedback, Generation, RolloutUnit, Sample

UnitT = TypeVar("UnitT")


@dataclass(frozen=True, slots=True)
class ByGroupId:
    """Groups by ``group_id`` (an ungrouped generation is its own group, by
    ``generation_id``); a group is complete at its declared ``group_size``.

    ``min_members``: None never emits an incomplete group (its scored members
    expire); a number emits one with at least that many scored members.
    """

    min_members: int | None = None
    #: Groups the generations of one group_id: the recipe must declare its ``group_size``.
    by_group_id: ClassVar[bool] = True

    @property
    def description(self) -> str:
        incomplete = ("incomplete groups expire" if self.min_members is None else
                      f"an incomplete group with at least {self.min_members} scored members "
                      "is emitted as a smaller unit")
        return ("by group_id (an ungrouped generation by its generation_id); complete when its "
                f"declared group_size members are scored; {incomplete}")

    def key(self, generation: Generation) -> str:
        if generation.group_id is None and generation.group_size != 1:
            raise InvalidRecord(f"group_size {generation.group_size} without a group_id",
                                field="group_id")
        return generation.group_id or generation.generation_id

    def size(self, generation: Generation) -> int:
        return generation.group_size

    def accept_incomplete(self, scored: int, size: int) -> bool:
        return self.min_members is not None and scored >= self.min_members


@dataclass(frozen=True, slots=True)
class Ungrouped:
    """Every generation is its own one-sample unit, whatever its group_id."""

    description: str = "ungrouped: each scored generation is a unit of its own"
    by_group_id: ClassVar[bool] = False

    def key(self, generation: Generation) -> str:
        return generation.generation_id

    def size(self, generation: Generation) -> int:
        return 1

    def accept_incomplete(self, scored: int, size: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class RequireSources:
    """Waits for feedback from every one of ``sources``; the reward is their weighted sum.

    ``weights``: by source, 1.0 where not given. The score's components are
    each source's reward under its name and each source's components as
    ``"<source>.<component>"``. Feedback from other sources is ignored.
    Raises ``ConfigurationError`` listing every problem when built wrong.
    """

    sources: tuple[str, ...]
    timeout_ms: int
    weights: Mapping[str, float] = field(default_factory=dict)
    missing: MissingFeedback = MissingFeedback.EXPIRE

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.sources, str) or not self.sources:
            problems.append(f"RequireSources.sources must be a non-empty tuple of source "
                            f"names, got {self.sources!r}")
        if not isinstance(self.timeout_ms, int) or self.timeout_ms < 1:
            problems.append(f"RequireSources.timeout_ms must be a positive integer, got "
                            f"{self.timeout_ms!r}")
        unknown = sorted(set(self.weights) - set(self.sources or ()))
        if unknown:
            problems.append(f"RequireSources.weights names sources it does not require: {unknown}")
        if problems:
            raise ConfigurationError(problems)

    @property
    def description(self) -> str:
        weights = ", ".join(f"{self.weights.get(s, 1.0):g} x {s}" for s in self.sources)
        return (f"requires feedback from {', '.join(self.sources)}; reward = {weights}; "
                f"waits {self.timeout_ms} ms; missing feedback: {self.missing.value}")

    def wants(self, source: str) -> bool:
        return source in self.sources

    def ready(self, received: Mapping[str, Feedback]) -> bool:
        return all(source in received for source in self.sources)

    def combine(self, generation: Generation, received: Mapping[str, Feedback]) -> Score:
        used = tuple(source for source in self.sources if source in received)
        if not used:
            raise InvalidRecord(f"no feedback from any of {list(self.sources)}")
        reward = 0.0
        components: dict[str, float] = {}
        for source in used:
            feedback = received[source]
            reward += self.weights.get(source, 1.0) * feedback.reward
            components[source] = feedback.reward
            for name, value in feedback.components.items():
                components[f"{source}.{name}"] = value
        return Score(reward=reward, components=components, sources=used)


@dataclass(frozen=True, slots=True)
class RolloutUnits:
    """Builds the default unit, ``RolloutUnit``: one ``Sample`` per member, in member order
    (with its generation's finish reason, sampling temperature and creation time)."""

    unit_type: type = RolloutUnit

    def build(self, *, unit_id: str, recipe: str, group_key: str, members: tuple[Scored, ...],
              created_at: EpochMillis) -> RolloutUnit:
        samples = tuple(
            Sample(generation_id=m.generation.generation_id, prompt_id=m.generation.prompt_id,
                   # an unknown version is the stalest it can be (schedule.unknown_version)
                   policy_version=m.generation.policy_version
                   if m.generation.policy_version_known else 0,
                   policy_version_known=m.generation.policy_version_known,
                   prompt_token_ids=m.generation.prompt_token_ids,
                   completion_token_ids=m.generation.completion_token_ids,
                   completion_logprobs=m.generation.completion_logprobs,
                   reward=m.score.reward, reward_components=dict(m.score.components),
                   finish_reason=m.generation.finish_reason,
                   temperature=m.generation.sampling.temperature,
                   created_at=m.generation.created_at)
            for m in members)
        return RolloutUnit(unit_id=unit_id, recipe=recipe, group_key=group_key, members=samples,
                           created_at=created_at)


@dataclass(frozen=True, slots=True)
class ComposedProcessor(Generic[UnitT]):
    """A ``Processor`` made of its three parts; ``units`` defaults to ``RolloutUnits()``.

    ``retention_ms``: how long a concluded generation is remembered to recognise a second
    record of it (or of its feedback) as a duplicate; 1 hour by default. Longer costs
    ~100 bytes of processor memory per generation concluded within it.
    """

    grouping: Grouping
    feedback: FeedbackPolicy
    units: UnitBuilder[UnitT] = field(default_factory=RolloutUnits)  # type: ignore[assignment]
    retention_ms: int = DEFAULT_RETENTION_MS
