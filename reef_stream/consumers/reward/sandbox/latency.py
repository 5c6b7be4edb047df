"""``LatencyWindow``: the last durations of something, and their percentiles."""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["LatencyWindow"]


class LatencyWindow:
    """The last ``size`` durations (seconds) added; thread-safe. ``percentile(99)`` is None
    until one was added."""

    def __init__(self, size: int = 1024) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._values.append(seconds)
            self.count += 1

    def __len__(self) -> int:
        return len(self._values)

    def percentile(self, q: float) -> float | None:
        with self._lock:
            values = sorted(self._values)
        if not values:
            return None
        return values[min(len(values) - 1, int(len(values) * q / 100.0))]
