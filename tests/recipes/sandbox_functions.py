"""The sandbox tests' reward functions, in a module without torch (``tests.recipes.sandbox_rewards``
binds them to recipes; what ``hostile`` and ``code`` do is described there).

A sandbox worker imports the reward function alone where the pool can name it
(``reef_stream.consumers.reward.sandbox.reference``): these are named ``tests.recipes.sandbox_functions:X``, so
the workers of the sandbox tests and of ``bench/sandbox.py`` import neither the recipe
machinery nor torch.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import sys
import time

from reef_stream.api.rewards import NamedReward, Reward
from reef_stream.consumers.reward.sandbox.code_reward import CodeExecutionReward, CodeTest
from reef_stream.core.events import Generation


def _score(generation: Generation) -> Reward:
    length = float(len(generation.completion_token_ids))
    return Reward(reward=length / 100.0, components={"length": length})


def _hostile(generation: Generation) -> Reward:
    what = generation.metadata.get("do", "score")
    if what == "loop":
        while True:
            pass
    if what == "fork_bomb":
        while True:
            os.fork()
    if what == "memory":
        block = bytearray(8 << 30)
        return Reward(reward=float(len(block)))
    if what == "segfault":
        ctypes.string_at(0)
    if what == "write_outside":
        with open(os.path.join(generation.metadata["path"], "escaped.txt"), "w") as f:
            f.write("out")
    if what == "socket":
        with socket.create_connection((generation.metadata["host"],
                                       int(generation.metadata["port"])), timeout=2):
            pass
    if what == "garbage":
        junk = "\x00garbage\xff" * (4 << 17)
        sys.stdout.write(junk)
        sys.stderr.write(junk)
    if what == "exit":
        sys.stderr.write(generation.metadata.get("say", ""))
        sys.exit(3)
    if what == "sleep":
        time.sleep(60)
    if what == "bad_output":
        return "a string"  # type: ignore[return-value]
    if what == "nan":
        return Reward(reward=float("nan"))
    if what == "raise":
        raise ValueError(f"the judge refused {generation.generation_id}")
    if what == "slow":
        time.sleep(float(generation.metadata["seconds"]))
    return _score(generation)


hostile_judge = NamedReward("hostile_judge", _hostile)


# The code-execution task: the "program" a model wrote is in the generation's metadata.
ADD_TESTS = (CodeTest("add(1, 2)", 3), CodeTest("add(-4, 4)", 0), CodeTest("add(10, 5)", 15),
             CodeTest("add(2, 2)", 4))


def _program(generation: Generation) -> str:
    return generation.metadata["program"]


unit_tests = CodeExecutionReward(source="unit_tests", tests=lambda g: ADD_TESTS, text=_program,
                                 test_timeout_s=0.5)


async def _async_score(generation: Generation) -> Reward:
    await asyncio.sleep(0.01)
    return _score(generation)


#: A coroutine reward function: in the sandbox it runs on a fresh event loop in the call.
async_score = NamedReward("async_judge", _async_score)


def _modules(generation: Generation) -> Reward:
    """Reward 1.0; components: whether torch and the recipe machinery are imported in the
    call's process (a worker's fork: what the worker imported)."""
    return Reward(reward=1.0, components={
        "torch": float("torch" in sys.modules),
        "recipe": float("reef_stream.api.recipe" in sys.modules),
        "modules": float(len(sys.modules))})


#: What the call's process has imported (``_modules``).
modules = NamedReward("modules", _modules)
