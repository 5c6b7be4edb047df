"""The sandbox against reward code that tries to get out (issue 28's review), as root.

Each test is one attack made through ``SandboxPool`` with the reward functions of
tests/recipes/sandbox_attacks.py; each failed on the sandbox before the change that closed
it. These tests need root (as CI runs): without it they fail, never skip.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path

import pytest

from reef_stream.consumers.reward.sandbox.categories import (
    Limits,
    RaisedInSandbox,
    SandboxFailure,
)
from reef_stream.consumers.reward.sandbox.pool import SandboxPool
from tests.faults.records import generation

LIMITS = Limits(cpu_s=5, memory_mb=512, file_mb=8, open_files=64, processes=32)
TARGET = "tests.recipes.sandbox_attacks:attack"
SECRETS = {"REEF_KAFKA_SASL_PASSWORD": "hunter2-sasl", "REEF_INTAKE_TOKEN": "hunter2-token"}


def _gen(do: str, **metadata: object):
    return dataclasses.replace(generation(5), metadata={"do": do, **{k: str(v) for k, v in
                                                                     metadata.items()}})


def _pool(size: int = 1, limits: Limits = LIMITS) -> SandboxPool:
    assert os.geteuid() == 0, "the sandbox escape tests run as root (as CI does)"
    pool = SandboxPool(TARGET, size=size, limits=limits)
    pool.start()
    return pool


@pytest.fixture(scope="module")
def pool():
    saved = {name: os.environ.get(name) for name in SECRETS}
    os.environ.update(SECRETS)  # the reward worker's credentials, as a deployment has them
    try:
        pool = _pool()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield pool
    pool.close()


def _healthy(pool: SandboxPool) -> None:
    assert pool.call(_gen("score"), timeout=20).reward == 1.0


def test_the_calls_environment_is_an_allow_list_without_credentials(pool):
    with pytest.raises(RaisedInSandbox) as raised:
        pool.call(_gen("environ"), timeout=20)
    names = set(str(raised.value).removeprefix("environ: ").split(","))
    assert not names & set(SECRETS)
    assert {n for n in names if n.startswith("REEF_")} <= {"REEF_SANDBOXED_CALL"}
    assert names <= {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "HOME", "TMPDIR",
                     "TMP", "TEMP", "REEF_SANDBOXED_CALL"}, names
    (worker,) = pool._live.values()
    with open(f"/proc/{worker.pid}/environ", "rb") as f:
        assert b"hunter2" not in f.read()


def _failure_text(pool: SandboxPool, do: str, timeout: float = 10, **metadata: object) -> str:
    """What a caller learns of a call: its failure's text (it must end within ``timeout``,
    as the function's failure or the sandbox's, never as a wall-clock timeout)."""
    started = time.monotonic()
    with pytest.raises((RaisedInSandbox, SandboxFailure)) as failed:
        pool.call(_gen(do, **metadata), timeout=timeout)
    assert getattr(failed.value, "category", "") != "timeout", failed.value
    assert time.monotonic() - started < timeout
    return str(failed.value)


def test_a_symlinked_stderr_does_not_read_a_root_only_file(pool, tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("TOPSECRET-" * 20)
    secret.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    assert "TOPSECRET" not in _failure_text(pool, "stderr_link", target=secret)
    (worker,) = pool._live.values()
    for path in (f"/proc/{worker.pid}/environ", f"/proc/{os.getpid()}/environ"):
        assert "PATH=" not in _failure_text(pool, "stderr_link", target=path)
    _healthy(pool)


def test_a_fifo_for_stderr_does_not_hang_the_worker(pool):
    _failure_text(pool, "stderr_fifo", timeout=5)
    assert pool.restarts == 0
    _healthy(pool)


def test_a_stderr_linked_to_dev_zero_is_read_bounded(pool):
    assert len(_failure_text(pool, "stderr_link", timeout=10, target="/dev/zero")) < 4000
    _healthy(pool)


def test_workers_ignore_modules_planted_in_a_world_writable_working_directory(tmp_path):
    planted = tmp_path / "cwd"
    planted.mkdir()
    planted.chmod(0o777)
    marker = tmp_path / "ran-as"
    # the worker imports these after start; from the cwd they would run as root
    for name in ("pprint", "difflib", "statistics"):
        (planted / f"{name}.py").write_text(
            f"import os\nopen({str(marker)!r}, 'a').write(str(os.getuid()))\n")
    here = os.getcwd()
    os.chdir(planted)
    try:
        pool = _pool()
    finally:
        os.chdir(here)
    try:
        _healthy(pool)
        (worker,) = pool._live.values()
        cwd = os.readlink(f"/proc/{worker.pid}/cwd")
        assert os.stat(cwd).st_uid == 0 and not os.stat(cwd).st_mode & stat.S_IWOTH
    finally:
        pool.close()
    assert not marker.exists(), f"planted code ran as uid {marker.read_text()}"


# --------------------------------------------------------------------------- the code reward

FORGERIES = {
    "__eq__ always True": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                          "def add(a, b):\n    return Yes()\n",
    "a fake result on the result pipe": (
        "import json, os, stat\n"
        "fake = json.dumps({'ok': {'reward': 1.0, 'components': {'passed': 4.0}}}).encode()\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    try:\n"
        "        if fd > 2 and stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
        "            os.write(fd, fake)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"),
    "a replaced builtins.sum": "import builtins\nbuiltins.sum = lambda *args, **kw: 4\n"
                               "def add(a, b):\n    return -1\n",
    "expected values read from memory": (
        "import gc\n"
        "def add(a, b):\n"
        "    for o in gc.get_objects():\n"
        "        if type(o).__name__ == 'CodeTest' and o.call == f'add({a}, {b})':\n"
        "            return o.expected\n"),
    "a subclass of int equal to anything": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Int(7)\n"),
}


@pytest.fixture(scope="module")
def code_pool():
    pool = SandboxPool("tests.recipes.sandbox_rewards:code", size=1, limits=LIMITS)
    pool.start()
    yield pool
    pool.close()


def _code(program: str):
    return dataclasses.replace(generation(1), metadata={"program": program})


@pytest.mark.parametrize("program", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_program_cannot_forge_its_code_reward(code_pool, program):
    try:
        reward = code_pool.call(_code(program), timeout=20)
    except (SandboxFailure, RaisedInSandbox):
        return  # a dead letter is not a reward
    assert reward.reward == 0.0 and reward.components["passed"] == 0.0, reward
    assert code_pool.call(_code("def add(a, b):\n    return a + b\n"), timeout=20).reward == 1.0


def test_a_program_cannot_open_its_judges_memory(code_pool):
    # A guard for the design above (the judge is the program's parent, as the same user):
    # not dumpable (it dropped from root; elsewhere it makes itself so), its memory is closed.
    program = ("import os\n"
               "def add(a, b):\n"
               "    open(f'/proc/{os.getppid()}/mem', 'rb').close()\n"
               "    return a + b\n")
    assert code_pool.call(_code(program), timeout=20).reward == 0.0


def test_code_tests_expect_plain_data_compared_structurally():
    from reef_stream.consumers.reward.sandbox.code_reward import CodeTest, same

    with pytest.raises(TypeError, match="plain data"):
        CodeTest("f()", {1, 2})
    assert same(3, 3.0) and same([1, {"a": None}], (1, {"a": None}))
    assert not same(True, 1) and not same(1, True) and not same(None, 0)
    assert not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2})


# --------------------------------------------------------------------------- survivors, uids

def _sleepers(token: str) -> list[int]:
    """Live processes running ``sleep 600.<token>`` (the ``daemon`` attack's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[1:2] == [f"600.{token}".encode()]:
                    with open(f"/proc/{pid}/stat") as stat_file:
                        if stat_file.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(pid))
        except (OSError, IndexError):
            pass
    return found


def _wait_none(token: str, seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := _sleepers(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_setsid_daemon_does_not_outlive_its_call(pool):
    token = str(time.monotonic_ns())
    _healthy(pool)
    assert pool.call(_gen("daemon", token=token), timeout=20).reward == 1.0
    try:
        assert _sleepers(token) == []  # killed before the call answered
    finally:
        for pid in _sleepers(token):
            os.kill(pid, 9)


def test_a_daemon_of_a_call_in_flight_does_not_outlive_the_pools_close():
    import threading

    pool = _pool()
    token = str(time.monotonic_ns())
    caller = threading.Thread(target=lambda: pytest.raises(
        SandboxFailure, pool.call, _gen("daemon", token=token, then_sleep=30), timeout=60))
    caller.start()
    deadline = time.monotonic() + 10
    while not _sleepers(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _sleepers(token), "the daemon did not start"
    pool.close()
    caller.join(10)
    try:
        assert _wait_none(token) == []
    finally:
        for pid in _sleepers(token):
            os.kill(pid, 9)


def test_pools_never_share_a_uid_and_one_pools_daemon_cannot_kill_anothers_calls():
    first, second = _pool(size=2), _pool(size=2)
    try:
        assert first.call(_gen("killer", seconds=3), timeout=20).reward == 1.0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            _healthy(second)
            _healthy(first)
        assert len(first.uids | second.uids) == 4
    finally:
        first.close()
        second.close()


# --------------------------------------------------------------------------- the filesystem

def test_tmp_files_are_neither_shared_nor_left_after_the_call(pool):
    token = f"reef-escape-{time.monotonic_ns()}"
    paths = [f"{d}/{token}" for d in ("/tmp", "/var/tmp", "/dev/shm")]
    try:
        assert pool.call(_gen("write", paths=":".join(paths), text=token), timeout=20).reward
        assert [p for p in paths if os.path.exists(p)] == []
        assert pool.call(_gen("read", paths=":".join(paths), text=token), timeout=20).reward \
            == 0.0
    finally:
        for path in paths:
            Path(path).unlink(missing_ok=True)
    assert pool.filesystem == "private"


def test_the_calls_tmp_is_size_limited(pool):
    token = f"reef-fill-{time.monotonic_ns()}"
    try:  # four files of 6 MB, each under RLIMIT_FSIZE (8 MB), but not all in an 8 MB tmpfs
        written = pool.call(_gen("fill", n=4, mb=6, token=token), timeout=30).reward
        assert written <= LIMITS.file_mb
    finally:
        for path in Path("/tmp").glob(f"{token}-*"):
            path.unlink()
    _healthy(pool)


def test_a_unix_socket_in_tmp_is_out_of_reach(pool):
    import socket

    path = f"/tmp/reef-sock-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(1)
        try:
            with pytest.raises(RaisedInSandbox, match="No such file"):
                pool.call(_gen("connect_unix", path=path), timeout=20)
        finally:
            os.unlink(path)


# --------------------------------------------------------------------------- limits per call

def test_memory_is_limited_per_call_not_per_process():
    pool = _pool(limits=dataclasses.replace(LIMITS, memory_mb=128))
    try:  # four children of 100 MB each: each under RLIMIT_AS, not together under 128 MB
        try:
            reward = pool.call(_gen("children", n=4, mb=100), timeout=30)
            assert reward.reward == 0.0, "all four children got their 100 MB"
        except SandboxFailure as failure:
            assert failure.category == "memory", failure
        assert pool.cgroup in ("v1", "v2")
        _healthy(pool)
        workers = [worker.pid for worker in pool._live.values()]
    finally:
        pool.close()
    assert [d for d in _call_groups() for pid in workers if f"reef-call-{pid}-" in d] == []


def _call_groups() -> list[str]:
    """The calls' cgroups left on this machine (``reef-call-*``)."""
    found = []
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(top, d) for d in dirs if d.startswith("reef-call-")]
    return found


# --------------------------------------------------------------------------- the kernel

def test_the_kernel_interfaces_a_reward_has_no_use_for_are_denied(pool):
    import re

    with pytest.raises(RaisedInSandbox) as raised:
        pool.call(_gen("kernel"), timeout=20)
    seen = dict(re.findall(r"(\w+)=(\S+)", str(raised.value)))
    # a user namespace (root of its own), tracing, the key ring, bpf; and a setuid program
    # it runs gains nothing
    assert seen == {"unshare_user": "EPERM", "clone_user": "EPERM", "ptrace": "EPERM",
                    "keyctl": "EPERM", "bpf": "EPERM", "no_new_privs": "1"}, seen
    assert pool.seccomp == "filtered"
    _healthy(pool)
