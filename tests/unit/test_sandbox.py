"""The sandbox pool against hostile reward code, without a broker (``reef_stream.consumers.reward.sandbox``).

Each hostile call ends in its category (or, where the refusal is an exception inside the
reward, as the reward function raising it), the pool's next call succeeds, and nothing leaks:
no process of the calls' users is left, the test process's descriptors and the pool's
temporary directories are back to what they were. The reward functions are in
tests/recipes/sandbox_rewards.py; the pool's workers import them as a fresh Python would.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from reef_stream.consumers.reward.sandbox.categories import Limits, RaisedInSandbox, SandboxFailure
from reef_stream.consumers.reward.sandbox.code_reward import CodeExecutionReward, CodeTest
from reef_stream.consumers.reward.sandbox.pool import RECYCLE_S, SandboxPool, Ticket
from reef_stream.core.errors import ConfigurationError
from tests.faults.records import generation
from tests.helpers import wait_until

_ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(cpu_s=1, memory_mb=256, file_mb=8, open_files=64, processes=16)


@pytest.fixture(scope="module")
def pool():
    os.chdir(_ROOT)  # the workers import tests.recipes.* from the current directory
    pool = SandboxPool("tests.recipes.sandbox_rewards:hostile", size=2, limits=LIMITS)
    pool.start()
    yield pool
    pool.close()


def _gen(do: str, **metadata: object):
    return dataclasses.replace(generation(7), metadata={"do": do, **{k: str(v) for k, v in
                                                                     metadata.items()}})


def _calls_processes(pool: SandboxPool) -> list[int]:
    """Processes running as the calls' users (or, not as root, the workers' children)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid in pool.uids:
            found.append(int(entry))
    return found


def _healthy(pool: SandboxPool) -> None:
    reward = pool.call(_gen("score"), timeout=20)
    assert reward.reward == 1.0 and reward.components == {"length": 100.0}


def _no_leaks(pool: SandboxPool, fds: int) -> None:
    def left() -> str:
        return (f"no call's process, {fds} descriptors and an empty {pool._tmp}; left: processes "
                f"{_calls_processes(pool)}, {len(os.listdir('/proc/self/fd'))} descriptors, "
                f"files {os.listdir(pool._tmp)}")

    wait_until(lambda: not (_calls_processes(pool) or len(os.listdir("/proc/self/fd")) != fds
                            or os.listdir(pool._tmp)), 10, left, poll_s=0.05)
    assert _calls_processes(pool) == []
    assert len(os.listdir("/proc/self/fd")) == fds
    assert os.listdir(pool._tmp) == []


@pytest.mark.parametrize(("do", "category", "words"), [
    ("loop", "timeout", "CPU limit of 1 s"),
    ("memory", "memory", "MemoryError"),
    ("segfault", "crashed", "SIGSEGV"),
    ("exit", "exit", "status 3"),
    ("sleep", "timeout", "wall clock"),
    ("bad_output", "output_invalid", "got str"),
    ("nan", "output_invalid", "not a finite reward"),
])
def test_hostile_calls_end_in_their_category_and_the_next_call_succeeds(pool, do, category,
                                                                       words):
    _healthy(pool)
    fds = len(os.listdir("/proc/self/fd"))
    restarts, recycled = pool.restarts, pool.recycled
    with pytest.raises(SandboxFailure) as failure:
        pool.call(_gen(do), timeout=3 if do == "sleep" else 30)
    assert failure.value.category == category and words in str(failure.value)
    assert failure.value.error_type == f"sandbox.{category}"
    if do == "sleep":  # killed at the wall-clock timeout; its worker answered and serves on
        assert failure.value.wall and failure.value.retryable
        wait_until(lambda: pool.recycled != recycled, 10, "the timed-out call's worker to be "
                   "recycled", poll_s=0.02)
        assert pool.recycled == recycled + 1
    else:
        assert not failure.value.retryable and pool.recycled == recycled
    assert pool.restarts == restarts
    _healthy(pool)
    _no_leaks(pool, fds)


def test_refusals_inside_the_reward_are_the_function_raising(pool, tmp_path):
    """A fork bomb meets the process limit, a write outside its directory the calls' user's
    permissions, a socket the empty network namespace: each refused with an exception in the
    reward, which the worker retries and dead-letters as the function's own failure."""
    assert pool.network == "isolated"
    _healthy(pool)
    fds = len(os.listdir("/proc/self/fd"))
    os.chmod(tmp_path, 0o755)
    for do, metadata, error_type, words in (
            ("fork_bomb", {}, "BlockingIOError", "Resource temporarily unavailable"),
            ("write_outside", {"path": "/usr/local"}, "PermissionError", "Permission denied"),
            # the host's /tmp is not even visible: the call's /tmp is its own
            ("write_outside", {"path": tmp_path}, "FileNotFoundError", "No such file"),
            ("socket", {"host": "127.0.0.1", "port": 9}, "OSError", "Network is unreachable"),
            ("raise", {}, "ValueError", "the judge refused gen-0000007")):
        with pytest.raises(RaisedInSandbox) as raised:
            pool.call(_gen(do, **metadata), timeout=10)
        assert raised.value.error_type == error_type and words in str(raised.value), do
        _healthy(pool)
    assert not (tmp_path / "escaped.txt").exists() and not Path("/usr/local/escaped.txt").exists()
    _no_leaks(pool, fds)


def test_a_failed_calls_stderr_ends_its_reason_and_leaves_no_file(pool):
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(SandboxFailure) as failure:
        pool.call(_gen("exit", say="x" * 4000 + "the judge gave up\n"), timeout=20)
    assert failure.value.category == "exit"
    assert str(failure.value).endswith("its stderr ends: " + "x" * 1482 + "the judge gave up")
    _no_leaks(pool, fds)


def test_garbage_on_stdout_cannot_corrupt_the_result(pool):
    assert pool.call(_gen("garbage"), timeout=20).reward == 1.0


def test_a_killed_call_frees_its_caller_at_once_and_counts(pool):
    started = time.monotonic()
    with pytest.raises(SandboxFailure):
        pool.call(_gen("sleep"), timeout=0.5)
    assert time.monotonic() - started < 2.0
    # The worker answers for the killed call on a thread of the pool's, after the caller was
    # freed: wait for that (within its RECYCLE_S), then it must have been recycled, not
    # replaced (on a loaded machine the count was read before the thread got to it).
    stats = wait_until(lambda: (lambda s: s if s["recycled"] or s["restarts"] else None)(
        pool.stats()), RECYCLE_S + 5, "the killed call's worker recycled or replaced")
    assert stats["recycled"] >= 1 and stats["network_isolated"] == 1.0
    assert stats["warm_starts"] > 0 and stats["size"] == 2
    assert pool.failures["timeout"] >= 1
    _healthy(pool)


def test_a_kill_from_another_thread_frees_the_caller_and_a_dead_worker_is_replaced(pool):
    ticket = Ticket()

    def kill_once_running() -> None:  # the call's process has started: its pid is known
        wait_until(lambda: ticket._call_pid, 10, "the call's process to start", poll_s=0.01)
        ticket.kill("killed by the test")

    threading.Thread(target=kill_once_running, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(SandboxFailure, match="killed by the test") as failure:
        pool.call(_gen("sleep"), timeout=30, ticket=ticket)
    assert failure.value.category == "timeout" and time.monotonic() - started < 5
    _healthy(pool)
    restarts = pool.restarts
    for worker in list(pool._live.values()):  # a worker killed outside any call
        os.killpg(worker.pid, signal.SIGKILL)

    def healthy_again() -> bool:
        try:
            _healthy(pool)
            return True
        except SandboxFailure as error:
            assert error.category == "sandbox_unavailable"
            return False

    wait_until(healthy_again, 120, "a call to succeed on the replaced workers", poll_s=0)
    assert pool.restarts >= restarts + 1
    _healthy(pool)


def test_a_coroutine_reward_function_runs_in_the_sandbox():
    pool = SandboxPool("tests.recipes.sandbox_rewards:async_score", size=1, limits=LIMITS)
    pool.start()
    try:
        assert pool.call(generation(3), timeout=30).components == {"length": 100.0}
    finally:
        pool.close()


def test_a_target_that_does_not_import_fails_at_start():
    with pytest.raises(ConfigurationError, match="no sandbox worker started.*ModuleNotFound"):
        SandboxPool("tests.recipes.no_such_module:recipe", size=1, start_timeout=60).start()


def test_the_code_reward_scores_the_pass_fraction_with_a_component_per_test():
    tests = (CodeTest("add(1, 2)", 3), CodeTest("add(2, 2)", 4), CodeTest("add(0, 0)", 0))
    reward = CodeExecutionReward("unit", tests=lambda g: tests,
                                 text=lambda g: g.metadata["program"], test_timeout_s=0.2,
                                 unsafe=True)
    program = "def add(a, b):\n    if a == 2: \n        while True: pass\n    return a + b\n"
    result = reward(dataclasses.replace(generation(1), metadata={"program": program}))
    assert result.reward == pytest.approx(2 / 3)
    assert result.components == {"test_0": 1.0, "test_1": 0.0, "test_2": 1.0, "passed": 2.0}
    broken = reward(dataclasses.replace(generation(1), metadata={"program": "def add(:"}))
    assert broken.reward == 0.0 and broken.components["passed"] == 0.0
    with pytest.raises(RuntimeError, match="only in a sandbox"):
        dataclasses.replace(reward, unsafe=False)(generation(1))


def test_a_recipe_names_where_its_reward_may_run():
    from reef_stream.api.recipe import recipe_problems
    from tests.recipes.sandbox_rewards import code, hostile

    assert code.reward_sandbox == "process" and hostile.reward_sandbox == "thread"
    assert not any("reward_sandbox" in p for p in recipe_problems(code))
    wrong = dataclasses.replace(code, reward_sandbox="container")
    assert any("reward_sandbox must be 'thread' or 'process', not 'container'" in p
               for p in recipe_problems(wrong))
