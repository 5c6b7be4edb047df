"""The SAO recipe: SAO's processor, objective and loss bound to a schedule, a model and an
evaluator, for the demo task (``reef_stream.demo.task``: the last digit of a + b).

``load_recipe("methods.sao")`` / ``reef check --recipe methods.sao`` check the
bindings: the processor emits the ``RolloutUnit`` the objective consumes, the
objective's loss family (``sao_truncated_pg``) is registered and the backend
has a loss for it, and the schedule's batches fit.
"""

from __future__ import annotations

from .loss import SAO_TRUNCATED_PG, TruncatedPolicyGradient
from .objective import StreamingAdvantage
from .processor import processor
from reef_stream.demo.task import HeldOutAccuracy, exact_match, policy_model
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule

#: The importance-weight bound of the loss (V-trace's rho-bar).
TRUNCATION = 1.0

recipe = Recipe(
    name="sao",
    processor=processor,
    objective=StreamingAdvantage(decay=0.9, global_decay=0.99, initial_mean=0.0,
                                 initial_variance=0.25, std_floor=0.1, max_keys=4096),
    # A unit is one sample: 256 samples a step, one update. One epoch: the truncated weights
    # bound a step's update, and no clipping protects a second pass. Samples up to 16 versions
    # old are corrected, not dropped (the demo's replicas serve a version a few steps behind
    # the trainer: evaluating and publishing take time). The gradient norm is clipped at 1:
    # without it the policy sometimes collapses onto wrong answers after a large update.
    # No bound on the units waiting for the trainer (max_backlog_steps): on the demo's two
    # cores a bound of 4 steps shed half the generations and learned slower, as the samples'
    # staleness came mostly from before the queue (serving, reward and processor latency).
    schedule=Schedule(units_per_step=256, optimizer_batch_size=256, micro_batch_size=256,
                      epochs=1, shuffle=True, seed=0, max_staleness=16),
    backend=Backend(name="torch", loss_families=(SAO_TRUNCATED_PG,), model=policy_model,
                    losses={SAO_TRUNCATED_PG: TruncatedPolicyGradient(truncation=TRUNCATION)},
                    max_grad_norm=1.0),
    # Promotes a candidate only if its held-out accuracy (greedy decoding) does not fall more
    # than 0.05 below the incumbent's: on 100 prompts one answer is 0.01, and a tighter bound
    # rejects the wobble of a policy still near chance, while the trainer runs ahead.
    evaluator=HeldOutAccuracy(tolerance=0.05),
    reward=exact_match,
)
