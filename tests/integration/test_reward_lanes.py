"""A few hanging reward calls do not clog the reward worker (the lanes of
``reef_stream.consumers.reward.calls``), against the real broker, in this process.

300 generations whose reward takes 10 ms, 6 of which hang for 60 s, far past the 20-s timeout,
with 4 call slots: before the lanes, those hangs held every slot for 20 s per try. Now every
healthy generation is rewarded long before the first hang could time out (the fast lane's
adaptive deadline moved the hangs out of it), and each hanging one ends in a dead letter as
timed out, never in feedback; the worker reports the slow lane and the call latency.

A call merely slower than the observed p99 is *overtime*: a new thread takes its place in the
fast lane at once, the call still returns its reward, and its thread ends after it, so the
fast lane is back to ``concurrency`` threads.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.api.recipe import NamedReward, Reward
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
from reef_stream.core.events import DeadLetter, Generation
from reef_stream.core.metric_names import REWARD_CALL_P99, REWARD_SATURATION, STAGE_REWARD
from reef_stream.core.settings import load_settings
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics
from tests.helpers import consume_events, wait_until
from tests.integration.test_reward_workers import _produce
from tests.integration.undecodable import metric_values
from tests.recipes.rewards import quick

HANGING = {40, 41, 90, 150, 200, 260}
TIMEOUT_S = 20.0


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def test_a_few_hanging_calls_do_not_hold_the_healthy_ones(kafka_bootstrap, namespace, topics,
                                                          tmp_path):
    count = 300
    _produce(kafka_bootstrap, namespace, tmp_path, count)
    release = threading.Event()

    def judge(generation: Generation) -> Reward:
        if int(generation.generation_id.removeprefix("gen-")) in HANGING:
            release.wait(60)
        else:
            time.sleep(0.01)
        return Reward(reward=0.5)

    healthy_done: list[float] = []
    lock = threading.Lock()

    def on_outcome(kind: str, event) -> None:
        with lock:
            if kind == "rewarded":
                healthy_done.append(time.monotonic())

    worker = RewardWorker(dataclasses.replace(quick, reward=NamedReward("hangs", judge)),
                          bootstrap=kafka_bootstrap, settings=load_settings(),
                          namespace=namespace, spool_dir=tmp_path / "worker-spool",
                          on_outcome=on_outcome,
                          options=RewardOptions(group=f"{namespace}-lanes", concurrency=4,
                                                timeout=TIMEOUT_S, retries=0, grace=30,
                                                max_records=count))
    started = time.monotonic()
    try:
        summary = worker.run()
    finally:
        release.set()
    assert summary.rewarded == count - len(HANGING)
    assert summary.failed == len(HANGING) and summary.timed_out == len(HANGING)
    # Every healthy generation was scored well before any hang could reach its timeout.
    assert healthy_done[-1] - started < TIMEOUT_S / 2, healthy_done[-1] - started
    letters = consume_events(kafka_bootstrap, dead_letters(namespace), len(HANGING), DeadLetter)
    assert {int(re.search(r"gen-(\d+)", x.reason).group(1)) for x in letters} == HANGING
    assert {x.error_type for x in letters} == {"TimeoutError"}
    p99 = metric_values(kafka_bootstrap, namespace, STAGE_REWARD, REWARD_CALL_P99)
    assert p99 and 0.01 <= p99[-1] < 1.0
    assert metric_values(kafka_bootstrap, namespace, STAGE_REWARD, REWARD_SATURATION)


#: Which calls (counted in the order they start) take 1 s. The 100th and 101st start once the
#: p99 is known and run into overtime together, filling the slow lanes; the 250th starts about
#: 0.75 s later, while they still run, so it finds no slow lane free and keeps its fast slot.
#: Counted by start, not by generation id: the partitions are read interleaved, so ids 100, 101
#: and 250 could start within 0.15 s of each other, before the p99 was known, leaving no moment
#: with ``concurrency`` others running (a CI run failed so).
SLOWISH = {100, 101, 250}


def test_an_overtime_call_is_replaced_in_the_fast_lane_and_still_rewarded(
        kafka_bootstrap, namespace, topics, tmp_path):
    """With the demotion deadline far away (5 s), three calls of 1 s run past the p99 of the
    20-ms ones: while they run, ``concurrency`` other calls still run at once (before overtime,
    a slow call held its fast slot until its demotion: ``concurrency - 1`` at most), no more
    than ``concurrency + slow lanes`` calls ever run at once, the slow calls are rewarded (not
    timed out), and the replaced threads end."""
    count, concurrency, slow = 400, 4, 2
    _produce(kafka_bootstrap, namespace, tmp_path, count)
    lock = threading.Lock()
    running = {"slowish": 0, "other": 0}
    starts: list[tuple[int, int]] = []  # (slowish running, others running) as each call started

    def judge(generation: Generation) -> Reward:
        with lock:
            kind = "slowish" if len(starts) + 1 in SLOWISH else "other"
            running[kind] += 1
            starts.append((running["slowish"], running["other"]))
        try:
            time.sleep(1.0 if kind == "slowish" else 0.02)
        finally:
            with lock:
                running[kind] -= 1
        return Reward(reward=0.5)

    rewarded = threading.Semaphore(0)

    def on_outcome(kind: str, event) -> None:
        if kind == "rewarded":
            rewarded.release()

    worker = RewardWorker(dataclasses.replace(quick, reward=NamedReward("slowish", judge)),
                          bootstrap=kafka_bootstrap, settings=load_settings(),
                          namespace=namespace, spool_dir=tmp_path / "worker-spool",
                          on_outcome=on_outcome,
                          options=RewardOptions(group=f"{namespace}-overtime",
                                                concurrency=concurrency, slow_concurrency=slow,
                                                fast_lane_floor=5.0,
                                                timeout=TIMEOUT_S, retries=0, grace=30))
    summaries = []
    running_worker = threading.Thread(target=lambda: summaries.append(worker.run()))
    running_worker.start()
    try:
        for _ in range(count):
            assert rewarded.acquire(timeout=60)
        fast_threads = _fast_threads_settled(concurrency)
    finally:
        worker.stop()
        running_worker.join(60)
    summary, = summaries
    assert summary.rewarded == count and summary.timed_out == 0 and summary.failed == 0
    # While a slow call ran, the fast lane still ran `concurrency` others at once.
    assert any(slowish and other == concurrency for slowish, other in starts), \
        max((other for slowish, other in starts if slowish), default=None)
    assert max(slowish + other for slowish, other in starts) <= concurrency + slow
    assert fast_threads == concurrency  # the replaced threads ended


def _fast_threads_settled(expected: int, within: float = 10.0) -> int:
    """The fast lane's live threads, once they are ``expected`` (failing after ``within`` s)."""
    def alive() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "reef-reward-fast")

    def settled() -> list[int] | None:  # in a list: zero threads is an answer too
        count = alive()
        return [count] if count == expected else None

    return wait_until(settled, within, lambda: f"{expected} fast-lane threads; {alive()} alive",
                      poll_s=0.05)[0]


def test_a_hanging_call_makes_room_in_the_full_slow_lane_for_a_slow_healthy_one(
        kafka_bootstrap, namespace, topics, tmp_path):
    """One slow-lane slot, held by a hanging call (the first to start after 50 returned, so
    the p99 is known). The first call to start 2.5 s after it takes 1 s, so it passes the
    fast lane's deadline while the slow lane is full: the hanging call, which has run far
    past 10 x the p99 of the 20-ms calls, times out to make room (a dead letter that says so)
    instead of the healthy call, which is rewarded. (Chosen by time, not by index: the
    worker takes partitions in no fixed order.)"""
    count = 1000
    _produce(kafka_bootstrap, namespace, tmp_path, count)
    release = threading.Event()
    lock = threading.Lock()
    returned, hanging, slow = [0], [], []  # hanging: (generation id, when it started)

    def judge(generation: Generation) -> Reward:
        with lock:
            hangs = not hanging and returned[0] >= 50
            if hangs:
                hanging.append((generation.generation_id, time.monotonic()))
            slowly = hanging and not hangs and not slow \
                and time.monotonic() - hanging[0][1] > 2.5
            if slowly:
                slow.append(generation.generation_id)
        if hangs:
            release.wait(60)
        time.sleep(1.0 if slowly else 0.02)
        with lock:
            returned[0] += 1
        return Reward(reward=0.5)

    worker = RewardWorker(dataclasses.replace(quick, reward=NamedReward("evicts", judge)),
                          bootstrap=kafka_bootstrap, settings=load_settings(),
                          namespace=namespace, spool_dir=tmp_path / "worker-spool",
                          options=RewardOptions(group=f"{namespace}-evict", concurrency=4,
                                                slow_concurrency=1, timeout=TIMEOUT_S,
                                                retries=0, grace=30, max_records=count))
    try:
        summary = worker.run()
    finally:
        release.set()
    assert slow, "no call started 2.5 s after the hanging one"
    assert summary.rewarded == count - 1 and summary.failed == 1 and summary.timed_out == 1
    letter, = consume_events(kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
    assert hanging[0][0] in letter.reason and letter.error_type == "TimeoutError"
    assert "the longest-running call in the full slow lane" in letter.reason, letter.reason
