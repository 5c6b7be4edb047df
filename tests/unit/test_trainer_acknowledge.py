"""The trainer's acknowledgement never leaves a transaction open after a failure, and its
resume after a failed step, and its first resume at start, wait a broker fault out.

Found on emulated hosts (tests/faults/test_cluster.py): a trainer partitioned from the broker
inside ``send_offsets_to_transaction`` got a timeout, which librdkafka calls retriable, not
``txn_requires_abort``; the transaction stayed open and every later step failed at
``begin_transaction`` ("Operation not valid in state InTransaction") after the heal, for ever.
Here the producer is a double that fails the way librdkafka did; no broker.

Found by the seeded nemesis (``bench/cluster.py --nemesis 1``): after a step failed while
the group's coordinator was cut off, the resume's read of the committed offsets got
NOT_COORDINATOR and the trainer exited 1. Now the resume is tried again until the brokers
answer. Seed 29 then found an abort refused as INVALID_TXN_STATE taken for a fence."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from reef_stream.consumers.trainer import trainer as trainer_module
from reef_stream.consumers.trainer.trainer import Trainer, TrainerFenced
from reef_stream.core.errors import RetryableError
from reef_stream.engine.checkpoints import CheckpointError
from reef_stream.core.events import TopicOffset
from reef_stream.topics.fencing import CommitWatchdog
from reef_stream.topics.kafka import KafkaError, KafkaException


class Producer:
    """A transactional producer's state machine, as far as the acknowledgement uses it:
    ``fail`` maps a call's name to the error it raises (once)."""

    def __init__(self, **fail: KafkaError) -> None:
        self.fail, self.open, self.committed = dict(fail), False, 0

    def _call(self, name: str) -> None:
        error = self.fail.pop(name, None)
        if error is not None:
            raise KafkaException(error)

    def begin_transaction(self) -> None:
        if self.open:
            raise KafkaException(KafkaError(KafkaError._STATE,
                                            "Operation not valid in state InTransaction"))
        self._call("begin")
        self.open = True

    def send_offsets_to_transaction(self, offsets, metadata, timeout) -> None:
        self._call("send_offsets")

    def commit_transaction(self, timeout) -> None:
        self._call("commit")
        self.open, self.committed = False, self.committed + 1

    def abort_transaction(self, timeout) -> None:
        self._call("abort")
        self.open = False


def _trainer(producer: Producer) -> SimpleNamespace:
    stored = SimpleNamespace(uri="/store/step-1.x")
    trainer = SimpleNamespace(
        store=SimpleNamespace(write=lambda contents: stored), fence_producer=producer,
        consumer=SimpleNamespace(consumer_group_metadata=lambda: None), topic="units",
        group="g", recipe=SimpleNamespace(name="r"), _abort_pending=False,
        _watchdog=CommitWatchdog("trainer g"),
        _produce_checkpoint_event=lambda producer, stored, contents: None)
    trainer._abort = lambda producer, step: Trainer._abort(trainer, producer, step)
    trainer._fenced = lambda *args: Trainer._fenced(trainer, *args)
    return trainer


def _step(step: int) -> SimpleNamespace:
    return SimpleNamespace(step=step, offsets=(TopicOffset(topic="units", partition=0,
                                                           offset=4 * step),))


TIMED_OUT = KafkaError(KafkaError._TIMED_OUT, "Failed to add offsets to transaction",
                       retriable=True)


def test_a_timed_out_acknowledgement_aborts_its_transaction_and_the_next_step_commits():
    producer = Producer(send_offsets=TIMED_OUT)
    trainer = _trainer(producer)
    with pytest.raises(RetryableError, match="not acknowledged"):
        Trainer._acknowledge(trainer, _step(1))
    assert not producer.open and not trainer._abort_pending
    Trainer._acknowledge(trainer, _step(1))
    assert producer.committed == 1


def test_an_abort_that_fails_too_is_retried_before_the_next_step():
    producer = Producer(send_offsets=TIMED_OUT, abort=TIMED_OUT)
    trainer = _trainer(producer)
    with pytest.raises(RetryableError):
        Trainer._acknowledge(trainer, _step(1))
    assert producer.open and trainer._abort_pending      # still partitioned, say
    Trainer._acknowledge(trainer, _step(1))              # healed: abort, then the step
    assert producer.committed == 1 and not trainer._abort_pending


INVALID_STATE = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction: Broker: "
                           "Producer attempted a transactional operation in an invalid state",
                           fatal=True)


def test_an_abort_refused_by_the_coordinators_state_renews_the_producer_not_a_fence():
    # Found by the seeded nemesis (seed 29): kafka-2, the coordinator, paused 42 s; the commit
    # timed out, the abort was refused as INVALID_TXN_STATE (fatal, the epoch unchanged: no
    # newer trainer), and the trainer exited as if fenced. Now it drops the producer; the
    # resume makes a new one (``_fence``) and reads whether the step was committed.
    producer = Producer(commit=TIMED_OUT, abort=INVALID_STATE)
    trainer = _trainer(producer)
    with pytest.raises(RetryableError, match="not acknowledged"):
        Trainer._acknowledge(trainer, _step(1))
    assert trainer.fence_producer is None and not trainer._abort_pending


def test_a_fenced_abort_stops_the_trainer():
    fenced = KafkaError(KafkaError._FENCED, "fenced", fatal=True)
    producer = Producer(send_offsets=TIMED_OUT, abort=fenced)
    with pytest.raises(TrainerFenced):
        Trainer._acknowledge(_trainer(producer), _step(1))


class Resumes:
    """A trainer whose ``_resume`` raises each of ``errors`` in turn, then resumes."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), 0
        self._stop, self._stop_asked = threading.Event(), threading.Event()

    def _stopping(self) -> bool:
        return Trainer._stopping(self)

    def _resume(self) -> list[str]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return ["assignment"]


NOT_COORDINATOR = KafkaError(KafkaError.NOT_COORDINATOR,
                             "Failed to get committed offsets: Broker: Not coordinator")


def test_a_resume_that_the_brokers_cannot_answer_is_tried_again(monkeypatch):
    monkeypatch.setattr(trainer_module, "RETRY_BACKOFF_S", 0.0)
    trainer = Resumes(KafkaException(NOT_COORDINATOR), RetryableError("offsets: timed out"),
                      TimeoutError("checkpoints not read to their end"))
    assert Trainer._resume_after_failure(trainer) == ["assignment"]
    assert trainer.calls == 4


def test_a_fatal_error_or_a_stop_ends_the_retries(monkeypatch):
    monkeypatch.setattr(trainer_module, "RETRY_BACKOFF_S", 0.0)
    fatal = KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))
    with pytest.raises(KafkaException):
        Trainer._resume_after_failure(Resumes(fatal))
    stopping = Resumes(KafkaException(NOT_COORDINATOR))
    stopping._stop_asked.set()
    with pytest.raises(KafkaException):
        Trainer._resume_after_failure(stopping)


def test_the_first_resume_is_tried_at_once_and_waits_a_broker_fault_out(monkeypatch):
    slept = []
    monkeypatch.setattr(trainer_module.time, "sleep", slept.append)
    trainer = Resumes()
    assert Trainer._resume_after_failure(trainer, at_start=True) == ["assignment"]
    assert (trainer.calls, slept) == (1, [])           # no wait before the first try
    trainer = Resumes(KafkaException(NOT_COORDINATOR))
    assert Trainer._resume_after_failure(trainer, at_start=True) == ["assignment"]
    assert (trainer.calls, slept) == (2, [trainer_module.RETRY_BACKOFF_S])
    assert Trainer._resume_after_failure(Resumes()) == ["assignment"]   # after a failed step:
    assert len(slept) == 2                                               # a wait first


def test_a_single_trainers_stop_ends_the_waits_for_the_brokers_and_the_store(monkeypatch):
    """One rank's ``stop`` sets ``_stop``, not ``_stop_asked`` (that is the data-parallel
    ranks'): the waits must end on either, or a SIGTERM during an outage is ignored (seen: a
    demo's trainer, its broker gone, ran on for minutes after SIGTERM)."""
    monkeypatch.setattr(trainer_module, "RETRY_BACKOFF_S", 0.0)
    stopping = Resumes(KafkaException(NOT_COORDINATOR))
    stopping._stop.set()
    with pytest.raises(KafkaException):
        Trainer._resume_after_failure(stopping)
    assert stopping.calls == 1

    def unreachable(uri, sha256):
        raise CheckpointError(f"{uri} cannot be opened") from ConnectionError("refused")

    monkeypatch.setattr(trainer_module, "load", unreachable)
    with pytest.raises(CheckpointError, match="cannot be opened"):
        Trainer._load_newest(stopping, SimpleNamespace(uri="s3://c/step-1", sha256="0",
                                                       step=1))
