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
- ``exit``: writes ``metadata["say"]`` (if any) to stderr, then ``sys.exit(3)``;
- ``sleep``: sleeps 60 s (past any test's timeout);
- ``bad_output``: returns a string, not a Reward;
- ``nan``: returns a NaN reward;
- ``raise``: raises ``ValueError``;
- ``slow``: sleeps ``metadata["seconds"]``, then scores.

``code``: the built-in ``CodeExecutionReward`` over ``metadata["program"]`` (a model's ``add``
function) against four tests; the recipe requires the sandbox.

The functions are in ``tests.recipes.sandbox_functions`` (a module without torch: the
sandbox workers import them alone); here they are bound to recipes.
"""

from __future__ import annotations

import dataclasses

from reef_stream.api.rewards import NamedReward, Reward
from tests.recipes.rewards import reward_recipe
from tests.recipes.sandbox_functions import (  # noqa: F401 - their recipes, and these too
    ADD_TESTS,
    async_score,
    hostile_judge,
    modules,
    unit_tests,
)

hostile = reward_recipe("sandbox-hostile", hostile_judge)
recipe = hostile
code = dataclasses.replace(reward_recipe("sandbox-code", unit_tests), reward_sandbox="process")
#: A reward the sandbox pool cannot name (a lambda inside the recipe): its workers import the
#: recipe module, and torch with it.
inline = reward_recipe("sandbox-inline", NamedReward("inline_judge", lambda g: Reward(reward=0.5)))
