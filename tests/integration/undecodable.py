"""Shared by the evaluation and follower tests: records on ``<ns>.publications`` that do not
decode, produced straight onto the real broker, and what the pipeline wrote about them
(dead letters with their Kafka keys, metric values).
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import Producer

from reef_stream.consumers.evaluator.evaluator import publication_key
from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import DeadLetter, Metric, Publication
from reef_stream.core.serde import decode, encode
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, metrics, publications
from reef_stream.topics.reading import read_to_end
from tests.helpers import consume_all

#: (topic, partition, offset) of a record.
Where = tuple[str, int, int]


@dataclass(frozen=True)
class Raw:
    """A record as a broken or foreign producer would write it."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


#: Bytes that are no Avro at all, without any header (no fingerprint, no schema name).
GARBAGE = Raw(b"stray", b"\x00\xffnot a publication\x13\x37", [])


def other_schema() -> Raw:
    """A valid event of another schema (a Metric, with its own fingerprint header)."""
    value, headers = encode(Metric(stage="intruder", name="oops", value=1.0, labels={},
                                   created_at=1_795_000_000_000))
    return Raw(b"stray", value, headers)


def produce_raw(bootstrap: str, topic: str, *records: Raw | Publication) -> list[Where]:
    """Each record (a publication keyed as the evaluator keys it, or raw), in order and
    acknowledged; where each one landed."""
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    landed: list[Where | None] = [None] * len(records)

    def delivered(i: int):
        def report(error, message) -> None:
            assert error is None, error
            landed[i] = (message.topic(), message.partition(), message.offset())
        return report

    for i, record in enumerate(records):
        if isinstance(record, Publication):
            value, headers = encode(record)
            key = publication_key(record)
        else:
            key, value, headers = record.key, record.value, record.headers
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered(i))
    assert producer.flush(30) == 0
    return landed  # type: ignore[return-value]


def publish_raw(bootstrap: str, namespace: str, *records: Raw | Publication) -> list[Where]:
    return produce_raw(bootstrap, publications(namespace), *records)


def letters(bootstrap: str, namespace: str, expected: int,
            stage: str | None = None) -> dict[Where, list[tuple[bytes | None, DeadLetter]]]:
    """The dead letters (of ``stage``, or all), as (Kafka key, letter), by the coordinates of
    the record each one is about, in the order written."""
    found: dict[Where, list[tuple[bytes | None, DeadLetter]]] = {}
    for message in consume_all(bootstrap, dead_letters(namespace), expected):
        letter = decode(message.value(), message.headers(), DeadLetter)
        if stage is None or letter.stage == stage:
            where = (letter.source_topic, letter.source_partition, letter.source_offset)
            found.setdefault(where, []).append((message.key(), letter))
    return found


def decodable_publications(bootstrap: str, namespace: str, expected: int) -> list[Publication]:
    """The publications of the topic that decode, in log order (the rest left out)."""
    found = []
    for message in consume_all(bootstrap, publications(namespace), expected):
        try:
            found.append(decode(message.value(), message.headers(), Publication))
        except InvalidRecord:
            continue
    return found


def metric_values(bootstrap: str, namespace: str, stage: str, name: str,
                  **labels: str) -> list[float]:
    """Every value written so far of metric ``stage``/``name`` whose labels include
    ``labels``, in order."""
    values = []
    for message in read_to_end(bootstrap, metrics(namespace), timeout=60):
        event = decode(message.value(), message.headers(), Metric)
        if event.stage == stage and event.name == name and \
                all(event.labels.get(k) == v for k, v in labels.items()):
            values.append(event.value)
    return values
