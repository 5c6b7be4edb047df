"""Trainer: the data path (consume + decode + collate) in units/s, and its share of a step.

    python bench/trainer.py [--units 2000] [--group-size 8] [--completion 128] [--steps 6]

Against one broker, in one run, over the same pre-produced units (groups of
``--group-size`` samples, 64-token prompts and ``--completion``-token
completions with logprobs, ~``(64 + 2 * completion) * 4 * group_size`` bytes
each):

- ``raw``: a bare confluent-kafka consumer reading the units topic's bytes
  (no decoding): the client's ceiling on this machine;
- ``data path``: the same reads, plus Avro decoding into ``RolloutUnit`` and
  collation of every micro batch into padded tensors (what the trainer does
  per unit besides training);
- ``step``: ``TorchBackend.train_step`` of a small model (``TinyCausalLM``,
  vocab 2048, width 128) on ``units_per_step`` units;
- ``trainer``: the real ``Trainer`` for ``--steps`` steps end to end
  (checkpoints and acknowledgements included), with its own measure of the
  time spent taking units.

Prints units/s, the data path's share of a step's time (target: under 2%),
and the ratio data path / raw. Uses REEF_BOOTSTRAP_SERVERS if set, otherwise
a throw-away single-node broker. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.core.settings import load_settings  # noqa: E402
from reef_stream.topics.connect import client_config  # noqa: E402
from reef_stream.consumers.trainer.trainer import Trainer  # noqa: E402
from reef_stream.core.events import RolloutUnit, Sample  # noqa: E402
from reef_stream.servers.kafka_local import configured_or_throwaway  # noqa: E402
from reef_stream.api.losses import POLICY_GRADIENT  # noqa: E402
from reef_stream.engine.models import TinyCausalLM  # noqa: E402
from reef_stream.api.processor import unit_id  # noqa: E402
from reef_stream.api.recipe import Backend, Recipe  # noqa: E402
from reef_stream.api.schedule import Schedule  # noqa: E402
from reef_stream.topics.declarations import units as units_topic  # noqa: E402
from reef_stream.core.serde import SchemaRegistry  # noqa: E402
from reef_stream.engine.training import TorchBackend, collate  # noqa: E402
from tests.recipes.trainable import recipe as small_recipe  # noqa: E402
from tests.unit_log import create_topics  # noqa: E402

VOCAB, WIDTH = 2048, 128


def bench_recipe(max_staleness: int) -> Recipe:
    return Recipe(
        name="trainable", processor=small_recipe.processor, objective=small_recipe.objective,
        schedule=Schedule(units_per_step=16, optimizer_batch_size=8, micro_batch_size=4,
                          seed=1, max_staleness=max_staleness),
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,),
                        model=lambda: TinyCausalLM(vocab_size=VOCAB, dim=WIDTH)))


def make_units(count: int, group_size: int, completion: int) -> list[RolloutUnit]:
    rng = np.random.default_rng(0)
    units = []
    for i in range(count):
        members = tuple(Sample(
            generation_id=f"g{i}-{k}", prompt_id=f"p{i}", policy_version=0,
            prompt_token_ids=rng.integers(0, VOCAB, 64).astype(np.int32),
            completion_token_ids=rng.integers(0, VOCAB, completion).astype(np.int32),
            completion_logprobs=(-rng.random(completion) * 5).astype(np.float32),
            reward=float(rng.random())) for k in range(group_size))
        units.append(RolloutUnit(unit_id=unit_id("trainable", [m.generation_id for m in members]),
                                 recipe="trainable", group_key=f"p{i}", members=members,
                                 created_at=i))
    return units


def produce(bootstrap: str, ns: str, units: list[RolloutUnit]) -> int:
    registry, topic = SchemaRegistry.default(), units_topic(ns, "trainable")
    producer = Producer(client_config(bootstrap, {"linger.ms": 5, "acks": "all"}))
    size = 0
    for unit in units:
        value, headers = registry.encode(unit)
        size += len(value)
        producer.produce(topic, key=unit.unit_id.encode(), value=value, headers=headers)
        producer.poll(0)
    producer.flush(60)
    return size // len(units)


def read(bootstrap: str, ns: str, count: int, *, decode: bool, micro: int) -> float:
    """Seconds to read ``count`` units (and, with ``decode``, decode + collate them), from the
    rate after the first fetch (the first batch is read but not timed)."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"bench-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
        "isolation.level": "read_committed"}))
    topic = units_topic(ns, "trainable")
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    registry = SchemaRegistry.default()
    seen, batch, first, started = 0, [], 0, None
    while seen < count:
        messages = consumer.consume(64, timeout=1.0)
        if messages and started is None:   # the clock starts once the first fetch is in:
            started, first = time.perf_counter(), len(messages)  # connecting is not the data path
            messages = []
        for message in messages:
            if message.error():
                continue
            seen += 1
            if decode:
                batch.append(registry.decode(message.value(), message.headers(), RolloutUnit))
                if len(batch) == micro:
                    collate([s for u in batch for s in u.members])
                    batch = []
        if started is not None and seen + first >= count:
            break
    elapsed = (time.perf_counter() - started) / max(seen, 1) * count
    consumer.close()
    return elapsed


def step_seconds(recipe: Recipe, units: list[RolloutUnit], steps: int) -> float:
    backend = TorchBackend(recipe)
    state = recipe.objective.initial_state()
    per_step = recipe.schedule.units_per_step
    times = []
    for step in range(steps):
        chosen = units[step * per_step:(step + 1) * per_step]
        started = time.perf_counter()
        result = recipe.objective.compute(chosen, state)
        backend.train_step(chosen, result, step + 1)
        times.append(time.perf_counter() - started)
        state = result.proposed_state
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        ns = f"bench{uuid.uuid4().hex[:6]}"
        create_topics(bootstrap, ns)
        units = make_units(args.units, args.group_size, args.completion)
        unit_bytes = produce(bootstrap, ns, units)
        recipe = bench_recipe(max_staleness=10**6)
        per_step = recipe.schedule.units_per_step

        raw_s = read(bootstrap, ns, args.units, decode=False, micro=recipe.schedule.micro_batch_size)
        data_s = read(bootstrap, ns, args.units, decode=True, micro=recipe.schedule.micro_batch_size)
        step_s = step_seconds(recipe, units, min(args.steps, args.units // per_step))
        data_per_step = data_s / args.units * per_step * recipe.schedule.epochs
        print(f"units: {args.units} of {args.group_size} samples, ~{unit_bytes / 1024:.0f} KiB each; "
              f"model TinyCausalLM vocab {VOCAB} width {WIDTH}; {per_step} units per step")
        print(f"raw consumer:             {args.units / raw_s:9.0f} units/s  "
              f"{args.units * unit_bytes / raw_s / 2**20:7.1f} MiB/s")
        print(f"data path (read+decode+collate): {args.units / data_s:9.0f} units/s  "
              f"(ratio data path/raw {raw_s / data_s:.2f})")
        print(f"training step (median):   {step_s * 1000:9.1f} ms for {per_step} units")
        print(f"data path share of a step: {data_per_step / (data_per_step + step_s) * 100:.2f}% "
              f"(target < 2%)")

        trainer = Trainer(recipe, bootstrap=bootstrap, namespace=ns, group="bench",
                          checkpoints=str(workdir / "ckpt"), max_steps=args.steps, keep=2,
                          settings=settings)
        started = time.perf_counter()
        summary = trainer.run()
        wall = time.perf_counter() - started
        print(f"trainer end to end: {summary.steps} steps in {wall:.1f} s "
              f"({summary.units_trained / wall:.1f} units/s incl. start-up and checkpoints); "
              f"taking units {summary.data_seconds:.2f} s = "
              f"{summary.data_seconds / summary.step_seconds * 100:.2f}% of step time "
              f"(steps incl. acknowledgement {summary.step_seconds:.1f} s)")


if __name__ == "__main__":
    main()
