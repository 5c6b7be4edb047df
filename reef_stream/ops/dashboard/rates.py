"""The dashboard's arithmetic: metric series as the page charts them. Pure (no Kafka, no web).

    charted = chart_series(store.series())                  # what the stage sections draw
    charted = chart_series(store.series(), per_instance=True)

Every process writes its metrics under labels of its own (``INSTANCE_LABELS``: ``instance``,
``client``, ``process``), so a stage of three processes writes three series of each metric. The
page shows what matters instead, one line per series that means something:

- **a counter** (``is_counter``: a running total since its process started, a restart starting
  again from 0) is charted as a rate per second, and the rates of its instances are added up
  (and over the labels of ``SUMMED_OVER``);
- **a gauge** (anything else) is charted as written when it has one instance; the values of
  several instances are averaged, or added up for the gauges in ``SUMMED_GAUGES`` (a spool, a
  backlog). ``consumer_lag`` is added up over partitions too: a partition's lag is the newest
  report of whichever instance held it, so a partition that moved in a rebalance counts once.

``per_instance=True`` keeps every series apart (counters are still rates). A counter seen at
one instant only has no rate yet, and is left out.

Counter arithmetic, in one place:

- ``RunningTotal`` reads a counter's values in the order written and adds them up over
  restarts: a value below the one before starts a new run (``scorecard.counter_total``'s
  reading, as Prometheus' ``increase()``), so a restart never gives a negative rate. The series
  store keeps this total on every point, so a restart among points it thinned out still counts.
- ``summed_rate`` adds up several series' totals at each time of a grid (each series' total is
  its last point's at or before that time) and takes the increase over the ``window`` seconds
  before it, divided by the window: the sum of the series' rates. The window never reaches back
  before the first point of the series combined, whose first values are its baseline; a series
  that starts a window or more later counts from 0 (a process that started meanwhile;
  ``from_zero``) or from its first value (a dashboard that reads from now on, whose first value
  of an old process is its whole past).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reef_stream.core import metric_names as m

__all__ = ["COUNTERS", "DEAD_LETTERS", "INSTANCE_LABELS", "LOOKBACK_S", "MAX_GRID",
           "RATE_WINDOW_S", "SUMMED_GAUGES", "SUMMED_OVER", "RunningTotal", "Series",
           "chart_series", "gauge_values", "grid", "is_counter", "running_totals",
           "summed_rate"]

#: Labels that name a process rather than what it measures: summed (or averaged) over.
INSTANCE_LABELS = frozenset({"instance", "client", "process"})
#: The page's own counter of dead letters (``server``: one series per stage and kind, which
#: starts with a 0 one ``RATE_WINDOW_S`` before its first letter, so that a lone letter has a
#: rate: one in that window).
DEAD_LETTERS = "dead_letters"

#: Running totals, by stage (``reef_stream.core.metric_names``); ``PROCESS_CPU_SECONDS`` in every stage.
COUNTERS: Mapping[str, frozenset[str]] = {
    m.STAGE_INTAKE: frozenset({m.INTAKE_SENT, m.INTAKE_ACKNOWLEDGED, m.INTAKE_FAILED,
                               m.INTAKE_REJECTED}),
    m.STAGE_REWARD: frozenset({m.REWARD_RECORDS, m.REWARD_REWARDED, m.REWARD_FAILED,
                               m.REWARD_INVALID, m.REWARD_UNDECODABLE, m.REWARD_RETRIED,
                               m.REWARD_TIMED_OUT, m.REWARD_DROPPED, m.SANDBOX_WARM_STARTS,
                               m.SANDBOX_COLD_STARTS, m.SANDBOX_RESTARTS, m.SANDBOX_FAILURES}),
    m.STAGE_PROCESSOR: frozenset({
        m.PROCESSOR_GENERATIONS, m.PROCESSOR_FEEDBACK, m.PROCESSOR_DUPLICATE_GENERATIONS,
        m.PROCESSOR_UNITS, m.PROCESSOR_TRANSACTIONS, m.PROCESSOR_ABORTED_TRANSACTIONS,
        m.PROCESSOR_INVALID_RECORDS, m.PROCESSOR_CHECKPOINTS_UNDECODABLE,
        f"{m.PROCESSOR_REWARD}.count", f"{m.PROCESSOR_RESPONSE_TOKENS}.count",
        f"{m.PROCESSOR_TRUNCATION_RATE}.count"}),
    m.STAGE_TRAINER: frozenset({
        m.TRAINER_UNITS_TRAINED, m.TRAINER_UNITS_DUPLICATE, m.TRAINER_UNITS_STALE,
        m.TRAINER_UNITS_INVALID, m.TRAINER_STALENESS_SAMPLES, m.TRAINER_SAMPLE_AGE_SAMPLES,
        m.TRAINER_SAMPLE_TO_UNIT_SAMPLES, m.TRAINER_UNIT_TO_TRAIN_SAMPLES}),
    m.STAGE_EVALUATOR: frozenset({m.EVALUATOR_DECISIONS, m.EVALUATOR_CANDIDATES_SKIPPED,
                                  m.EVALUATOR_CANDIDATES_SUPERSEDED}),
    m.STAGE_FOLLOWER: frozenset({m.FOLLOWER_VERSIONS_LOADED, m.FOLLOWER_VERSIONS_REFUSED,
                                 m.FOLLOWER_PUBLICATIONS_UNDECODABLE}),
}
#: Labels a counter's rate is added up over besides the instance's: the processor's counts of
#: joined records per policy version (one rate, not one line per version ever trained).
SUMMED_OVER: Mapping[tuple[str, str], frozenset[str]] = {
    (m.STAGE_PROCESSOR, f"{name}.count"): frozenset({"policy_version"})
    for name in (m.PROCESSOR_REWARD, m.PROCESSOR_RESPONSE_TOKENS, m.PROCESSOR_TRUNCATION_RATE)}
#: Gauges whose instances add up rather than average: (stage, name).
SUMMED_GAUGES = frozenset({(m.STAGE_INTAKE, m.INTAKE_SPOOLED),
                           (m.STAGE_PROCESSOR, m.PROCESSOR_TRAINER_BACKLOG),
                           (m.STAGE_REWARD, m.REWARD_SATURATED_SLOTS),
                           (m.STAGE_REWARD, m.REWARD_SLOW_LANE),
                           (m.STAGE_REWARD, m.REWARD_ABANDONED),
                           (m.STAGE_REWARD, m.REWARD_HELD),
                           (m.STAGE_REWARD, m.SANDBOX_POOL_SIZE),
                           (m.STAGE_REWARD, m.SANDBOX_LIVE)})
#: Seconds a rate is taken over (at least the grid's step): several writes of the slowest
#: writer (the intake's, every 10 s), so the rate is not a saw of 0s and spikes.
RATE_WINDOW_S = 30.0
#: Seconds a gauge's last value still counts in a sum or a mean (the lag is written again every
#: ``LAG_REPEAT_S`` when it does not change); older, its instance is gone.
LOOKBACK_S = m.LAG_REPEAT_S * 1.5
#: Most times in a combined series' grid.
MAX_GRID = 300
MIN_STEP_S = 1.0


def is_counter(stage: str, name: str) -> bool:
    """Whether ``stage``'s metric ``name`` is a running total."""
    return (name in COUNTERS.get(stage, ()) or name == m.PROCESS_CPU_SECONDS
            or name == DEAD_LETTERS)


class RunningTotal:
    """A counter's values added up over restarts, one value at a time in the order written:
    ``add`` returns the total so far (a value below the one before starts a new run)."""

    def __init__(self) -> None:
        self.carried = 0.0
        self.last: float | None = None

    def add(self, value: float) -> float:
        if self.last is not None and value < self.last:
            self.carried += self.last
        self.last = value
        return self.carried + value


def running_totals(values: Iterable[float]) -> list[float]:
    """The total after each value (``RunningTotal``); the last is ``counter_total(values)``."""
    total = RunningTotal()
    return [total.add(v) for v in values]


@dataclass(frozen=True)
class Series:
    """One series of the store: ``points`` are ``(seconds, value, total)`` in time order
    (``total``: ``RunningTotal``'s, meaningful for a counter)."""

    stage: str
    name: str
    labels: Mapping[str, str]
    points: Sequence[tuple[float, float, float]]


def grid(first: float, last: float, *, max_points: int = MAX_GRID,
         min_step: float = MIN_STEP_S) -> list[float]:
    """Times from ``first`` to ``last``, ``max_points`` at most, at least ``min_step`` apart,
    counted back from ``last`` (so the newest value is always on the grid)."""
    if last <= first:
        return [last]
    step = max(min_step, (last - first) / (max_points - 1))
    count = math.floor((last - first) / step + 1e-9) + 1
    return [last - step * k for k in range(count - 1, -1, -1)]


def _at(times: Sequence[float], values: Sequence[float], t: float, before: float) -> float:
    """The value of the last point at or before ``t`` (``before`` if there is none)."""
    i = bisect.bisect_right(times, t)
    return values[i - 1] if i else before


def summed_rate(totals: Sequence[Sequence[tuple[float, float]]], times: Sequence[float],
                window: float, *, from_zero: bool = True) -> list[float | None]:
    """The rate per second, at each of ``times``, of the sum of counters given by their
    ``(seconds, total)`` points (totals non-decreasing: ``RunningTotal``'s), over the ``window``
    seconds before it, clipped at the earliest point of all (``None`` at that first instant:
    no interval yet). Before its first point a series counts its first total (its past is not
    counted), or 0 when ``from_zero`` and that point came ``window`` seconds or more after the
    earliest (a process that started meanwhile: what it counted falls in whole windows, never
    in the short ones just after the start, where it would be a spike)."""
    series = [([p[0] for p in s], [p[1] for p in s]) for s in totals if s]
    if not series:
        return [None for _ in times]
    start = min(ts[0] for ts, _ in series)
    # What each series counted before its first point: 0 where that point came a window or more
    # after the start, so its first value falls in whole windows; else its first value (a
    # process seen from the start has its past before the start).
    bases = [0.0 if from_zero and ts[0] >= start + window else vs[0] for ts, vs in series]

    def total(t: float) -> float:
        return sum(_at(ts, vs, t, base) for (ts, vs), base in zip(series, bases))

    rates: list[float | None] = []
    for t in times:
        since = max(t - window, start)
        rates.append((total(t) - total(since)) / (t - since) if t > since else None)
    return rates


def gauge_values(series: Sequence[Sequence[tuple[float, float]]], times: Sequence[float], *,
                 how: str, lookback: float = LOOKBACK_S) -> list[float | None]:
    """At each of ``times``, the sum (``how="sum"``) or mean (``"mean"``) of each series' last
    value at or before it, of those written within ``lookback`` seconds (``None``: none was)."""
    series = [([p[0] for p in s], [p[1] for p in s]) for s in series if s]
    out: list[float | None] = []
    for t in times:
        found = []
        for ts, vs in series:
            i = bisect.bisect_right(ts, t)
            if i and t - ts[i - 1] <= lookback:
                found.append(vs[i - 1])
        out.append(None if not found else sum(found) if how == "sum" else
                   sum(found) / len(found))
    return out


def _merged(series: Iterable[Series]) -> list[tuple[float, float]]:
    """The points of several series as one, in time order: the newest report at any time."""
    return sorted((p[0], p[1]) for s in series for p in s.points)


def chart_series(series: Iterable[Series], *, per_instance: bool = False,
                 from_zero: bool = True) -> list[dict[str, Any]]:
    """The series the page charts (see the module docstring), in order of stage, name and
    labels: ``{"stage", "name", "labels", "kind": "rate" | "gauge", "instances": how many series
    were combined, "points": [[seconds, value], ...]}``."""
    groups: dict[tuple, list[Series]] = defaultdict(list)
    for one in series:
        dropped = set() if per_instance else {
            *INSTANCE_LABELS, *SUMMED_OVER.get((one.stage, one.name), ())}
        if one.name == m.CONSUMER_LAG and not per_instance:
            dropped.add("partition")
        labels = tuple(sorted((k, v) for k, v in one.labels.items() if k not in dropped))
        groups[(one.stage, one.name, labels)].append(one)
    charted = []
    for (stage, name, labels), members in sorted(groups.items()):
        members = [s for s in members if s.points]
        if not members:
            continue
        points = _combine(stage, name, members, from_zero=from_zero)
        if not points:   # a counter seen at one instant only: no rate yet
            continue
        charted.append({"stage": stage, "name": name, "labels": dict(labels),
                        "kind": "rate" if is_counter(stage, name) else "gauge",
                        "instances": len(members), "points": points})
    return charted


def _combine(stage: str, name: str, members: list[Series], *,
             from_zero: bool) -> list[list[float]]:
    first = min(s.points[0][0] for s in members)
    last = max(s.points[-1][0] for s in members)
    if is_counter(stage, name):
        times = grid(first, last)
        step = times[1] - times[0] if len(times) > 1 else 0.0
        values = summed_rate([[(p[0], p[2]) for p in s.points] for s in members], times,
                             max(RATE_WINDOW_S, step), from_zero=from_zero)
    elif len(members) == 1:
        return [[p[0], p[1]] for p in members[0].points]
    else:
        times = grid(first, last)
        if name == m.CONSUMER_LAG:   # each partition: the newest report, whoever held it
            parts: dict[tuple, list[Series]] = defaultdict(list)
            for s in members:
                parts[tuple(sorted((k, v) for k, v in s.labels.items()
                                   if k not in INSTANCE_LABELS))].append(s)
            inputs = [_merged(group) for group in parts.values()]
            how = "sum"
        else:
            inputs = [[(p[0], p[1]) for p in s.points] for s in members]
            how = "sum" if (stage, name) in SUMMED_GAUGES else "mean"
        values = gauge_values(inputs, times, how=how)
    return [[t, v] for t, v in zip(times, values) if v is not None]
