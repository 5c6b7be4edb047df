"""The reward worker's circuit: when most calls fail, the grading service is down, not the
generations wrong.

    circuit = Circuit()
    if circuit.record(ok=False) == OPEN: ...   # most of the last tries failed
    if circuit.probe_due(): ...                # open: time to try one generation again

Closed, it is told how each generation's first try ended (retries say again what the first
try said about one generation, not about the service). Once at least ``min_tries`` of the
last ``window`` were recorded and ``open_fraction`` of them failed, it opens. Open, the worker
takes no new generation (its partitions pause, so the group's lag grows, visible in
``reef top``), holds the generations whose tries fail instead of dead-lettering them (their
tries do not count), and every ``probe_every`` seconds tries one again: a held one and a new
one in turn, so a run of bad inputs cannot keep it open. The first try that succeeds closes it
and the held generations are tried again.

A grader that fails on a minority of inputs never opens it: with the default 0.8, a fifth of
the generations failing is far below it.
A grader that fails on every input (a bug, not an outage) also opens it; the worker's log
names the last error, and nothing is dead-lettered for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["CLOSED", "OPEN", "Circuit"]

CLOSED, OPEN = "closed", "open"
#: The tries looked at, the least of them that must have been recorded, and the share of them
#: that must have failed for the circuit to open.
WINDOW = 50
MIN_TRIES = 20
OPEN_FRACTION = 0.8
#: Seconds between two probes of an open circuit.
PROBE_EVERY_S = 1.0


class Circuit:
    """Closed or open, from the outcomes of the last tries; thread-safe (see the module
    docstring). ``openings``: how many times it opened."""

    def __init__(self, *, window: int = WINDOW, min_tries: int = MIN_TRIES,
                 open_fraction: float = OPEN_FRACTION, probe_every: float = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < min_tries <= window:
            raise ValueError(f"min_tries must be in 1..window ({window}), not {min_tries}")
        if not 0 < open_fraction <= 1:
            raise ValueError(f"open_fraction must be in (0, 1], not {open_fraction}")
        self.window, self.min_tries, self.open_fraction = window, min_tries, open_fraction
        self.probe_every, self._clock = probe_every, clock
        self._lock = threading.Lock()
        self._outcomes: deque[bool] = deque(maxlen=window)  # True: the try failed
        self._failed = 0
        self.state = CLOSED
        self.openings = 0
        self.opened_at: float | None = None
        self._next_probe = 0.0

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

    def record(self, ok: bool) -> str | None:
        """A try finished: ``ok`` if it returned a reward. The new state if it changed."""
        with self._lock:
            if self.state == OPEN:
                if ok:
                    self._close()
                    return CLOSED
                return None
            if len(self._outcomes) == self.window:
                self._failed -= self._outcomes[0]
            self._outcomes.append(not ok)
            self._failed += not ok
            if len(self._outcomes) >= self.min_tries \
                    and self._failed >= self.open_fraction * len(self._outcomes):
                self.state, self.openings = OPEN, self.openings + 1
                self.opened_at = self._clock()
                self._next_probe = self.opened_at + self.probe_every
                return OPEN
            return None

    def probe_due(self) -> bool:
        """Open and ``probe_every`` seconds past the last probe (or the opening): True once per
        probe, so the caller tries one generation."""
        with self._lock:
            now = self._clock()
            if self.state != OPEN or now < self._next_probe:
                return False
            self._next_probe = now + self.probe_every
            return True

    def seconds_to_probe(self) -> float | None:
        """Seconds until the next probe is due; None while closed."""
        with self._lock:
            return None if self.state != OPEN else max(0.0, self._next_probe - self._clock())

    def _close(self) -> None:
        self.state, self.opened_at = CLOSED, None
        self._outcomes.clear()
        self._failed = 0
