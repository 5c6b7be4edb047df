"""`reef train` against a real broker: groups train independently and identically, re-emitted
units are trained once, stale and undecodable units go to the dead letters, and every step
is acknowledged in order (checkpoint, event, committed offsets)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import torch
from confluent_kafka import Consumer, TopicPartition

from reef_stream.core.events import Checkpoint, DeadLetter, Metric, now_ms
from reef_stream.engine.checkpoints import CheckpointStore, load
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import checkpoints, dead_letters, metrics, units
from tests.helpers import consume_events
from tests.unit_log import create_topics, produce_units, rollout_unit

RECIPE = "tests.recipes.trainable"


def _train(cli_env, group: str, store, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "train", "--recipe", RECIPE, "--group", group,
         "--checkpoints", str(store), "--keep", "0", *extra],
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _with_created_at(unit, at_ms: int):
    """``unit`` made at ``at_ms``, its samples' generations created 2 s before."""
    members = tuple(dataclasses.replace(m, created_at=at_ms - 2_000) for m in unit.members)
    return dataclasses.replace(unit, members=members, created_at=at_ms)


def test_two_groups_train_every_unit_once_and_identically(kafka_bootstrap, cli_env, namespace,
                                                          tmp_path):
    create_topics(kafka_bootstrap, namespace)
    fresh = [rollout_unit(i) for i in range(16)]
    stale = rollout_unit(16)                                   # version 0, read at step 4
    # Only these carry their generations' created_at; the others' samples are unknown (0).
    current = [_with_created_at(rollout_unit(i, policy_version=4), now_ms()) for i in range(17, 21)]
    produce_units(kafka_bootstrap, namespace,
                  [*fresh, stale, fresh[3], b"\x00not avro", *current])

    trainers = {g: _train(cli_env, g, tmp_path / g, "--idle-exit", "5") for g in ("a", "b")}
    try:
        for process in trainers.values():
            out, err = process.communicate(timeout=180)
            assert process.returncode == 0, err[-3000:]
            assert "trained 5 steps (now at step 5" in out, out + err[-2000:]
            assert "skipped 1 duplicates, dropped 1 stale and 1 invalid" in out, out
    finally:
        for process in trainers.values():
            if process.poll() is None:
                process.kill()

    expected = Counter(u.unit_id for u in [*fresh, *current])
    weights = {}
    for group in ("a", "b"):
        stored = CheckpointStore(tmp_path / group).steps()
        assert [c.step for c in stored] == [1, 2, 3, 4, 5]
        contents = [load(c.uri, c.sha256) for c in stored]
        assert Counter(u for c in contents for u in c.step_units) == expected
        # Steps 1-4 train version-0 samples with the weights of versions 0-3; step 5 trains
        # version-4 samples with version 4's.
        assert [(c.metrics["staleness_mean"], c.metrics["staleness_max"]) for c in contents] \
            == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 0)]
        assert ["sample_age_mean_s" in c.metrics for c in contents] == [False] * 4 + [True]
        assert contents[-1].metrics["sample_age_mean_s"] >= 2.0
        weights[group] = contents[-1].weights

        # Acknowledged in order: the group's committed offsets are the last checkpoint's.
        consumer = Consumer(client_config(kafka_bootstrap, {"group.id": group}))
        committed = consumer.committed([TopicPartition(units(namespace, "trainable"), o.partition)
                                        for o in contents[-1].offsets], timeout=30)
        consumer.close()
        assert {(tp.partition, tp.offset) for tp in committed} == \
            {(o.partition, o.offset) for o in contents[-1].offsets}
        assert sum(o.offset for o in contents[-1].offsets) == 16 + 1 + 4 + 1 + 1

    # The same log and recipe give the same weights, bit for bit, whatever the group.
    for name, tensor in weights["a"].items():
        assert torch.equal(tensor, weights["b"][name]), name

    events = consume_events(kafka_bootstrap, checkpoints(namespace), 10, Checkpoint)
    assert sorted((e.trainer_group, e.step) for e in events) == \
        sorted((g, s) for g in ("a", "b") for s in range(1, 6))
    assert all(e.model == e.trainer_group and e.policy_version == e.step for e in events)

    letters = consume_events(kafka_bootstrap, dead_letters(namespace), 4, DeadLetter)
    assert sorted(("too stale" in d.reason, d.stage) for d in letters) == \
        [(False, "trainer"), (False, "trainer"), (True, "trainer"), (True, "trainer")]
    assert all(d.source_topic == units(namespace, "trainable") for d in letters)

    counts = consume_events(kafka_bootstrap, metrics(namespace), 10, Metric)
    latest = {(m.labels["group"], m.name): m.value for m in counts}
    assert latest[("a", "units_trained")] == 20 and latest[("b", "units_duplicate")] == 1
    labelled = {(m.labels["group"], m.name, *sorted(m.labels.items())): m.value for m in counts}
    # The off-policy degree over the run: steps 1-4 trained 4 units each at staleness 0-3,
    # step 5 four more at 0; and the lag per partition, 0 once every unit was read.
    samples = len(rollout_unit(0).members)
    staleness = {dict(k[2:])["staleness"]: v for k, v in labelled.items()
                 if k[:2] == ("a", "staleness_samples")}
    assert staleness == {"0": 8 * samples, "1": 4 * samples, "2": 4 * samples, "3": 4 * samples}
    # The age histograms (per bucket, label le) count exactly the trained samples with a
    # created_at: the step-5 units', their generations made 2 s before the unit.
    ages = {name: {dict(k[2:])["le"]: v for k, v in labelled.items() if k[:2] == ("a", name)}
            for name in ("sample_age_samples", "sample_to_unit_samples", "unit_to_train_samples")}
    assert sum(ages["sample_age_samples"].values()) == 4 * samples, ages
    assert sum(ages["unit_to_train_samples"].values()) == 4 * samples, ages
    assert ages["sample_to_unit_samples"] == {"2": 4 * samples}, ages
    lags = [v for k, v in labelled.items() if k[:2] == ("a", "consumer_lag")]
    assert lags and all(v == 0 for v in lags), labelled
