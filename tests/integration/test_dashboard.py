"""`reef dashboard` over logs written by hand on a real broker: the API serves exactly the series
written (identity labels only, NaN and histogram buckets skipped, publications' measurements
included, undecodable records counted); the scorecard row and the stages' rates are the values
worked out here from what was written (counters as rates with their instances added up, a
restart a new run); headless Chromium draws the scorecard row first, then a chart for each
series and none for metrics never written, with y ticks that read differently and headlines
that say whose each value is; a taken port is a clear error, and the series store stays
bounded."""

from __future__ import annotations

import math

import pytest
from confluent_kafka import Producer

from reef_stream.core.events import DeadLetter, Decision, Metric, Publication
from reef_stream.core.metric_names import (
    CONSUMER_LAG, FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, FOLLOWER_POLICY_VERSION,
    INTAKE_ACKNOWLEDGED, PROCESSOR_GENERATIONS, REWARD_CALL_P50, REWARD_CALL_P99, REWARD_RECORDS,
    REWARD_REWARDED, STAGE_EVALUATOR,
    STAGE_FOLLOWER, STAGE_INTAKE, STAGE_PROCESSOR, STAGE_REWARD, STAGE_TRAINER,
    TRAINER_LOGPROB_GAP_OLDER, TRAINER_LOGPROB_GAP_SAME_VERSION, TRAINER_STALENESS_MAX,
    TRAINER_STALENESS_MEAN, TRAINER_STALENESS_SAMPLES, TRAINER_UPDATE_RATIO,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.ops.dashboard.store import SeriesStore
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from reef_stream.topics.metrics import metric
from tests.helpers import reef
from tests.integration.dashboard_check import (
    api, check_dashboard, rendered_page, require_chromium, running_dashboard, settled_series,
)
from tests.unit_log import create_topics

T0 = 1_767_000_000_000  # ms
TRAINER = {"recipe": "grpo", "group": "g"}


def _metrics():
    """Known metrics: a trainer's loss, staleness and logprob gap over 3 steps (one NaN loss,
    skipped), two reward workers' running totals, two replicas' heartbeats whose host and
    state change (one series per replica), a histogram bucket (not kept)."""
    events = [metric(STAGE_PROCESSOR, "reward.bucket", 3, {"le": "1.0"}, created_at=T0)]
    for step, loss in enumerate([0.5, math.nan, 0.125]):
        at = T0 + step * 1000
        events += [metric(STAGE_TRAINER, "loss", loss, TRAINER, created_at=at),
                   metric(STAGE_TRAINER, TRAINER_STALENESS_MEAN, step / 2, TRAINER, created_at=at),
                   metric(STAGE_TRAINER, TRAINER_STALENESS_MAX, step, TRAINER, created_at=at),
                   metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_SAME_VERSION, 0.01, TRAINER,
                          created_at=at),
                   metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, 0.1 * step, TRAINER,
                          created_at=at)]
    for worker, totals in (("w1", [10, 30]), ("w2", [5])):
        events += [metric(STAGE_REWARD, REWARD_REWARDED, total, {"instance": worker},
                          created_at=T0 + i * 1000) for i, total in enumerate(totals)]
    for replica, versions in (("a", [-1, 1, 2]), ("b", [1, 2])):
        events += [metric(STAGE_FOLLOWER, FOLLOWER_POLICY_VERSION, version,
                          {"replica": replica, "model": "m", "host": f"h{i}",
                           "state": "waiting" if version < 0 else "serving"},
                          created_at=T0 + i * 1000) for i, version in enumerate(versions)]
    return events


def _publication(version, decision, accuracy):
    return Publication(model="m", policy_version=version, checkpoint_id=f"c{version}",
                       uri="file:///nowhere", sha256="0" * 64, decision=decision,
                       reason="measured", evaluator="e", evaluated=True,
                       measurement={"accuracy": accuracy}, created_at=T0 + version * 1000)


def _labels(**labels):
    return dict(sorted(labels.items()))


#: What /api/series must answer for ``_metrics`` and the publications, in its order.
EXPECTED = [
    {"stage": "evaluator", "name": "measurement.accuracy",
     "labels": _labels(model="m", decision="PROMOTED"), "points": [[1767000001.0, 0.5]]},
    {"stage": "evaluator", "name": "measurement.accuracy",
     "labels": _labels(model="m", decision="REJECTED"), "points": [[1767000002.0, 0.25]]},
    {"stage": "follower", "name": "policy_version", "labels": _labels(model="m", replica="a"),
     "points": [[1767000000.0, -1.0], [1767000001.0, 1.0], [1767000002.0, 2.0]]},
    {"stage": "follower", "name": "policy_version", "labels": _labels(model="m", replica="b"),
     "points": [[1767000000.0, 1.0], [1767000001.0, 2.0]]},
    {"stage": "reward", "name": "rewarded", "labels": {"instance": "w1"},
     "points": [[1767000000.0, 10.0], [1767000001.0, 30.0]]},
    {"stage": "reward", "name": "rewarded", "labels": {"instance": "w2"},
     "points": [[1767000000.0, 5.0]]},
    {"stage": "trainer", "name": "logprob_gap.older", "labels": TRAINER,
     "points": [[1767000000.0, 0.0], [1767000001.0, 0.1], [1767000002.0, 0.2]]},
    {"stage": "trainer", "name": "logprob_gap.same_version", "labels": TRAINER,
     "points": [[1767000000.0, 0.01], [1767000001.0, 0.01], [1767000002.0, 0.01]]},
    {"stage": "trainer", "name": "loss", "labels": TRAINER,
     "points": [[1767000000.0, 0.5], [1767000002.0, 0.125]]},
    {"stage": "trainer", "name": "staleness_max", "labels": TRAINER,
     "points": [[1767000000.0, 0.0], [1767000001.0, 1.0], [1767000002.0, 2.0]]},
    {"stage": "trainer", "name": "staleness_mean", "labels": TRAINER,
     "points": [[1767000000.0, 0.0], [1767000001.0, 0.5], [1767000002.0, 1.0]]},
]


def _produce(bootstrap, records) -> int:
    """``(topic, value, headers)`` records, in this order; how many."""
    producer = Producer(client_config(bootstrap, {"acks": "all"}))
    for topic, value, headers in records:
        producer.produce(topic, key=b"k", value=value, headers=headers)
    assert producer.flush(30) == 0
    return len(records)


def _write_log(bootstrap, ns) -> int:
    """The known metrics, two publications and one record that does not decode; the number of
    records written."""
    create_topics(bootstrap, ns)
    registry = SchemaRegistry.default()
    records = [(declarations.metrics(ns), *registry.encode(m)) for m in _metrics()]
    records += [(declarations.publications(ns), *registry.encode(p)) for p in (
        _publication(1, Decision.PROMOTED, 0.5), _publication(2, Decision.REJECTED, 0.25))]
    records.append((declarations.metrics(ns), b"not avro", None))
    return _produce(bootstrap, records)


# --------------------------------------------------------------------------- the scorecard row

RECIPE = {"recipe": "r", "group": "g"}
GENERATED = 110


def _at(second: float) -> int:
    return T0 + int(second * 1000)


def _scorecard_metrics(ns):
    """A loop's metrics with known figures (worked out by hand in ``SCORECARD``):

    - reward workers' ``records``: w1 counts 10/s for 60 s; w2 5/s, restarted (same labels) at
      30 s having counted 5 since: 15/s together, all along;
    - the processor's ``generations``: 12/s (two outcomes, 8 + 4), one instance;
    - the intake's ``acknowledged``: 20/s, written every 10 s;
    - the trainer's ``staleness_samples`` at 10, 20 and 30 s (restarted before 30 s): totals
      0 -> 40+4, 1 -> 30+3, 2 -> 10+1 = 88 samples; its reward and staleness per step;
    - ``consumer_lag`` of the processor's group: partition 0 held by p1, then by p2; partition
      1 by p1: at 40 s, 2 + 4;
    - checkpoint -> serving: 0.5 and 1.5 s (replica a), 0.25 and 3 s (replica b).
    """
    events = []
    for t in range(61):
        events += [
            metric(STAGE_REWARD, REWARD_RECORDS, 10 * t, {**RECIPE, "instance": "w1"},
                   created_at=_at(t)),
            metric(STAGE_REWARD, REWARD_RECORDS, 5 * t if t < 30 else 5 * (t - 29),
                   {**RECIPE, "instance": "w2"}, created_at=_at(t)),
            metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 8 * t,
                   {**RECIPE, "instance": "p1", "outcome": "unit"}, created_at=_at(t)),
            metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 4 * t,
                   {**RECIPE, "instance": "p1", "outcome": "expired"}, created_at=_at(t))]
    events += [metric(STAGE_INTAKE, INTAKE_ACKNOWLEDGED, 20 * t,
                      {"instance": "i1", "client": "sdk", "topic": f"{ns}.generations"},
                      created_at=_at(t)) for t in range(0, 61, 10)]
    for t, counts, reward, staleness in ((10, (20, 15, 5), 0.25, 0.75),
                                         (20, (40, 30, 10), 0.5, 0.625),
                                         (30, (4, 3, 1), 0.75, 0.625)):
        events += [metric(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, n,
                          {**RECIPE, "staleness": str(k)}, created_at=_at(t))
                   for k, n in enumerate(counts)]
        events += [metric(STAGE_TRAINER, "objective.reward_mean", reward, RECIPE,
                          created_at=_at(t)),
                   metric(STAGE_TRAINER, TRAINER_STALENESS_MEAN, staleness, RECIPE,
                          created_at=_at(t))]
    lag = {"recipe": "r", "group": "pg", "topic": f"{ns}.generations"}
    events += [metric(STAGE_PROCESSOR, CONSUMER_LAG, v, {**lag, "partition": p, "instance": i},
                      created_at=_at(t))
               for t, p, i, v in ((0, "0", "p1", 5), (0, "1", "p1", 3), (40, "0", "p2", 2),
                                  (40, "1", "p1", 4))]
    events += [metric(STAGE_FOLLOWER, FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, v,
                      {"replica": r, "model": "m"}, created_at=_at(t))
               for t, r, v in ((5, "a", 0.5), (15, "a", 1.5), (6, "b", 0.25), (16, "b", 3.0))]
    return events


def _dead_letter(kind, stage, second):
    return DeadLetter(reason="r", error_type=kind, source_topic="x.generations", value=b"v",
                      headers=(), stage=stage, created_at=_at(second))


def _write_scorecard_log(bootstrap, ns) -> int:
    """``_scorecard_metrics``, three publications, six dead letters and ``GENERATED`` records
    in ``<ns>.generations``; the number of records the dashboard reads (not the generations)."""
    create_topics(bootstrap, ns)
    registry = SchemaRegistry.default()
    records = [(declarations.metrics(ns), *registry.encode(m)) for m in _scorecard_metrics(ns)]
    records += [(declarations.publications(ns), *registry.encode(p)) for p in (
        _publication(1, Decision.PROMOTED, 0.5), _publication(2, Decision.REJECTED, 0.25),
        _publication(3, Decision.PROMOTED, 0.75))]
    records += [(declarations.dead_letters(ns), *registry.encode(_dead_letter(kind, stage, t)))
                for kind, stage, t in (("processor.expired", "processor", 5),
                                       ("processor.expired", "processor", 7),
                                       ("processor.shed", "processor", 8),
                                       ("TooStale", "trainer", 9),
                                       ("processor.expired", "processor", 12),
                                       ("processor.shed", "processor", 20))]
    read = _produce(bootstrap, records)
    _produce(bootstrap, [(declarations.generations(ns), b"g", None)] * GENERATED)
    return read


#: Each tile's headline and figures, worked out by hand from ``_write_scorecard_log``.
SCORECARD = {
    "measurement": ("v3 PROMOTED: accuracy 0.75", {"published": [
        ["m", 1, "PROMOTED", {"accuracy": 0.5}], ["m", 2, "REJECTED", {"accuracy": 0.25}],
        ["m", 3, "PROMOTED", {"accuracy": 0.75}]]}),
    "reward": ("0.75", {"latest": [0.75]}),
    # 88 samples: 44 at 0 versions, 33 at 1, 11 at 2: mean 55/88; the 44th is 0, the 88th 2
    "staleness": ("mean 0.625 · p50 0 · p99 2 (n=88)",
                  {"count": 88, "mean": 0.625, "p50": 0.0, "p99": 2.0}),
    "goodput": ("0.8 (88 trained / 110 generated)",
                {"trained": 88, "generated": GENERATED, "goodput": 0.8}),
    # at 60 s, over the 30 s before (the trainer's: at 30 s, over the 20 s since its first)
    "throughput": ("intake 20/s · reward 15/s · processor 12/s · trainer 2.4/s", {"latest": {
        "intake: acknowledged": 20.0, "reward: generations scored": 15.0,
        "processor: generations": 12.0, "trainer: samples": (88 - 40) / 20}}),
    "lag": ("max 6 (processor pg ← generations)",
            {"latest": {"processor pg ← generations": 6.0}}),
    # 0.25, 0.5, 1.5, 3: mean 5.25/4, the 2nd and the 4th
    "serving": ("mean 1.31 s · p50 0.5 s · p99 3 s (n=4)",
                {"count": 4, "mean": 1.3125, "p50": 0.5, "p99": 3.0}),
    "dead_letters": ("6: TooStale 1, processor.expired 3, processor.shed 2",
                     {"counts": {"TooStale": 1, "processor.expired": 3, "processor.shed": 2}}),
}


def _rates(answer, stage, name):
    return [(s["labels"], s["kind"], s["instances"], dict((t, v) for t, v in s["points"]))
            for s in answer["series"] if (s["stage"], s["name"]) == (stage, name)]


def test_the_scorecard_row_and_the_rates_are_the_values_written(kafka_bootstrap, cli_env,
                                                                namespace):
    read = _write_scorecard_log(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace) as url:
        settled_series(url, events=read)
        answer = api(url)
        apart = api(url, "api/dashboard?per_instance=1")
    tiles = {tile["id"]: tile for tile in answer["scorecard"]}
    assert list(tiles) == list(SCORECARD)
    for tile, (value, figures) in SCORECARD.items():   # exact: one division each, as here
        assert (tiles[tile]["value"], tiles[tile]["figures"]) == (value, figures), tiles[tile]
    assert tiles["measurement"]["series"] == [
        {"label": "accuracy PROMOTED", "points": [[1, 0.5], [3, 0.75]]},
        {"label": "accuracy REJECTED", "points": [[2, 0.25]]}]
    # The reward workers: one series, 15/s at every second after the first, w2's restart in it
    [(labels, kind, instances, records)] = _rates(answer, STAGE_REWARD, REWARD_RECORDS)
    assert (labels, kind, instances) == (RECIPE, "rate", 2)
    assert sorted(records) == [T0 / 1000 + t for t in range(1, 61)]
    assert all(v == pytest.approx(15.0) for v in records.values()), records
    # per instance: w1 at 10/s, w2 at 5/s, never negative across its restart
    per = {labels["instance"]: r for labels, _, _, r in _rates(apart, STAGE_REWARD,
                                                                 REWARD_RECORDS)}
    assert all(v == pytest.approx(10.0) for v in per["w1"].values())
    assert all(v == pytest.approx(5.0) for v in per["w2"].values()), per["w2"]
    # the processor: one series per outcome (no instance), the lag added up over partitions
    outcomes = {labels["outcome"]: r[T0 / 1000 + 60] for labels, _, _, r in
                _rates(answer, STAGE_PROCESSOR, PROCESSOR_GENERATIONS)}
    assert outcomes == pytest.approx({"unit": 8.0, "expired": 4.0})
    [(labels, kind, _, lag)] = _rates(answer, STAGE_PROCESSOR, CONSUMER_LAG)
    assert labels == {"recipe": "r", "group": "pg", "topic": f"{namespace}.generations"}
    assert (lag[T0 / 1000], lag[T0 / 1000 + 40]) == (5 + 3, 2 + 4)
    # dead letters: a rate per stage and kind
    kinds = {(s["stage"], s["labels"]["kind"]) for s in answer["series"]
             if s["name"] == "dead_letters"}
    assert kinds == {("processor", "processor.expired"), ("processor", "processor.shed"),
                     ("trainer", "TooStale")}


def test_the_api_serves_exactly_the_series_written(kafka_bootstrap, cli_env, namespace):
    written = _write_log(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace) as url:
        answer = settled_series(url, events=written)
    assert answer["series"] == EXPECTED
    assert (answer["events"], answer["undecodable"]) == (written - 1, 1)
    assert answer["topics"] == [declarations.metrics(namespace),
                                declarations.publications(namespace),
                                declarations.dead_letters(namespace)]


def test_from_now_charts_only_what_arrives_later(kafka_bootstrap, cli_env, namespace):
    _write_log(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace, "--from-now") as url:
        settled_series(url, events=0)
        producer = Producer(client_config(kafka_bootstrap))
        value, headers = SchemaRegistry.default().encode(
            metric(STAGE_EVALUATOR, "decisions", 3, {"decision": "PROMOTED"}, created_at=T0))
        producer.produce(declarations.metrics(namespace), value=value, headers=headers)
        assert producer.flush(30) == 0
        answer = settled_series(url, events=1)
    assert answer["series"] == [{"stage": "evaluator", "name": "decisions",
                                 "labels": {"decision": "PROMOTED"},
                                 "points": [[1767000000.0, 3.0]]}]


def test_headless_chromium_draws_every_series(kafka_bootstrap, cli_env, namespace):
    written = _write_log(kafka_bootstrap, namespace)
    loss, staleness = "trainer/loss", "trainer/staleness: trainer − behaviour version"
    gap, rewarded = ("trainer/logprob gap |current − behaviour| per token",
                     "reward/records scored, per second")
    versions, measured = ("follower/policy version per replica",
                          "evaluator/measurements of candidates")
    result = check_dashboard(cli_env, namespace, "dashboard", events=written,
                             require=[loss, staleness, gap, rewarded, versions, measured],
                             require_tiles=["measurement", "staleness"])
    charts = result["charts"]
    drawn = {chart: (c["series"], c["points"]) for chart, c in charts.items() if c["series"]}
    # rewarded: w1 and w2 added up, one rate: (30 + 5 - (10 + 5)) / 1 s at the second second
    assert drawn == {loss: (1, 2), staleness: (2, 6), gap: (2, 6), rewarded: (1, 1),
                     versions: (2, 5), measured: (2, 2)}
    [rate] = [s for s in result["dashboard"]["series"] if s["name"] == REWARD_REWARDED]
    assert rate["points"] == [[1767000001.0, 20.0]]
    # A declared chart of metrics never written is not on the page, nor a stage never heard of
    for declared in ("trainer/gradient norm (before clipping)",
                     "processor/units the newest checkpoint has not passed (trainer backlog)"):
        assert declared not in charts
    assert result["stages"] == {"intake": False, "reward": True, "processor": False,
                                "trainer": True, "evaluator": True, "follower": True}
    assert result["screenshot"].stat().st_size > 10_000


def test_headless_chromium_opens_on_the_scorecard_row(kafka_bootstrap, cli_env, namespace):
    read = _write_scorecard_log(kafka_bootstrap, namespace)
    result = check_dashboard(cli_env, namespace, "dashboard-scorecard", events=read,
                             require=["reward/records scored, per second",
                                      "processor/generation outcomes, per second",
                                      "processor/consumer lag per topic",
                                      "processor/dead letters by kind, per second"],
                             require_tiles=list(SCORECARD))
    # the first row, in the page's order, each headline the value worked out by hand
    assert result["order"][:len(SCORECARD)] == [f"tile:{tile}" for tile in SCORECARD]
    assert {tile: drawn["value"] for tile, drawn in result["tiles"].items()} == \
        {tile: value for tile, (value, _) in SCORECARD.items()}
    # one legend line per series that matters: the reward workers' records are one line
    assert result["charts"]["reward/records scored, per second"]["series"] == 1
    assert result["screenshot"].stat().st_size > 10_000


def test_headless_chromium_draws_each_instance_on_demand(kafka_bootstrap, cli_env, namespace):
    require_chromium()
    read = _write_scorecard_log(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace) as url:
        settled_series(url, events=read)
        page = rendered_page(url + "?per_instance=1")
    assert page.body["data-per-instance"] == "1"
    # w1 and w2 apart; the lag per partition and instance: p1's two, p2's one
    assert page.charts["reward/records scored, per second"]["series"] == 2
    assert page.charts["processor/consumer lag per topic"]["series"] == 3
    # the scorecard row is the same
    assert {tile: drawn["value"] for tile, drawn in page.tiles.items()} == \
        {tile: value for tile, (value, _) in SCORECARD.items()}


# ------------------------------------------------------------- what a newcomer sees of a run

#: Reward call seconds of a fast reward function: p50 3 to 3.3 ms, p99 3.4 to 3.67 ms (ticks
#: a tenth of a millisecond or two apart, which 3 decimals print alike).
CALLS = [(0.003 + 0.00005 * (t % 7), 0.0034 + 0.00003 * (t % 10)) for t in range(30)]
#: A large model's update ratio ‖Δθ‖ / ‖θ‖: 1e-5 to 4e-5 (3 decimals print every tick "0").
RATIOS = [1e-5 * (1 + t % 4) for t in range(30)]
#: Three trainer groups' reward of trained samples, the last of each by hand.
GROUPS = {"a": 0.512, "b": 0.113, "c": 0.0859}


def _newcomer_metrics():
    """A run without a sandbox: a reward worker's call seconds (small values), three trainer
    groups' reward and loss, one's update ratio (tiny values)."""
    events = []
    for t, (p50, p99) in enumerate(CALLS):
        labels = {"recipe": "grpo", "group": "rw", "instance": "w1"}
        events += [metric(STAGE_REWARD, REWARD_CALL_P50, p50, labels, created_at=_at(t)),
                   metric(STAGE_REWARD, REWARD_CALL_P99, p99, labels, created_at=_at(t))]
    for group, last in GROUPS.items():
        labels = {"recipe": "grpo", "group": group}
        for t, reward in ((0, 0.0), (10, last / 2), (20, last)):
            events += [metric(STAGE_TRAINER, "objective.reward_mean", reward, labels,
                              created_at=_at(t)),
                       metric(STAGE_TRAINER, "loss", 1 - reward, labels, created_at=_at(t))]
    events += [metric(STAGE_TRAINER, TRAINER_UPDATE_RATIO, ratio, {"recipe": "grpo", "group": "a"},
                      created_at=_at(t)) for t, ratio in enumerate(RATIOS)]
    return events


def test_a_newcomer_sees_what_the_run_uses_with_readable_ticks_and_labelled_headlines(
        kafka_bootstrap, cli_env, namespace):
    create_topics(kafka_bootstrap, namespace)
    registry = SchemaRegistry.default()
    written = _produce(kafka_bootstrap, [(declarations.metrics(namespace), *registry.encode(e))
                                         for e in _newcomer_metrics()])
    calls = "reward/reward call seconds, p50 and p99"
    result = check_dashboard(cli_env, namespace, "dashboard-newcomer", events=written,
                             require=[calls, "trainer/loss"], require_tiles=["reward"])
    charts, tiles = result["charts"], result["tiles"]
    # no sandbox in this run: none of its charts; no replica: no serving tile
    assert not [chart for chart in charts if "sandbox" in chart], list(charts)
    assert list(tiles) == ["reward", "dead_letters"]
    # milliseconds on a seconds axis: each tick reads differently, not "0.003" thrice
    ticks = charts[calls]["yticks"]
    assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks
    assert [float(tick) for tick in ticks] == sorted(float(tick) for tick in ticks), ticks
    assert all(0.0029 <= float(tick) <= 0.0038 for tick in ticks), ticks
    ratios = charts["trainer/update ratio ‖Δθ‖ / ‖θ‖"]["yticks"]
    assert len(ratios) >= 3 and len(set(ratios)) == len(ratios), ratios
    assert all(0 <= float(tick) <= 5e-5 for tick in ratios) and float(ratios[-1]) > 0, ratios
    # three groups: each value of the headline says whose it is, as its line in the legend
    assert tiles["reward"]["value"] == "group=a 0.512 · group=b 0.113 · group=c 0.0859"
    assert tiles["reward"]["series"] == 3
    assert tiles["reward"]["legend"] == charts["trainer/loss"]["legend"] == [
        "group=a", "group=b", "group=c"]
    assert result["stages"] == {"intake": False, "reward": True, "processor": False,
                                "trainer": True, "evaluator": False, "follower": False}


def test_a_taken_port_is_a_clear_error(kafka_bootstrap, cli_env, namespace):
    create_topics(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace) as url:
        port = url.rsplit(":", 1)[1].strip("/")
        result = reef("dashboard", "--port", port, env=cli_env, check=False, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"port {port} on 127.0.0.1 is taken" in result.stderr
    assert "--port" in result.stderr


def test_the_store_stays_bounded_and_keeps_the_newest_point():
    store = SeriesStore(max_points=4, max_series=2)
    for i in range(100):
        store.add(Metric(stage="trainer", name="loss", value=float(i), created_at=i * 1000))
    points = store.snapshot()[0]["points"]
    assert len(points) <= 4
    assert points[0] == [0.0, 0.0] and points[-1] == [99.0, 99.0]
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    for name in ("a", "b"):
        store.add(Metric(stage="trainer", name=name, value=1.0, created_at=0))
    assert len(store.snapshot()) == 2 and store.dropped_series == 1
