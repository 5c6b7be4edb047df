"""The GRPO recipe: grouped sampling, group-normalised advantages, the built-in clipped
``policy_gradient`` family, for the demo task (``reef_stream.demo.task``).

Replicas serving this recipe sample ``GROUP_SIZE`` completions per prompt under one
``group_id`` (each generation declares ``group_size=GROUP_SIZE``); a unit is one group.
"""

from __future__ import annotations

from methods.grpo.objective import GroupNormalisedAdvantage
from methods.grpo.processor import processor
from reef_stream.demo.task import HeldOutAccuracy, exact_match, policy_model
from reef_stream.losses import POLICY_GRADIENT, ClippedPolicyGradient
from reef_stream.recipe import Backend, Recipe
from reef_stream.schedule import Schedule

#: Completions sampled per prompt (each generation's declared group_size).
GROUP_SIZE = 8
#: PPO's clip range of the importance ratio.
CLIP_EPSILON = 0.2

recipe = Recipe(
    name="grpo",
    processor=processor,
    objective=GroupNormalisedAdvantage(epsilon=1e-4),
    # A unit is one group of GROUP_SIZE samples: 8 groups (64 samples) per step, two passes;
    # the clipped ratio keeps the second pass close to the behaviour policy.
    schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=4,
                      epochs=2, shuffle=True, seed=0, max_staleness=1),
    backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,), model=policy_model,
                    losses={POLICY_GRADIENT: ClippedPolicyGradient(epsilon=CLIP_EPSILON)}),
    evaluator=HeldOutAccuracy(tolerance=0.02),
    reward=exact_match,
)
