"""Reward worker: generations scored per second, against a raw consume+produce loop.

    python bench/reward.py [--generations 5000] [--concurrency 8] [--async]

Against one broker, in one run, over the same pre-produced demo generations (the
toy task's, ``reef_stream.demo.task``):

- ``raw``: a bare confluent-kafka consumer reading ``<ns>.generations`` and a
  bare idempotent producer writing one small record per generation to
  ``<ns>.feedback``, waiting for every acknowledgement: the clients' ceiling;
- ``worker``: ``RewardWorker`` with the demo's exact-match reward (a sync
  function, or with ``--async`` the same function as a coroutine), from the
  first record taken to the last outcome acknowledged and committed.

Prints generations/s of both, the ratio worker / raw, and the CPU time of this
process per generation in each phase (``time.process_time``: every thread of
it, librdkafka's included; the broker's is not counted). Uses
REEF_BOOTSTRAP_SERVERS if set, otherwise a throw-away single-node broker.
Figures, never assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.core.settings import load_settings  # noqa: E402
from reef_stream.topics.connect import client_config  # noqa: E402
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker  # noqa: E402
from reef_stream.demo.task import ProblemStream, exact_match, make_generation  # noqa: E402
from reef_stream.servers.kafka_local import configured_or_throwaway  # noqa: E402
from reef_stream.demo.recipes import sao as sao_recipe  # noqa: E402
from reef_stream.api.recipe import NamedReward  # noqa: E402
from reef_stream.topics.declarations import feedback as feedback_topic  # noqa: E402
from reef_stream.topics.declarations import generations as generations_topic  # noqa: E402
from reef_stream.core.serde import SchemaRegistry  # noqa: E402
from tests.unit_log import create_topics  # noqa: E402


def produce_generations(bootstrap: str, ns: str, count: int) -> None:
    registry = SchemaRegistry()
    producer = Producer(client_config(bootstrap, {"linger.ms": 5, "acks": "all"}))
    stream = ProblemStream(1)
    rng = np.random.default_rng(1)
    for problem in stream.take(count):
        generation = make_generation(model="bench", policy_version=0, replica_id="bench",
                                     problem=problem, token_ids=rng.integers(0, 10, 1),
                                     logprobs=np.array([-2.3]), temperature=1.0)
        value, headers = registry.encode(generation)
        producer.produce(generations_topic(ns), value=value, key=generation.generation_id.encode(),
                         headers=headers)
        producer.poll(0)
    producer.flush(60)


def run_raw(bootstrap: str, ns: str, count: int) -> tuple[float, float]:
    """Seconds and process CPU seconds from the first generation read to the last ack."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"raw-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False}))
    producer = Producer(client_config(bootstrap, {"linger.ms": 5, "acks": "all",
                                                  "enable.idempotence": True}))
    consumer.subscribe([generations_topic(ns)])
    acked = [0]
    seen = 0
    started = None
    while acked[0] < count:
        message = consumer.poll(0.1)
        producer.poll(0)
        if message is None or message.error() is not None:
            continue
        if started is None:
            started, cpu = time.perf_counter(), time.process_time()
        seen += 1
        producer.produce(feedback_topic(ns), value=b"x" * 64, key=message.key(),
                         on_delivery=lambda e, m: acked.__setitem__(0, acked[0] + (e is None)))
        if seen == count:
            producer.flush(60)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    consumer.close()
    return elapsed, cpu


def run_worker(bootstrap: str, ns: str, count: int, concurrency: int, asynchronous: bool,
               workdir: Path) -> tuple[float, float, str]:
    """Seconds and process CPU seconds from the first outcome to the worker's return (its
    last outcome acknowledged, committed, the clients closed), and its summary line."""
    reward = exact_match
    if asynchronous:
        async def exact_match_async(generation):
            return exact_match(generation)
        reward = NamedReward("exact_match", exact_match_async)
    recipe = dataclasses.replace(sao_recipe, reward=reward)
    first = []
    worker = RewardWorker(recipe, bootstrap=bootstrap, namespace=ns,
                          options=RewardOptions(concurrency=concurrency, max_records=count,
                                                group=f"worker-{uuid.uuid4().hex[:6]}"),
                          spool_dir=workdir / f"spool-{uuid.uuid4().hex[:6]}",
                          on_outcome=lambda kind, event: first or first.append(
                              (time.perf_counter(), time.process_time())))
    summary = worker.run()
    return (time.perf_counter() - first[0][0], time.process_time() - first[0][1],
            summary.line())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="Score with a coroutine reward function.")
    args = parser.parse_args()
    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        ns = f"bench{uuid.uuid4().hex[:6]}"
        create_topics(bootstrap, ns)
        produce_generations(bootstrap, ns, args.generations)
        raw_s, raw_cpu = run_raw(bootstrap, ns, args.generations)
        worker_s, worker_cpu, line = run_worker(bootstrap, ns, args.generations, args.concurrency,
                                    args.asynchronous, workdir)
        n = args.generations
        print(f"data: {n} demo generations")
        print(f"raw consume+produce (acks=all):        {n / raw_s:9.0f} generations/s, "
              f"{1000 * raw_cpu / n:.3f} ms CPU per generation")
        print(f"RewardWorker ({'async' if args.asynchronous else 'sync'} reward, "
              f"concurrency {args.concurrency}): {n / worker_s:9.0f} generations/s, "
              f"{1000 * worker_cpu / n:.3f} ms CPU per generation")
        print(f"ratio worker/raw: {raw_s / worker_s:.2f}")
        print(line)


if __name__ == "__main__":
    main()
