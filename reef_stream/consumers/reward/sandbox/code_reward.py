"""``CodeExecutionReward``: run a model-written Python function against test cases.

    reward = CodeExecutionReward(
        source="unit_tests",
        tests=lambda generation: TESTS[generation.prompt_id],   # [CodeTest("add(1, 2)", 3), ...]
        text=my_tokenizer_decode)                               # Generation -> the program
    recipe = Recipe(..., reward=reward, reward_sandbox="process")

The reward is the fraction of tests passed; each test's outcome is a component (``test_0``,
``test_1``, ... : 1.0 passed, 0.0 failed) and ``passed`` counts them. The program is
``exec``'d in a namespace of its own; each test evaluates its ``call`` there and compares the
value with ``expected`` (``==``), under ``test_timeout_s`` (an interval timer): a test that
raises (anything, a ``MemoryError`` or a ``RecursionError`` included), runs past its time or
gives another value failed, and the next one runs. A program that does not even compile or
whose top level raises passes nothing (reward 0: the model's failure, scored). What the
sandbox catches is not scored: a program that kills its process (a segfault, ``os._exit``),
spends the call's CPU limit or hangs past the worker's timeout ends in a dead letter with
its category.

It runs only in a sandbox call (``reef reward --sandbox process``): called anywhere else it
raises ``RuntimeError`` rather than run model-written code in the reward worker (``unsafe``
lifts that, for tests of the scoring alone).
"""

from __future__ import annotations

import builtins
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reef_stream.api.rewards import Reward
from reef_stream.core.events import Generation

__all__ = ["SANDBOXED_ENV", "CodeExecutionReward", "CodeTest", "byte_text"]

#: Set in the environment of a sandboxed call's process (``reef_stream.consumers.reward.sandbox.worker``).
SANDBOXED_ENV = "REEF_SANDBOXED_CALL"


@dataclass(frozen=True)
class CodeTest:
    """``call``: a Python expression evaluated in the program's namespace; it passes when its
    value ``== expected``."""

    call: str
    expected: Any


def byte_text(generation: Generation) -> str:
    """The completion's token ids read as bytes (a byte-level tokenizer), as UTF-8 text."""
    return bytes(int(t) & 0xFF for t in generation.completion_token_ids).decode(errors="replace")


class _TestTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _TestTimeout


@dataclass(frozen=True)
class CodeExecutionReward:
    """See the module docstring."""

    source: str
    tests: Callable[[Generation], Sequence[CodeTest]]
    text: Callable[[Generation], str] = byte_text
    test_timeout_s: float = 1.0
    unsafe: bool = False

    def __call__(self, generation: Generation) -> Reward:
        if not self.unsafe and os.environ.get(SANDBOXED_ENV) != "1":
            raise RuntimeError(f"reward {self.source!r} runs model-written code: only in a "
                               "sandbox call (reef reward --sandbox process)")
        tests = list(self.tests(generation))
        if not tests:
            raise ValueError(f"no test cases for generation {generation.generation_id}")
        outcomes = self._run(self.text(generation), tests)
        passed = sum(outcomes)
        components = {f"test_{i}": float(ok) for i, ok in enumerate(outcomes)}
        components["passed"] = float(passed)
        return Reward(reward=passed / len(tests), components=components)

    def _run(self, program: str, tests: list[CodeTest]) -> list[bool]:
        namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "solution"}

        def load() -> bool:
            exec(compile(program, "<completion>", "exec"), namespace)  # noqa: S102
            return True

        previous = signal.signal(signal.SIGALRM, _alarm)
        try:
            if self._timed(load) is not True:
                return [False] * len(tests)
            return [self._timed(lambda test=test: eval(test.call, namespace)  # noqa: S307
                                == test.expected) is True for test in tests]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _timed(self, step: Callable[[], Any]) -> Any:
        """``step()`` under ``test_timeout_s``; False if it raised (``SystemExit`` included) or
        ran out of time."""
        try:
            signal.setitimer(signal.ITIMER_REAL, self.test_timeout_s)
            try:
                return step()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException:  # noqa: BLE001 - the model's code failed this test
            return False
