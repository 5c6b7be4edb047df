"""The GRPO recipe factory: grouped sampling, group-normalised advantages, the built-in clipped
``policy_gradient`` family, for any task.

    from methods.grpo import recipe as grpo
    recipe = grpo(model=my_model, reward=my_reward, evaluator=my_evaluator, group_size=16)

Replicas serving it sample ``recipe.group_size`` completions per prompt under one ``group_id``
(each generation declares that ``group_size``); a unit is one group. ``reef check`` refuses a
grouped recipe without a group size. ``reef_stream.demo.recipes:grpo`` is GRPO bound to the demo
task (what ``reef demo --recipe methods.grpo`` runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .objective import GroupNormalisedAdvantage
from .processor import processor
from reef_stream.api.evaluator import CandidateEvaluator
from reef_stream.api.losses import POLICY_GRADIENT, ClippedPolicyGradient
from reef_stream.api.recipe import AdamW, Backend, Recipe, RewardFunction, awaited_sources
from reef_stream.api.schedule import Schedule

#: Completions sampled per prompt by default (each generation's declared group_size).
GROUP_SIZE = 16
#: PPO's clip range of the importance ratio.
CLIP_EPSILON = 0.2

# A unit is one group of GROUP_SIZE samples: 16 groups (256 samples) a step, one update
# (a second pass or smaller batches learned slower or collapsed on the demo task). Samples
# up to 8 versions old train, their ratio clipped.
SCHEDULE = Schedule(units_per_step=16, optimizer_batch_size=16, micro_batch_size=16,
                    epochs=1, shuffle=True, seed=0, max_staleness=8)


def recipe(*, model: Callable[[], Any], reward: RewardFunction | None,
           evaluator: CandidateEvaluator, group_size: int = GROUP_SIZE,
           external_sources: tuple[str, ...] = (), name: str = "grpo") -> Recipe:
    """GRPO bound to a task: ``model``, ``reward`` (its ``source`` is the feedback awaited; None
    when every source is ``external_sources``), ``evaluator``, and ``group_size``, the
    completions replicas sample per prompt. Pure; ``ConfigurationError`` when no source is
    left to wait for."""
    sources = awaited_sources(reward, external_sources, method="methods.grpo.recipe")
    return Recipe(
        name=name,
        processor=processor(sources),
        objective=GroupNormalisedAdvantage(epsilon=1e-4),
        schedule=SCHEDULE,
        # The gradient norm is clipped at 1.
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,), model=model,
                        optimizer=AdamW(lr=1e-3),
                        losses={POLICY_GRADIENT: ClippedPolicyGradient(epsilon=CLIP_EPSILON)},
                        max_grad_norm=1.0),
        evaluator=evaluator,
        reward=reward,
        group_size=group_size,
        external_sources=tuple(external_sources),
    )
