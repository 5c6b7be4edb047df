"""The Prometheus exposition without a broker: reef names and labels → Prometheus ones, one label
set per name, ``MetricsWriter`` setting gauges even when Kafka refuses, and a taken port."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reef_stream.core import metric_names
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.prometheus import Exposition, label_name, metric_name, serve
from reef_stream.topics import metrics


def test_names_and_labels_keep_only_what_prometheus_allows():
    assert metric_name("trainer", metric_names.TRAINER_LOGPROB_GAP_OLDER) == \
        "reef_trainer_logprob_gap_older"
    assert metric_name("reward", "reward_mean") == "reef_reward_reward_mean"
    assert metric_name("my-stage", "a b/c") == "reef_my_stage_a_b_c"
    assert [label_name(k) for k in ("decision", "a.b", "9lives", "__x", "")] == \
        ["decision", "a_b", "_9lives", "_x", "_"]


def test_one_name_written_with_different_label_keys_gets_their_union():
    exposition = Exposition()
    exposition.set("evaluator", "decisions", 3, {"decision": "PROMOTED"})
    exposition.set("evaluator", "decisions", 5, {"decision": "PROMOTED"})
    exposition.set("evaluator", "decisions", 1, {"why.not": "x"})
    (family,) = [f for f in exposition.collect() if f.name == "reef_evaluator_decisions"]
    assert family.type == "gauge"
    assert sorted((s.labels["decision"], s.labels["why_not"], s.value)
                  for s in family.samples) == [("", "x", 1.0), ("PROMOTED", "", 5.0)]
    assert exposition.value("evaluator", "decisions", decision="PROMOTED") == 5.0


class _FullProducer:
    def produce(self, *args, **kwargs):
        raise BufferError("queue full")


def test_a_writer_sets_the_gauge_even_when_kafka_refuses_and_a_server_serves_it():
    exposition = Exposition()
    writer = metrics.MetricsWriter(_FullProducer(), "ns", metric_names.STAGE_REWARD,
                                   {"group": "g"}, exposition=exposition)
    writer.write(metric_names.REWARD_REWARDED, 7)  # dropped for Kafka, logged, not raised
    with serve(0, source=exposition) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=5) as response:
            text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("reef_reward_rewarded", (("group", "g"),))] == 7.0


def test_a_port_already_taken_is_a_configuration_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"127.0.0.1:{port}"):
            serve(port, source=Exposition())
