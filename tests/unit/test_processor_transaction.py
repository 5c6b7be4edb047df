"""The processor's transaction after its coordinator aborted it, without a broker.

Found by the seeded nemesis (``bench/cluster.py --nemesis 29 --brokers 3``): kafka-2, the
processor's transaction coordinator, was paused for 42 s. The transaction's offsets timed
out after 30 s (its ``transaction.timeout.ms``), the coordinator aborted it on its own once
it ran again, and the processor's abort was refused with INVALID_TXN_STATE, a fatal error:
the processor exited 1. A transaction open past its timeout was already renewed when the
abort was refused as fenced; now also when it is refused as INVALID_TXN_STATE. Within the
timeout the same refusal stays fatal (the fence is then a newer instance's).

Found by the nemesis with the object store and the supervisor (seed 26): after an isolation of
the processor's host, its transaction's offsets were refused with FENCED_INSTANCE_ID (another
member took its static membership). The processor aborted and rewound, and the rewind's seek on
the fenced consumer raised _STATE: it exited 1. Now the fence is the consumer's: the
transaction is aborted and ``ConsumerFenced`` raised, which the stage loop answers by
rejoining with a new consumer.
Here the producer is a double that fails as librdkafka did."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.consumers.stage import ConsumerFenced
from reef_stream.core.errors import FatalError
from reef_stream.topics.fencing import CommitWatchdog
from reef_stream.topics.kafka import KafkaError, KafkaException

TIMED_OUT = KafkaError(KafkaError._TIMED_OUT, "1 message(s) timed out on processor-state [0]")
INVALID_STATE = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction: Broker: "
                           "Producer attempted a transactional operation in an invalid state",
                           fatal=True)


FENCED_INSTANCE = KafkaError(
    KafkaError.FENCED_INSTANCE_ID, "Failed to commit offsets to transaction on broker "
    "10.213.28.1:9092/1: generations[1](Broker: Static consumer fenced by other consumer with "
    "same group.instance.id)")


class Producer:
    """Fails ``commit_transaction`` with ``TIMED_OUT`` and ``abort_transaction`` with
    ``abort`` (None: aborts); ``send_offsets_to_transaction`` with ``offsets`` (None: sends)."""

    def __init__(self, abort: KafkaError | None, offsets: KafkaError | None = None) -> None:
        self.abort, self.offsets, self.aborted = abort, offsets, 0

    def send_offsets_to_transaction(self, offsets, metadata, timeout: float) -> None:
        if self.offsets is not None:
            raise KafkaException(self.offsets)

    def begin_transaction(self) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(TIMED_OUT)

    def abort_transaction(self, timeout: float) -> None:
        self.aborted += 1
        if self.abort is not None:
            raise KafkaException(self.abort)

    def poll(self, timeout: float) -> None:
        pass


def _runtime(producer: Producer, timeout_ms: int) -> SimpleNamespace:
    runtime = SimpleNamespace(
        _producer=producer, _parts={}, _watchdog=CommitWatchdog("test"), aborted=0, transactions=0,
        transaction_timeout_ms=timeout_ms, renewed=[], rewound=[],
        _backlog=SimpleNamespace(aborted=lambda: None, committed=lambda: None),
        _consumer=SimpleNamespace(consumer_group_metadata=lambda: None),
        _retry=ProcessorRuntime._retry, _abort_for_fence=ProcessorRuntime._abort_for_fence)
    runtime._renew_producer = runtime.renewed.append
    runtime._rewind = lambda: runtime.rewound.append(True)
    return runtime


def test_a_transaction_its_coordinator_aborted_past_its_timeout_gets_a_new_producer():
    runtime = _runtime(Producer(abort=INVALID_STATE), timeout_ms=0)
    ProcessorRuntime._commit(runtime, [], [], {})
    assert len(runtime.renewed) == 1 and "could not be aborted" in str(runtime.renewed[0])
    assert runtime.rewound == [True] and runtime.aborted == 1 and runtime.transactions == 0


def test_the_same_refusal_within_the_timeout_is_fatal():
    runtime = _runtime(Producer(abort=INVALID_STATE), timeout_ms=3_600_000)
    with pytest.raises(FatalError, match="could not be aborted"):
        ProcessorRuntime._commit(runtime, [], [], {})
    assert runtime.renewed == [] and runtime.rewound == []


@pytest.mark.parametrize("abort", [None, INVALID_STATE], ids=["aborted", "abort-refused"])
def test_offsets_refused_by_the_consumers_fence_rejoin_instead_of_rewinding(abort):
    producer = Producer(abort=abort, offsets=FENCED_INSTANCE)
    runtime = _runtime(producer, timeout_ms=3_600_000)
    with pytest.raises(ConsumerFenced, match="fenced at its transaction's offsets"):
        ProcessorRuntime._commit(runtime, [], [], {("generations", 1): 2066})
    assert producer.aborted == 1 and runtime.aborted == 1 and runtime.transactions == 0
    assert runtime.rewound == [] and runtime.renewed == []
