"""SAO's processor: each generation, once its reward arrives, is a unit of one scored sample.

SAO needs no groups (its baseline is the running per-prompt statistics of
``objective.py``), so the processor is three built-in parts composed
(``reef_stream.api.parts``):

- ``Ungrouped``: every generation is its own group of one, whatever its
  ``group_id``;
- ``RequireSources(sources)``: the generation is complete when feedback from
  every one of ``sources`` has arrived (the task's reward function's source,
  e.g. the demo's ``exact_match``); the reward is their sum. Feedback from
  other sources is ignored. A generation whose feedback does not arrive within
  ``FEEDBACK_TIMEOUT_MS`` of it expires (a dead letter);
- ``RolloutUnits`` (the default): the unit is a ``RolloutUnit`` with one
  ``Sample``.

The processor is pure (no Kafka); ``reef process`` runs it, and
``reef_stream.engine.testing.run_processor`` runs the same state machine in tests.
"""

from __future__ import annotations

from reef_stream.api.parts import ComposedProcessor, RequireSources, Ungrouped
from reef_stream.core.events import RolloutUnit

#: How long a generation waits for its reward before it expires.
FEEDBACK_TIMEOUT_MS = 60_000


def processor(sources: tuple[str, ...], *, timeout_ms: int = FEEDBACK_TIMEOUT_MS
              ) -> ComposedProcessor[RolloutUnit]:
    """SAO's processor waiting for feedback from ``sources`` (the recipe's reward function's
    source, and any fed from outside). Pure; ``ConfigurationError`` for no sources."""
    return ComposedProcessor(grouping=Ungrouped(),
                             feedback=RequireSources(tuple(sources), timeout_ms=timeout_ms))
