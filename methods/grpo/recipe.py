"""The GRPO recipe factory: grouped sampling, group-normalised advantages, the built-in clipped
``policy_gradient`` family, for any task.

    from methods.grpo import recipe as grpo
    recipe = grpo(model=my_model, reward=my_reward, evaluator=my_evaluator, group_size=16)

Replicas serving it sample ``recipe.group_size`` completions per prompt under one ``group_id``
(each generation declares that ``group_size``); a unit is one group. ``reef check`` refuses a
grouped recipe without a group size. ``reef_stream.demo.recipes:grpo`` is GRPO bound to the demo
task (what ``reef demo --recipe methods.grpo`` runs).

The variants of current practice are options of the factory (``reef_stream.api.variants``;
``reef check`` prints the chosen ones)::

    from reef_stream.api.losses import ClippedPolicyGradient
    from reef_stream.api.variants import AdvantageNormalisation, KLPenalty

    dapo_like = grpo(model=..., reward=..., evaluator=...,
                     loss=ClippedPolicyGradient(epsilon=0.2, epsilon_high=0.28),
                     dynamic_sampling=True)
    dr_grpo = grpo(model=..., reward=..., evaluator=...,
                   normalisation=AdvantageNormalisation.NONE)

``normalisation`` and ``dynamic_sampling`` are fields of the objective, so ``--set
objective.normalisation=none`` (or ``=rloo``) or ``--set objective.dynamic_sampling=true``
changes them on the command line too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reef_stream.api.evaluator import CandidateEvaluator
from reef_stream.api.losses import POLICY_GRADIENT, ClippedPolicyGradient, PolicyGradientLoss
from reef_stream.api.recipe import AdamW, Backend, Recipe, RewardFunction, awaited_sources
from reef_stream.api.schedule import Schedule
from reef_stream.api.variants import AdvantageNormalisation

from .objective import GroupNormalisedAdvantage
from .processor import processor

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
           external_sources: tuple[str, ...] = (), name: str = "grpo",
           loss: PolicyGradientLoss | None = None,
           normalisation: AdvantageNormalisation = AdvantageNormalisation.GROUP_POPULATION_STD,
           dynamic_sampling: bool = False, schedule: Schedule = SCHEDULE) -> Recipe:
    """GRPO bound to a task: ``model``, ``reward`` (its ``source`` is the feedback awaited; None
    when every source is ``external_sources``), ``evaluator``, and ``group_size``, the
    completions replicas sample per prompt. The variants: ``loss`` (a ``policy_gradient`` loss:
    ``ClippedPolicyGradient`` with its options, or ``ClippedWeightPolicyGradient`` for CISPO;
    default PPO's clip at ``CLIP_EPSILON``), the advantages' ``normalisation`` and
    ``dynamic_sampling`` (``GroupNormalisedAdvantage``), and the ``schedule``. Pure;
    ``ConfigurationError`` when no source is left to wait for or an option is bad."""
    sources = awaited_sources(reward, external_sources, method="methods.grpo.recipe")
    return Recipe(
        name=name,
        processor=processor(sources),
        objective=GroupNormalisedAdvantage(epsilon=1e-4, normalisation=normalisation,
                                           dynamic_sampling=dynamic_sampling),
        schedule=schedule,
        # The gradient norm is clipped at 1.
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,), model=model,
                        optimizer=AdamW(lr=1e-3),
                        losses={POLICY_GRADIENT: loss if loss is not None
                                else ClippedPolicyGradient(epsilon=CLIP_EPSILON)},
                        max_grad_norm=1.0),
        evaluator=evaluator,
        reward=reward,
        group_size=group_size,
        external_sources=tuple(external_sources),
    )
