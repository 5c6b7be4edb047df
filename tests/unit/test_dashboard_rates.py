"""The dashboard's arithmetic (``reef_stream.ops.dashboard.rates``) against values worked out by
hand: a counter's restart is a new run, never a negative rate; the rates of instances add up;
gauges of instances are averaged or added up; a partition's lag counts once whichever instance
reported it."""

from __future__ import annotations

import pytest

from reef_stream.ops.dashboard.rates import (
    INSTANCE_LABELS, Series, chart_series, gauge_values, grid, is_counter, running_totals,
    summed_rate,
)
from reef_stream.ops.scorecard import counter_total


def _series(stage, name, labels, raw):
    """A store's series of ``(t, value)`` points, with their running totals."""
    totals = running_totals(v for _, v in raw)
    return Series(stage, name, labels, [(t, v, total) for (t, v), total in zip(raw, totals)])


def test_a_value_below_the_last_starts_a_new_run():
    values = [0, 10, 20, 5, 15, 15, 3]
    assert running_totals(values) == [0, 10, 20, 25, 35, 35, 38]
    assert running_totals(values)[-1] == counter_total(values)


def test_the_rates_of_two_instances_add_up_across_a_restart():
    # a: 10/s. b: 5/s, restarted between t=2 and t=3 (it had counted 5 more when it wrote 5).
    a = list(zip(range(5), running_totals([0, 10, 20, 30, 40])))
    b = list(zip(range(5), running_totals([0, 5, 10, 5, 10])))
    assert [total for _, total in b] == [0, 5, 10, 15, 20]
    rates = summed_rate([a, b], [0, 1, 2, 3, 4], window=2)
    # t=0: no interval yet; t=1: (15 - 0) / 1; t=2: (30 - 0) / 2; t=3: (45 - 15) / 2; ...
    assert rates == [None, 15.0, 15.0, 15.0, 15.0]


def test_a_series_that_starts_later_counts_from_zero_or_from_its_first_value():
    a = [(0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0)]
    late = [(2, 8.0), (3, 8.0)]           # a process that started meanwhile, 8 counted by t=2
    assert summed_rate([a, late], [3], window=2) == [(30 + 8 - 10) / 2]
    # read from now on: its first value is its past, not counted
    assert summed_rate([a, late], [3], window=2, from_zero=False) == [(30 - 10) / 2]


def test_the_window_never_reaches_back_before_the_first_point():
    a = [(10, 100.0), (11, 103.0), (12, 106.0)]
    assert summed_rate([a], [10, 11, 12], window=30) == [None, 3.0, 3.0]


def test_gauges_are_summed_or_averaged_within_the_lookback():
    a = [(0, 2.0), (10, 4.0)]
    b = [(5, 6.0)]
    assert gauge_values([a, b], [0, 5, 10, 100], how="sum", lookback=45) == [2.0, 8.0, 10.0, None]
    assert gauge_values([a, b], [0, 5, 10], how="mean", lookback=45) == [2.0, 4.0, 5.0]
    # b's value is older than the lookback at t=10: its instance is gone
    assert gauge_values([a, b], [10], how="sum", lookback=4) == [4.0]


def test_the_grid_counts_back_from_the_newest_time():
    assert grid(0, 10) == [float(t) for t in range(11)]
    assert grid(0, 1000, max_points=11) == [100.0 * k for k in range(11)]
    assert grid(3, 3) == [3]
    assert grid(0.5, 2.9) == pytest.approx([0.9, 1.9, 2.9])


def test_chart_series_adds_up_instances_by_default_and_keeps_them_apart_on_demand():
    group = {"recipe": "r", "group": "g"}
    w1 = _series("reward", "records", {**group, "instance": "h.1"},
                 [(t, 10.0 * t) for t in range(0, 61)])
    # restarted at t=30 under a new instance (a new pid) and, at t=45, under the same one
    w2 = _series("reward", "records", {**group, "instance": "h.2"},
                 [(t, 5.0 * t) for t in range(0, 30)])
    w3 = _series("reward", "records", {**group, "instance": "h.3"},
                 [(t, 5.0 * (t - 29)) for t in range(30, 45)]
                 + [(t, 5.0 * (t - 44)) for t in range(45, 61)])
    assert is_counter("reward", "records")
    [summed] = chart_series([w1, w2, w3])
    assert (summed["stage"], summed["name"], summed["labels"]) == ("reward", "records", group)
    assert (summed["kind"], summed["instances"]) == ("rate", 3)
    by_time = dict((t, v) for t, v in summed["points"])
    # the window (30 s) holds 30 increments of 10 + 5 once it is past the first point
    assert all(by_time[float(t)] == pytest.approx(15.0) for t in range(1, 61)), by_time
    apart = chart_series([w1, w2, w3], per_instance=True)
    assert [s["labels"]["instance"] for s in apart] == ["h.1", "h.2", "h.3"]
    assert all(v >= 0 for s in apart for _, v in s["points"])
    assert apart[0]["points"][-1] == [60.0, pytest.approx(10.0)]
    assert apart[2]["points"][-1] == [60.0, pytest.approx(5.0)]


def test_chart_series_combines_gauges_and_counts_a_moved_partition_once():
    lag = "consumer_lag"
    labels = {"group": "g", "topic": "ns.generations"}
    # partition 0: instance a until t=10, then b (a rebalance); partition 1: a throughout
    p0a = _series("processor", lag, {**labels, "partition": "0", "instance": "a"},
                  [(0, 5.0), (10, 7.0)])
    p0b = _series("processor", lag, {**labels, "partition": "0", "instance": "b"},
                  [(11, 1.0), (20, 2.0)])
    p1a = _series("processor", lag, {**labels, "partition": "1", "instance": "a"},
                  [(0, 3.0), (20, 4.0)])
    [summed] = chart_series([p0a, p0b, p1a])
    assert summed["labels"] == labels and summed["kind"] == "gauge"
    by_time = dict((t, v) for t, v in summed["points"])
    assert by_time[0.0] == 5 + 3 and by_time[10.0] == 7 + 3
    assert by_time[11.0] == 1 + 3 and by_time[20.0] == 2 + 4
    backlog = [_series("processor", "trainer_backlog", {"instance": i}, [(0, v), (1, v)])
               for i, v in (("a", 2.0), ("b", 6.0))]
    mean = [_series("reward", "reward_mean", {"source": "s", "instance": i}, [(0, v), (1, v)])
            for i, v in (("a", 0.25), ("b", 0.75))]
    [summed_backlog, averaged] = chart_series(backlog + mean)
    assert summed_backlog["points"] == [[0.0, 8.0], [1.0, 8.0]]
    assert averaged["points"] == [[0.0, 0.5], [1.0, 0.5]]
    assert averaged["labels"] == {"source": "s"}
    # one instance: the points as written
    [alone] = chart_series([_series("trainer", "loss", {"group": "g"}, [(0, 0.5), (3, 0.25)])])
    assert alone["points"] == [[0, 0.5], [3, 0.25]] and alone["kind"] == "gauge"
    assert "instance" in INSTANCE_LABELS and "process" in INSTANCE_LABELS


def test_the_sandbox_counters_are_rates_and_its_pool_adds_up_over_reward_workers():
    """reef reward --sandbox process: kills by category and restarts are running totals (a
    rate, per second); two workers' pools are one fleet of sandboxes (summed, not averaged)."""
    assert all(is_counter("reward", n) for n in (
        "sandbox_failures", "sandbox_restarts", "sandbox_warm_starts", "sandbox_cold_starts"))
    assert not is_counter("reward", "sandbox_live")
    failures = _series("reward", "sandbox_failures", {"category": "timeout", "instance": "a"},
                       [(t, 2.0 * t) for t in range(0, 31)])
    [rate] = chart_series([failures])
    assert rate["kind"] == "rate" and rate["points"][-1] == [30.0, pytest.approx(2.0)]
    live = [_series("reward", "sandbox_live", {"instance": i}, [(0, v), (1, v)])
            for i, v in (("a", 4.0), ("b", 3.0))]
    [summed] = chart_series(live)
    assert summed["points"] == [[0.0, 7.0], [1.0, 7.0]]


def test_the_goodput_tile_divides_the_samples_trained_by_then_by_each_count_of_generations():
    from reef_stream.ops.dashboard.card import first_row

    trained = [_series("trainer", "staleness_samples", {"staleness": k}, raw) for k, raw in (
        ("0", [(10, 20.0), (20, 40.0), (30, 4.0)]),   # the trainer restarted before 30 s
        ("1", [(10, 5.0), (20, 10.0)]))]
    tiles = {t["id"]: t for t in first_row(trained, generated=[(5, 50), (15, 100), (35, 110)])}
    # trained by then: 0 at 5 s; 20 + 5 at 15 s; 44 + 10 at 35 s
    assert tiles["goodput"]["series"] == [
        {"label": "goodput", "points": [[5, 0.0], [15, 0.25], [35, 54 / 110]]}]
    assert tiles["goodput"]["figures"] == {"trained": 54.0, "generated": 110,
                                           "goodput": 54 / 110}
    assert tiles["staleness"]["figures"] == {"count": 54, "mean": 10 / 54, "p50": 0.0,
                                             "p99": 1.0}


def test_a_series_seen_just_after_the_start_is_a_baseline_not_a_spike():
    a = [(0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0)]
    early = [(1, 90.0), (2, 100.0), (3, 110.0)]   # counted 90 before we saw it, 10/s since
    # its 90 is not put into the second after the start: 10 + 10 per second
    assert summed_rate([a, early], [2, 3], window=30) == [(20 + 100 - 0 - 90) / 2,
                                                          (30 + 110 - 0 - 90) / 3]


def test_the_processors_counts_per_policy_version_are_one_rate():
    per_version = [_series("processor", "reward.count", {"source": "s", "policy_version": v,
                                                         "instance": "p"},
                           [(t, float(n * t)) for t in range(0, 40)])
                   for v, n in (("1", 2), ("2", 3))]
    [rate] = chart_series(per_version)
    assert rate["labels"] == {"source": "s"} and rate["instances"] == 2
    assert rate["points"][-1] == [39.0, pytest.approx(5.0)]
    assert len(chart_series(per_version, per_instance=True)) == 2
