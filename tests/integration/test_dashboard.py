"""`reef dashboard` over a metrics log written by hand on a real broker: the API serves exactly
the series written (identity labels only, NaN and histogram buckets skipped, publications'
measurements included, undecodable records counted), headless Chromium draws a chart for each
with every point, a taken port is a clear error, and the series store stays bounded."""

from __future__ import annotations

import math

from confluent_kafka import Producer

from reef_stream.topics.connect import client_config
from reef_stream.ops.dashboard.store import SeriesStore
from reef_stream.topics.events import Decision, Metric, Publication
from reef_stream.ops.metrics import (
    FOLLOWER_POLICY_VERSION, REWARD_REWARDED, STAGE_EVALUATOR, STAGE_FOLLOWER, STAGE_PROCESSOR,
    STAGE_REWARD, STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, TRAINER_LOGPROB_GAP_SAME_VERSION,
    TRAINER_STALENESS_MAX, TRAINER_STALENESS_MEAN, metric,
)
from reef_stream.topics import declarations
from reef_stream.topics.serde import SchemaRegistry
from tests.helpers import reef
from tests.integration.dashboard_check import check_dashboard, running_dashboard, settled_series
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


def _write_log(bootstrap, ns) -> int:
    """The known metrics, two publications and one record that does not decode; the number of
    records written."""
    create_topics(bootstrap, ns)
    registry = SchemaRegistry.default()
    producer = Producer(client_config(bootstrap, {"acks": "all"}))
    records = [(declarations.metrics(ns), *registry.encode(m)) for m in _metrics()]
    records += [(declarations.publications(ns), *registry.encode(p)) for p in (
        _publication(1, Decision.PROMOTED, 0.5), _publication(2, Decision.REJECTED, 0.25))]
    records.append((declarations.metrics(ns), b"not avro", None))
    for topic, value, headers in records:
        producer.produce(topic, key=b"k", value=value, headers=headers)
    assert producer.flush(30) == 0
    return len(records)


def test_the_api_serves_exactly_the_series_written(kafka_bootstrap, cli_env, namespace):
    written = _write_log(kafka_bootstrap, namespace)
    with running_dashboard(cli_env, namespace) as url:
        answer = settled_series(url, events=written)
    assert answer["series"] == EXPECTED
    assert (answer["events"], answer["undecodable"]) == (written - 1, 1)
    assert answer["topics"] == [declarations.metrics(namespace),
                                declarations.publications(namespace)]


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
                     "reward/records scored (running totals)")
    versions, measured = ("follower/policy version per replica",
                          "evaluator/measurements of candidates")
    result = check_dashboard(cli_env, namespace, "dashboard", events=written,
                             require=[loss, staleness, gap, rewarded, versions, measured])
    charts = result["charts"]
    drawn = {chart: (c["series"], c["points"]) for chart, c in charts.items() if c["series"]}
    assert drawn == {loss: (1, 2), staleness: (2, 6), gap: (2, 6), rewarded: (2, 3),
                     versions: (2, 5), measured: (2, 2)}
    # Every declared chart is on the page, those without data say so.
    for declared in ("trainer/gradient norm (before clipping)",
                     "processor/units the newest checkpoint has not passed (trainer backlog)"):
        assert charts[declared] == {"series": 0, "points": 0, "canvas": False}, declared
    assert result["screenshot"].stat().st_size > 10_000


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
