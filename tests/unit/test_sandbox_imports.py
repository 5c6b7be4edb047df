"""What a sandbox worker imports: the reward function alone, not the recipe and torch
(``reef_stream.consumers.reward.sandbox.reference``, ``reef_stream.api.rewards``).

Each check is on a real worker process: its memory map (``/proc/<pid>/maps`` lists torch's
shared libraries once torch is imported), its ready frame, and what a call forked from it has
in ``sys.modules``. No broker.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reef_stream.api.rewards import NamedReward, Reward
from reef_stream.consumers.reward.sandbox.categories import Limits
from reef_stream.consumers.reward.sandbox.pool import SandboxPool, Ticket
from reef_stream.consumers.reward.sandbox.reference import worker_target
from tests.faults.records import generation
from tests.helpers import wait_until

_ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(cpu_s=2, memory_mb=512, file_mb=8, open_files=64, processes=16)


@pytest.fixture(autouse=True)
def _in_the_checkout():
    os.chdir(_ROOT)  # the workers import tests.recipes.* from the current directory


def _torch_libraries(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps
                       if "libtorch" in line or "/torch/" in line})


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _started(target: str, overrides: tuple[str, ...] = ()) -> SandboxPool:
    pool = SandboxPool(target, overrides=overrides, size=1, limits=LIMITS)
    pool.start()
    return pool


def _worker_pid(pool: SandboxPool) -> int:
    (worker,) = pool._live.values()
    return worker.pid


def _demo_generation(a: int, b: int, answer: int):
    from reef_stream.demo.task import BOS, DIGIT_TOKENS, encode

    prompt = np.concatenate([[BOS], encode(f"{a}+{b}=")]).astype(np.int32)
    return dataclasses.replace(generation(1), prompt_token_ids=prompt,
                               completion_token_ids=np.array([DIGIT_TOKENS[answer]], np.int32),
                               completion_logprobs=np.array([-0.5], np.float32))


def test_the_reward_types_import_without_torch_and_are_re_exported():
    script = ("import sys\nfrom reef_stream import NamedReward, Reward, RewardFunction\n"
              "import reef_stream.api.rewards\n"
              "print(sorted(m for m in ('torch', 'numpy', 'reef_stream.api.recipe') "
              "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, cwd=_ROOT)
    assert result.stdout.strip() == "[]"
    import reef_stream
    from reef_stream.api import recipe

    assert recipe.Reward is Reward is reef_stream.Reward
    assert recipe.NamedReward is NamedReward is reef_stream.NamedReward
    assert recipe.RewardFunction is reef_stream.RewardFunction


def test_the_demo_reward_runs_in_a_worker_without_torch():
    pool = _started("reef_stream.demo.recipes:sao")
    try:
        assert pool.worker_target == {"target": "reef_stream.demo.arithmetic:exact_match",
                                      "overrides": []}
        pid = _worker_pid(pool)
        assert _torch_libraries(pid) == [] and pool.worker_torch is False
        assert _rss_mb(pid) < 150
        assert pool.call(_demo_generation(7, 5, 2), timeout=30) == \
            Reward(reward=1.0, components={"exact_match": 1.0})
        assert pool.call(_demo_generation(7, 5, 3), timeout=30).reward == 0.0
    finally:
        pool.close()


def test_an_overridden_reward_is_built_from_its_fields_in_the_worker():
    pool = _started("reef_stream.demo.recipes:sao", ("reward.source=other",))
    try:
        assert pool.worker_target == {"target": "reef_stream.demo.arithmetic:ExactMatch",
                                      "overrides": [], "build": {"source": "other"}}
        assert _torch_libraries(_worker_pid(pool)) == []
        assert pool.call(_demo_generation(1, 2, 3), timeout=30).reward == 1.0
    finally:
        pool.close()


def test_the_code_execution_reward_runs_in_a_worker_without_torch():
    pool = _started("tests.recipes.sandbox_rewards:code")
    try:
        assert pool.worker_target["target"] == "tests.recipes.sandbox_functions:unit_tests"
        assert _torch_libraries(_worker_pid(pool)) == [] and pool.worker_torch is False
        program = "def add(a, b):\n    return a + b if a != 2 else 5\n"
        result = pool.call(dataclasses.replace(generation(1), metadata={"program": program}),
                           timeout=30)
        assert result.reward == pytest.approx(0.75) and result.components["test_3"] == 0.0
    finally:
        pool.close()


def test_a_model_program_may_import_the_usual_standard_modules_in_the_sandbox():
    # As root the calls run as users who may not read the Python installation: what the
    # program imports must be in the worker already (PRELOADED), now that torch is not.
    pool = _started("tests.recipes.sandbox_rewards:code")
    try:
        program = ("import heapq, statistics, string, itertools, functools, datetime, queue\n"
                   "def add(a, b):\n    return int(statistics.fmean([a + b, a + b]))\n")
        result = pool.call(dataclasses.replace(generation(1), metadata={"program": program}),
                           timeout=30)
        assert result.reward == 1.0, result.components
    finally:
        pool.close()


def test_a_call_forked_from_the_worker_has_neither_torch_nor_the_recipe_module():
    pool = _started("tests.recipes.sandbox_functions:modules")
    try:
        components = pool.call(generation(1), timeout=30).components
        assert components["torch"] == 0.0 and components["recipe"] == 0.0
    finally:
        pool.close()


def test_a_reward_the_parent_cannot_name_makes_the_worker_import_the_recipe_and_torch():
    # The check above can fail: a lambda inside a recipe has no smaller name to import.
    pool = _started("tests.recipes.sandbox_rewards:inline")
    try:
        assert pool.worker_target == {"target": "tests.recipes.sandbox_rewards:inline",
                                      "overrides": []}
        assert _torch_libraries(_worker_pid(pool)) != [] and pool.worker_torch is True
        assert pool.call(generation(1), timeout=30).reward == 0.5
    finally:
        pool.close()
    assert worker_target("tests.recipes.no_such_module:recipe") == \
        {"target": "tests.recipes.no_such_module:recipe", "overrides": []}



def test_a_call_in_flight_when_the_pool_closes_is_neither_a_restart_nor_a_failure():
    import threading

    from reef_stream.consumers.reward.sandbox.categories import SandboxFailure

    pool = _started("tests.recipes.sandbox_rewards:hostile")
    outcome: list[BaseException] = []
    ticket = Ticket()  # only to see the call's process start

    def hang() -> None:
        try:
            pool.call(dataclasses.replace(generation(1), metadata={"do": "sleep"}), timeout=30,
                      ticket=ticket)
        except SandboxFailure as error:
            outcome.append(error)

    caller = threading.Thread(target=hang)
    caller.start()
    wait_until(lambda: ticket._call_pid, 10, "the call to be running in its process",
               poll_s=0.01)
    pool.close()
    caller.join(10)
    assert not caller.is_alive() and len(outcome) == 1
    assert "closed during the call" in str(outcome[0])
    assert pool.restarts == 0 and dict(pool.failures) == {}
    if pool.uid_base is not None:  # as root the call ran as a user of its own: it was killed
        wait_until(lambda: not _alive(pool.uids), 5,
                   lambda: f"the call's processes to die; alive: {_alive(pool.uids)}",
                   poll_s=0.05)


def _alive(uids: set[int]) -> list[str]:
    """The processes of ``uids`` that are not dead (a zombie waits for init to reap it)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid in uids:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
        except OSError:
            pass
    return alive
