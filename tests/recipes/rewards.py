"""Recipes with reward functions, for the reward-worker tests (``--recipe tests.recipes.rewards:X``).

- ``quick``: correct and fast; reward = completion length / 100, with one component.
- ``slow``: sleeps 5 s, far past the tests' per-try timeout.
- ``raising``: raises ``RuntimeError`` on every call.
- ``flaky``: raises ``ConnectionError`` on the first try of each generation, succeeds on the next
  (state per process).
- ``not_finite``: returns a NaN reward, an invalid result.
- ``paced``: like ``quick`` but an ``async`` function taking 20 ms, which first waits (up to
  30 s) for the file named by ``REWARD_TEST_GATE`` to exist, where that variable is set: a test
  opens the gate once every worker of its group has its partitions. Each call waiting at the
  gate leaves a file named after its generation in ``$REWARD_TEST_GATE.arrived/``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, NamedReward, Recipe, Reward
from reef_stream.api.schedule import Schedule
from reef_stream.core.events import Generation
from tests.recipes.parts import GroupBaseline


def _score(generation: Generation) -> Reward:
    length = float(len(generation.completion_token_ids))
    return Reward(reward=length / 100.0, components={"length": length})


def _slow(generation: Generation) -> Reward:
    time.sleep(5.0)
    return _score(generation)


def _raising(generation: Generation) -> Reward:
    raise RuntimeError(f"the judge refused {generation.generation_id}")


_tries: dict[str, int] = {}
_tries_lock = threading.Lock()


def _flaky(generation: Generation) -> Reward:
    with _tries_lock:
        _tries[generation.generation_id] = tries = _tries.get(generation.generation_id, 0) + 1
    if tries == 1:
        raise ConnectionError("the sandbox dropped the connection")
    return _score(generation)


async def _paced(generation: Generation) -> Reward:
    """Waits (up to 30 s) for the file ``$REWARD_TEST_GATE`` to exist; a call waiting there
    says so with a file named after its generation in ``$REWARD_TEST_GATE.arrived/``."""
    gate = os.environ.get("REWARD_TEST_GATE")
    if gate:
        arrived = Path(f"{gate}.arrived")
        arrived.mkdir(exist_ok=True)
        (arrived / generation.generation_id).touch()
    deadline = time.monotonic() + 30
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.02)
    return _score(generation)


def _not_finite(generation: Generation) -> Reward:
    return Reward(reward=float("nan"))


def reward_recipe(name: str, reward: Any) -> Recipe:
    """A small trainable recipe around ``reward`` (any reward function with a ``source``), its
    processor waiting for that source: the reward-worker and sandbox tests' recipes."""
    return Recipe(
        name=name,
        processor=ComposedProcessor(grouping=ByGroupId(),
                                    feedback=RequireSources((reward.source,), timeout_ms=60_000)),
        objective=GroupBaseline(),
        schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2,
                          max_staleness=2),
        backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT,)),
        reward=reward,
    )


quick = reward_recipe("rewards-quick", NamedReward("length", _score))
slow = reward_recipe("rewards-slow", NamedReward("slow_judge", _slow))
raising = reward_recipe("rewards-raising", NamedReward("refusing_judge", _raising))
flaky = reward_recipe("rewards-flaky", NamedReward("flaky_sandbox", _flaky))
not_finite = reward_recipe("rewards-not-finite", NamedReward("nan_judge", _not_finite))
paced = reward_recipe("rewards-paced", NamedReward("paced_judge", _paced))
recipe = quick
