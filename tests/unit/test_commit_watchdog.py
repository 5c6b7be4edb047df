"""Every transactional writer is watched for a transaction stuck inside librdkafka.

librdkafka's ``send_offsets_to_transaction`` can wait forever for a group coordinator that
died (confluentinc/librdkafka#5456, #5511). The processor had a watchdog for it; the trainer
and the evaluator, which commit offsets in their transactions too since they are fenced, had
none. A CI run of ``tests/faults/test_broker_faults.py`` saw the evaluator stay silent from
the controller's SIGKILL to the run's end while the trainer trained 17 versions past the last
promoted one, the loop stalled. Each writer now begins its ``CommitWatchdog`` before a
transaction and ends it after; the CLI's stages exit with ``EXIT_RESTART`` when it reports.

The producer here is a double that blocks as librdkafka did until the watchdog reports; the
exit itself is a real process's."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from reef_stream.consumers.evaluator.evaluator import EvaluatorWorker
from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.consumers.trainer.trainer import Trainer
from reef_stream.topics.fencing import EXIT_RESTART, CommitWatchdog

STUCK_S = 0.3


class StuckProducer:
    """``send_offsets_to_transaction`` blocks until ``released`` (at most 30 s); the rest
    succeeds. ``stuck`` is set while it blocks."""

    def __init__(self) -> None:
        self.stuck, self.released = threading.Event(), threading.Event()
        self.committed = 0

    def begin_transaction(self) -> None:
        pass

    def send_offsets_to_transaction(self, offsets, metadata, timeout: float) -> None:
        self.stuck.set()
        assert self.released.wait(30), "the watchdog never reported the stuck transaction"

    def commit_transaction(self, timeout: float) -> None:
        self.committed += 1

    def poll(self, timeout: float) -> None:
        pass


def _consumer() -> SimpleNamespace:
    return SimpleNamespace(consumer_group_metadata=lambda: None)


def _processor(producer, watchdog) -> None:
    runtime = SimpleNamespace(
        _producer=producer, _parts={}, _watchdog=watchdog, aborted=0, transactions=0,
        counts=Counter(), stats=SimpleNamespace(observe=lambda steps: None), _consumer=_consumer(),
        _retry=ProcessorRuntime._retry,
        _backlog=SimpleNamespace(aborted=lambda: None, committed=lambda: None))
    ProcessorRuntime._commit(runtime, [], [], {("generations", 0): 7})


def _trainer(producer, watchdog) -> None:
    contents = SimpleNamespace(step=3, offsets=[SimpleNamespace(partition=0, offset=7)])
    trainer = SimpleNamespace(
        store=SimpleNamespace(write=lambda contents: "stored"), fence_producer=producer,
        _abort_pending=False, _produce_checkpoint_event=lambda *args: None, topic="units",
        consumer=_consumer(), _watchdog=watchdog)
    assert Trainer._acknowledge(trainer, contents) == "stored"


def _evaluator(producer, watchdog) -> None:
    worker = SimpleNamespace(_fence_producer=producer, _watchdog=watchdog)
    EvaluatorWorker._write(worker, None, {("checkpoints", 0): 7}, _consumer(), "the offsets")


@pytest.mark.parametrize("write", [_processor, _trainer, _evaluator],
                         ids=["processor", "trainer", "evaluator"])
def test_a_writer_stuck_in_its_transaction_is_reported_and_its_writes_watched(
        write):
    producer, reports = StuckProducer(), []

    def on_stuck(why: str) -> None:
        reports.append(why)
        producer.released.set()

    watchdog = CommitWatchdog("writer", on_stuck, stuck_after_s=STUCK_S)
    stopped = threading.Event()
    watching = threading.Thread(target=watchdog.watch, args=(stopped, 0.02))
    watching.start()
    try:
        write(producer, watchdog)
    finally:
        stopped.set()
        watching.join()
    assert len(reports) == 1 and "librdkafka#5456" in reports[0], reports
    assert producer.committed == 1
    assert watchdog.began is None   # the transaction ended: nothing left to report


def test_a_transaction_that_commits_in_time_is_never_reported():
    watchdog = CommitWatchdog("writer", print, stuck_after_s=STUCK_S)
    stopped, reports = threading.Event(), []
    watchdog.on_stuck = reports.append
    watching = threading.Thread(target=watchdog.watch, args=(stopped, 0.02))
    watching.start()
    try:
        for _ in range(5):   # five quick transactions, more than STUCK_S in all
            watchdog.begin()
            stopped.wait(STUCK_S / 3)
            watchdog.end()
    finally:
        stopped.set()
        watching.join()
    assert reports == []


def test_exit_for_restart_ends_the_process_with_the_status_a_supervisor_restarts():
    code = ("import threading, time\n"
            "from reef_stream.topics.fencing import exit_for_restart\n"
            "threading.Thread(target=exit_for_restart('evaluator'), args=('stuck',)).start()\n"
            "time.sleep(30)\n")   # the main thread blocked, as in librdkafka
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == EXIT_RESTART == 75, done
    assert "restart this evaluator" in done.stderr, done.stderr
