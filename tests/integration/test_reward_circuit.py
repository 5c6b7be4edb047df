"""The reward pipe against faults that are not the generations', on the real broker, in this
process (issue 28, items 1 and 3):

- an outage (every call raises ConnectionError) opens the circuit: the worker stops taking
  generations and only probes, dead-letters none of them, and scores every one once the
  service is back;
- a retry waits out its backoff on a timer, not in its slot: with one slot and a long backoff,
  every other generation is scored before the one that failed;
- a minority whose calls fail every time never opens the circuit: each of those is tried
  twice (the same failure is not tried a third time) and dead-lettered, the rest scored.
"""

from __future__ import annotations

import threading
import time

import dataclasses

from reef_stream.api.recipe import NamedReward, Reward
from reef_stream.api.rewards import Transient
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
from reef_stream.core.events import DeadLetter, Feedback, Generation
from reef_stream.core.settings import load_settings
from reef_stream.topics.declarations import dead_letters, feedback
from tests.helpers import events_to_end, wait_until
from tests.integration.test_reward_calls import _lettered_ids, _number, _run, topics  # noqa: F401
from tests.integration.test_reward_workers import _produce
from tests.recipes.rewards import quick


def _worker(kafka_bootstrap, namespace, tmp_path, reward, on_outcome=None,
            **options) -> RewardWorker:
    """A worker of ``reward``, not started."""
    return RewardWorker(dataclasses.replace(quick, reward=reward), bootstrap=kafka_bootstrap,
                        settings=load_settings(), namespace=namespace,
                        spool_dir=tmp_path / "worker-spool", on_outcome=on_outcome,
                        options=RewardOptions(group=f"{namespace}-calls", **options))


def test_an_outage_holds_the_generations_and_they_are_scored_once_it_ends(
        kafka_bootstrap, namespace, topics, tmp_path):  # noqa: F811
    count = 300
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, count))
    down = threading.Event()
    down.set()
    calls = {"during": 0}

    def service(generation: Generation) -> Reward:
        if down.is_set():
            calls["during"] += 1
            raise ConnectionError("the grading service refused the connection")
        return Reward(reward=1.0)

    worker = _worker(kafka_bootstrap, namespace, tmp_path, NamedReward("service", service),
                     concurrency=4, retries=2, backoff=0.05, max_records=count)
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    wait_until(lambda: worker.circuit.is_open, timeout=60, message="the circuit never opened")
    opened_with = calls["during"]
    time.sleep(3)  # the outage goes on: only probes reach the service now
    probes = calls["during"] - opened_with
    down.clear()
    runner.join(120)
    assert not runner.is_alive(), "the worker did not finish after the outage"

    summary = worker.summary
    assert (summary.rewarded, summary.failed, summary.invalid) == (count, 0, 0)
    assert worker.circuit.openings >= 1 and not worker.circuit.is_open
    # Open, the worker stopped calling: a probe a second (and the calls already running), not
    # the hundreds of calls a second it made before.
    assert probes <= 12, probes
    assert events_to_end(kafka_bootstrap, dead_letters(namespace), DeadLetter) == []
    scored = events_to_end(kafka_bootstrap, feedback(namespace), Feedback)
    assert sorted(f.generation_id for f in scored) == sorted(ids)


def test_a_retry_waits_on_a_timer_not_in_its_slot(kafka_bootstrap, namespace, topics,  # noqa: F811
                                                   tmp_path):
    count = 20
    _produce(kafka_bootstrap, namespace, tmp_path, count)
    first: list[str] = []

    def once_unavailable(generation: Generation) -> Reward:
        if not first:
            first.append(generation.generation_id)
            raise Transient("rate limited; try again later")
        return Reward(reward=1.0)

    order: list[str] = []
    worker = _worker(kafka_bootstrap, namespace, tmp_path,
                     NamedReward("limited", once_unavailable), concurrency=1, slow_concurrency=0,
                     retries=1, backoff=5.0, max_records=count,
                     on_outcome=lambda kind, event: order.append(event.generation_id))
    worker.run()
    assert worker.summary.rewarded == count and worker.summary.retried == 1
    # One slot: had the retry's backoff held it, the failed generation would have been scored
    # before every generation after it.
    assert len(order) == count and order[-1] == first[0]


def test_a_failing_minority_is_dead_lettered_after_two_tries_and_never_opens_the_circuit(
        kafka_bootstrap, namespace, topics, tmp_path):  # noqa: F811
    count = 200
    ids = set(_produce(kafka_bootstrap, namespace, tmp_path, count))

    def grader(generation: Generation) -> Reward:
        if _number(generation) % 10 == 3:
            raise ValueError(f"cannot parse the answer of {generation.generation_id}")
        return Reward(reward=0.5)

    worker = _run(kafka_bootstrap, namespace, tmp_path, NamedReward("grader", grader),
                  concurrency=4, retries=5, backoff=0.01, max_records=count)
    failing = {i for i in ids if _number(i) % 10 == 3}
    assert worker.circuit.openings == 0
    assert (worker.summary.rewarded, worker.summary.failed) == (count - len(failing),
                                                                len(failing))
    assert worker.summary.retried == len(failing)  # once each, though --retries allows 5
    letters = events_to_end(kafka_bootstrap, dead_letters(namespace), DeadLetter)
    assert set(_lettered_ids(letters)) == failing and len(letters) == len(failing)
    for letter in letters:
        assert "failed on every one of 2 tries (all raised)" in letter.reason
        assert "failed the same way as the try before" in letter.reason
