"""The reward worker's circuit, on a clock the test moves: it opens when most tries fail, not
for a failing minority; open, it probes at its interval and the first success closes it."""

from __future__ import annotations

import pytest

from reef_stream.consumers.reward.circuit import CLOSED, OPEN, Circuit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failing_minority_never_opens_it() -> None:
    circuit = Circuit(window=50, min_tries=20, open_fraction=0.8, clock=Clock())
    # A fifth of the generations fail (the worker records each one's first try).
    for i in range(10_000):
        assert circuit.record(ok=i % 5 != 0) is None
    assert circuit.state == CLOSED and circuit.openings == 0


def test_most_tries_failing_opens_it_once_enough_were_seen() -> None:
    circuit = Circuit(window=50, min_tries=20, open_fraction=0.8, clock=Clock())
    changes = [circuit.record(ok=False) for _ in range(19)]
    assert changes == [None] * 19 and not circuit.is_open  # 19 tries are too few to judge
    assert circuit.record(ok=False) == OPEN
    assert circuit.is_open and circuit.openings == 1
    assert circuit.record(ok=False) is None  # already open


def test_the_share_is_of_the_last_tries_only() -> None:
    circuit = Circuit(window=10, min_tries=10, open_fraction=0.8, clock=Clock())
    for _ in range(100):
        circuit.record(ok=True)
    for _ in range(7):
        assert circuit.record(ok=False) is None  # 7 of the last 10
    assert circuit.record(ok=False) == OPEN  # 8 of the last 10


def test_open_it_probes_at_its_interval_and_a_success_closes_it() -> None:
    clock = Clock()
    circuit = Circuit(window=20, min_tries=20, open_fraction=1.0, probe_every=2.0, clock=clock)
    for _ in range(20):
        circuit.record(ok=False)
    assert circuit.is_open
    assert not circuit.probe_due() and circuit.seconds_to_probe() == pytest.approx(2.0)
    clock.now += 2.0
    assert circuit.probe_due()
    assert not circuit.probe_due()  # once per interval
    assert circuit.record(ok=False) is None and circuit.is_open  # the probe failed
    clock.now += 2.0
    assert circuit.probe_due()
    assert circuit.record(ok=True) == CLOSED
    assert circuit.state == CLOSED and circuit.seconds_to_probe() is None
    # Closed, it starts over: the failures before it closed count no more.
    for _ in range(19):
        assert circuit.record(ok=False) is None
    assert circuit.record(ok=False) == OPEN and circuit.openings == 2


@pytest.mark.parametrize("kwargs", [{"min_tries": 0}, {"min_tries": 60}, {"open_fraction": 0.0},
                                    {"open_fraction": 1.5}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Circuit(window=50, **kwargs)
