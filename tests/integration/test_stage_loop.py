"""The one stage loop against the real broker: it commits only what its strategy says is
durable, pauses and resumes for backpressure without losing or repeating a record,
dead-letters what the strategy cannot process (the record kept whole), stops gracefully
(join, then the final commit, then close), and a failure in a rebalance callback or a missing
topic is raised from ``run``."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from reef_stream.consumers.stage import ConsumerFenced, MessageRejected, StageLoop
from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import DeadLetter, MessageHeader
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import Topic, dead_letters, declare_topics
from tests.helpers import consume_events, wait_until

RECORDS = 20
BAD = {5, 13}  # offsets of records the strategy cannot process
HOLD = 3  # records the strategy holds at most before it refuses more


def _topic(bootstrap: str, namespace: str) -> str:
    name = f"{namespace}.stage-test"
    ensure_topics(AdminClient(client_config(bootstrap)),
                  [*declare_topics(namespace), Topic(name, 1, doc="stage loop test")])
    return name


def _produce(bootstrap: str, topic: str) -> None:
    producer = Producer(client_config(bootstrap))
    for n in range(RECORDS):
        producer.produce(topic, key=f"k{n}".encode(),
                         value=b"bad" if n in BAD else f"ok-{n}".encode(),
                         headers=[("n", str(n).encode())])
    assert producer.flush(30) == 0


def _committed(bootstrap: str, group: str, topic: str) -> int:
    consumer = Consumer(client_config(bootstrap, {"group.id": group}))
    try:
        (position,) = consumer.committed([TopicPartition(topic, 0)], timeout=30)
        return position.offset
    finally:
        consumer.close()


class Holding:
    """A strategy that holds up to ``HOLD`` records and makes one durable every fourth ``poll``;
    it refuses more while full (backpressure) and raises ``InvalidRecord`` for a bad one."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.loop: StageLoop | None = None
        self.held: list[int] = []  # offsets submitted, not durable yet
        self.durable = 0  # records before this offset are durable
        self.submitted: list[int] = []
        self.rejected = 0
        self.commits: list[int] = []
        self.calls: list[str] = []
        self.polls = 0

    def on_assign(self, partitions):
        self.calls.append("assign")

    def on_revoke(self, partitions):
        self.calls.append("revoke")

    def submit(self, message):
        if len(self.held) >= HOLD:
            self.rejected += 1
            raise MessageRejected
        if message.value() == b"bad":
            raise InvalidRecord(f"bad record at {message.offset()}")
        self.submitted.append(message.offset())
        self.held.append(message.offset())

    def dead_lettered(self, message):
        self.held.append(message.offset())  # durable: its letter is acknowledged

    def poll(self):
        self.polls += 1
        if self.held and self.polls % 4 == 0:  # slower than records arrive: it fills up
            self.held.sort()
            offset = self.held.pop(0)
            assert offset == self.durable, "records become durable in offset order here"
            self.durable = offset + 1
        if self.durable == RECORDS:
            self.loop.stop()

    def committable(self):
        return {(self.topic, 0): self.durable} if self.durable else {}

    def committed(self, positions):
        (offset,) = positions.values()
        assert offset <= self.durable, "the loop committed past what is durable"
        self.commits.append(offset)

    def join(self, timeout):
        self.calls.append("join")

    def close(self):
        self.calls.append("close")


def test_commit_last_backpressure_and_dead_letters(kafka_bootstrap, namespace):
    topic = _topic(kafka_bootstrap, namespace)
    _produce(kafka_bootstrap, topic)
    group = f"{namespace}.stage-test"
    strategy = Holding(topic)
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all", "enable.idempotence": True}))
    loop = strategy.loop = StageLoop(strategy, stage="test", bootstrap=kafka_bootstrap,
                                     group=group, topics=[topic], namespace=namespace,
                                     reads="test record", producer=producer)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(120)
    assert not runner.is_alive(), "the loop did not stop"

    # every good record submitted exactly once, in order, although the loop paused and
    # offered refused records again; the bad ones went to dead letters instead
    assert strategy.submitted == [n for n in range(RECORDS) if n not in BAD]
    assert strategy.rejected > 0, "the strategy never pushed back: backpressure untested"
    # commits only of durable positions, never backwards, the last one past everything
    assert strategy.commits == sorted(strategy.commits) and strategy.commits[-1] == RECORDS
    assert _committed(kafka_bootstrap, group, topic) == RECORDS
    assert strategy.calls[0] == "assign" and strategy.calls[-2:] == ["revoke", "close"]
    assert "join" in strategy.calls

    letters = consume_events(kafka_bootstrap, dead_letters(namespace), len(BAD), DeadLetter)
    assert sorted(letter.source_offset for letter in letters) == sorted(BAD)
    for letter in letters:
        n = letter.source_offset
        assert letter == DeadLetter(
            reason=f"undecodable test record: bad record at {n}", error_type="InvalidRecord",
            source_topic=topic, source_partition=0, source_offset=n, key=f"k{n}".encode(),
            value=b"bad", headers=(MessageHeader(key="n", value=str(n).encode()),),
            stage="test", created_at=letter.created_at)


def test_a_failing_assignment_is_raised_from_run(kafka_bootstrap, namespace):
    topic = _topic(kafka_bootstrap, namespace)

    class Refuses(Holding):
        def on_assign(self, partitions):
            raise ValueError("cannot restore")

    strategy = Refuses(topic)
    loop = strategy.loop = StageLoop(strategy, stage="test", bootstrap=kafka_bootstrap,
                                     group=f"{namespace}.refuses", topics=[topic],
                                     namespace=namespace, reads="test record", producer=None)
    with pytest.raises(ValueError, match="cannot restore"):
        loop.run()
    assert strategy.calls[-1] == "close" and "join" not in strategy.calls


def test_a_missing_topic_is_a_configuration_error(kafka_bootstrap, namespace):
    strategy = Holding(f"{namespace}.nowhere")
    loop = strategy.loop = StageLoop(strategy, stage="test", bootstrap=kafka_bootstrap,
                                     group=f"{namespace}.nowhere", topics=[strategy.topic],
                                     namespace=namespace, reads="test record", producer=None)
    with pytest.raises(ConfigurationError, match="does not exist"):
        loop.run()
    assert strategy.calls == ["close"]


def test_the_loop_writes_its_process_cpu_time_while_running_and_at_the_end(
        kafka_bootstrap, namespace):
    """``process_cpu_seconds`` under the loop's stage, labelled with this process: at the first
    commit, every second, and once more after the final commit; a running total that never
    exceeds what the process has used."""
    import os
    import socket
    import time

    from reef_stream.core.events import Metric
    from reef_stream.core.metric_names import PROCESS_CPU_SECONDS
    from reef_stream.topics.declarations import metrics
    from reef_stream.topics.metrics import MetricsWriter

    topic = _topic(kafka_bootstrap, namespace)
    _produce(kafka_bootstrap, topic)
    strategy = Holding(topic)
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all", "enable.idempotence": True}))
    loop = strategy.loop = StageLoop(strategy, stage="test", bootstrap=kafka_bootstrap,
                                     group=f"{namespace}.cpu", topics=[topic],
                                     namespace=namespace, reads="test record", producer=producer,
                                     metrics=MetricsWriter(producer, namespace, "test"))
    loop.run()
    used = time.process_time()
    written = [m for m in consume_events(kafka_bootstrap, metrics(namespace), 2, Metric)
               if m.name == PROCESS_CPU_SECONDS]
    assert len(written) >= 2, written                  # the first commit's and the final one
    assert {(m.stage, m.labels["process"]) for m in written} == \
        {("test", f"{socket.gethostname()}.{os.getpid()}")}
    values = [m.value for m in written]
    assert values == sorted(values) and 0 < values[-1] <= used


class Taking:
    """A strategy that records, in order, what it was handed."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.loop: StageLoop | None = None
        self.consumer: Consumer | None = None
        self.events: list[tuple] = []  # ("record", p, offset) / ("end", p, offset) in order
        self.next: dict[int, int] = {}
        self.calls: list[str] = []

    def on_start(self, consumer):
        self.consumer = consumer
        self.calls.append("start")

    def on_assign(self, partitions):
        self.calls.append("assign")

    def on_revoke(self, partitions):
        pass

    def submit(self, message):
        self.events.append(("record", message.partition(), message.offset()))
        self.next[message.partition()] = message.offset() + 1

    def at_end(self, topic, partition, offset):
        self.events.append(("end", partition, offset))

    def poll(self):
        pass

    def committable(self):
        raise AssertionError("a strategy that commits itself is never asked")

    def join(self, timeout):
        self.calls.append("join")

    def close(self):
        self.calls.append("close")


class Batches(Taking):
    """Like the trainer: assigned manually (partitions 0 and 2 of three, partition 0 from
    offset ``START``), taking fetches of up to ``BATCH`` records and committing, itself, what
    it took after each fetch; it stops once it has read both partitions to their end."""

    def __init__(self, topic: str) -> None:
        super().__init__(topic)
        self.drained: list[int | None] = []

    def assignment(self, partitions):
        assert partitions == {self.topic: [0, 1, 2]}
        return [TopicPartition(self.topic, 0, START),
                TopicPartition(self.topic, 2, OFFSET_BEGINNING)]

    def fetched(self, drained_at_ms):
        self.drained.append(drained_at_ms)
        if self.next:
            self.consumer.commit(offsets=[TopicPartition(self.topic, p, o)
                                          for p, o in sorted(self.next.items())],
                                 asynchronous=False)
        ends = {p for kind, p, _ in self.events if kind == "end"}
        if self.next.get(0) == PER_PARTITION and self.next.get(2) == PER_PARTITION \
                and ends == {0, 2}:
            self.loop.stop()


PER_PARTITION, START, BATCH = 25, 4, 7


def test_batches_a_manual_assignment_and_a_strategy_that_commits_itself(
        kafka_bootstrap, namespace):
    topic = f"{namespace}.batches"
    ensure_topics(AdminClient(client_config(kafka_bootstrap)),
                  [*declare_topics(namespace), Topic(topic, 3, doc="stage loop test")])
    producer = Producer(client_config(kafka_bootstrap))
    for p in range(3):
        for n in range(PER_PARTITION):
            producer.produce(topic, partition=p, value=f"{p}-{n}".encode())
    assert producer.flush(30) == 0
    group = f"{namespace}.batches"
    strategy = Batches(topic)
    loop = strategy.loop = StageLoop(
        strategy, stage="test", bootstrap=kafka_bootstrap, group=group, topics=[topic],
        namespace=namespace, reads="test record", producer=None, batch=BATCH,
        strategy_commits=True, consumer_config={"enable.partition.eof": True})
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(120)
    assert not runner.is_alive(), "the loop did not stop"

    # only the assigned partitions, from where the assignment said, each record once, in
    # offset order, and each partition's end after its last record
    for p, first in ((0, START), (2, 0)):
        seen = [(kind, offset) for kind, q, offset in strategy.events if q == p]
        assert [offset for kind, offset in seen if kind == "record"] == \
            list(range(first, PER_PARTITION))
        assert ("end", PER_PARTITION) in seen
        assert seen.index(("end", PER_PARTITION)) > seen.index(("record", PER_PARTITION - 1))
    assert not any(q == 1 for _, q, _ in strategy.events), "read a partition not assigned"
    # fetches of at most BATCH records; one that emptied the client's queue is stamped
    assert any(d is not None for d in strategy.drained)
    assert strategy.calls == ["start", "assign", "join", "close"]
    # what is committed is exactly what the strategy committed: the loop committed nothing
    # of its own (partition 1 has no committed offset at all)
    reader = Consumer(client_config(kafka_bootstrap, {"group.id": group}))
    try:
        committed = {tp.partition: tp.offset for tp in reader.committed(
            [TopicPartition(topic, p) for p in range(3)], timeout=30)}
    finally:
        reader.close()
    assert committed[0] == committed[2] == PER_PARTITION and committed[1] < 0


class Rejoins(Taking):
    """Subscribes as a static member; rejoins when fenced."""

    def __init__(self, topic: str) -> None:
        super().__init__(topic)
        self.fenced: list[Exception] = []

    def on_fenced(self, fenced):
        self.fenced.append(fenced)


def test_a_fenced_static_member_rejoins_with_a_new_consumer(kafka_bootstrap, namespace):
    topic = _topic(kafka_bootstrap, namespace)
    group = f"{namespace}.static"
    static = {"group.instance.id": f"{group}.0", "session.timeout.ms": 10_000}
    strategy = Rejoins(topic)
    loop = strategy.loop = StageLoop(
        strategy, stage="test", bootstrap=kafka_bootstrap, group=group, topics=[topic],
        namespace=namespace, reads="test record", producer=None, strategy_commits=True,
        consumer_config=static)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: "assign" in strategy.calls, 60, "the first assignment")
        usurper = Consumer(client_config(kafka_bootstrap, {"group.id": group, **static}))
        usurper.subscribe([topic])
        try:
            wait_until(lambda: usurper.poll(0.2) is None and bool(strategy.fenced), 60,
                       "the loop's consumer to be fenced by the usurper")
        finally:
            try:
                usurper.close()
            except Exception:  # noqa: BLE001 - fenced in turn by the loop's new consumer
                pass
        wait_until(lambda: strategy.calls.count("start") == 2, 60, "a new consumer")
        _produce(kafka_bootstrap, topic)
        wait_until(lambda: len([e for e in strategy.events if e[0] == "record"]) >= RECORDS,
                   60, "the records produced after the rejoin")
    finally:
        loop.stop()
        runner.join(60)
    assert isinstance(strategy.fenced[0], ConsumerFenced)
    assert runner.is_alive() is False
