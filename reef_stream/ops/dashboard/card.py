"""The dashboard's first row: the scorecard as people who run RL watch it. Pure.

    tiles = first_row(store.series(), publications, generated=[(seconds, count), ...])

It answers "is the policy getting better, and is the loop healthy?", one tile per figure,
each a headline (``value``) over a small chart; ``docs/metrics.md`` defines the figures and
``reef_stream.ops.scorecard`` is their arithmetic where it applies:

- ``measurement``: each published version's held-out measurement, by decision (x: the version);
- ``reward``: the trainer's reward of trained samples (``objective.reward_mean``), one line per
  trainer group (or recipe); with several, each value of the headline says whose it is;
- ``staleness``: the trainer's staleness per step (``staleness_mean``); the headline is the
  distribution of every sample trained (``staleness_samples``: ``scorecard.counted``), or
  the newest step's mean where no sample was counted;
- ``goodput``: samples trained (``staleness_samples``, added up over restarts) per generation in
  ``<ns>.generations`` (its record count, as the dashboard looked at it every few seconds);
  with several trainer groups (one replaying the units topic), each group's apart, as the
  staleness headline is (their sum would overstate the loop's; ``figures`` then by group);
- ``throughput``: records per second of each stage, its instances added up: the intake's
  acknowledged records, the reward workers' generations taken, the processor's generations
  (every outcome), the trainer's samples;
- ``lag``: consumer lag per stage, group and topic (added up over partitions and instances);
- ``serving``: checkpoint -> serving seconds, every replica's loads (``scorecard.observed``);
- ``dead_letters``: dead letters per second by kind; the headline counts them.

A tile appears once the namespace has written something it shows, so a run is not shown the
features it does not use (no ``serving`` tile without replicas that report); ``dead_letters``
always appears, its "none" being the figure. Every figure is over every recipe of the
namespace (the scorecard's are per recipe). A tile is
``{"id", "title", "value": headline text, "x": "time" | "version", "series": [{"label",
"points": [[x, y], ...]}], "figures": the headline's numbers}``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from reef_stream.core import metric_names as m
from reef_stream.core.events import Publication
from reef_stream.ops.dashboard.rates import (
    DEAD_LETTERS, RATE_WINDOW_S, Series, chart_series, grid, summed_rate,
)
from reef_stream.ops.scorecard import Distribution, counted, observed

__all__ = ["REWARD", "THROUGHPUT", "first_row"]

#: The trainer's reward of trained samples (an objective's metric, written by every recipe).
REWARD = "objective.reward_mean"
#: Each stage's records, for ``throughput``: (label, stage, counter).
THROUGHPUT = (
    ("intake: acknowledged", m.STAGE_INTAKE, m.INTAKE_ACKNOWLEDGED),
    ("reward: generations scored", m.STAGE_REWARD, m.REWARD_RECORDS),
    ("processor: generations", m.STAGE_PROCESSOR, m.PROCESSOR_GENERATIONS),
    ("trainer: samples", m.STAGE_TRAINER, m.TRAINER_STALENESS_SAMPLES),
)


def first_row(series: Iterable[Series], publications: Iterable[Publication] = (), *,
              generated: Sequence[tuple[float, int]] = (), namespace: str = "",
              from_zero: bool = True, charted: list[dict] | None = None) -> list[dict[str, Any]]:
    """The tiles of the module docstring, in its order, those with nothing written yet left out.
    ``generated``: the generations topic's record count each time the dashboard looked, oldest
    first. ``charted``: the series' ``chart_series`` with their instances combined, where the
    caller has it already."""
    series = list(series)
    if charted is None:
        charted = chart_series(series, from_zero=from_zero)
    tiles = [_measurement(publications), _gauge_tile("reward", "reward of trained samples",
                                                     charted, m.STAGE_TRAINER, REWARD),
             _staleness(series, charted), _goodput(series, generated),
             _throughput(series, from_zero), _lag(charted, namespace), _serving(series),
             _dead_letters(series, from_zero)]
    return [tile for tile in tiles if tile is not None]


def _tile(id_: str, title: str, value: str, lines: list[dict[str, Any]], figures: dict,
          x: str = "time") -> dict[str, Any]:
    return {"id": id_, "title": title, "value": value, "x": x, "series": lines,
            "figures": figures}


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value)}{unit}"
    return f"{value:.0f}{unit}" if abs(value) >= 1000 else f"{value:.3g}{unit}"


def _dist(d: Distribution, unit: str = "") -> str:
    if not d.count:
        return "no data yet"
    return f"mean {_num(d.mean, unit)} · p50 {_num(d.p50, unit)} · p99 {_num(d.p99, unit)} " \
           f"(n={d.count})"


def _dist_figures(d: Distribution) -> dict[str, Any]:
    return {"count": d.count, "mean": d.mean, "p50": d.p50, "p99": d.p99}


def _last_total(one: Series) -> float:
    return one.points[-1][2] if one.points else 0.0


def _measurement(publications: Iterable[Publication]) -> dict[str, Any] | None:
    latest: dict[tuple[str, int, str], Publication] = {}   # a re-emitted one: the last read
    for p in publications:
        latest[(p.model, p.policy_version, p.decision.value)] = p
    if not latest:
        return None
    models = {model for model, _, _ in latest}
    lines: dict[str, list[list[float]]] = defaultdict(list)
    for (model, version, decision), p in sorted(latest.items()):
        for key, value in sorted(p.measurement.items()):
            label = " ".join([model] * (len(models) > 1) + [key, decision])
            lines[label].append([version, value])
    newest = max(latest.values(), key=lambda p: (p.created_at, p.policy_version))
    value = f"v{newest.policy_version} {newest.decision.value}: " + ", ".join(
        f"{k} {_num(v)}" for k, v in sorted(newest.measurement.items()))
    figures = {"published": [[model, version, decision, dict(p.measurement)]
                             for (model, version, decision), p in sorted(latest.items())]}
    waiting = _waiting(latest)
    if waiting:  # versions waiting for a decision (reef_stream.consumers.evaluator.canary)
        figures["waiting"] = [[p.model, p.policy_version, p.share, p.awaiting] for p in waiting]
        value += " · waiting for a decision: " + ", ".join(
            f"{p.model} v{p.policy_version} ({p.awaiting}"
            + (f", canary {p.share:.0%})" if p.share else ")") for p in waiting)
    return _tile("measurement", "held-out measurement per published version", value,
                 [{"label": k, "points": v} for k, v in lines.items()], figures, x="version")


def _waiting(latest: dict[tuple[str, int, str], Publication]) -> list[Publication]:
    """The CANARY publications no later decision ended: each model's version waiting for a
    decision (a canary's live measurement, or a person's approval)."""
    decided = {(model, version) for model, version, decision in latest
               if decision != "CANARY"}
    promoted: dict[str, int] = {}
    for model, version, decision in latest:
        if decision == "PROMOTED":
            promoted[model] = max(promoted.get(model, -1), version)
    return sorted((p for (model, version, decision), p in latest.items()
                   if decision == "CANARY" and (model, version) not in decided
                   and version > promoted.get(model, -1)),
                  key=lambda p: (p.model, p.policy_version))


def _gauge_lines(charted: list[dict], stage: str, name: str) -> list[dict[str, Any]]:
    found = [c for c in charted if c["stage"] == stage and c["name"] == name]
    return [{"label": " ".join(f"{k}={v}" for k, v in c["labels"].items()
                               if len({str(o["labels"].get(k)) for o in found}) > 1) or name,
             "points": c["points"]} for c in found]


def _gauge_tile(id_: str, title: str, charted: list[dict], stage: str,
                name: str) -> dict[str, Any] | None:
    """The newest value of each line; with several, each after its line's label (its group,
    say: ``group=a 0.5 · group=b 0.25``). ``None`` when nothing was written."""
    lines = [line for line in _gauge_lines(charted, stage, name) if line["points"]]
    if not lines:
        return None
    return _tile(id_, title, _newest(lines), lines,
                 {"latest": [line["points"][-1][1] for line in lines]})


def _newest(lines: list[dict[str, Any]]) -> str:
    """The newest value of each line (with points), each after its label where there are
    several: ``0.5``, or ``group=a 0.5 · group=b 0.25``."""
    lines = [line for line in lines if line["points"]]
    return " · ".join(_num(line["points"][-1][1]) if len(lines) == 1
                      else f"{line['label']} {_num(line['points'][-1][1])}" for line in lines)


def _staleness(series: list[Series], charted: list[dict]) -> dict[str, Any] | None:
    """The distribution of every sample trained, each trainer group's apart (a group replaying
    the units topic is not the loop's)."""
    counts: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for one in series:
        if (one.stage, one.name) == (m.STAGE_TRAINER, m.TRAINER_STALENESS_SAMPLES):
            try:
                counts[one.labels.get("group", "")][float(one.labels.get("staleness", ""))] \
                    += _last_total(one)
            except ValueError:
                continue
    by_group = {group: counted(c) for group, c in sorted(counts.items())}
    d = counted({k: v for c in counts.values() for k, v in c.items()}) if len(counts) == 1 \
        else next(iter(by_group.values())) if by_group else counted({})
    lines = [line for line in _gauge_lines(charted, m.STAGE_TRAINER, m.TRAINER_STALENESS_MEAN)
             if line["points"]]
    if not d.count and not lines:
        return None
    # without the samples by staleness, the newest step's mean (its chart's line) says it
    value = (" · ".join(f"group={g} {_dist(x)}" for g, x in by_group.items())
             if len(by_group) > 1 else _dist(d) if d.count else
             f"mean per step {_newest(lines)}")
    return _tile("staleness", "staleness of trained samples, versions", value, lines,
                 _dist_figures(d) if len(by_group) <= 1 else
                 {g: _dist_figures(x) for g, x in by_group.items()})


def _trained(series: list[Series]) -> list[Series]:
    return [s for s in series
            if (s.stage, s.name) == (m.STAGE_TRAINER, m.TRAINER_STALENESS_SAMPLES) and s.points]


def _goodput(series: list[Series],
             generated: Sequence[tuple[float, int]]) -> dict[str, Any] | None:
    """``None`` until a count found generations (the topic may not exist, or be empty). Each
    trainer group's apart: a group replaying the units topic trains the same generations
    again, so their sum would overstate the loop's."""
    if not any(n for _, n in generated):
        return None
    groups: dict[str, list[Series]] = defaultdict(list)
    for one in _trained(series):
        groups[one.labels.get("group", "")].append(one)
    count = generated[-1][1]
    lines, values, figures = [], [], {}
    for group, trained in sorted(groups.items()) or [("", [])]:
        total = sum(_last_total(s) for s in trained)
        columns = [([p[0] for p in s.points], [p[2] for p in s.points]) for s in trained]

        def trained_at(t: float, columns=columns) -> float:   # each series' total at its
            return sum(totals[i - 1] for times, totals in columns   # last point at or before t
                       if (i := bisect.bisect_right(times, t)))

        goodput = total / count if count else None
        points = [[t, trained_at(t) / n] for t, n in generated if n]
        label = f"group={group}" if len(groups) > 1 else "goodput"
        if points:
            lines.append({"label": label, "points": points})
        values.append(("no generations yet" if goodput is None else
                       f"{_num(goodput)} ({_num(total)} trained / {count} generated)"))
        figures[group] = {"trained": total, "generated": count, "goodput": goodput}
    value = values[0] if len(groups) <= 1 else " · ".join(
        f"group={g} {v}" for g, v in zip(sorted(groups), values))
    return _tile("goodput", "goodput: samples trained per generation", value, lines,
                 next(iter(figures.values())) if len(figures) == 1 else figures)


def _summed_rate_line(members: list[Series], from_zero: bool) -> list[list[float]]:
    members = [s for s in members if s.points]
    if not members:
        return []
    times = grid(min(s.points[0][0] for s in members), max(s.points[-1][0] for s in members))
    step = times[1] - times[0] if len(times) > 1 else 0.0
    rates = summed_rate([[(p[0], p[2]) for p in s.points] for s in members], times,
                        max(RATE_WINDOW_S, step), from_zero=from_zero)
    return [[t, r] for t, r in zip(times, rates) if r is not None]


def _throughput(series: list[Series], from_zero: bool) -> dict[str, Any] | None:
    lines, latest = [], {}
    for label, stage, name in THROUGHPUT:
        points = _summed_rate_line([s for s in series if (s.stage, s.name) == (stage, name)],
                                   from_zero)
        if points:
            lines.append({"label": label, "points": points})
            latest[label] = points[-1][1]
    if not lines:
        return None
    value = " · ".join(f"{k.partition(':')[0]} {_num(v, '/s')}" for k, v in latest.items())
    return _tile("throughput", "records per second, per stage", value, lines,
                 {"latest": latest})


def _lag(charted: list[dict], namespace: str) -> dict[str, Any] | None:
    lines, latest = [], {}
    for c in charted:
        if c["name"] != m.CONSUMER_LAG or not c["points"]:
            continue
        topic, group = (c["labels"].get(k, "").removeprefix(f"{namespace}.")
                        for k in ("topic", "group"))
        label = f"{c['stage']} {group} ← {topic}".replace("  ", " ")
        lines.append({"label": label, "points": c["points"]})
        latest[label] = c["points"][-1][1]
    if not lines:
        return None
    worst = max(latest.items(), key=lambda kv: kv[1])
    value = f"max {_num(worst[1])} ({worst[0]})"
    return _tile("lag", "consumer lag per group and topic, records", value, lines,
                 {"latest": latest})


def _serving(series: list[Series]) -> dict[str, Any] | None:
    points = sorted((p[0], p[1]) for s in series
                    if (s.stage, s.name) == (m.STAGE_FOLLOWER,
                                             m.FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS)
                    for p in s.points)
    if not points:
        return None
    d = observed(v for _, v in points)
    return _tile("serving", "checkpoint → serving, seconds", _dist(d, " s"),
                 [{"label": "checkpoint → serving", "points": [list(p) for p in points]}],
                 _dist_figures(d))


def _dead_letters(series: list[Series], from_zero: bool) -> dict[str, Any]:
    by_kind: dict[str, list[Series]] = defaultdict(list)
    for s in series:
        if s.name == DEAD_LETTERS and s.points:
            by_kind[s.labels.get("kind", "")].append(s)
    counts = {kind: round(sum(_last_total(s) for s in members))
              for kind, members in sorted(by_kind.items())}
    lines = [{"label": kind, "points": _summed_rate_line(members, from_zero)}
             for kind, members in sorted(by_kind.items())]
    value = (f"{sum(counts.values())}: " + ", ".join(f"{k} {n}" for k, n in counts.items())
             if counts else "none")
    return _tile("dead_letters", "dead letters per second, by kind", value, lines,
                 {"counts": counts})
