"""``CodeExecutionReward``: run a model-written Python function against test cases.

    reward = CodeExecutionReward(
        source="unit_tests",
        tests=lambda generation: TESTS[generation.prompt_id],   # [CodeTest("add(1, 2)", 3), ...]
        text=my_tokenizer_decode)                               # Generation -> the program
    recipe = Recipe(..., reward=reward, reward_sandbox="process")

The reward is the fraction of tests passed; each test's outcome is a component (``test_0``,
``test_1``, ... : 1.0 passed, 0.0 failed) and ``passed`` counts them. The program never judges
itself: it is ``exec``'d in a child process of the call's (a fork that reaches none of the
call's descriptors nor its memory, with the tests' expected values blanked); each test
evaluates its ``call`` there under ``test_timeout_s`` (an interval timer) and the child
reports the values as JSON. The call decodes them (plain types only) and compares each with
``expected`` structurally (``same``): a test that raises (anything, a ``MemoryError`` or a
``RecursionError`` included), runs past its time, gives a value that is not plain data or
another value failed. A program that does not even compile, whose top level raises, or whose
report is garbled or late passes nothing (reward 0: the model's failure, scored). What the
sandbox catches is not scored: a program whose process dies of a signal (a segfault) or ends
without a report (``os._exit``), or that spends the call's CPU limit, ends its call the same
way: a dead letter with its category.

It runs only in a sandbox call (``reef reward --sandbox process``): called anywhere else it
raises ``RuntimeError`` rather than run model-written code in the reward worker (``unsafe``
lifts that, for tests of the scoring alone).
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reef_stream.api.rewards import Reward
from reef_stream.core.events import Generation

__all__ = ["SANDBOXED_ENV", "CodeExecutionReward", "CodeTest", "byte_text", "same"]

#: Set in the environment of a sandboxed call's process (``reef_stream.consumers.reward.sandbox.worker``).
SANDBOXED_ENV = "REEF_SANDBOXED_CALL"
#: Seconds the program's process has beyond its tests' time to report.
START_S = 2.0
#: The largest report the program's process may write.
MAX_REPORT_BYTES = 1 << 20
PR_SET_DUMPABLE = 4


class _TestTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _TestTimeout


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data: None, bool, int, float, str, and lists, tuples and
    ``str``-keyed dicts of them."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(_plain(item) for item in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def same(got: Any, expected: Any) -> bool:
    """``got`` (JSON-decoded: plain types only) equals the plain ``expected``, compared
    structurally: a bool only to a bool, numbers by value (never a bool), ``None`` only to
    ``None``, strings, lists (a tuple expects a list) and dicts item by item."""
    if expected is None or type(expected) in (bool, str):
        return type(got) is type(expected) and got == expected
    if type(expected) in (int, float):
        return type(got) in (int, float) and got == expected
    if type(expected) in (list, tuple):
        return type(got) is list and len(got) == len(expected) and \
            all(same(g, e) for g, e in zip(got, expected))
    if type(expected) is dict:
        return type(got) is dict and set(got) == set(expected) and \
            all(same(got[k], e) for k, e in expected.items())
    return False


@dataclass(frozen=True)
class CodeTest:
    """``call``: a Python expression evaluated in the program's namespace; it passes when its
    value, as JSON, equals ``expected`` (plain data, compared by ``same``). Raises
    ``TypeError`` when ``expected`` is not plain data."""

    call: str
    expected: Any

    def __post_init__(self) -> None:
        if not _plain(self.expected):
            raise TypeError(f"CodeTest {self.call!r}: expected must be plain data (None, bool, "
                            f"int, float, str, lists and str-keyed dicts), not "
                            f"{type(self.expected).__name__}")


def byte_text(generation: Generation) -> str:
    """The completion's token ids read as bytes (a byte-level tokenizer), as UTF-8 text."""
    return bytes(int(t) & 0xFF for t in generation.completion_token_ids).decode(errors="replace")


@dataclass(frozen=True)
class CodeExecutionReward:
    """See the module docstring."""

    source: str
    tests: Callable[[Generation], Sequence[CodeTest]]
    text: Callable[[Generation], str] = byte_text
    test_timeout_s: float = 1.0
    unsafe: bool = False

    def __call__(self, generation: Generation) -> Reward:
        sandboxed = os.environ.get(SANDBOXED_ENV) == "1"
        if not self.unsafe and not sandboxed:
            raise RuntimeError(f"reward {self.source!r} runs model-written code: only in a "
                               "sandbox call (reef reward --sandbox process)")
        tests = list(self.tests(generation))
        if not tests:
            raise ValueError(f"no test cases for generation {generation.generation_id}")
        outputs = _outputs(self.text(generation), tests, self.test_timeout_s, sandboxed)
        outcomes = [output is not None and same(output[0], test.expected)
                    for output, test in zip(outputs, tests)]
        passed = len([ok for ok in outcomes if ok])
        components = {f"test_{i}": 1.0 if ok else 0.0 for i, ok in enumerate(outcomes)}
        components["passed"] = float(passed)
        return Reward(reward=passed / len(tests), components=components)


def _outputs(program: str, tests: list[CodeTest], timeout_s: float,
             sandboxed: bool) -> list[tuple[Any] | None]:
    """Each test's value as the program's process reported it, JSON-decoded here (``(value,)``),
    or None where it failed. The program runs in a child of this process that reaches none of
    its descriptors and, in a sandbox call, cannot read or write its memory (not dumpable).
    A child that dies of a signal or exits without its report ends this process the same way
    in a sandbox call (its category's dead letter); elsewhere it raises ``RuntimeError``."""
    if sandboxed:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            _program_process(program, [t.call for t in tests], tests, timeout_s, write_fd)
        finally:
            os._exit(70)
    os.close(write_fd)
    try:
        data, complete = _read_bounded(read_fd, timeout_s * (len(tests) + 1) + START_S)
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    failed: list[tuple[Any] | None] = [None] * len(tests)
    if complete and not data:
        _died_like(status, sandboxed)
    try:
        report = json.loads(data) if complete else None
    except (ValueError, RecursionError):
        return failed
    if type(report) is not list or len(report) != len(tests):
        return failed
    return [(item[0],) if type(item) is list and len(item) == 1 else None for item in report]


def _read_bounded(fd: int, seconds: float) -> tuple[bytes, bool]:
    """What ``fd`` gives until its end, within ``seconds`` and ``MAX_REPORT_BYTES``; whether it
    ended within both."""
    deadline = time.monotonic() + seconds
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"", False
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), True
        size += len(chunk)
        if size > MAX_REPORT_BYTES:
            return b"", False
        chunks.append(chunk)


def _died_like(status: int, sandboxed: bool) -> None:
    if not sandboxed:
        raise RuntimeError(f"the program's process ended without its report (status {status})")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70)


def _program_process(program: str, calls: list[str], tests: list[CodeTest], timeout_s: float,
                     report_fd: int) -> None:
    """The program's process (after the fork): forgets the expected values it can reach,
    keeps only stdin, stdout, stderr and ``report_fd``, runs the program and each call under
    ``timeout_s``, and writes their values as one JSON list (``[value]`` or ``null`` each).
    Never returns."""
    for test in tests:
        object.__setattr__(test, "expected", None)
    del tests
    os.closerange(3, report_fd)
    os.closerange(report_fd + 1, 1 << 16)
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "solution"}
    signal.signal(signal.SIGALRM, _alarm)
    report = []
    loaded = _timed(lambda: exec(compile(program, "<completion>", "exec"), namespace),  # noqa: S102
                    timeout_s)
    for call in calls:
        value = _timed(lambda call=call: [eval(call, namespace)], timeout_s) \
            if loaded is not None else None  # noqa: S307
        try:
            report.append(json.dumps(value) if value is not None else "null")
        except (TypeError, ValueError, RecursionError):
            report.append("null")
    data = ("[" + ",".join(report) + "]").encode()
    while data:
        data = data[os.write(report_fd, data):]
    os._exit(0)


def _timed(step: Callable[[], Any], timeout_s: float) -> Any:
    """``step()`` under ``timeout_s`` (an interval timer); None if it raised (``SystemExit``
    included) or ran out of time; ``True`` when it returned None."""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            result = step()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException:  # noqa: BLE001 - the model's code failed this test
        return None
    return True if result is None else result
