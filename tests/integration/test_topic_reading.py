"""``reef_stream.topics.reading`` against the real broker: to the end of a transactional topic
(committed records only, a commit marker last), incrementally, and up to given offsets."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from reef_stream.topics.connect import client_config
from reef_stream.topics.reading import TopicReader, read_to_end
from tests.helpers import wait_until


@pytest.fixture
def topic(kafka_bootstrap, namespace):
    name = f"{namespace}.reading"
    admin = AdminClient(client_config(kafka_bootstrap))   # kept until the future is done
    admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1)])[name].result(30)
    return name


def _transaction(bootstrap: str, topic: str, values: list[str], *, commit: bool) -> None:
    producer = Producer(client_config(bootstrap, {"transactional.id": uuid.uuid4().hex}))
    producer.init_transactions(30)
    producer.begin_transaction()
    for i, value in enumerate(values):
        producer.produce(topic, value=value.encode(), partition=i % 3)
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)


def _values(messages) -> list[str]:
    return sorted(m.value().decode() for m in messages)


def test_reads_the_committed_records_to_the_end_then_only_what_came_after(kafka_bootstrap,
                                                                         topic):
    _transaction(kafka_bootstrap, topic, [f"a{i}" for i in range(30)], commit=True)
    _transaction(kafka_bootstrap, topic, [f"aborted{i}" for i in range(9)], commit=False)
    # Every partition now ends in a transaction marker, which is never delivered.
    assert _values(read_to_end(kafka_bootstrap, topic, timeout=60)) == sorted(
        f"a{i}" for i in range(30))

    with TopicReader(kafka_bootstrap, topic, timeout=60) as reader:
        assert len(list(reader.to_end())) == 30
        assert list(reader.to_end()) == []             # nothing new: nothing read again
        _transaction(kafka_bootstrap, topic, ["b0", "b1", "b2", "b3"], commit=True)
        # commit_transaction returns once the commit is decided; the coordinator writes each
        # partition's commit marker after that, and until it does the partition's last stable
        # offset (the end a read_committed reader is given) stays before the transaction's
        # records: a call may find some of them, the next one the rest (seen on a freshly
        # started broker). Nothing is read twice and nothing is missed.
        read: list = []
        wait_until(lambda: read.extend(reader.to_end()) or len(read) >= 4, 30,
                   "the four committed records")
        assert _values(read) == ["b0", "b1", "b2", "b3"]
        assert list(reader.to_end()) == []


def test_reads_up_to_the_given_offsets_and_only_those_partitions(kafka_bootstrap, topic):
    producer = Producer(client_config(kafka_bootstrap))
    for i in range(10):
        producer.produce(topic, value=f"p0-{i}".encode(), partition=0)
        producer.produce(topic, value=f"p1-{i}".encode(), partition=1)
    producer.flush(30)
    read = list(read_to_end(kafka_bootstrap, topic, until={0: 4, 1: 0}, timeout=60))
    assert [(m.partition(), m.offset(), m.value().decode()) for m in read] == [
        (0, i, f"p0-{i}") for i in range(4)]


def test_a_topic_that_does_not_exist_has_no_records(kafka_bootstrap, namespace):
    assert list(read_to_end(kafka_bootstrap, f"{namespace}.nothing-here", timeout=30)) == []
