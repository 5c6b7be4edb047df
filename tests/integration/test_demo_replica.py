"""The demo's serving replica against the real broker and Redis.

A replica process serves version 0 (the trainer's seeded initial weights) and, once a new
checkpoint is promoted, samples from it; a replica started late serves the newest promoted
version at once and ignores a rejected one. Every generation's behaviour logprobs are checked
against the weights of the version it claims, so a generation stamped with a version it was
not sampled from would fail the test.

The tests play the trainer and the evaluator: they write real checkpoints with
``CheckpointStore`` and produce the Publication events themselves.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import torch
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from reef_stream.core.events import Checkpoint, Decision, Generation, now_ms
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.replica import run_replica
from reef_stream.demo.task import initial_policy, parse_prompt
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import generations
from tests.helpers import wait_until
from tests.integration.publishing import (
    create_topics, eventually, fleet_of, produce_publications, promoted, settings_for,
)

MODEL = "demo"
SEED = 7


class GenerationReader:
    """Reads ``<ns>.generations`` from the beginning of every partition, as it grows."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        topic = generations(namespace)
        self.consumer = Consumer(client_config(bootstrap, {
            "group.id": f"{namespace}.test-reader", "enable.auto.commit": False}))
        partitions = self.consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        self.registry = SchemaRegistry.default()
        self.seen: list[Generation] = []

    def until(self, predicate: Callable[[list[Generation]], bool], timeout: float,
              what: str) -> list[Generation]:
        wait_until(lambda: predicate(self.seen) or self._read(), timeout, what, poll_s=0)
        return self.seen

    def _read(self) -> None:
        """Decode what arrives in half a second into ``seen``."""
        for message in self.consumer.consume(num_messages=1000, timeout=0.5):
            assert message.error() is None, message.error()
            self.seen.append(self.registry.decode(message.value(), message.headers(), Generation))

    def close(self) -> None:
        self.consumer.close()


def publish_version(store, version: int, weights: dict, bootstrap: str, namespace: str, *,
                    decision: Decision = Decision.PROMOTED) -> Checkpoint:
    """A real checkpoint of ``weights`` as step/version ``version``, and its publication."""
    stored = CheckpointStore(store).write(CheckpointContents(
        step=version, policy_version=version, model=MODEL, recipe="demo", trainer_group="t",
        weights=weights, optimizer={}, rng={}, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64), created_at=now_ms()))
    checkpoint = Checkpoint(
        checkpoint_id=stored.checkpoint_id, recipe="demo", trainer_group="t", step=version,
        model=MODEL, policy_version=version, uri=stored.uri, sha256=stored.sha256, offsets=(),
        trained_unit_count=0, created_at=now_ms())
    publication = promoted(checkpoint)
    if decision is Decision.REJECTED:
        publication = dataclasses.replace(publication, decision=Decision.REJECTED,
                                          reason="regressed (the test)")
    produce_publications(bootstrap, namespace, publication)
    return checkpoint


def assert_sampled_from(generation: Generation, model: torch.nn.Module) -> None:
    """The generation's behaviour logprob is what ``model`` gives its completion."""
    prompt = torch.from_numpy(generation.prompt_token_ids.astype(np.int64))[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(prompt, torch.ones_like(prompt, dtype=torch.bool))
                                     [0, -1], dim=-1)
    token = int(generation.completion_token_ids[0])
    assert abs(float(logprobs[token]) - float(generation.completion_logprobs[0])) < 1e-4, (
        f"generation {generation.generation_id} of version {generation.policy_version} was not "
        "sampled from that version's weights")


def test_a_replica_process_serves_version_0_then_the_newly_promoted_version(
        kafka_bootstrap, redis_url, namespace, cli_env, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    version_0, version_1 = initial_policy(SEED).eval(), initial_policy(SEED + 100).eval()
    replica = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.demo.replica", "--model", MODEL, "--grouped",
         "--group-size", "4", "--prompts", "2", "--rate", "40", "--seed", str(SEED),
         "--replica-id", "replica-t", "--heartbeat", "0.5"],
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = GenerationReader(kafka_bootstrap, namespace)
    try:
        seen = reader.until(lambda gs: len(gs) >= 24, 45, "24 generations of version 0")
        assert {(g.model, g.policy_version, g.replica_id, g.group_size) for g in seen} == {
            (MODEL, 0, "replica-t", 4)}
        groups = defaultdict(list)
        for g in seen:
            groups[g.group_id].append(g)
        assert None not in groups and all(len(members) <= 4 for members in groups.values())
        assert sum(len(members) == 4 for members in groups.values()) >= 4
        for members in groups.values():  # a group: one prompt, sampled several times
            assert len({m.prompt_id for m in members}) == 1
            assert len({m.generation_id for m in members}) == len(members)
        for g in seen:
            assert parse_prompt(g.prompt_token_ids).prompt_id == g.prompt_id
            assert g.completion_token_ids.shape == (1,) and g.sampling.max_tokens == 1
            assert_sampled_from(g, version_0)

        publish_version(tmp_path / "store", 1, version_1.state_dict(), kafka_bootstrap,
                        namespace)
        seen = reader.until(lambda gs: sum(g.policy_version == 1 for g in gs) >= 8, 45,
                            "8 generations of version 1")
        assert {g.policy_version for g in seen} == {0, 1}
        for g in seen:
            assert_sampled_from(g, version_1 if g.policy_version == 1 else version_0)
        fleet = fleet_of(redis_url, namespace)
        eventually(lambda: [(r.replica_id, r.version) for r in fleet.replicas(MODEL)]
                   == [("replica-t", 1)], what="the fleet projection showing version 1")
    finally:
        replica.send_signal(signal.SIGTERM)
        out, err = replica.communicate(timeout=60)
    assert replica.returncode == 0, err
    assert "serves demo (version 0)" in err and "sampling from version 1 now" in err, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["replica_id"] == "replica-t" and summary["final_version"] == 1
    assert set(summary["by_version"]) == {"0", "1"}
    assert sum(summary["by_version"].values()) == summary["sent"]
    assert summary["acknowledged"] == summary["sent"]
    assert summary["failed"] == summary["unflushed"] == summary["backpressured"] == 0
    # Every generation it reported sent is in the log, exactly once.
    seen = reader.until(lambda gs: len(gs) >= summary["sent"], 30, "every generation sent")
    reader.close()
    assert len(seen) == summary["sent"] == len({g.generation_id for g in seen})
    assert Counter(str(g.policy_version) for g in seen) == Counter(summary["by_version"])


def test_a_late_replica_serves_the_newest_promoted_version_never_a_rejected_one(
        kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    store = tmp_path / "store"
    version_3 = initial_policy(SEED + 3).eval()
    publish_version(store, 2, initial_policy(SEED + 2).state_dict(), kafka_bootstrap, namespace)
    publish_version(store, 3, version_3.state_dict(), kafka_bootstrap, namespace)
    publish_version(store, 4, initial_policy(SEED + 4).state_dict(), kafka_bootstrap, namespace,
                    decision=Decision.REJECTED)
    results = []
    worker = threading.Thread(target=lambda: results.append(run_replica(
        MODEL, grouped=False, prompts=5, seed=SEED, settings=settings, replica_id="late",
        max_generations=30, fleet=None, ready_timeout=30)))
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and results, "the replica did not finish"
    report = results[0]
    assert (report.sent, report.by_version, report.final_version) == (30, {3: 30}, 3)
    assert report.acknowledged == 30 and report.rounds == 6
    reader = GenerationReader(kafka_bootstrap, namespace)
    seen = reader.until(lambda gs: len(gs) >= 30, 30, "30 generations")
    reader.close()
    assert len(seen) == 30
    for g in seen:
        assert (g.model, g.policy_version, g.replica_id) == (MODEL, 3, "late")
        assert (g.group_id, g.group_size) == (None, 1)
        assert_sampled_from(g, version_3)
