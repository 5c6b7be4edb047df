"""A sandbox worker's slot: one cgroup per worker that every call's process is born in, reused
call after call (``reef_stream.consumers.reward.sandbox.cgroups``), as root.

The slot replaced a cgroup per call that each call's process joined by writing
``cgroup.procs`` (10-20 ms of waiting for the kernel's cgroup lock); what a call leaves in
it must not reach the next call: files, environment, processes, memory. These tests need
root and a cgroup (as CI has): without them they fail, never skip.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest

from reef_stream.consumers.reward.sandbox.categories import (
    Limits,
    RaisedInSandbox,
    SandboxFailure,
)
from reef_stream.consumers.reward.sandbox.pool import SandboxPool
from tests.faults.records import generation

LIMITS = Limits(cpu_s=5, memory_mb=256, file_mb=8, open_files=64, processes=32)
TARGET = "tests.recipes.sandbox_attacks:attack"


def _gen(do: str, **metadata: object):
    return dataclasses.replace(generation(7), metadata={"do": do, **{k: str(v) for k, v in
                                                                     metadata.items()}})


@pytest.fixture(scope="module")
def pool():
    assert os.geteuid() == 0, "the sandbox slot tests run as root (as CI does)"
    pool = SandboxPool(TARGET, size=1, limits=LIMITS)
    pool.start()
    assert pool.cgroup in ("v1", "v2"), pool.cgroup
    yield pool
    pool.close()


def _worker(pool: SandboxPool) -> int:
    (worker,) = pool._live.values()
    return worker.pid


def _look(pool: SandboxPool) -> dict[str, str]:
    with pytest.raises(RaisedInSandbox) as raised:
        pool.call(_gen("look"), timeout=20)
    return dict(re.findall(r"(\w+)=(\S*)", str(raised.value)))


def _slot_dir(pid: int, controller: str) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return f"/sys/fs/cgroup/{controller}{path}"
    raise AssertionError(f"worker {pid} has no {controller} cgroup")


def _charged(pid: int) -> int:
    directory = _slot_dir(pid, "memory")
    for name in ("memory.usage_in_bytes", "memory.current"):
        if os.path.exists(os.path.join(directory, name)):
            with open(os.path.join(directory, name)) as f:
                return int(f.read())
    raise AssertionError(f"no memory charge in {directory}")


def _in_slot(worker: int) -> list[int]:
    with open(os.path.join(_slot_dir(worker, "pids"), "cgroup.procs")) as f:
        return [int(pid) for pid in f.read().split()]


def test_every_call_is_born_in_its_workers_slot(pool):
    worker = _worker(pool)
    first, second = _look(pool), _look(pool)
    assert first["cgroups"] == second["cgroups"]  # the same group, call after call
    assert first["cgroups"].count(f"/reef-call-{worker}-slot") == 2  # memory and pids
    assert _slot_dir(worker, "memory").endswith(f"/reef-call-{worker}-slot")
    assert _in_slot(worker) == [worker]  # between calls, the worker alone


def test_a_reused_slot_leaks_nothing_to_the_next_call(pool):
    worker = _worker(pool)
    assert pool.call(_gen("score"), timeout=20).reward == 1.0
    before = _charged(worker)
    assert pool.call(_gen("leave", mb=100), timeout=30).reward == 1.0
    assert _in_slot(worker) == [worker]  # processes: its daemon died before it answered
    # memory: its 100 MB (and the 100 MB in its /dev/shm) went with it
    assert _charged(worker) - before < 16 << 20
    seen = _look(pool)
    assert seen["env"] == "[]"  # environment
    assert seen["files"] == "[]"  # home, /tmp, /var/tmp, /dev/shm
    assert seen["user_others"] == "[]"
    # and the next call has the whole limit: two children of 100 MB (of 256) together
    assert pool.call(_gen("children", n=2, mb=100), timeout=30).reward == 1.0


def test_a_fork_bomb_that_filled_the_slot_leaves_the_worker_able_to_fork_the_next_call(pool):
    worker = _worker(pool)
    for _ in range(2):  # its children still run when it answers: the worker kills them all
        assert pool.call(_gen("fork_bomb"), timeout=20).reward >= LIMITS.processes - 2
        assert _in_slot(worker) == [worker]
        assert pool.call(_gen("score"), timeout=20).reward == 1.0
    assert pool.restarts == 0


def test_an_oom_kill_is_counted_for_its_own_call_only(pool):
    try:  # four children of 100 MB each: not together under 256 MB
        reward = pool.call(_gen("children", n=4, mb=100), timeout=30)
        assert reward.reward == 0.0
    except SandboxFailure as failure:
        assert failure.category == "memory", failure
    with pytest.raises(SandboxFailure) as killed:  # SIGKILL, but not by the OOM killer
        pool.call(_gen("suicide"), timeout=20)
    assert killed.value.category == "crashed", killed.value


def test_the_slot_is_removed_with_its_worker():
    pool = SandboxPool(TARGET, size=2, limits=LIMITS)
    pool.start()
    try:
        workers = [worker.pid for worker in pool._live.values()]
        slots = [_slot_dir(pid, "memory") for pid in workers]
        assert all(os.path.isdir(slot) for slot in slots)
        assert pool.call(_gen("leave", mb=10), timeout=30).reward == 1.0
    finally:
        pool.close()
    deadline = time.monotonic() + 5
    while any(os.path.isdir(slot) for slot in slots) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [slot for slot in slots if os.path.isdir(slot)] == []
