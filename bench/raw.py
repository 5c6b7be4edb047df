"""Raw Kafka's CPU per record: what the loop's plumbing is compared against.

    from raw import raw_cpu_per_record   # bench/ is on sys.path when a bench runs
    seconds = raw_cpu_per_record(bootstrap, "raw1", 20000, broker_pids)

Produces ``records`` records, each the encoded bytes of one demo generation (the demo's schema
and headers), to a topic of the demo's partitions (``DemoOptions.partitions``), with the producer settings a bench's raw path uses (linger 5 ms,
lz4, acks all), and consumes them back with one consumer; then returns the CPU seconds per
record of this process (the clients' threads) plus the given broker processes.
"""

from __future__ import annotations

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


def raw_cpu_per_record(bootstrap: str, topic: str, records: int, broker_pids: list[int]
                       ) -> float:
    """CPU seconds per record of producing and consuming ``records`` generation-sized records
    through ``bootstrap`` (see the module docstring): this process's plus ``broker_pids``'.
    Blocks until every record is read back; ``RuntimeError`` after ``DEADLINE_S``."""
    value, headers = generation_record()
    ensure_topics(AdminClient(client_config(bootstrap)),
                  [Topic(topic, DemoOptions.partitions)])
    producer = Producer(client_config(bootstrap, {"linger.ms": 5, "compression.type": "lz4",
                                                  "acks": "all"}))
    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"raw-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False}))
    brokers = [process_cpu_seconds(pid) or 0.0 for pid in broker_pids]
    cpu = time.process_time()
    for number in range(records):
        producer.produce(topic, value=value, key=str(number).encode(), headers=headers)
        producer.poll(0)
    producer.flush(60)
    consumer.subscribe([topic])
    seen, started = 0, time.monotonic()
    while seen < records:
        if time.monotonic() - started > DEADLINE_S:
            raise RuntimeError(f"raw Kafka: read {seen} of {records} records in {DEADLINE_S} s")
        seen += sum(1 for m in consumer.consume(2000, timeout=0.2) if m.error() is None)
    cpu = time.process_time() - cpu
    broker = sum((process_cpu_seconds(pid) or 0.0) - before
                 for pid, before in zip(broker_pids, brokers))
    consumer.close()
    return (cpu + broker) / records
