"""Serving replicas against the real broker and Redis: a tampered, mismatched or missing
checkpoint is refused and the previous version keeps serving; generations must carry a version
the replica served; `reef follow` reports what it loaded; a record on the publications topic
that does not decode is counted and logged, and serving goes on.

The tests play the evaluator: they write real checkpoints and produce Publication events.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import Generation
from reef_stream.core.metric_names import FOLLOWER_PUBLICATIONS_UNDECODABLE, STAGE_FOLLOWER
from reef_stream.intake.producer import RecordProducer
from reef_stream.serving.follower import Follower
from reef_stream.topics.declarations import generations
from tests.faults.records import generation
from tests.helpers import consume_events, reef
from tests.integration.publishing import (
    Loads, create_topics, eventually, fleet_of, produce_publications, promoted, settings_for,
    write_checkpoint,
)
from tests.integration.undecodable import GARBAGE, letters, metric_values, other_schema, publish_raw


@pytest.fixture
def setup(kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    return settings, fleet_of(redis_url, namespace)


class Refusals:
    """An ``on_refused`` callback recording (version, error text)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def __call__(self, publication, error) -> None:
        with self._lock:
            self.seen.append((publication.policy_version, str(error)))


def test_a_tampered_checkpoint_is_refused_and_the_previous_version_keeps_serving(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    store = tmp_path / "published"
    v1, v2, v3, v4, v5 = (write_checkpoint(store, step, 0.1 * step) for step in range(1, 6))
    produce_publications(kafka_bootstrap, namespace, promoted(v1))
    loads, refusals = Loads(), Refusals()
    with Follower("tiny", on_version=loads, on_refused=refusals, settings=settings, fleet=fleet,
                  heartbeat_s=0.5, retry_s=60) as replica:
        assert replica.wait_ready(30) == 1

        # v2: a byte of its weights changed after it was published.
        weights_file = Path(v2.uri) / "model.safetensors"
        data = bytearray(weights_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights_file.write_bytes(bytes(data))
        produce_publications(kafka_bootstrap, namespace, promoted(v2))
        eventually(lambda: len(refusals.seen) == 1, what="the refusal of v2")
        assert refusals.seen[0][0] == 2
        assert "model.safetensors does not match its sha256" in refusals.seen[0][1]
        assert replica.policy_version == 1

        # v3: the files are intact but the publication names another checksum.
        produce_publications(kafka_bootstrap, namespace, promoted(v3, sha256="0" * 64))
        eventually(lambda: len(refusals.seen) == 2, what="the refusal of v3")
        assert refusals.seen[1][0] == 3 and "manifest sha256 is" in refusals.seen[1][1]

        # v4: the checkpoint is gone.
        produce_publications(kafka_bootstrap, namespace,
                             promoted(v4, uri=str(tmp_path / "nowhere" / "step-00000004")))
        eventually(lambda: len(refusals.seen) == 3, what="the refusal of v4")
        assert refusals.seen[2][0] == 4 and "cannot be read" in refusals.seen[2][1]

        assert replica.policy_version == 1 and loads.versions == [1]
        assert set(replica.refused) == {4}  # v2 and v3 are superseded by v4
        eventually(lambda: fleet.snapshot().model("tiny").replicas, what="a heartbeat")
        assert fleet.snapshot().model("tiny").replicas[0].version == 1
        assert fleet.serving_version("tiny") == 1

        # A good version after the bad ones is loaded.
        produce_publications(kafka_bootstrap, namespace, promoted(v5))
        assert replica.wait_for_version(5, 30) == 5
        assert loads.versions == [1, 5] and replica.refused == {}
        eventually(lambda: fleet.serving_version("tiny") == 5, what="serving 5")


def test_generations_must_carry_a_version_the_replica_served(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    v1, v2 = (write_checkpoint(tmp_path / "ckpt", step, 0.5) for step in (1, 2))
    produce_publications(kafka_bootstrap, namespace, promoted(v1))
    with Follower("tiny", on_version=Loads(), settings=settings, fleet=None) as replica, \
            RecordProducer(kafka_bootstrap, settings=settings, namespace=namespace,
                           spool_dir=tmp_path / "spool", guard=replica) as producer:
        assert replica.wait_ready(30) == 1

        def sampled(i: int, version: int, model: str = "tiny") -> Generation:
            import dataclasses

            return dataclasses.replace(generation(i), model=model, policy_version=version,
                                       replica_id=replica.replica_id)

        producer.send(sampled(0, replica.policy_version)).wait(30)
        with pytest.raises(InvalidRecord, match="never served version 2"):
            producer.send(sampled(1, 2))
        with pytest.raises(InvalidRecord, match="serves model 'tiny', not 'other'"):
            producer.send(sampled(2, 1, model="other"))

        # A request that started on v1 and ends after the swap to v2 still carries v1.
        started_on = replica.policy_version
        produce_publications(kafka_bootstrap, namespace, promoted(v2))
        replica.wait_for_version(2, 30)
        producer.send(sampled(3, started_on)).wait(30)
        producer.send(sampled(4, replica.policy_version)).wait(30)

    sent = consume_events(kafka_bootstrap, generations(namespace), 3, Generation)
    assert sorted((g.generation_id, g.policy_version) for g in sent) == [
        ("gen-0000000", 1), ("gen-0000003", 1), ("gen-0000004", 2)]


def test_a_replica_without_any_version_refuses_to_emit(setup, kafka_bootstrap, namespace,
                                                       tmp_path):
    settings, _ = setup
    with Follower("tiny", on_version=Loads(), settings=settings, fleet=None) as replica:
        assert replica.wait_ready(30) is None
        with pytest.raises(InvalidRecord, match="has loaded no version"):
            replica.check(generation(0))
    with Follower("tiny", on_version=Loads(), settings=settings, fleet=None,
                  initial_version=0) as base:
        assert base.wait_ready(30) == 0
        base.check(generation(0))  # policy_version 0: the base weights it serves


def test_reef_follow_once_reports_the_verified_version(setup, cli_env, kafka_bootstrap,
                                                        namespace, tmp_path):
    v1, v2 = (write_checkpoint(tmp_path / "ckpt", step, 0.5) for step in (1, 2))
    nothing = reef("follow", "--model", "tiny", "--once", env=cli_env, check=False)
    assert nothing.returncode == 1 and "no promoted version of tiny" in nothing.stderr

    produce_publications(kafka_bootstrap, namespace, promoted(v1), promoted(v2))
    result = reef("follow", "--model", "tiny", "--once", "--replica-id", "r-1", env=cli_env)
    assert "model tiny: loaded version 2 (checkpoint " + v2.checkpoint_id in result.stdout
    assert "2 tensors" in result.stdout
    assert "replica r-1: serving version 2 of tiny" in result.stdout
    assert "loaded version 1" not in result.stdout

    (Path(v2.uri) / "meta.json").write_text("{}")
    refused = reef("follow", "--model", "tiny", "--once", env=cli_env, check=False)
    assert refused.returncode == 1
    assert "refused version 2 of model tiny" in refused.stderr and "meta.json" in refused.stderr
    assert "keeps serving nothing" in refused.stderr


def test_undecodable_publications_are_counted_and_logged_never_dead_lettered_by_a_replica(
        setup, kafka_bootstrap, namespace, tmp_path, caplog):
    settings, _ = setup
    v1, v2, v3 = (write_checkpoint(tmp_path / "ckpt", step, 0.1 * step) for step in (1, 2, 3))
    bad = publish_raw(kafka_bootstrap, namespace, GARBAGE, promoted(v1), other_schema(),
                      promoted(v2))[0::2]
    loads = Loads()
    caplog.set_level(logging.WARNING, logger="reef_stream.serving.follower")
    with Follower("tiny", on_version=loads, settings=settings, fleet=None,
                  heartbeat_s=0.5) as replica:
        assert replica.wait_ready(30) == 2 and loads.versions == [2]
        assert replica.undecodable == 2

        # Read as they arrive, while serving: counted once each; a valid version still loads.
        bad += publish_raw(kafka_bootstrap, namespace, other_schema(), promoted(v3))[:1]
        assert replica.wait_for_version(3, 30) == 3
        assert replica.undecodable == 3
        labels = {"replica": replica.replica_id, "model": "tiny"}
        eventually(lambda: metric_values(kafka_bootstrap, namespace, STAGE_FOLLOWER,
                                         FOLLOWER_PUBLICATIONS_UNDECODABLE, **labels)[-1:] == [3],
                   30, "the undecodable count in the metrics topic")
    assert metric_values(kafka_bootstrap, namespace, STAGE_FOLLOWER,
                         FOLLOWER_PUBLICATIONS_UNDECODABLE, **labels) == [1, 2, 3]
    assert loads.versions == [2, 3]
    # One warning per record, naming where it is; no dead letter (that is the evaluator's).
    warned = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(warned) == 3
    for message, (topic, partition, offset) in zip(warned, bad):
        assert f"{topic}[{partition}]@{offset}" in message
    assert "UnknownSchemaError" in warned[0] and "reef-schema-fp" in warned[0]
    assert "reef.events.Metric" in warned[1]
    assert letters(kafka_bootstrap, namespace, 0) == {}
