"""The SAO recipe factory: SAO's processor, objective and loss bound to a schedule, for any task.

A method is task-agnostic: the task brings the model, the reward function and the candidate
evaluator, and binds them::

    from methods.sao import recipe as sao
    recipe = sao(model=my_model, reward=my_reward, evaluator=my_evaluator)

``reef_stream.demo.recipes:sao`` is SAO bound to the demo task (what ``reef demo --recipe
methods.sao`` runs). ``load_recipe`` / ``reef check`` check the bindings: the processor emits the
``RolloutUnit`` the objective consumes, the objective's loss family (``sao_truncated_pg``) is
registered and the backend has a loss for it, the schedule's batches fit, and the processor
waits for the reward function's source. The settings people change (``--set
schedule.max_staleness=8``, ``--set backend.optimizer.lr=3e-4``, ``--set objective.decay=0.8``)
are fields of the recipe's frozen configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reef_stream.api.evaluator import CandidateEvaluator
from reef_stream.api.recipe import AdamW, Backend, Recipe, RewardFunction, awaited_sources
from reef_stream.api.schedule import Schedule

from .loss import SAO_TRUNCATED_PG, TruncatedPolicyGradient
from .objective import StreamingAdvantage
from .processor import processor

#: The importance-weight bound of the loss (V-trace's rho-bar).
TRUNCATION = 1.0
#: Adam's learning rate. 4e-4, not 1e-3: the demo's synchronous loop needs 38k samples to 0.9
#: instead of 48k-56k, with a narrower spread over seeds; 2e-3 mostly never gets there
#: (docs/history.md, "SAO's learning rate").
LEARNING_RATE = 4e-4

# A unit is one sample: 256 samples a step, one update. One epoch: the truncated weights
# bound a step's update, and no clipping protects a second pass. Samples up to 16 versions
# old are corrected, not dropped (the demo's replicas serve a version a few steps behind
# the trainer: evaluating and publishing take time). At most 2 steps of units wait for the
# trainer (max_backlog_steps): what completes beyond is shed, counted, so that when replicas
# outrun the trainer it trains fresh samples at its own pace. Why 2 and not 1 or none:
# docs/history.md ("SAO's schedule"). A full backlog holds what the processor reads for up to
# 0.5 s (backlog_wait_s) before shedding: the checkpoint that makes room comes a step after
# the last one, and what arrived meanwhile then trains instead of being shed
# (docs/history.md, "Waiting for the checkpoint").
SCHEDULE = Schedule(units_per_step=256, optimizer_batch_size=256, micro_batch_size=256,
                    epochs=1, shuffle=True, seed=0, max_staleness=16, max_backlog_steps=2,
                    backlog_wait_s=0.5)


def recipe(*, model: Callable[[], Any], reward: RewardFunction | None,
           evaluator: CandidateEvaluator, external_sources: tuple[str, ...] = (),
           name: str = "sao") -> Recipe:
    """SAO bound to a task: ``model`` (a zero-argument callable building the torch module to
    train), ``reward`` (its ``source`` is the feedback the processor waits for; None when every
    source is ``external_sources``), ``evaluator`` (decides which checkpoints to promote).
    ``external_sources``: feedback sources fed from outside ``reef reward``, also awaited.
    Pure; ``ConfigurationError`` when no source is left to wait for."""
    sources = awaited_sources(reward, external_sources, method="methods.sao.recipe")
    return Recipe(
        name=name,
        processor=processor(sources),
        objective=StreamingAdvantage(decay=0.9, global_decay=0.99, initial_mean=0.0,
                                     initial_variance=0.25, std_floor=0.1, max_keys=4096),
        schedule=SCHEDULE,
        # The gradient norm is clipped at 1: without it the policy sometimes collapses onto
        # wrong answers after a large update.
        backend=Backend(name="torch", loss_families=(SAO_TRUNCATED_PG,), model=model,
                        optimizer=AdamW(lr=LEARNING_RATE),
                        losses={SAO_TRUNCATED_PG: TruncatedPolicyGradient(truncation=TRUNCATION)},
                        max_grad_norm=1.0),
        evaluator=evaluator,
        reward=reward,
        external_sources=tuple(external_sources),
    )
