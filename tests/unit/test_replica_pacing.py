"""The demo replica's pacing (``reef_stream.demo.replica.Pacer``), on a clock the test moves."""

from __future__ import annotations

import pytest

from reef_stream.demo.replica import Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rounds_are_paced_at_the_rate():
    clock = Clock()
    pacer = Pacer(50.0, catch_up_s=1.0, clock=clock)
    assert pacer.wait_after(10) == pytest.approx(0.2)      # 10 items at 50/s: due at +0.2 s
    clock.now += 0.2
    assert pacer.wait_after(25) == pytest.approx(0.5)


def test_after_a_stall_only_catch_up_s_of_items_are_made_up():
    clock = Clock()
    pacer = Pacer(100.0, catch_up_s=1.0, clock=clock)
    pacer.wait_after(100)
    clock.now += 1.0 + 30.0                     # a 30-second stall (a broker fault, no CPU)
    sent_without_waiting = 0
    while (wait := pacer.wait_after(10)) < 1e-6:
        sent_without_waiting += 10
    # About one second of items (100) at once, not the 3,000 the stall "missed"; then the rate.
    assert sent_without_waiting in (90, 100) and wait <= 0.1 + 1e-6
    clock.now += wait
    assert pacer.wait_after(10) == pytest.approx(0.1)
