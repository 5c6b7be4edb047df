"""The producer SDK against the real broker: acknowledgement, handles, batches, the asyncio face."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import numpy as np
import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Feedback, Generation, Metric
from reef_stream.core.metric_names import (
    INTAKE_ACKNOWLEDGED, INTAKE_FAILED, INTAKE_REJECTED, INTAKE_SENT, INTAKE_SPOOLED, STAGE_INTAKE,
)
from reef_stream.core.serde import decode
from reef_stream.core.settings import load_settings
from reef_stream.intake.aio import AsyncRecordProducer
from reef_stream.intake.producer import (
    DeliveryError, DeliveryState, InvalidRecordInBatch, RecordProducer, record_key,
)
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, feedback, generations, metrics
from tests.faults.records import generation
from tests.helpers import consume_all, consume_events


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def _producer(kafka_bootstrap, namespace, tmp_path, **kwargs) -> RecordProducer:
    return RecordProducer(kafka_bootstrap, settings=load_settings(), namespace=namespace,
                          spool_dir=tmp_path / "spool", **kwargs)


def test_sent_records_are_acknowledged_with_their_position(kafka_bootstrap, namespace, topics, tmp_path):
    with _producer(kafka_bootstrap, namespace, tmp_path) as producer:
        handles = [producer.send(generation(i)) for i in range(200)]
        reward = Feedback(feedback_id="f1", generation_id="gen-0000007", source="exact_match",
                          reward=1.0, created_at=1_795_000_000_000)
        feedback_handle = producer.send(reward)
        report = producer.flush(30)

    assert report.complete and report.acknowledged == 201 and report.failed == 0
    assert all(h.wait(0) and h.durable and h.offset is not None for h in handles)
    messages = consume_all(kafka_bootstrap, generations(namespace), 200)
    by_id = {decode(m.value(), m.headers(), Generation).generation_id: m for m in messages}
    assert len(by_id) == 200
    for handle, i in zip(handles, range(200)):
        message = by_id[generation(i).generation_id]
        assert (message.partition(), message.offset()) == (handle.partition, handle.offset)
        assert message.key() == record_key(generation(i))

    (sent,) = consume_all(kafka_bootstrap, feedback(namespace), 1)
    assert decode(sent.value(), sent.headers(), Feedback).reward == 1.0
    # Co-partitioned: the feedback sits in the same partition as its generation.
    assert sent.partition() == by_id["gen-0000007"].partition() == feedback_handle.partition


def test_invalid_records_raise_and_nothing_is_sent(kafka_bootstrap, namespace, topics, tmp_path):
    import dataclasses

    with _producer(kafka_bootstrap, namespace, tmp_path) as producer:
        bad = dataclasses.replace(generation(1), policy_version=-3)
        with pytest.raises(InvalidRecord, match="policy_version"):
            producer.send(bad)
        assert producer.flush(5).acknowledged == 0


def test_intake_metrics_count_what_was_sent_acknowledged_and_refused(kafka_bootstrap, namespace,
                                                                     topics, tmp_path):
    import dataclasses

    with _producer(kafka_bootstrap, namespace, tmp_path, metrics_every_s=0.2,
                   client="test") as producer:
        for i in range(30):
            producer.send(generation(i))
        producer.send(Feedback(feedback_id="f1", generation_id="gen-0000001", source="judge",
                               reward=1.0, created_at=1_795_000_000_000))
        for bad in (dataclasses.replace(generation(1), policy_version=-3),
                    dataclasses.replace(generation(2), model="")):
            with pytest.raises(InvalidRecord):
                producer.send(bad)
        tokens = 1_500_000  # 12 MB of tokens and logprobs: over the topic's 8 MB
        huge = dataclasses.replace(generation(3), completion_token_ids=np.zeros(tokens, np.int32),
                                   completion_logprobs=np.zeros(tokens, np.float32))
        with pytest.raises(InvalidRecord, match="max.message.bytes"):
            producer.send(huge)
        assert producer.flush(30).acknowledged == 31
    # close() wrote the last values: the newest of each name and label.
    latest = {}
    for event in consume_events(kafka_bootstrap, metrics(namespace), 1, Metric):
        assert event.stage == STAGE_INTAKE and event.labels["client"] == "test"
        latest[(event.name, *sorted((k, v) for k, v in event.labels.items()
                                    if k not in ("instance", "client")))] = event.value
    assert latest == {
        (INTAKE_SENT, ("topic", generations(namespace))): 30,
        (INTAKE_SENT, ("topic", feedback(namespace))): 1,
        (INTAKE_ACKNOWLEDGED,): 31,
        (INTAKE_FAILED,): 0,
        (INTAKE_REJECTED, ("reason", "invalid")): 2,
        (INTAKE_REJECTED, ("reason", "too_large")): 1,
        (INTAKE_SPOOLED,): 0,
    }


def test_a_record_for_a_missing_topic_fails_with_a_clear_error(kafka_bootstrap, namespace, tmp_path):
    # No topics were created in this namespace.
    producer = _producer(kafka_bootstrap, namespace, tmp_path,
                         config={"topic.metadata.propagation.max.ms": 1000})
    handle = producer.send(generation(1))
    with pytest.raises(DeliveryError, match="does not exist: run `reef topics create`"):
        handle.wait(30)
    assert handle.state is DeliveryState.FAILED
    report = producer.close(5)
    assert report.failed == 1 and report.complete


def test_callbacks_run_once_done(kafka_bootstrap, namespace, topics, tmp_path):
    seen = []
    with _producer(kafka_bootstrap, namespace, tmp_path) as producer:
        handle = producer.send(generation(3))
        handle.add_done_callback(lambda h: seen.append(h.state))
        producer.flush(30)
        handle.add_done_callback(lambda h: seen.append("late"))
    assert seen == [DeliveryState.ACKNOWLEDGED, "late"]


def test_the_asyncio_producer(kafka_bootstrap, namespace, topics, tmp_path):
    async def run():
        async with AsyncRecordProducer(bootstrap=kafka_bootstrap, settings=load_settings(),
                                       namespace=namespace, spool_dir=tmp_path / "spool") as producer:
            handles = [await producer.send(generation(i)) for i in range(50)]
            assert all([await producer.acknowledged(h, timeout=30) for h in handles])
            assert await producer.durable(handles[0], timeout=0)
            with pytest.raises(InvalidRecord):
                await producer.send("not a record")
            return (await producer.flush(10)).acknowledged

    assert asyncio.run(run()) == 50
    assert len(consume_all(kafka_bootstrap, generations(namespace), 50)) == 50


def _ids(messages) -> Counter:
    return Counter(decode(m.value(), m.headers(), Generation).generation_id for m in messages)


def test_send_many_delivers_every_record_once_in_order_with_its_handle(kafka_bootstrap, namespace,
                                                                        topics, tmp_path):
    batches = [[generation(i) for i in range(start, start + 250)] for start in range(0, 1000, 250)]
    reward = Feedback(feedback_id="f1", generation_id="gen-0000007", source="exact_match",
                      reward=1.0, created_at=1_795_000_000_000)
    with _producer(kafka_bootstrap, namespace, tmp_path) as producer:
        handles = [h for batch in batches for h in producer.send_many(batch)]
        (feedback_handle,) = producer.send_many([reward])
        assert producer.send_many([]) == []
        report = producer.flush(30)

    assert report.complete and report.acknowledged == 1001 and report.failed == 0
    assert [h.key for h in handles] == [record_key(generation(i)) for i in range(1000)]
    assert all(h.state is DeliveryState.ACKNOWLEDGED for h in handles + [feedback_handle])
    messages = consume_all(kafka_bootstrap, generations(namespace), 1000)
    assert _ids(messages) == Counter(generation(i).generation_id for i in range(1000))
    by_id = {decode(m.value(), m.headers(), Generation).generation_id: m for m in messages}
    for i, handle in enumerate(handles):
        message = by_id[generation(i).generation_id]
        assert (message.partition(), message.offset()) == (handle.partition, handle.offset)
    # Within a partition, the batch's order is the log's order.
    offsets = {}
    for i, handle in enumerate(handles):
        assert offsets.get(handle.partition, -1) < handle.offset
        offsets[handle.partition] = handle.offset
    assert feedback_handle.partition == by_id["gen-0000007"].partition()


@pytest.mark.parametrize("index, bad, field", [
    (0, {"policy_version": -3}, "policy_version"),
    (17, {"completion_logprobs": np.full(100, np.nan, np.float32)}, "completion_logprobs"),
    (49, {"completion_token_ids": np.zeros(1_500_000, np.int32),     # 12 MB: over the topic's 8 MB
          "completion_logprobs": np.zeros(1_500_000, np.float32)}, None),
])
def test_a_bad_record_in_a_batch_is_named_and_nothing_of_the_batch_is_sent(
        kafka_bootstrap, namespace, topics, tmp_path, index, bad, field):
    batch = [generation(i) for i in range(50)]
    batch[index] = dataclasses.replace(batch[index], **bad)
    with _producer(kafka_bootstrap, namespace, tmp_path) as producer:
        with pytest.raises(InvalidRecordInBatch, match=f"record {index} of the batch") as raised:
            producer.send_many(batch)
        assert raised.value.index == index and raised.value.field == field
        assert isinstance(raised.value, InvalidRecord)
        assert producer.report().pending == 0
        producer.send(generation(1_000)).wait(30)      # a marker: the topic holds only it
    assert _ids(consume_all(kafka_bootstrap, generations(namespace), 1)) == \
        Counter([generation(1_000).generation_id])


def test_send_many_spools_what_the_clients_queue_has_no_room_for(kafka_bootstrap, namespace,
                                                                 topics, tmp_path):
    # A client queue of 40 records: the rest of each batch goes to the spool, in order, and is
    # replayed from it; every record arrives once. The client lingers 2 s before it sends, so
    # no acknowledgement makes room in its queue while send_many hands the batch over (one did,
    # on a loaded machine, and fewer went to the spool).
    with _producer(kafka_bootstrap, namespace, tmp_path,
                   config={"queue.buffering.max.messages": 40, "linger.ms": 2000}) as producer:
        handles = producer.send_many([generation(i) for i in range(300)])
        states = [h.state for h in handles]
        handles += producer.send_many([generation(i) for i in range(300, 400)])
        spooled_after = sum(h.state is DeliveryState.SPOOLED for h in handles[300:])
        report = producer.flush(60)
    assert states == [DeliveryState.PENDING] * 40 + [DeliveryState.SPOOLED] * 260, \
        "the client's queue took what it had no room for, or the spool missed some"
    assert spooled_after == 100, "a batch went around the spool while records waited in it"
    assert report.complete and report.acknowledged == 400 and report.failed == 0, report
    assert all(h.state is DeliveryState.ACKNOWLEDGED for h in handles)
    ids = _ids(consume_all(kafka_bootstrap, generations(namespace), 400))
    assert ids == Counter(generation(i).generation_id for i in range(400))
