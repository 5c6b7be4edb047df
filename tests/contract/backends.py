"""The two brokers the stage loop's contract runs on, behind one small surface (after arroyo's
``tests/backends/mixins.py``): the in-memory broker, for speed, and the real Kafka broker, which
every guarantee keeps."""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from reef_stream.consumers.stage import ConsumerFactory, kafka_consumers
from reef_stream.core.events import DeadLetter
from reef_stream.core.serde import decode
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import Topic, dead_letters, declare_topics
from reef_stream.topics.memory import MemoryBroker
from tests.helpers import consume_events

#: A record to produce: (partition or None for the key's, key, value, headers).
Record = tuple[int | None, bytes | None, bytes | None, list[tuple[str, bytes]] | None]


class Backend:
    """A broker for one test: its topics live in ``namespace``."""

    name: str
    consumers: ConsumerFactory

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def create(self, topic: str, partitions: int) -> None:
        """``topic`` and the namespace's dead-letters topic."""
        raise NotImplementedError

    def producer(self) -> Producer:
        raise NotImplementedError

    def produce(self, topic: str, records: Iterable[Record]) -> None:
        """Every record, acknowledged before it returns."""
        producer = self.producer()
        for partition, key, value, headers in records:
            if partition is None:
                producer.produce(topic, key=key, value=value, headers=headers)
            else:
                producer.produce(topic, key=key, value=value, headers=headers,
                                 partition=partition)
        assert producer.flush(30) == 0

    def committed(self, group: str, topic: str, partition: int) -> int:
        """The group's committed offset (negative: none)."""
        raise NotImplementedError

    def size(self, topic: str) -> int:
        """How many records ``topic`` holds (the sum of its partitions' end offsets)."""
        raise NotImplementedError

    def dead_letters(self, count: int) -> list[DeadLetter]:
        """The namespace's dead letters, once ``count`` are there."""
        raise NotImplementedError


class Memory(Backend):
    name = "memory"

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.broker = MemoryBroker()
        self.consumers = self.broker.consumer

    def create(self, topic: str, partitions: int) -> None:
        self.broker.create_topic(dead_letters(self.namespace), 1)
        self.broker.create_topic(topic, partitions)

    def producer(self):
        return self.broker.producer()

    def committed(self, group: str, topic: str, partition: int) -> int:
        return self.broker.committed(group, topic, partition)

    def size(self, topic: str) -> int:
        return len(self.broker.messages(topic))

    def dead_letters(self, count: int) -> list[DeadLetter]:
        letters = [decode(m.value(), m.headers(), DeadLetter, topic=m.topic(),
                          partition=m.partition(), offset=m.offset())
                   for m in self.broker.messages(dead_letters(self.namespace))]
        assert len(letters) == count, letters
        return letters


class Kafka(Backend):
    name = "kafka"

    def __init__(self, bootstrap: str, namespace: str) -> None:
        super().__init__(namespace)
        self.bootstrap = bootstrap
        self.consumers = kafka_consumers(bootstrap)
        self._asker: Consumer | None = None

    def create(self, topic: str, partitions: int) -> None:
        ensure_topics(AdminClient(client_config(self.bootstrap)),
                      [*declare_topics(self.namespace),
                       Topic(topic, partitions, doc="stage loop contract")])

    def producer(self) -> Producer:
        return Producer(client_config(self.bootstrap,
                                      {"acks": "all", "enable.idempotence": True}))

    def committed(self, group: str, topic: str, partition: int) -> int:
        consumer = Consumer(client_config(self.bootstrap, {"group.id": group}))
        try:
            (position,) = consumer.committed([TopicPartition(topic, partition)], timeout=30)
            return position.offset
        finally:
            consumer.close()

    def size(self, topic: str) -> int:
        if self._asker is None:
            self._asker = Consumer(client_config(self.bootstrap, {"group.id": "contract-ends"}))
        partitions = self._asker.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(self._asker.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in partitions)

    def dead_letters(self, count: int) -> list[DeadLetter]:
        return consume_events(self.bootstrap, dead_letters(self.namespace), count, DeadLetter)

    def close(self) -> None:
        if self._asker is not None:
            self._asker.close()
