"""The reward worker's call slots against the real broker, in this process.

Generations are queued in batches and taken by ``concurrency`` call slots (threads for a sync
function, tasks on the asyncio loop for a coroutine function; reef_stream.consumers.reward.worker):

- with mixed outcomes over a few fetches, every generation gets exactly one outcome (feedback
  or dead letter), none gets both, and every offset is committed;
- a sync call past its timeout is abandoned by the watchdog and dead-lettered as timed out, never
  scored, while a new thread takes its slot: with one slot, the generations after it are
  still rewarded;
- an object whose ``__call__`` is a coroutine runs on the loop, with its timeout and failures;
  a sync callable that returns an awaitable is still scored;
- a backlog as small as the concurrency still gives one outcome per generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections import Counter

import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.api.recipe import NamedReward, Reward
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
from reef_stream.core.events import DeadLetter, Feedback, Generation
from reef_stream.core.settings import load_settings
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics, feedback, generations
from tests.helpers import consume_events
from tests.integration.test_reward_workers import _committed, _produce
from tests.recipes.rewards import quick


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def _number(generation: Generation | str) -> int:
    """i of ``tests.faults.records.generation(i)``, from it or its id."""
    generation_id = generation if isinstance(generation, str) else generation.generation_id
    return int(generation_id.removeprefix("gen-"))


def _run(kafka_bootstrap, namespace, tmp_path, reward, **options) -> RewardWorker:
    """A worker of ``reward`` run on this thread until its ``max_records``."""
    worker = RewardWorker(dataclasses.replace(quick, reward=reward), bootstrap=kafka_bootstrap,
                          settings=load_settings(), namespace=namespace,
                          spool_dir=tmp_path / "worker-spool",
                          options=RewardOptions(group=f"{namespace}-calls", **options))
    worker.run()
    return worker


def _outcomes(kafka_bootstrap, namespace, rewarded: int, lettered: int):
    """The feedback and dead letters of the namespace, each expected count read."""
    return (consume_events(kafka_bootstrap, feedback(namespace), rewarded, Feedback),
            consume_events(kafka_bootstrap, dead_letters(namespace), lettered, DeadLetter))


def _lettered_ids(letters: list[DeadLetter]) -> list[str]:
    return [re.search(r"generation (gen-\d+)", letter.reason).group(1) for letter in letters]


def test_every_generation_gets_exactly_one_outcome_across_batches(
        kafka_bootstrap, namespace, topics, tmp_path):
    count = 300  # several fetches and wake-ups of the call slots
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, count))

    def mixed(generation: Generation) -> Reward:
        n = _number(generation)
        if n % 5 == 0:
            raise RuntimeError(f"refused {generation.generation_id}")
        return Reward(reward=float("nan") if n % 5 == 1 else 0.25 * (n % 4 + 1))

    worker = _run(kafka_bootstrap, namespace, tmp_path, NamedReward("mixed", mixed),
                  concurrency=4, retries=1, backoff=0, max_records=count)

    summary = worker.summary
    assert (summary.rewarded, summary.failed, summary.invalid) == (180, 60, 60)
    assert summary.retried == 60 and summary.dropped == 0
    feedbacks, letters = _outcomes(kafka_bootstrap, namespace, 180, 120)
    scored = Counter(f.generation_id for f in feedbacks)
    lettered = Counter(_lettered_ids(letters))
    assert max(scored.values()) == 1 and max(lettered.values()) == 1
    assert set(scored) | set(lettered) == ids and not set(scored) & set(lettered)
    assert all(_number(g) % 5 in (0, 1) for g in lettered)
    assert all(f.reward > 0 for f in feedbacks)
    assert _committed(kafka_bootstrap, f"{namespace}-calls", generations(namespace)) == count


def test_a_sync_call_past_its_timeout_is_dead_lettered_and_its_slot_goes_on(
        kafka_bootstrap, namespace, topics, tmp_path):
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, 10))
    release = threading.Event()
    hanging = {f"gen-{i:07d}" for i in (0, 3, 7)}

    def stuck(generation: Generation) -> Reward:
        if generation.generation_id in hanging:
            release.wait(30)  # far past the timeout; released when the test ends
        return Reward(reward=0.5)

    try:
        worker = _run(kafka_bootstrap, namespace, tmp_path, NamedReward("stuck", stuck),
                      concurrency=1, timeout=0.3, retries=0, max_records=10)
    finally:
        release.set()

    summary = worker.summary
    assert (summary.rewarded, summary.failed, summary.timed_out) == (7, 3, 3)
    feedbacks, letters = _outcomes(kafka_bootstrap, namespace, 7, 3)
    assert {f.generation_id for f in feedbacks} == ids - hanging  # none scored, not even 0
    assert set(_lettered_ids(letters)) == hanging
    for letter in letters:
        assert letter.error_type == "TimeoutError"
        assert "failed on every one of 1 tries (all timed out)" in letter.reason
        assert "no result within 0.3 s" in letter.reason
    assert _committed(kafka_bootstrap, f"{namespace}-calls", generations(namespace)) == 10


class _AsyncJudge:
    """A reward function object whose ``__call__`` is a coroutine: too slow for some
    generations, refusing others, and saying which thread each call ran on."""

    source = "async_judge"

    def __init__(self) -> None:
        self.threads: set[str] = set()

    async def __call__(self, generation: Generation) -> Reward:
        self.threads.add(threading.current_thread().name)
        n = _number(generation)
        if n % 4 == 0:
            await asyncio.sleep(30)
        if n % 4 == 1:
            raise ConnectionError("the judge hung up")
        await asyncio.sleep(0.01)
        return Reward(reward=1.0)


def test_a_coroutine_call_object_runs_on_the_loop_with_its_timeout(
        kafka_bootstrap, namespace, topics, tmp_path):
    _produce(kafka_bootstrap, namespace, tmp_path, 16)
    judge = _AsyncJudge()
    worker = _run(kafka_bootstrap, namespace, tmp_path, judge, concurrency=4, timeout=0.3,
                  retries=0, max_records=16)

    assert judge.threads == {"reef-reward-loop"}
    summary = worker.summary
    assert (summary.rewarded, summary.failed, summary.timed_out) == (8, 8, 4)
    feedbacks, letters = _outcomes(kafka_bootstrap, namespace, 8, 8)
    assert all(_number(f.generation_id) % 4 in (2, 3) for f in feedbacks)
    kinds = Counter(letter.error_type for letter in letters)
    assert kinds == {"TimeoutError": 4, "ConnectionError": 4}
    assert _committed(kafka_bootstrap, f"{namespace}-calls", generations(namespace)) == 16


def test_a_sync_callable_returning_an_awaitable_is_scored(
        kafka_bootstrap, namespace, topics, tmp_path):
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, 4))

    async def later(generation: Generation) -> Reward:
        await asyncio.sleep(0)
        return Reward(reward=0.75)

    worker = _run(kafka_bootstrap, namespace, tmp_path,
                  NamedReward("deferred", lambda generation: later(generation)),
                  concurrency=2, max_records=4)

    assert worker.summary.rewarded == 4
    feedbacks = consume_events(kafka_bootstrap, feedback(namespace), 4, Feedback)
    assert {f.generation_id for f in feedbacks} == ids and {f.reward for f in feedbacks} == {0.75}


def test_a_backlog_as_small_as_the_concurrency_gives_one_outcome_each(
        kafka_bootstrap, namespace, topics, tmp_path):
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, 40))
    worker = _run(kafka_bootstrap, namespace, tmp_path, NamedReward("length", _quick_score),
                  concurrency=2, backlog=2, max_records=40)

    assert (worker.summary.rewarded, worker.summary.dropped) == (40, 0)
    feedbacks = consume_events(kafka_bootstrap, feedback(namespace), 40, Feedback)
    assert Counter(f.generation_id for f in feedbacks) == Counter(ids)
    assert _committed(kafka_bootstrap, f"{namespace}-calls", generations(namespace)) == 40


def _quick_score(generation: Generation) -> Reward:
    time.sleep(0.005)  # the work of a call that takes a little while
    return Reward(reward=1.0)
