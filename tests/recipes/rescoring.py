"""Recipes for the rescore test (``tests.recipes.rescoring:buggy`` / ``:fixed``).

The task: a completion is right when its first token is even. ``buggy`` scores it the other way
round (the deliberate bug, source ``parity_v1``); ``fixed`` scores it right, under source
``parity_v2``, taking 0.25 s a call so that a rescore can be killed half way. Each recipe's
processor waits for its own source only; ``max_staleness`` is large because a rescore trains a
fresh group on generations sampled long ago.
"""

from __future__ import annotations

import time

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, NamedReward, Recipe, Reward
from reef_stream.api.schedule import Schedule
from reef_stream.core.events import Generation
from reef_stream.engine.models import TinyCausalLM
from tests.recipes.parts import GroupBaseline


def right(generation: Generation) -> float:
    """1.0 when the completion's first token is even: what the task rewards."""
    return 1.0 if int(generation.completion_token_ids[0]) % 2 == 0 else 0.0


def _buggy(generation: Generation) -> Reward:
    return Reward(reward=1.0 - right(generation))


def _fixed(generation: Generation) -> Reward:
    time.sleep(0.25)
    return Reward(reward=right(generation), components={"even": right(generation)})


def _recipe(name: str, reward: NamedReward) -> Recipe:
    return Recipe(
        name=name,
        processor=ComposedProcessor(grouping=ByGroupId(),
                                    feedback=RequireSources((reward.source,), timeout_ms=120_000)),
        objective=GroupBaseline(),
        schedule=Schedule(units_per_step=4, optimizer_batch_size=2, micro_batch_size=1, seed=3,
                          max_staleness=1000),
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,),
                        model=lambda: TinyCausalLM(vocab_size=64, dim=16)),
        reward=reward,
    )


buggy = _recipe("rescore-buggy", NamedReward("parity_v1", _buggy))
fixed = _recipe("rescore-fixed", NamedReward("parity_v2", _fixed))
recipe = fixed
