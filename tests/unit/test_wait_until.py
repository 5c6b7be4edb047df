"""``tests.helpers.wait_until``, the one way a test waits for something to happen."""

from __future__ import annotations

import time

import pytest

from tests.helpers import wait_until


def test_returns_the_first_true_value_of_the_condition():
    calls = []

    def third_time() -> str:
        calls.append(None)
        return "ready" if len(calls) == 3 else ""

    assert wait_until(third_time, 5, "the third call", poll_s=0.01) == "ready"
    assert len(calls) == 3


def test_fails_saying_what_it_waited_for_once_the_deadline_passes():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the flag"):
        wait_until(lambda: False, 0.2, "the flag", poll_s=0.01)
    assert 0.2 <= time.monotonic() - started < 2


def test_a_condition_already_true_returns_at_once_even_with_no_time_left():
    assert wait_until(lambda: 7, 0, "seven") == 7
