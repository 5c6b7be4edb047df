"""The processor's transaction after its coordinator aborted it, without a broker.

Found by the seeded nemesis (``bench/cluster.py --nemesis 29 --brokers 3``): kafka-2, the
processor's transaction coordinator, was paused for 42 s. The transaction's offsets timed
out after 30 s (its ``transaction.timeout.ms``), the coordinator aborted it on its own once
it ran again, and the processor's abort was refused with INVALID_TXN_STATE, a fatal error:
the processor exited 1. A transaction open past its timeout was already renewed when the
abort was refused as fenced; now also when it is refused as INVALID_TXN_STATE. Within the
timeout the same refusal stays fatal (the fence is then a newer instance's).
Here the producer is a double that fails as librdkafka did."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.core.errors import FatalError
from reef_stream.topics.kafka import KafkaError, KafkaException

TIMED_OUT = KafkaError(KafkaError._TIMED_OUT, "1 message(s) timed out on processor-state [0]")
INVALID_STATE = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction: Broker: "
                           "Producer attempted a transactional operation in an invalid state",
                           fatal=True)


class Producer:
    """Fails ``commit_transaction`` with ``TIMED_OUT`` and ``abort_transaction`` with
    ``abort``."""

    def __init__(self, abort: KafkaError) -> None:
        self.abort = abort

    def begin_transaction(self) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(TIMED_OUT)

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(self.abort)

    def poll(self, timeout: float) -> None:
        pass


def _runtime(producer: Producer, timeout_ms: int) -> SimpleNamespace:
    runtime = SimpleNamespace(
        _producer=producer, _parts={}, _commit_began=None, aborted=0, transactions=0,
        transaction_timeout_ms=timeout_ms, renewed=[], rewound=[],
        _backlog=SimpleNamespace(aborted=lambda: None, committed=lambda: None),
        _consumer=SimpleNamespace(consumer_group_metadata=lambda: None),
        _retry=ProcessorRuntime._retry)
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
