"""GRPO's processor: the completions of one prompt form one group, a unit once all are scored.

A replica samples ``group_size`` completions of a prompt under one
``group_id``, each generation declaring that ``group_size``. Built-in parts
(``reef_stream.api.parts``):

- ``ByGroupId()``: the group key is ``group_id``; the group is complete when
  its declared ``group_size`` members are scored. A group that cannot
  complete (a member expired or was invalid) expires whole: group-normalised
  advantages over a partial group would be biased;
- ``RequireSources(("exact_match",))``: a member is scored when its
  ``exact_match`` feedback arrives; it expires after ``FEEDBACK_TIMEOUT_MS``;
- ``RolloutUnits`` (the default): one ``RolloutUnit`` per group, members
  ordered by generation id.
"""

from __future__ import annotations

from reef_stream.topics.events import RolloutUnit
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources

#: The feedback source GRPO trains on (the demo task's reward function emits it).
REWARD_SOURCE = "exact_match"
#: How long a generation waits for its reward before it expires.
FEEDBACK_TIMEOUT_MS = 60_000

processor: ComposedProcessor[RolloutUnit] = ComposedProcessor(
    grouping=ByGroupId(),
    feedback=RequireSources((REWARD_SOURCE,), timeout_ms=FEEDBACK_TIMEOUT_MS),
)
