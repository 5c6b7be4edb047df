"""Typed events through the real broker: encode, produce, consume, decode."""

from __future__ import annotations

import numpy as np
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from reef_stream.core.errors import CorruptRecordError, UnknownSchemaError
from reef_stream.core.events import Generation, SamplingParams, events_equal
from reef_stream.core.serde import FINGERPRINT_HEADER, decode, encode
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, generations
from tests import factories
from tests.helpers import consume_all


def _generation(i: int) -> Generation:
    """The factory's generation (tests/factories.py) with seeded random tokens, 1 to 199."""
    rng = np.random.default_rng(i)
    length = int(rng.integers(1, 200))
    return factories.generation(
        f"gen-{i:05d}", request_id=f"req-{i}", prompt_id=f"prompt-{i % 7}",
        group_id=f"group-{i // 4}", group_size=4, policy_version=i // 50,
        prompt_token_ids=rng.integers(0, 50_000, 16, dtype=np.int32),
        completion_token_ids=rng.integers(0, 50_000, length, dtype=np.int32),
        completion_logprobs=-rng.random(length, dtype=np.float32), created_at=factories.T0 + i,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=256))


@pytest.fixture
def topic(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))
    return generations(namespace)


def test_generations_round_trip_through_the_broker(kafka_bootstrap, topic):
    sent = [_generation(i) for i in range(300)]
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all", "enable.idempotence": True}))
    for event in sent:
        value, headers = encode(event)
        producer.produce(topic, value=value, key=event.generation_id.encode(), headers=headers)
    assert producer.flush(30) == 0

    messages = consume_all(kafka_bootstrap, topic, len(sent))
    received = {}
    for message in messages:
        assert dict(message.headers())[FINGERPRINT_HEADER]
        event = decode(message.value(), message.headers(), Generation, topic=message.topic(),
                       partition=message.partition(), offset=message.offset())
        assert message.key() == event.generation_id.encode()
        received[event.generation_id] = event
    assert len(messages) == len(sent)
    for event in sent:
        assert events_equal(received[event.generation_id], event)


def test_corrupt_and_unknown_bytes_on_the_topic_give_typed_errors_with_their_location(
        kafka_bootstrap, topic):
    good_value, headers = encode(_generation(1))
    producer = Producer(client_config(kafka_bootstrap))
    producer.produce(topic, value=good_value[:-5], headers=headers, partition=0)  # truncated
    producer.produce(topic, value=good_value, headers=[(FINGERPRINT_HEADER, b"\x00" * 8)],
                     partition=0)  # a schema nobody knows
    producer.produce(topic, value=b"plain text, no headers", partition=0)
    assert producer.flush(30) == 0

    messages = sorted(consume_all(kafka_bootstrap, topic, 3), key=lambda m: m.offset())
    errors = []
    for message in messages:
        with pytest.raises((CorruptRecordError, UnknownSchemaError)) as caught:
            decode(message.value(), message.headers(), Generation, topic=message.topic(),
                   partition=message.partition(), offset=message.offset())
        errors.append(caught.value)
    assert [type(e) for e in errors] == [CorruptRecordError, UnknownSchemaError, UnknownSchemaError]
    assert [(e.topic, e.partition, e.offset) for e in errors] == [(topic, 0, 0), (topic, 0, 1),
                                                                  (topic, 0, 2)]
    assert f"{topic}[0]@1" in str(errors[1])
