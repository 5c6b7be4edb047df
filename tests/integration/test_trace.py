"""`reef trace` and `reef top` over a small log written by hand on a real broker: every link
is found, points at the record it names, and a missing or dropped link says so; the view
shows that log's versions, replicas, dead letters and lag."""

from __future__ import annotations

import json

import numpy as np
import torch
from confluent_kafka import Consumer, Producer, TopicPartition

from reef_stream.core.events import (
    Checkpoint, DeadLetter, Decision, Feedback, Metric, Publication, RolloutUnit, Sample,
    TopicOffset,
)
from reef_stream.core.metric_names import FOLLOWER_POLICY_VERSION, STAGE_FOLLOWER
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.task import ALL_PROBLEMS, make_generation
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, unit_hash
from reef_stream.topics import declarations
from reef_stream.topics.connect import ask_broker, client_config
from tests.helpers import reef
from tests.unit_log import create_topics


def _send(bootstrap, topic, events, partition=0, key=b"k"):
    """Append ``events`` to ``topic``'s ``partition``; their offsets, in order."""
    registry, offsets = SchemaRegistry.default(), []
    producer = Producer(client_config(bootstrap, {"acks": "all"}))
    for event in events:
        value, headers = registry.encode(event)
        producer.produce(topic, key=key, value=value, headers=headers, partition=partition,
                         on_delivery=lambda error, message: offsets.append(
                             (error, message.offset())))
        producer.flush(30)
    assert all(error is None for error, _ in offsets), offsets
    return [offset for _, offset in offsets]


def _unit(unit_id, generation):
    return RolloutUnit(unit_id=unit_id, recipe="trainable", group_key=generation.prompt_id,
                       members=(Sample(generation_id=generation.generation_id,
                                       prompt_id=generation.prompt_id, policy_version=2,
                                       prompt_token_ids=generation.prompt_token_ids,
                                       completion_token_ids=generation.completion_token_ids,
                                       completion_logprobs=generation.completion_logprobs,
                                       reward=1.0),),
                       created_at=1)


def _write_log(kafka_bootstrap, ns, tmp_path):
    """A small pipeline's log with known offsets: three generations (gen-0 trained in unit u-0,
    gen-1 in u-1 dropped by the trainer as too stale, gen-2 in no unit), gen-0's feedback, a
    real stored checkpoint (step 3, version 3) past both units, version 4 promoted, two
    replicas' heartbeats (one serving 3, one 4), and a trainer group "g" that committed the
    units topic up to u-0 (lag 1)."""
    create_topics(kafka_bootstrap, ns)
    generations = [make_generation(model="m", policy_version=2, replica_id="replica-a",
                                   problem=ALL_PROBLEMS[i], token_ids=np.array([3]),
                                   logprobs=np.array([-1.0]), temperature=1.0,
                                   generation_id=f"gen-{i}") for i in range(3)]
    gen_offsets = _send(kafka_bootstrap, declarations.generations(ns), generations)
    _send(kafka_bootstrap, declarations.feedback(ns), [
        Feedback(feedback_id="gen-0:exact", generation_id="gen-0", source="exact", reward=1.0,
                 created_at=1)])
    units_topic = declarations.units(ns, "trainable")
    unit_offsets = _send(kafka_bootstrap, units_topic,
                         [_unit("u-0", generations[0]), _unit("u-1", generations[1])])
    _send(kafka_bootstrap, declarations.dead_letters(ns), [DeadLetter(
        reason="unit u-1 is too stale", error_type="TooStale", source_topic=units_topic,
        source_partition=0, source_offset=unit_offsets[1], value=None, headers=(),
        stage="trainer", created_at=1)])
    stored = CheckpointStore(tmp_path / "ckpt").write(CheckpointContents(
        step=3, policy_version=3, model="m", recipe="trainable", trainer_group="g",
        weights={"w": torch.zeros(2)}, optimizer={"state": {}, "param_groups": []}, rng={},
        algorithm_state={}, offsets=(TopicOffset(topic=units_topic, partition=0,
                                                 offset=unit_offsets[1] + 1),),
        trained_units=np.array([unit_hash("u-0")], dtype=np.uint64), step_units=("u-0",),
        metrics={}, created_at=5))
    _send(kafka_bootstrap, declarations.checkpoints(ns), [Checkpoint(
        checkpoint_id=stored.checkpoint_id, recipe="trainable", trainer_group="g", step=3,
        model="m", policy_version=3, uri=stored.uri, sha256=stored.sha256,
        offsets=(TopicOffset(topic=units_topic, partition=0, offset=unit_offsets[1] + 1),),
        trained_unit_count=1, created_at=5)])
    _send(kafka_bootstrap, declarations.publications(ns), [Publication(
        model="m", policy_version=4, checkpoint_id="later", uri="file:///nowhere", sha256="0" * 64,
        decision=Decision.PROMOTED, reason="better", evaluator="e", evaluated=True,
        created_at=6)], key=b"m")
    _send(kafka_bootstrap, declarations.metrics(ns), [
        Metric(stage=STAGE_FOLLOWER, name=FOLLOWER_POLICY_VERSION, value=value,
               labels={"replica": replica, "model": "m"}, created_at=7)
        for replica, value in (("replica-old", 3.0), ("replica-new", 4.0))])
    committer = Consumer(client_config(kafka_bootstrap, {"group.id": f"{ns}.g"}))
    # (a broker that just started may answer NOT_COORDINATOR while it loads the group's offsets)
    ask_broker("committing the group's offset", lambda: committer.commit(
        offsets=[TopicPartition(units_topic, 0, unit_offsets[1])], asynchronous=False))
    committer.close()
    return gen_offsets, unit_offsets, stored


def test_a_generation_a_unit_and_a_checkpoint_trace_to_the_replicas(kafka_bootstrap, cli_env,
                                                                   namespace, tmp_path):
    ns = namespace
    gen_offsets, unit_offsets, stored = _write_log(kafka_bootstrap, ns, tmp_path)

    def trace(*args):
        result = reef("trace", *args, "--json", env=cli_env, check=False)
        return result.returncode, json.loads(result.stdout)

    status, lineage = trace("gen-0")
    assert status == 0 and lineage["complete"], lineage
    assert [link["kind"] for link in lineage["links"]] == \
        ["generation", "feedback", "unit", "step", "publication", "replica"]
    generation, feedback, unit, step, publication, replica = lineage["links"]
    assert (generation["topic"], generation["offset"]) == \
        (declarations.generations(ns), gen_offsets[0])
    assert "replica-a" in generation["text"] and "version 2" in generation["text"]
    assert "reward 1" in feedback["text"]
    assert unit["offset"] == unit_offsets[0] and "u-0" in unit["text"]
    assert "step 3 of trainer group g (trained)" in step["text"]
    assert "version 4" in publication["text"]
    assert "replica-new served version 4" in replica["text"]  # replica-old serves only 3

    status, lineage = trace("gen-1")
    kinds = [link["kind"] for link in lineage["links"]]
    assert kinds == ["generation", "unit", "dead-letter", "step", "publication", "replica"]
    assert "not trained (dropped)" in lineage["links"][3]["text"]
    assert "too stale" in lineage["links"][2]["text"]

    status, lineage = trace("gen-2")
    assert status == 1 and not lineage["complete"]
    assert lineage["links"][-1]["kind"] == "missing"

    status, lineage = trace("--unit", "u-0")
    assert status == 0 and [link["kind"] for link in lineage["links"]] == \
        ["unit", "step", "publication", "replica"]
    status, lineage = trace("--checkpoint", stored.checkpoint_id)
    assert status == 0 and [link["kind"] for link in lineage["links"]] == \
        ["step", "publication", "replica"]
    status, lineage = trace("no-such-generation")
    assert status == 1 and "no generation no-such-generation" in lineage["links"][0]["text"]


def test_top_shows_that_log(kafka_bootstrap, cli_env, namespace, tmp_path):
    _write_log(kafka_bootstrap, namespace, tmp_path)
    result = reef("top", "--once", env={**cli_env, "COLUMNS": "200"})
    rows = {tuple(line.replace("│", " ").split()) for line in result.stdout.splitlines()}
    assert ("generations", "3", "-") in rows, result.stdout
    assert ("units.trainable", "2", "-") in rows, result.stdout
    # trained, published, rejected, rollbacks, serving
    assert ("m", "3", "4", "0", "0", "3-4") in rows, result.stdout
    assert ("replica-new", "m", "4") in rows and ("replica-old", "m", "3") in rows
    assert ("trainer", "1") in rows, result.stdout                # dead letters by stage
    assert any(r[:1] == (f"{namespace}.g",) and r[-1] == "1" for r in rows), result.stdout
