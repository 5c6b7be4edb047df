"""GRPO's processor: the completions of one prompt form one group, a unit once all are scored.

A replica samples the recipe's ``group_size`` completions of a prompt under one ``group_id``,
each generation declaring that ``group_size``. Built-in parts (``reef_stream.api.parts``):

- ``ByGroupId()``: the group key is ``group_id``; the group is complete when
  its declared ``group_size`` members are scored. A group that cannot
  complete (a member expired or was invalid) expires whole: group-normalised
  advantages over a partial group would be biased;
- ``RequireSources(sources)``: a member is scored when feedback from every one of
  ``sources`` arrived (the task's reward function's source, e.g. the demo's
  ``exact_match``); it expires after ``FEEDBACK_TIMEOUT_MS``;
- ``RolloutUnits`` (the default): one ``RolloutUnit`` per group, members
  ordered by generation id.
"""

from __future__ import annotations

from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.core.events import RolloutUnit

#: How long a generation waits for its reward before it expires.
FEEDBACK_TIMEOUT_MS = 60_000


def processor(sources: tuple[str, ...], *, timeout_ms: int = FEEDBACK_TIMEOUT_MS
              ) -> ComposedProcessor[RolloutUnit]:
    """GRPO's processor waiting for feedback from ``sources``. Pure; ``ConfigurationError``
    for no sources."""
    return ComposedProcessor(grouping=ByGroupId(),
                             feedback=RequireSources(tuple(sources), timeout_ms=timeout_ms))
