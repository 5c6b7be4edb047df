"""Deterministic rollout units for the trainer's tests and benchmark: unit ``i`` is always the same."""

from __future__ import annotations

import numpy as np

from reef_stream.api.processor import unit_id
from reef_stream.core.events import RolloutUnit, Sample


def rollout_unit(i: int, *, recipe: str = "trainable", policy_version: int = 0, group_size: int = 4,
                 vocab: int = 64, prompt_len: int = 6, completion_len: int = 10) -> RolloutUnit:
    """Group ``i``: ``group_size`` samples with seeded tokens, logprobs and rewards."""
    rng = np.random.default_rng(i)
    members = []
    for k in range(group_size):
        completion = rng.integers(0, vocab, completion_len).astype(np.int32)
        members.append(Sample(
            generation_id=f"g{i}-{k}", prompt_id=f"p{i}", policy_version=policy_version,
            prompt_token_ids=rng.integers(0, vocab, prompt_len).astype(np.int32),
            completion_token_ids=completion,
            completion_logprobs=(-rng.random(completion_len) * 4 - 0.1).astype(np.float32),
            reward=float(rng.random() < 0.5)))
    return RolloutUnit(unit_id=unit_id(recipe, [m.generation_id for m in members]), recipe=recipe,
                       group_key=f"p{i}", members=tuple(members), created_at=1_700_000_000_000 + i)


def create_topics(bootstrap: str, namespace: str, recipe: str = "trainable") -> None:
    """Every topic of ``namespace``, with the units topic of ``recipe``."""
    from confluent_kafka.admin import AdminClient

    from reef_stream.topics.admin import ensure_topics
    from reef_stream.topics.connect import client_config
    from reef_stream.topics.declarations import declare_topics

    ensure_topics(AdminClient(client_config(bootstrap)), declare_topics(namespace, (recipe,)))


def produce_units(bootstrap: str, namespace: str, records, *, recipe: str = "trainable",
                  spread: bool = False) -> None:
    """Append ``records`` (units, or raw ``bytes`` that do not decode) to the units topic in this
    order of broker time: one flush per record, then a wait until this host's clock (the
    broker's) has passed the millisecond the record was stamped with, so that each gets a later
    LogAppendTime than the one before (two appended within one millisecond would tie, and a
    trainer orders ties by partition). With ``spread``, record ``i`` goes to partition ``i % 6``
    instead of its key's partition."""
    from confluent_kafka import Producer

    from reef_stream.core.serde import SchemaRegistry
    from reef_stream.topics.connect import client_config
    from reef_stream.topics.declarations import units as units_topic

    registry, topic = SchemaRegistry.default(), units_topic(namespace, recipe)
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    stamped: list[int] = []  # the broker's timestamp of each record, as its delivery reports it

    def delivered(error, message) -> None:
        stamped.append(message.timestamp()[1] if error is None else -1)  # -1: no wait

    for i, record in enumerate(records):
        where = {"partition": i % 6} if spread else {}
        if isinstance(record, bytes):
            producer.produce(topic, key=b"garbage", value=record, on_delivery=delivered, **where)
        else:
            value, headers = registry.encode(record)
            producer.produce(topic, key=record.unit_id.encode(), value=value, headers=headers,
                             on_delivery=delivered, **where)
        assert producer.flush(30) == 0
        after_stamp(stamped[-1])


def after_stamp(stamp_ms: int, timeout: float = 5) -> None:
    """Return once this host's clock, which the test broker runs on, is past ``stamp_ms``: a
    record appended from now on gets a later LogAppendTime than the one stamped ``stamp_ms``."""
    import time

    from tests.helpers import wait_until

    wait_until(lambda: time.time_ns() // 1_000_000 > stamp_ms, timeout,
               f"this host's clock to pass the broker's stamp {stamp_ms}", poll_s=0.0005)
