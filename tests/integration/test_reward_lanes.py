"""A few hanging reward calls do not clog the reward worker (the lanes of
``reef_stream.consumers.reward_calls``), against the real broker, in this process.

300 generations whose reward takes 10 ms, 6 of which hang for 60 s, far past the 20-s timeout,
with 4 call slots: before the lanes, those hangs held every slot for 20 s per try. Now every
healthy generation is rewarded long before the first hang could time out (the fast lane's
adaptive deadline moved the hangs out of it), and each hanging one ends in a dead letter as
timed out, never in feedback; the worker reports the slow lane and the call latency.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.api.recipe import NamedReward, Reward
from reef_stream.config import load_settings
from reef_stream.consumers.reward import RewardOptions, RewardWorker
from reef_stream.ops.metrics import REWARD_CALL_P99, REWARD_SATURATION, STAGE_REWARD
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics
from reef_stream.topics.events import DeadLetter, Generation
from tests.helpers import consume_events
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
