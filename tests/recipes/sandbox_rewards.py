"""Hostile (and healthy) reward code for the sandbox tests (``tests.recipes.sandbox_rewards:X``).

``hostile``: what the reward does is named by the generation's ``metadata["do"]``:

- ``score`` (or none): reward = completion length / 100, one component;
- ``loop``: an infinite loop (the CPU limit ends it);
- ``fork_bomb``: ``while True: os.fork()`` (the process limit ends it);
- ``memory``: allocates 8 GB (the memory limit refuses it);
- ``segfault``: reads address 0 with ctypes;
- ``write_outside``: writes a file into the directory named by ``metadata["path"]``;
- ``socket``: connects to ``metadata["host"]:metadata["port"]``;
- ``garbage``: prints 4 MB of garbage to stdout and stderr, then scores;
- ``exit``: ``sys.exit(3)``;
- ``sleep``: sleeps 60 s (past any test's timeout);
- ``bad_output``: returns a string, not a Reward;
- ``nan``: returns a NaN reward;
- ``raise``: raises ``ValueError``;
- ``slow``: sleeps ``metadata["seconds"]``, then scores.

``code``: the built-in ``CodeExecutionReward`` over ``metadata["program"]`` (a model's ``add``
function) against four tests; the recipe requires the sandbox.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import os
import socket
import sys
import time

from reef_stream.api.recipe import NamedReward, Reward
from reef_stream.sandbox.code_reward import CodeExecutionReward, CodeTest
from reef_stream.topics.events import Generation
from tests.recipes.rewards import reward_recipe


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


hostile = reward_recipe("sandbox-hostile", NamedReward("hostile_judge", _hostile))
recipe = hostile


# The code-execution task: the "program" a model wrote is in the generation's metadata.
ADD_TESTS = (CodeTest("add(1, 2)", 3), CodeTest("add(-4, 4)", 0), CodeTest("add(10, 5)", 15),
             CodeTest("add(2, 2)", 4))


def _program(generation: Generation) -> str:
    return generation.metadata["program"]


code = dataclasses.replace(
    reward_recipe("sandbox-code", CodeExecutionReward(
        source="unit_tests", tests=lambda g: ADD_TESTS, text=_program, test_timeout_s=0.5)),
    reward_sandbox="process")


async def _async_score(generation: Generation) -> Reward:
    await asyncio.sleep(0.01)
    return _score(generation)


#: A coroutine reward function: in the sandbox it runs on a fresh event loop in the call.
async_score = NamedReward("async_judge", _async_score)
