"""Reward workers against the real broker, run as real `reef reward` processes.

A reward that times out and one that raises end in dead letters naming the error and the number
of tries, with no feedback; a flaky reward succeeds on its retry with exactly one feedback per
generation; an undecodable record and a non-finite reward are dead-lettered; two workers in one
group split the work; SIGTERM lets running calls finish, then flushes and commits.

The workers run as `python -m reef_stream.cli reward` subprocesses (one in this process);
the reward functions are in tests/recipes/rewards.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from reef_stream.core.events import DeadLetter, Feedback
from reef_stream.core.metric_names import REWARD_RECORDS, STAGE_REWARD
from reef_stream.core.serde import decode
from reef_stream.core.settings import load_settings
from reef_stream.intake.producer import RecordProducer, record_key
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics, feedback, generations
from tests.faults.records import generation
from tests.helpers import consume_all, consume_events, wait_until
from tests.integration.undecodable import metric_values

_ROOT = Path(__file__).resolve().parents[2]
_SUMMARY = re.compile(r"reward worker (\S+): (.*) elapsed_s=")


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def _produce(kafka_bootstrap, namespace, tmp_path, count: int) -> dict[str, int]:
    """``count`` generations; returns the partition of each, by generation id."""
    with RecordProducer(kafka_bootstrap, settings=load_settings(), namespace=namespace,
                        spool_dir=tmp_path / "producer-spool") as producer:
        handles = {generation(i).generation_id: producer.send(generation(i)) for i in range(count)}
        assert producer.flush(30).complete
    return {gid: handle.partition for gid, handle in handles.items()}


def _start(kafka_bootstrap, namespace, tmp_path, recipe: str, *args: str, log: Path | None = None,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """A reward worker process; its stderr (the log) goes to ``log`` when given."""
    env = {"PATH": "/usr/bin:/bin", "REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home"), **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "reward",
         "--recipe", f"tests.recipes.rewards:{recipe}", *args],
        env=env, cwd=_ROOT, stdout=subprocess.PIPE, text=True,
        stderr=subprocess.PIPE if log is None else log.open("w"))


def _finish(process: subprocess.Popen, log: Path | None = None,
            timeout: float = 60) -> dict[str, int]:
    """Wait for a worker; return the counters of its summary line."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    if log is not None:
        err = log.read_text()
    assert process.returncode == 0, f"worker exited {process.returncode}\n{out}\n{err}"
    (match,) = [m for m in map(_SUMMARY.search, out.splitlines()) if m]
    return {name: int(value) for name, value in
            (pair.split("=") for pair in match.group(2).split())}


def _committed(kafka_bootstrap, group: str, topic: str) -> int:
    """The records ``group`` committed past on ``topic``, all partitions together."""
    consumer = Consumer(client_config(kafka_bootstrap, {"group.id": group}))
    try:
        partitions = consumer.committed([TopicPartition(topic, p) for p in range(6)], timeout=10)
        return sum(max(tp.offset, 0) for tp in partitions)
    finally:
        consumer.close()


def test_timeouts_and_exceptions_become_dead_letters_and_never_feedback(
        kafka_bootstrap, namespace, topics, tmp_path):
    partitions = _produce(kafka_bootstrap, namespace, tmp_path, 8)
    slow = _start(kafka_bootstrap, namespace, tmp_path, "slow", "--group", f"{namespace}-slow",
                  "--timeout", "0.3", "--retries", "1", "--backoff", "0.05",
                  "--max-records", "8")
    raising = _start(kafka_bootstrap, namespace, tmp_path, "raising",
                     "--group", f"{namespace}-raising", "--retries", "2", "--backoff", "0.05",
                     "--max-records", "8")
    slow_counts, raising_counts = _finish(slow), _finish(raising)

    assert slow_counts["failed"] == 8 and slow_counts["rewarded"] == 0
    assert slow_counts["timed_out"] == 16 and slow_counts["retried"] == 8
    assert raising_counts["failed"] == 8 and raising_counts["rewarded"] == 0
    # The same failure twice is not tried a third time, whatever --retries allows.
    assert raising_counts["retried"] == 8 and raising_counts["timed_out"] == 0

    letters = consume_events(kafka_bootstrap, dead_letters(namespace), 16, DeadLetter)
    assert len(letters) == 16
    by_source = {"slow_judge": [], "refusing_judge": []}
    for letter in letters:
        source = re.search(r"reward function '(\w+)'", letter.reason).group(1)
        by_source[source].append(letter)
        assert letter.stage == "reward"
        assert letter.source_topic == generations(namespace)
        assert letter.value is not None and letter.headers
        original = generation(int(re.search(r"gen-(\d+)", letter.reason).group(1)))
        assert letter.key == record_key(original)
        assert letter.source_partition == partitions[original.generation_id]
        assert letter.source_offset is not None
    for letter in by_source["slow_judge"]:
        assert "failed on every one of 2 tries (all timed out)" in letter.reason
        assert letter.error_type == "TimeoutError"
    for letter in by_source["refusing_judge"]:
        assert "failed on every one of 2 tries (all raised)" in letter.reason
        assert "it failed the same way as the try before" in letter.reason
        assert "RuntimeError: the judge refused gen-" in letter.reason
        assert letter.error_type == "RuntimeError"
    assert {len(v) for v in by_source.values()} == {8}
    # A failed reward is never recorded as a reward of 0: no feedback at all.
    assert consume_all(kafka_bootstrap, feedback(namespace), 0, idle_rounds=2) == []
    # Their outcomes are durable, so every offset is committed.
    assert _committed(kafka_bootstrap, f"{namespace}-raising", generations(namespace)) == 8


def test_a_flaky_reward_succeeds_on_retry_and_undecodable_records_are_dead_lettered(
        kafka_bootstrap, namespace, topics, tmp_path):
    partitions = _produce(kafka_bootstrap, namespace, tmp_path, 20)
    garbage = Producer(client_config(kafka_bootstrap))
    garbage.produce(generations(namespace), value=b"not avro", key=b"junk", partition=0)
    assert garbage.flush(10) == 0
    group = f"{namespace}-flaky"
    # Every generation fails its first try: the circuit would read that as an outage and hold
    # them (tests/integration/test_reward_circuit.py); here the retries are under test.
    worker = _start(kafka_bootstrap, namespace, tmp_path, "flaky", "--group", group,
                    "--retries", "1", "--backoff", "0.05", "--concurrency", "4",
                    "--max-records", "21", "--no-circuit")
    counts = _finish(worker)

    assert counts["rewarded"] == 20 and counts["retried"] == 20 and counts["failed"] == 0
    assert counts["undecodable"] == 1
    messages = consume_all(kafka_bootstrap, feedback(namespace), 20)
    feedbacks = [decode(m.value(), m.headers(), Feedback) for m in messages]
    assert Counter(f.generation_id for f in feedbacks) == Counter(partitions.keys())
    for item in feedbacks:
        assert item.source == "flaky_sandbox" and item.reward == 1.0
        assert item.feedback_id == f"{item.generation_id}:flaky_sandbox"
    # Co-partitioned with its generation.
    assert {f.generation_id: m.partition() for m, f in zip(messages, feedbacks)} == partitions
    (letter,) = consume_events(kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
    assert letter.reason.startswith("undecodable generation: ")
    assert (letter.source_partition, letter.source_offset, letter.value, letter.key) == \
        (0, letter.source_offset, b"not avro", b"junk")
    assert letter.error_type == "UnknownSchemaError"
    assert _committed(kafka_bootstrap, group, generations(namespace)) == 21


def test_a_non_finite_reward_is_an_invalid_result_not_feedback(
        kafka_bootstrap, namespace, topics, tmp_path):
    from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
    from tests.recipes.rewards import not_finite

    _produce(kafka_bootstrap, namespace, tmp_path, 4)
    worker = RewardWorker(not_finite, bootstrap=kafka_bootstrap, settings=load_settings(),
                          namespace=namespace, spool_dir=tmp_path / "worker-spool",
                          options=RewardOptions(group=f"{namespace}-nan", max_records=4))
    summary = worker.run()  # in this process, on this thread

    assert (summary.invalid, summary.rewarded, summary.retried) == (4, 0, 0)
    letters = consume_events(kafka_bootstrap, dead_letters(namespace), 4, DeadLetter)
    assert len(letters) == 4
    assert all("returned an invalid result" in letter.reason and "reward is nan" in letter.reason
               and "after 1 try" in letter.reason for letter in letters)
    assert consume_all(kafka_bootstrap, feedback(namespace), 0, idle_rounds=2) == []
    assert _committed(kafka_bootstrap, f"{namespace}-nan", generations(namespace)) == 4


def test_two_workers_in_one_group_split_the_work(kafka_bootstrap, namespace, topics, tmp_path):
    partitions = _produce(kafka_bootstrap, namespace, tmp_path, 120)
    gate = tmp_path / "gate"
    args = ("--group", f"{namespace}-paced", "--concurrency", "4", "--idle-exit", "3")
    logs = [tmp_path / f"worker-{n}.log" for n in range(2)]
    workers = [_start(kafka_bootstrap, namespace, tmp_path, "paced", *args, log=log,
                      extra_env={"REWARD_TEST_GATE": str(gate)}) for log in logs]
    # Rewards wait at the gate until both workers hold their share of the six partitions.
    wait_until(lambda: _assignments(logs) is not None or _exited(workers, logs), 45,
               "both workers to hold their share of the six partitions")
    assert not _exited(workers, logs), _exited(workers, logs)
    gate.touch()
    counts = [_finish(worker, log) for worker, log in zip(workers, logs)]

    assert all(c["rewarded"] > 0 for c in counts), counts
    assert sum(c["rewarded"] for c in counts) >= 120
    assert all(c["failed"] == c["invalid"] == 0 for c in counts)
    feedbacks = consume_events(kafka_bootstrap, feedback(namespace), 120, Feedback)
    # Every generation rewarded; a duplicate only where a partition moved between the workers.
    assert set(f.generation_id for f in feedbacks) == set(partitions)
    assert len(feedbacks) == sum(c["rewarded"] for c in counts)
    assert _committed(kafka_bootstrap, f"{namespace}-paced", generations(namespace)) == 120


def test_sigterm_finishes_running_calls_drops_waiting_ones_and_commits(
        kafka_bootstrap, namespace, topics, tmp_path):
    _produce(kafka_bootstrap, namespace, tmp_path, 40)
    gate, log, group = tmp_path / "gate", tmp_path / "worker.log", f"{namespace}-term"
    worker = _start(kafka_bootstrap, namespace, tmp_path, "paced", "--group", group,
                    "--concurrency", "4", log=log, extra_env={"REWARD_TEST_GATE": str(gate)})
    wait_until(lambda: _assignments([log]) is not None or _exited([worker], [log]), 45,
               "the worker to hold the six partitions")
    assert not _exited([worker], [log]), _exited([worker], [log])
    # Four calls run, waiting at the gate; more generations were taken and wait for a slot.
    arrived = gate.with_name(f"{gate.name}.arrived")
    wait_until(lambda: arrived.is_dir() and len(list(arrived.iterdir())) >= 4, 30,
               "four calls waiting at the gate")
    assert len(list(arrived.iterdir())) == 4, "more calls running than --concurrency"
    wait_until(lambda: max(metric_values(kafka_bootstrap, namespace, STAGE_REWARD,
                                         REWARD_RECORDS), default=0) > 4, 30,
               "generations taken beyond the four running calls")
    worker.send_signal(signal.SIGTERM)
    # The worker shows nothing when its handler has run (it polls every 0.1 s at most): this
    # gives it that long, many times over, before the running calls may finish.
    time.sleep(0.5)
    gate.touch()  # within the grace period: the running calls finish
    counts = _finish(worker, log)

    # The four running calls finished and were stored; the generations taken but waiting for
    # a call slot were dropped at the stop, uncommitted, for the group to read again.
    assert counts["rewarded"] == 4
    assert counts["dropped"] == counts["records"] - 4 > 0
    assert len(consume_all(kafka_bootstrap, feedback(namespace), counts["rewarded"])) \
        == counts["rewarded"]
    assert _committed(kafka_bootstrap, group, generations(namespace)) == counts["rewarded"]


def _exited(workers, logs) -> list[str]:
    """The logs of the workers that exited already (none should, before the test stops them)."""
    return [f"exited {w.returncode}: {log.read_text()}" for w, log in zip(workers, logs)
            if w.poll() is not None]


def _assignments(logs) -> list[set[int]] | None:
    """The partitions each worker holds, from its log, once they split all six; else None."""
    held = []
    for log in logs:
        current: set[int] = set()
        for line in log.read_text().splitlines():
            match = re.search(r"(assigned|revoked) \[([\d, ]*)\]", line)
            if match:
                numbers = {int(n) for n in match.group(2).split(",") if n.strip()}
                current = current | numbers if match.group(1) == "assigned" else current - numbers
        held.append(current)
    if all(held) and set().union(*held) == set(range(6)) and sum(map(len, held)) == 6:
        return held
    return None
