"""SAO's processor: each generation, once its reward arrives, is a unit of one scored sample.

SAO needs no groups (its baseline is the running per-prompt statistics of
``methods.sao.objective``), so the processor is three built-in parts
composed (``reef_stream.api.parts``):

- ``Ungrouped``: every generation is its own group of one, whatever its
  ``group_id``;
- ``RequireSources(("exact_match",))``: the generation is complete when its
  ``exact_match`` feedback arrives; the reward is that feedback's reward.
  Feedback from other sources is ignored. A generation whose feedback does
  not arrive within ``FEEDBACK_TIMEOUT_MS`` of it expires (a dead letter);
- ``RolloutUnits`` (the default): the unit is a ``RolloutUnit`` with one
  ``Sample``.

The processor is pure (no Kafka); ``reef process`` runs it, and
``reef_stream.api.testing.run_processor`` runs the same state machine in tests.
"""

from __future__ import annotations

from reef_stream.topics.events import RolloutUnit
from reef_stream.api.parts import ComposedProcessor, RequireSources, Ungrouped

#: The feedback source SAO trains on (the demo task's reward function emits it).
REWARD_SOURCE = "exact_match"
#: How long a generation waits for its reward before it expires.
FEEDBACK_TIMEOUT_MS = 60_000

processor: ComposedProcessor[RolloutUnit] = ComposedProcessor(
    grouping=Ungrouped(),
    feedback=RequireSources((REWARD_SOURCE,), timeout_ms=FEEDBACK_TIMEOUT_MS),
)
