"""The evaluator's decision write tells a newer evaluator's fence from a fatal state of its
own producer. Only the fence (``FENCED_CODES``) is ``EvaluatorFenced``; a fatal
INVALID_TXN_STATE (a commit's answer lost while the coordinator's host was paused, as the
seeded nemesis found for the trainer) says what it is and drops the producer, so the next
fence takes the transactional id again. The producer is a double that fails as librdkafka
does; no broker (the fencing itself is tests/faults/test_evaluator_fencing.py's, on Kafka)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reef_stream.consumers.evaluator.evaluator import EvaluatorFenced, EvaluatorWorker
from reef_stream.core.errors import FatalError
from reef_stream.topics.fencing import CommitWatchdog
from reef_stream.topics.kafka import KafkaError, KafkaException


class Producer:
    def __init__(self, error: KafkaError) -> None:
        self.error, self.aborted = error, 0

    def begin_transaction(self) -> None:
        pass

    def commit_transaction(self, timeout) -> None:
        raise KafkaException(self.error)

    def abort_transaction(self, timeout) -> None:
        self.aborted += 1


def _worker(error: KafkaError) -> SimpleNamespace:
    """What ``EvaluatorWorker._write`` reads of its worker, holding a producer failing so."""
    return SimpleNamespace(_fence_producer=Producer(error), group="eval-a",
                           _watchdog=CommitWatchdog("evaluator eval-a"),
                           recipe=SimpleNamespace(name="sao"))


def _write(worker: SimpleNamespace) -> None:
    EvaluatorWorker._write(worker, None, {}, None, "the decision on version 3")


@pytest.mark.parametrize("code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                  KafkaError.INVALID_PRODUCER_EPOCH])
def test_a_newer_evaluators_fence_stops_this_one(code):
    with pytest.raises(EvaluatorFenced, match="a newer evaluator of recipe sao took over"):
        _write(_worker(KafkaError(code, "fenced", fatal=True)))


def test_a_fatal_state_of_its_own_is_not_called_a_fence_and_drops_the_producer():
    worker = _worker(KafkaError(KafkaError.INVALID_TXN_STATE, "lost commit", fatal=True))
    with pytest.raises(FatalError) as raised:
        _write(worker)
    assert not isinstance(raised.value, EvaluatorFenced)
    assert "fatal state" in str(raised.value) and "no newer evaluator fenced it" in str(
        raised.value)
    assert worker._fence_producer is None


def test_an_abortable_failure_is_aborted_and_keeps_the_producer():
    worker = _worker(KafkaError(KafkaError._TIMED_OUT, "timed out", txn_requires_abort=True))
    producer = worker._fence_producer
    with pytest.raises(FatalError, match="was not committed") as raised:
        _write(worker)
    assert not isinstance(raised.value, EvaluatorFenced)
    assert producer.aborted == 1 and worker._fence_producer is producer
