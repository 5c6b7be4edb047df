"""A stage's Prometheus ``/metrics`` against the real broker: a `reef reward` worker run with
``--metrics-port`` serves its counters while it runs, and ``<ns>.metrics`` holds the same counts
as Metric events. (The name and label mapping and a taken port: tests/unit/test_prometheus.py.)
"""

from __future__ import annotations

import urllib.request

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from reef_stream.core import metric_names
from reef_stream.core.events import Metric
from reef_stream.core.processes import free_ports
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, generations
from reef_stream.topics.declarations import metrics as metrics_topic
from tests.helpers import consume_events, wait_until
from tests.integration.test_reward_workers import _finish, _produce, _start

COUNT = 8
EXPECTED = {metric_names.REWARD_RECORDS: COUNT + 1, metric_names.REWARD_REWARDED: COUNT,
            metric_names.REWARD_RETRIED: COUNT, metric_names.REWARD_UNDECODABLE: 1,
            metric_names.REWARD_FAILED: 0, metric_names.REWARD_INVALID: 0, metric_names.REWARD_TIMED_OUT: 0,
            metric_names.REWARD_DROPPED: 0}


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def scrape(port: int, group: str) -> dict[str, float]:
    """The reward stage's samples of ``group`` at ``/metrics``, by reef metric name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    prefix = f"reef_{metric_names.STAGE_REWARD}_"
    return {sample.name.removeprefix(prefix): sample.value
            for family in text_string_to_metric_families(text) if family.name.startswith(prefix)
            for sample in family.samples if sample.labels.get("group") == group}


def test_a_reward_worker_serves_its_counters_and_writes_the_same_to_the_metrics_topic(
        kafka_bootstrap, namespace, topics, tmp_path):
    _produce(kafka_bootstrap, namespace, tmp_path, COUNT)
    garbage = Producer(client_config(kafka_bootstrap))
    garbage.produce(generations(namespace), value=b"not avro", key=b"junk", partition=0)
    assert garbage.flush(10) == 0
    group, (port,) = f"{namespace}-prometheus", free_ports(1)
    worker = _start(kafka_bootstrap, namespace, tmp_path, "flaky", "--group", group,
                    "--retries", "1", "--backoff", "0.01", "--idle-exit", "3",
                    "--metrics-port", str(port))

    served: dict = {}

    def all_rewarded() -> bool:  # while it runs: it idles 3 s at the end
        nonlocal served
        assert worker.poll() is None, \
            f"worker exited; /metrics had {served}\n{worker.communicate()}"
        try:
            served = scrape(port, group)
        except OSError:  # not listening yet
            pass
        return served.get(metric_names.REWARD_REWARDED) == COUNT

    wait_until(all_rewarded, 60, lambda: f"{COUNT} rewarded on /metrics; it had {served}")
    served = scrape(port, group)  # one write sets every counter; scrape once more to be sure
    counts = _finish(worker)

    assert {name: served[name] for name in EXPECTED} == EXPECTED
    assert served[metric_names.REWARD_MEAN] == 1.0  # flaky's reward: 100 completion tokens / 100
    assert {name: counts[name] for name in EXPECTED} == EXPECTED
    latest: dict[str, Metric] = {}
    lags: dict[str, float] = {}
    for event in consume_events(kafka_bootstrap, metrics_topic(namespace), 9,
                                Metric):  # key = stage: one partition, in the order written
        if event.stage == metric_names.STAGE_REWARD and event.labels["group"] == group:
            latest[event.name] = event
            if event.name == metric_names.CONSUMER_LAG:
                assert event.labels["topic"] == generations(namespace)
                lags[event.labels["partition"]] = event.value
    # The worker read every partition to its end while it idled: its last lag is 0 everywhere.
    assert lags and set(lags.values()) == {0}, lags
    assert {name: latest[name].value for name in EXPECTED} == EXPECTED
    assert latest[metric_names.REWARD_MEAN].value == 1.0
    assert latest[metric_names.REWARD_MEAN].labels["source"] == "flaky_sandbox"
    assert set(latest[metric_names.REWARD_RECORDS].labels) == {"recipe", "group", "instance"}
