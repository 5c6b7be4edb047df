"""``ask_broker`` retries what a broker fault makes transient and reports the rest at once."""
import pytest
from confluent_kafka import KafkaError, KafkaException

from reef_stream.core.errors import RetryableError
from reef_stream.topics.connect import ask_broker


def failing(codes: list[int], answer: str = "offsets"):
    """A call that raises a KafkaException for each code in turn, then answers."""
    left = list(codes)

    def call() -> str:
        if left:
            raise KafkaException(KafkaError(left.pop(0)))
        return answer
    return call


@pytest.mark.parametrize("code", [
    KafkaError._UNKNOWN_PARTITION,    # the partition's leader was killed (broker fault test)
    KafkaError._TRANSPORT, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError._DESTROY_BROKER])
def test_a_transient_error_is_asked_again_until_the_broker_answers(code):
    assert ask_broker("reading the offsets of t[0]", failing([code, code])) == "offsets"


def test_a_permanent_error_is_reported_at_once_naming_what_failed():
    with pytest.raises(RetryableError, match=r"reading the offsets of t\[0\] failed"):
        ask_broker("reading the offsets of t[0]",
                   failing([KafkaError.TOPIC_AUTHORIZATION_FAILED]), timeout=30)


def test_a_transient_error_that_lasts_past_the_timeout_is_reported():
    with pytest.raises(RetryableError, match="check that the cluster is reachable"):
        ask_broker("reading the offsets of t[0]",
                   failing([KafkaError._UNKNOWN_PARTITION] * 100), timeout=0.3)


class _Unassigned:
    """What a consumer assigned nothing does after a partition's leader was killed: it no
    longer knows the partition until something refreshes the topic's metadata."""

    def __init__(self) -> None:
        self.knows, self.refreshed = False, 0

    def get_watermark_offsets(self, tp, timeout):
        if not self.knows:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
        return (3, 17)

    def list_topics(self, topic, timeout):
        self.refreshed += 1
        self.knows = True


def test_watermarks_refresh_the_metadata_of_a_partition_the_consumer_lost():
    from reef_stream.topics.connect import watermarks

    consumer = _Unassigned()
    assert watermarks(consumer, "t", 0, timeout=5) == (3, 17)
    assert consumer.refreshed == 1
