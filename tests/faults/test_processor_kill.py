"""The processor process SIGKILLed at random moments while input flows, restarted each time.

Uses the session broker (only the processor is killed, never the broker).
The same invariant as tests/integration/test_processor_runtime.py must hold
in the committed log, and in the uncommitted log too (aborted transactions
included) every unit id has one member set and every generation one unit id:
a unit re-emitted after a crash carries its original id.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from tests.helpers import wait_until
from tests.integration.test_processor_runtime import (
    check_invariant,
    create_topics,
    make_workload,
    produce,
    read_back,
)

ROOT = Path(__file__).resolve().parents[2]
KILLS = 10


def _spawn(env: dict[str, str]) -> tuple[subprocess.Popen, queue.Queue, list[str]]:
    child = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli.process",
         "--recipe", "tests.integration.test_processor_runtime:RECIPE", "--group", "kill-test",
         "--batch", "100"],  # many small transactions: kills land inside some
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    tail: list[str] = []

    def pump() -> None:
        for line in child.stderr:
            tail.append(line)
            del tail[:-50]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return child, lines, tail


def _wait_assigned(child: subprocess.Popen, lines: queue.Queue, tail: list[str],
                   timeout: float = 60) -> None:
    def assigned() -> bool:
        try:
            return "assigned partitions" in lines.get(timeout=0.2)
        except queue.Empty:
            assert child.poll() is None, "processor exited:\n" + "".join(tail)
            return False

    wait_until(assigned, timeout, lambda: "the processor's partitions:\n" + "".join(tail),
               poll_s=0)


def test_processor_killed_at_random_moments_loses_and_duplicates_nothing(
        kafka_bootstrap, namespace, tmp_path):
    rng = random.Random(1234)
    work = make_workload(windows=60, groups_per_window=20, seed=11)  # up to 4,800 complete
    create_topics(kafka_bootstrap, namespace)
    env = {**os.environ, "REEF_BOOTSTRAP_SERVERS": kafka_bootstrap, "REEF_NAMESPACE": namespace,
           "REEF_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}

    # Input flows until the kills are done (at least 15 windows): windows produced, paced.
    kills_done = threading.Event()
    sent: list[list] = []

    def flow() -> None:
        for window in work.windows:
            produce(kafka_bootstrap, namespace, [window])
            sent.append(window)
            if kills_done.is_set() and len(sent) >= 15:
                return
            time.sleep(0.3)

    producer = threading.Thread(target=flow, daemon=True)
    started = time.monotonic()
    producer.start()
    kills = 0
    child = None
    try:
        while kills < KILLS:
            child, lines, tail = _spawn(env)
            _wait_assigned(child, lines, tail)
            time.sleep(rng.uniform(0.05, 1.5))
            assert child.poll() is None, "processor exited:\n" + "".join(tail)
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            kills += 1
        kills_done.set()
        producer.join(120)
        assert not producer.is_alive()
        work.windows = sent  # what was actually sent
        sent_ids = {r.generation_id for w in sent for r in w if type(r).__name__ == "Generation"}
        work.complete &= sent_ids
        work.other &= sent_ids
        work.orphan_feedback &= {r.feedback_id for w in sent for r in w
                                 if type(r).__name__ == "Feedback"}
        child, lines, tail = _spawn(env)  # the last one runs to the end
        back = read_back(kafka_bootstrap, namespace, work, deadline_s=90,
                         alive=lambda: child.poll() is None)
        assert child.poll() is None, "processor exited:\n" + "".join(tail)
        uncommitted = read_back(kafka_bootstrap, namespace, work, isolation="read_uncommitted",
                                deadline_s=5)
    finally:
        kills_done.set()
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    elapsed = time.monotonic() - started
    check_invariant(back, work)
    # Aborted transactions included: one member set per unit id, one unit id per generation.
    ids_of: dict[str, set[str]] = defaultdict(set)
    for uid, members in uncommitted.units.items():
        for gid in members:
            ids_of[gid].add(uid)
    assert all(len(ids) == 1 for ids in ids_of.values()), "a generation under two unit ids"
    assert set(uncommitted.units) == set(back.units), "committed and re-emitted ids differ"
    print(f"\n{kills} SIGKILLs while {len(sent)} windows flowed; {len(work.generations)} "
          f"generations -> {len(back.units)} units ({back.unit_records} committed records, "
          f"{uncommitted.unit_records} incl. aborted, "
          f"{uncommitted.unit_records - back.unit_records} re-emitted), dead letters {dict(back.kinds)}; "
          f"{elapsed:.1f} s")
