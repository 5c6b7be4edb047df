"""Raw Kafka's CPU per record: what the loop's plumbing is compared against.

    from raw import paced_raw_cpu_per_record, raw_cpu_per_record   # bench/ is on sys.path
    seconds = paced_raw_cpu_per_record(bootstrap, "raw1", rate=213, seconds=30, round_size=32,
                                       producers=2, broker_pids=broker_pids)
    seconds = raw_cpu_per_record(bootstrap, "raw2", 20000, broker_pids)   # as fast as it goes

Both send records that are each the encoded bytes of one demo generation (the demo's schema
and headers) to a topic of the demo's partitions (``DemoOptions.partitions``), with the
producer settings a bench's raw path uses (linger 5 ms, lz4, acks all), read them back with
one consumer of Kafka's default fetch settings, and return the CPU seconds per record of
this process (the clients' threads) plus the given broker processes.

``paced_raw_cpu_per_record`` carries the loop's traffic as the loop carries it: ``rate``
records a second, in rounds of ``round_size`` from ``producers`` producers (the replicas),
for ``seconds``, read as they come. That is the figure the loop's infra is compared with:
a broker costs CPU every second whether records flow or not, and fewer records share it at
a lower rate, on the loop's side and on raw Kafka's alike. ``raw_cpu_per_record`` sends
``records`` as fast as the producer takes them, then reads them back: Kafka's best case,
whose figure moves with the broker's JIT more than with anything the loop does
(``docs/benchmarks.md``, "Raw Kafka at the loop's rate").
"""

from __future__ import annotations

import math
import threading
import time
import uuid

import numpy as np
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.run import DemoOptions, process_cpu_seconds
from reef_stream.demo.task import ProblemStream, make_generation
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import Topic

#: Longest the consumer waits for the records it produced.
DEADLINE_S = 300.0


def generation_record() -> tuple[bytes, list[tuple[str, bytes]]]:
    """One demo generation, encoded as a replica sends it: its value and headers."""
    problem = ProblemStream(0).take(1)[0]
    generation = make_generation(model="policy", policy_version=1, replica_id="replica-0",
                                 problem=problem, token_ids=np.zeros(1, dtype=np.int32),
                                 logprobs=np.zeros(1, dtype=np.float32), temperature=1.0)
    value, headers = SchemaRegistry.default().encode(generation)
    return value, list(headers)


class _RawClients:
    """``producers`` producers and one consumer of ``topic`` (created), and the CPU the
    clients and ``broker_pids`` spend between ``start()`` and ``cpu_seconds()``."""

    def __init__(self, bootstrap: str, topic: str, broker_pids: list[int],
                 producers: int = 1) -> None:
        self.topic, self.broker_pids = topic, broker_pids
        self.value, self.headers = generation_record()
        ensure_topics(AdminClient(client_config(bootstrap)),
                      [Topic(topic, DemoOptions.partitions)])
        self.producers = [Producer(client_config(bootstrap, {
            "linger.ms": 5, "compression.type": "lz4", "acks": "all"}))
            for _ in range(producers)]
        self.consumer = Consumer(client_config(bootstrap, {
            "group.id": f"raw-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
            "enable.auto.commit": False}))
        self._brokers: list[float] = []
        self._cpu = 0.0

    def start(self) -> None:
        self._brokers = [process_cpu_seconds(pid) or 0.0 for pid in self.broker_pids]
        self._cpu = time.process_time()

    def send(self, producer: Producer, number: int) -> None:
        producer.produce(self.topic, value=self.value, key=str(number).encode(),
                         headers=self.headers)
        producer.poll(0)

    def read(self, records: int, count: list[int] | None = None) -> int:
        """Read until ``records`` records were seen (``count[0]`` keeps the tally for
        another thread); ``RuntimeError`` after ``DEADLINE_S``."""
        count = count if count is not None else [0]
        started = time.monotonic()
        while count[0] < records:
            if time.monotonic() - started > DEADLINE_S:
                raise RuntimeError(f"raw Kafka: read {count[0]} of {records} records in "
                                   f"{DEADLINE_S} s")
            count[0] += sum(1 for m in self.consumer.consume(2000, timeout=0.2)
                            if m.error() is None)
        return count[0]

    def cpu_seconds(self) -> float:
        broker = sum((process_cpu_seconds(pid) or 0.0) - before
                     for pid, before in zip(self.broker_pids, self._brokers))
        return time.process_time() - self._cpu + broker

    def close(self) -> None:
        self.consumer.close()


def raw_cpu_per_record(bootstrap: str, topic: str, records: int, broker_pids: list[int]
                       ) -> float:
    """CPU seconds per record of producing ``records`` generation-sized records through
    ``bootstrap`` as fast as the producer takes them, then consuming them (see the module
    docstring). Blocks until every record is read back; ``RuntimeError`` after
    ``DEADLINE_S``."""
    clients = _RawClients(bootstrap, topic, broker_pids)
    clients.start()
    producer = clients.producers[0]
    for number in range(records):
        clients.send(producer, number)
    producer.flush(60)
    clients.consumer.subscribe([topic])
    clients.read(records)
    cpu = clients.cpu_seconds()
    clients.close()
    return cpu / records


def paced_raw_cpu_per_record(bootstrap: str, topic: str, *, rate: float, seconds: float,
                             round_size: int, producers: int, broker_pids: list[int]) -> float:
    """CPU seconds per record of carrying generation-sized records through ``bootstrap`` at
    ``rate`` a second for ``seconds``, in rounds of ``round_size`` sent by ``producers``
    producers in turn, read back by one consumer as they come (see the module docstring).
    Blocks for about ``seconds``, until every record is read back; ``RuntimeError`` after
    ``DEADLINE_S``."""
    if rate <= 0 or seconds <= 0 or round_size < 1 or producers < 1:
        raise ValueError(f"paced raw Kafka: rate, seconds, round_size and producers must be "
                         f"positive, not {rate}, {seconds}, {round_size}, {producers}")
    clients = _RawClients(bootstrap, topic, broker_pids, producers)
    clients.consumer.subscribe([topic])
    clients.consumer.consume(1, timeout=3.0)   # joined and assigned before the clock starts
    rounds = math.ceil(rate * seconds / round_size)
    records = rounds * round_size
    seen = [0]
    errors: list[BaseException] = []

    def read() -> None:
        try:
            clients.read(records, seen)
        except BaseException as error:   # noqa: BLE001 -- re-raised on the calling thread
            errors.append(error)

    clients.start()
    reader = threading.Thread(target=read, name="raw-reader", daemon=True)
    reader.start()
    started = time.monotonic()
    for number in range(rounds):
        wait = started + number * round_size / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        producer = clients.producers[number % producers]
        for offset in range(round_size):
            clients.send(producer, number * round_size + offset)
    for producer in clients.producers:
        producer.flush(60)
    reader.join()
    cpu = clients.cpu_seconds()
    clients.close()
    if errors:
        raise errors[0]
    return cpu / records
