"""The dashboard's memory: per-series points of ``Metric`` events, bounded.

    store = SeriesStore(max_points=1000)
    store.add(metric)                     # the consumer thread
    store.snapshot()                      # the web server's thread: JSON-ready dicts
    store.series()                        # the same as ``rates.Series``, for ``rates``

A series is one ``(stage, name, labels)``: a stage's metric as one process (or replica, or
decision) reports it. Labels that describe a series rather than name it (``DESCRIPTIVE_LABELS``:
a replica's host and its serving state, which changes while its version is plotted) are left
out of its identity. A point is ``(created_at in seconds, value)``; non-finite values are
skipped (JSON has no NaN), as are histogram buckets (``SKIPPED_SUFFIXES``).

Memory stays bounded however long the run: a series holds at most ``max_points`` points and
the store at most ``max_series`` series (more are counted in ``dropped_series``, not kept).
When a series is full, every second point is dropped and from then on only one point per
``stride`` new ones is kept (each kept point is the newest of its stride), so the whole run
stays visible at a coarser resolution and the newest value is always shown. Thread-safe.

Each point also keeps the series' value added up over restarts (``rates.RunningTotal``, taken
at every point added, the thinned-out ones too): a counter's rate is read from it, so a
restart among points the thinning dropped still counts.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from reef_stream.core.events import Metric
from reef_stream.ops.dashboard.rates import RunningTotal, Series

__all__ = ["DESCRIPTIVE_LABELS", "SKIPPED_SUFFIXES", "SeriesStore"]

DESCRIPTIVE_LABELS = frozenset({"host", "state"})
#: Histogram buckets (``<name>.bucket`` per bound ``le``, Prometheus' convention) are not kept:
#: one series per bound and label set would crowd out the rest; a distribution is charted by
#: its ``.mean``, ``.std`` and ``.count``.
SKIPPED_SUFFIXES = (".bucket",)

SeriesKey = tuple[str, str, tuple[tuple[str, str], ...]]


@dataclass
class _Series:
    points: list[tuple[float, float, float]] = field(default_factory=list)  # (t, value, total)
    stride: int = 1
    added: int = 0
    total: RunningTotal = field(default_factory=RunningTotal)

    def add(self, at: float, value: float, max_points: int) -> None:
        point = (at, value, self.total.add(value))
        if self.points and self.added % self.stride:
            self.points[-1] = point          # still within the stride of the last kept point
        else:
            self.points.append(point)
        self.added += 1
        if len(self.points) > max_points:   # every second point, counted back from the newest
            self.points = self.points[(len(self.points) - 1) % 2::2]
            self.stride *= 2
            self.added = 0


class SeriesStore:
    """Series of metric points, bounded (see the module docstring)."""

    def __init__(self, max_points: int = 1000, max_series: int = 2000) -> None:
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        self.max_points, self.max_series = max_points, max_series
        self.dropped_series = 0
        self._series: dict[SeriesKey, _Series] = {}
        self._lock = threading.Lock()

    def add(self, metric: Metric) -> None:
        """One point for the metric's series (created on first use, within ``max_series``)."""
        if not math.isfinite(metric.value) or metric.name.endswith(SKIPPED_SUFFIXES):
            return
        labels = tuple(sorted((k, v) for k, v in metric.labels.items()
                              if k not in DESCRIPTIVE_LABELS))
        key = (metric.stage, metric.name, labels)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                if len(self._series) >= self.max_series:
                    self.dropped_series += 1
                    return
                series = self._series[key] = _Series()
            series.add(metric.created_at / 1000.0, metric.value, self.max_points)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every series as ``{"stage", "name", "labels", "points": [[t, value], ...]}``, in
        order of stage, name and labels; points in time order."""
        with self._lock:
            items = [(key, list(series.points)) for key, series in self._series.items()]
        return [{"stage": stage, "name": name, "labels": dict(labels),
                 "points": [[t, v] for t, v, _ in sorted(points)]}
                for (stage, name, labels), points in sorted(items)]

    def series(self) -> list[Series]:
        """Every series with its points ``(t, value, total)`` in time order."""
        with self._lock:
            items = [(key, list(series.points)) for key, series in self._series.items()]
        return [Series(stage, name, dict(labels), sorted(points))
                for (stage, name, labels), points in sorted(items)]
