"""The scorecard of a namespace, read back from a real broker: a small log written by hand
(generations with known timestamps across partitions, publications, dead letters, the
trainer's, follower's and every stage's metrics, a checkpoint store) gives the figures worked
out below, through ``read_scorecard`` and through ``reef scorecard --json``; a namespace with
its topics and nothing in them gives empty figures; a missing one is a configuration error
naming its topics."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from confluent_kafka import Producer

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import DeadLetter, Decision, Metric, Publication, TopicOffset, now_ms
from reef_stream.core.metric_names import (
    FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, PROCESS_CPU_SECONDS, STAGE_FOLLOWER, STAGE_PROCESSOR,
    STAGE_REWARD, STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, TRAINER_STALENESS_SAMPLES,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, unit_hash
from reef_stream.ops.scorecard import Distribution, read_scorecard
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from reef_stream.topics.dead_letters import headers_of
from tests.faults.records import generation
from tests.helpers import reef
from tests.unit_log import create_topics, rollout_unit

RECIPE = "scored"
#: The first generation's timestamp: ten minutes ago (the broker takes past timestamps).
T0 = now_ms() - 600_000
#: (partition, timestamp) of each generation: 7 in all, the first at T0, the last at T0 + 9 s.
GENERATIONS = [(0, T0 + 1000), (0, T0 + 2000), (1, T0), (1, T0 + 5000),
               (3, T0 + 3000), (3, T0 + 4000), (3, T0 + 9000)]


def _send(bootstrap, topic, records):
    """``records``: (event, key, partition or None, timestamp or None), produced in order."""
    registry, failures = SchemaRegistry.default(), []
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    offsets = []
    for event, key, partition, timestamp in records:
        value, headers = registry.encode(event)
        extra = {"partition": partition} if partition is not None else {}
        if timestamp is not None:
            extra["timestamp"] = timestamp
        producer.produce(topic, key=key, value=value, headers=headers, **extra,
                         on_delivery=lambda error, message: (failures if error else offsets)
                         .append(error or message.offset()))
    assert producer.flush(30) == 0 and not failures, failures
    return offsets


def _metric(stage, name, value, at, **labels):
    return (Metric(stage=stage, name=name, value=float(value), labels=labels, created_at=at),
            stage.encode(), None, None)


def _write_log(bootstrap, ns, store):
    create_topics(bootstrap, ns, RECIPE)
    _send(bootstrap, declarations.generations(ns),
          [(dataclasses.replace(generation(i), generation_id=f"g{i}"), f"g{i}".encode(), p, at)
           for i, (p, at) in enumerate(GENERATIONS)])

    def publication(decision, accuracy, at, version):
        return (Publication(model="m", policy_version=version, checkpoint_id=f"c{version}",
                            uri="file:///c", sha256="0" * 64, decision=decision, reason="r",
                            evaluator="e", evaluated=True, measurement={"accuracy": accuracy},
                            created_at=at),
                b"m" if decision is Decision.PROMOTED else b"m#rejected", None, None)

    _send(bootstrap, declarations.publications(ns), [
        publication(Decision.PROMOTED, 0.5, T0 + 20_000, 1),
        publication(Decision.REJECTED, 0.95, T0 + 25_000, 2),
        publication(Decision.PROMOTED, 0.92, T0 + 30_000, 3),
        publication(Decision.PROMOTED, 0.99, T0 + 40_000, 4)])

    # the units topic: u-0 (trained by the one checkpoint) and u-1 (3 samples, too stale)
    units_topic = declarations.units(ns, RECIPE)
    trained, stale = rollout_unit(0, recipe=RECIPE, group_size=2), \
        rollout_unit(1, recipe=RECIPE, group_size=3)
    unit_offsets = _send(bootstrap, units_topic, [
        (unit, unit.unit_id.encode(), 0, None) for unit in (trained, stale)])
    stale_value, stale_headers = SchemaRegistry.default().encode(stale)
    CheckpointStore(store).write(CheckpointContents(
        step=1, policy_version=1, model="m", recipe=RECIPE, trainer_group="g",
        weights={"w": torch.zeros(2)}, optimizer={"state": {}, "param_groups": []}, rng={},
        algorithm_state={}, offsets=(TopicOffset(topic=units_topic, partition=0,
                                                 offset=unit_offsets[1] + 1),),
        trained_units=np.array([unit_hash(trained.unit_id)], dtype=np.uint64),
        step_units=(trained.unit_id,), metrics={}, created_at=T0 + 15_000))

    def letter(kind, stage=STAGE_PROCESSOR, source=None, offset=0, value=None, headers=()):
        return (DeadLetter(reason="why", error_type=kind,
                           source_topic=source or declarations.generations(ns),
                           source_partition=0, source_offset=offset, value=value,
                           headers=headers, stage=stage, created_at=T0 + 50_000),
                b"k", None, None)

    _send(bootstrap, declarations.dead_letters(ns), [
        letter("processor.shed"), letter("processor.shed"), letter("processor.too_stale"),
        letter("processor.expired"),
        letter("TooStale", STAGE_TRAINER, units_topic, unit_offsets[1], stale_value,
               headers_of(stale_headers))])

    trainer = {"recipe": RECIPE, "group": "g"}
    _send(bootstrap, declarations.metrics(ns), [
        # staleness 0: 2, 4, then the trainer restarts: 1 -> 5 samples; staleness 2: 1 sample
        *(_metric(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, v, T0 + 10_000, staleness="0",
                  **trainer) for v in (2, 4, 1)),
        _metric(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, 1, T0 + 10_000, staleness="2",
                **trainer),
        # ages: 4 samples in (0.25, 0.5], 2 in (2, 3]
        _metric(STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, 4, T0 + 10_000, le="0.5", **trainer),
        _metric(STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, 2, T0 + 10_000, le="3", **trainer),
        # CPU: trainer 1 -> 2.5 s, reward 0.5 -> 1.5 s, processor 3 s
        _metric(STAGE_TRAINER, PROCESS_CPU_SECONDS, 1, T0 + 10_000, process="h.1", **trainer),
        _metric(STAGE_TRAINER, PROCESS_CPU_SECONDS, 2.5, T0 + 11_000, process="h.1", **trainer),
        _metric(STAGE_REWARD, PROCESS_CPU_SECONDS, 0.5, T0 + 10_000, process="h.2"),
        _metric(STAGE_REWARD, PROCESS_CPU_SECONDS, 1.5, T0 + 11_000, process="h.2"),
        _metric(STAGE_PROCESSOR, PROCESS_CPU_SECONDS, 3, T0 + 11_000, process="h.3"),
        # checkpoint -> serving: 1.5, 0.5, 2.5 s; the last record of the run at T0 + 60 s
        *(_metric(STAGE_FOLLOWER, FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, s, T0 + at,
                  replica="a", model="m") for s, at in ((1.5, 31_000), (0.5, 41_000),
                                                        (2.5, 60_000)))])


def _check(card):
    assert card.generated == 7
    assert card.seconds == 60.0                        # T0 -> the follower's event at T0 + 60 s
    assert card.time_to_target_s == 30.0               # the 0.92 at T0 + 30 s, not the rejected
    assert card.trained == 6                           # 4 + 1 at staleness 0, 1 at staleness 2
    assert card.goodput == pytest.approx(6 / 7)
    # staleness: 5 at 0, 1 at 2: mean 2 / 6; rank 3 is 0, rank ceil(5.94) = 6 is 2
    assert card.staleness_versions == Distribution(6, pytest.approx(1 / 3), 0.0, 2.0)
    # ages: midpoints 0.375 and 2.5: mean (4 * 0.375 + 2 * 2.5) / 6 = 6.5 / 6; rank 3 is in
    # (0.25, 0.5], rank 6 in (2, 3]
    assert card.staleness_seconds == Distribution(6, pytest.approx(6.5 / 6), 0.5, 3.0)
    # 0.5, 1.5, 2.5: mean 1.5, rank 2 is 1.5, rank 3 is 2.5
    assert card.checkpoint_to_serving_s == Distribution(3, 1.5, 1.5, 2.5)
    assert card.shed == {"processor.shed": 2}
    assert card.dead_lettered == {"TooStale": 1, "processor.expired": 1, "processor.shed": 2,
                                  "processor.too_stale": 1}
    assert (card.too_stale, card.too_stale_samples) == (2, 1 + 3)
    assert card.cpu_seconds == {"processor": 3.0, "reward": 1.5, "trainer": 2.5}
    assert card.infra_cpu_share == pytest.approx(4.5 / 7)
    assert card.cpu_per_generation == pytest.approx(7 / 7)


def test_the_scorecard_of_a_log_written_by_hand(kafka_bootstrap, namespace, cli_env, tmp_path):
    store = tmp_path / "checkpoints"
    _write_log(kafka_bootstrap, namespace, store)

    card = read_scorecard(kafka_bootstrap, namespace, RECIPE, target=0.9,
                          extra_cpu={"broker": 1.0})
    _check(dataclasses.replace(card, cpu_seconds={k: v for k, v in card.cpu_seconds.items()
                                                  if k != "broker"}))
    assert card.cpu_seconds["broker"] == 1.0
    assert card.infra_cpu_share == pytest.approx(5.5 / 8)   # 1.5 + 3 + 1 over 8 s
    assert card.ledger is None

    printed = json.loads(reef("scorecard", "--recipe", RECIPE, "--target", "0.9",
                              "--checkpoints", str(store), "--json", env=cli_env).stdout)
    assert printed["time_to_target_s"] == 30.0 and printed["generated"] == 7
    assert printed["trained"] == 6 and printed["too_stale"] == 2
    assert printed["staleness_versions"] == {"count": 6, "mean": pytest.approx(1 / 3),
                                             "p50": 0.0, "p99": 2.0}
    assert printed["checkpoint_to_serving_s"]["p50"] == 1.5
    assert printed["cpu_seconds"] == {"processor": 3.0, "reward": 1.5, "trainer": 2.5}
    assert printed["infra_cpu_share"] == pytest.approx(4.5 / 7)
    # u-0 trained by the checkpoint, u-1 dead-lettered by the trainer: nothing lost or doubled
    assert printed["ledger"] == {"trained": 1, "trained_twice": 0, "duplicates": 0,
                                 "dropped": 1, "lost": 0}

    block = reef("scorecard", "--recipe", RECIPE, "--target", "0.9", env=cli_env).stdout
    assert "time to target (accuracy >= 0.9), s: 30" in block
    assert "SCORECARD time_to_target_s=30 generated=7 trained=6 " in block


def test_an_empty_namespace_and_a_missing_one(kafka_bootstrap, namespace, cli_env):
    create_topics(kafka_bootstrap, namespace, RECIPE)
    card = read_scorecard(kafka_bootstrap, namespace, RECIPE, target=0.9)
    assert (card.generated, card.trained, card.seconds) == (0, 0, 0.0)
    assert card.time_to_target_s is None and card.goodput is None
    assert card.staleness_versions == Distribution.empty()

    with pytest.raises(ConfigurationError, match=rf"{namespace}\.units\.other") as raised:
        read_scorecard(kafka_bootstrap, namespace, "other")
    assert RECIPE in str(raised.value)                 # the recipes the namespace has
    result = reef("scorecard", "--namespace", f"{namespace}x", "--recipe", RECIPE,
                  env=cli_env, check=False)
    assert result.returncode == 2
    assert f"{namespace}x.generations" in result.stderr
