"""The stage loop's metrics against the real broker: the process's CPU time. Every other
behaviour of the loop is its contract (tests/contract/test_stage_loop_contract.py), run on the
in-memory broker and on this one."""

from __future__ import annotations

import os
import socket
import time

from confluent_kafka import Producer

from reef_stream.consumers.stage import (
    Committing, Group, StageLoop, StageOptions, kafka_consumers,
)
from reef_stream.core.events import Metric
from reef_stream.core.metric_names import PROCESS_CPU_SECONDS
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config, new_admin
from reef_stream.topics.declarations import Topic, declare_topics, metrics
from reef_stream.topics.metrics import MetricsWriter
from tests.helpers import consume_events

RECORDS = 20


class Counting:
    """Makes each record durable at once; stops after ``RECORDS``."""

    capabilities = frozenset({Committing})

    def __init__(self, topic: str) -> None:
        self.topic, self.durable = topic, 0
        self.loop: StageLoop | None = None

    def submit(self, message):
        self.durable = message.offset() + 1
        if self.durable == RECORDS:
            self.loop.stop()

    def poll(self): ...

    def committable(self):
        return {(self.topic, 0): self.durable} if self.durable else {}

    def committed(self, positions): ...

    def join(self, timeout): ...

    def close(self): ...


def test_the_loop_writes_its_process_cpu_time_while_running_and_at_the_end(
        kafka_bootstrap, namespace):
    """``process_cpu_seconds`` under the loop's stage, labelled with this process: at the first
    commit, every second, and once more after the final commit; a running total that never
    exceeds what the process has used."""
    topic = f"{namespace}.stage-test"
    ensure_topics(new_admin(kafka_bootstrap),
                  [*declare_topics(namespace), Topic(topic, 1, doc="stage loop test")])
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all", "enable.idempotence": True}))
    for n in range(RECORDS):
        producer.produce(topic, value=f"ok-{n}".encode())
    assert producer.flush(30) == 0
    strategy = Counting(topic)
    strategy.loop = StageLoop(
        strategy, StageOptions(stage="test", topics=(topic,), namespace=namespace,
                               reads="test record", membership=Group(f"{namespace}.cpu")),
        consumers=kafka_consumers(kafka_bootstrap), producer=producer,
        metrics=MetricsWriter(producer, namespace, "test"))
    strategy.loop.run()
    used = time.process_time()
    written = [m for m in consume_events(kafka_bootstrap, metrics(namespace), 2, Metric)
               if m.name == PROCESS_CPU_SECONDS]
    assert len(written) >= 2, written                  # the first commit's and the final one
    assert {(m.stage, m.labels["process"]) for m in written} == \
        {("test", f"{socket.gethostname()}.{os.getpid()}")}
    values = [m.value for m in written]
    assert values == sorted(values) and 0 < values[-1] <= used
