"""The GRPO recipe: grouped sampling, group-normalised advantages, the built-in clipped
``policy_gradient`` family, for the demo task (``reef_stream.demo.task``).

Replicas serving this recipe sample ``GROUP_SIZE`` completions per prompt under one
``group_id`` (each generation declares ``group_size=GROUP_SIZE``); a unit is one group.
"""

from __future__ import annotations

from .objective import GroupNormalisedAdvantage
from .processor import processor
from reef_stream.demo.task import HeldOutAccuracy, exact_match, policy_model
from reef_stream.api.losses import POLICY_GRADIENT, ClippedPolicyGradient
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule

#: Completions sampled per prompt (each generation's declared group_size).
GROUP_SIZE = 16
#: PPO's clip range of the importance ratio.
CLIP_EPSILON = 0.2

recipe = Recipe(
    name="grpo",
    processor=processor,
    objective=GroupNormalisedAdvantage(epsilon=1e-4),
    # A unit is one group of GROUP_SIZE samples: 16 groups (256 samples) a step, one update
    # (a second pass or smaller batches learned slower or collapsed on the demo task). Samples
    # up to 8 versions old train, their ratio clipped; the gradient norm is clipped at 1.
    schedule=Schedule(units_per_step=16, optimizer_batch_size=16, micro_batch_size=16,
                      epochs=1, shuffle=True, seed=0, max_staleness=8),
    backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,), model=policy_model,
                    losses={POLICY_GRADIENT: ClippedPolicyGradient(epsilon=CLIP_EPSILON)},
                    max_grad_norm=1.0),
    evaluator=HeldOutAccuracy(tolerance=0.05),
    reward=exact_match,
)
