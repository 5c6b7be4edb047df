"""Shared by the evaluation, follower and fleet tests: real checkpoints of a tiny model, their
Checkpoint events on the real broker, an in-process evaluator, and publications read back.

No trainer is involved: the tests play the trainer (and, for the follower tests, the evaluator)
by writing checkpoints with ``CheckpointStore`` and producing the events themselves.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import redis as redis_client
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import (
    EvaluateOptions, EvaluateSummary, EvaluatorWorker, publication_key,
)
from reef_stream.core.events import Checkpoint, Decision, Publication, now_ms
from reef_stream.core.serde import encode
from reef_stream.core.settings import Settings, load_settings
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore
from reef_stream.publishing.fleet import Fleet
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import checkpoints, declare_topics, publications
from tests.helpers import consume_all, consume_events, wait_until
from tests.recipes.evaluators import weights

TRAINER_GROUP = "trainer-a"


def create_topics(bootstrap: str, namespace: str) -> None:
    ensure_topics(AdminClient(client_config(bootstrap)), declare_topics(namespace))


def settings_for(bootstrap: str, redis_url: str, namespace: str, home: Path) -> Settings:
    return load_settings({"REEF_BOOTSTRAP_SERVERS": bootstrap, "REEF_REDIS_URL": redis_url,
                          "REEF_NAMESPACE": namespace, "REEF_HOME": str(home)})


def fleet_of(redis_url: str, namespace: str, ttl_s: float = 20.0) -> Fleet:
    client = redis_client.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    return Fleet(client, namespace, ttl_s=ttl_s)


def write_checkpoint(store: Path, step: int, alpha: float, *, model: str = "tiny",
                     recipe: str = "promoting") -> Checkpoint:
    """A real checkpoint of the tiny model at ``alpha`` (see tests.recipes.evaluators), and the
    Checkpoint event a trainer would emit for it (policy version = step)."""
    stored = CheckpointStore(store).write(CheckpointContents(
        step=step, policy_version=step, model=model, recipe=recipe, trainer_group=TRAINER_GROUP,
        weights=weights(alpha), optimizer={}, rng={}, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64), created_at=now_ms()))
    return Checkpoint(checkpoint_id=stored.checkpoint_id, recipe=recipe,
                      trainer_group=TRAINER_GROUP, step=step, model=model, policy_version=step,
                      uri=stored.uri, sha256=stored.sha256, offsets=(), trained_unit_count=0,
                      metrics={"loss": 1.0 - alpha}, created_at=now_ms())


def produce_checkpoints(bootstrap: str, namespace: str, *events: Checkpoint) -> None:
    """The events on ``<ns>.checkpoints``, keyed by trainer group, acknowledged."""
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    for event in events:
        value, headers = encode(event)
        producer.produce(checkpoints(namespace), key=event.trainer_group.encode(), value=value,
                         headers=headers)
    assert producer.flush(30) == 0


def produce_publications(bootstrap: str, namespace: str, *events: Publication) -> None:
    """Publications as the evaluator would produce them (the follower tests play the evaluator)."""
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    for event in events:
        value, headers = encode(event)
        producer.produce(publications(namespace), key=publication_key(event), value=value,
                         headers=headers)
    assert producer.flush(30) == 0


def promoted(checkpoint: Checkpoint, *, uri: str | None = None,
             sha256: str | None = None) -> Publication:
    """A PROMOTED publication of ``checkpoint`` (pointing at ``uri`` / ``sha256`` if given)."""
    return Publication(model=checkpoint.model, policy_version=checkpoint.policy_version,
                       checkpoint_id=checkpoint.checkpoint_id, uri=uri or checkpoint.uri,
                       sha256=sha256 or checkpoint.sha256, decision=Decision.PROMOTED,
                       reason="promoted by the test", evaluator="test", evaluated=True,
                       created_at=now_ms())


def run_evaluator(recipe: str, settings: Settings, *, fleet: Fleet | None = None,
                  idle_exit: float = 3.0, **options) -> EvaluateSummary:
    """An evaluator of ``tests.recipes.<recipe>`` run in this process until it was idle for
    ``idle_exit`` seconds; returns its summary."""
    worker = EvaluatorWorker(load_recipe(f"tests.recipes.{recipe}"), settings=settings,
                             options=EvaluateOptions(idle_exit=idle_exit, **options), fleet=fleet)
    return worker.run()


def read_publications(bootstrap: str, namespace: str, expected: int) -> list[Publication]:
    return consume_events(bootstrap, publications(namespace), expected, Publication)


def publication_keys(bootstrap: str, namespace: str, expected: int) -> list[bytes]:
    return [m.key() for m in consume_all(bootstrap, publications(namespace), expected)]


class Loads:
    """An ``on_version`` callback recording every version handed over (thread-safe)."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.weights: dict[int, dict] = {}
        self._lock = threading.Lock()

    def __call__(self, loaded) -> None:
        with self._lock:
            self.versions.append(loaded.policy_version)
            self.weights[loaded.policy_version] = dict(loaded.weights)


def eventually(predicate, timeout: float = 15.0, what: str = "the condition") -> None:
    """Wait until ``predicate()`` is true (polling), or fail the test (``wait_until``)."""
    wait_until(predicate, timeout, what)


class Running:
    """An evaluator of ``tests.recipes.<recipe>`` on a thread, until ``stop`` (which returns
    its summary)."""

    def __init__(self, recipe: str, settings: Settings, fleet: Fleet | None) -> None:
        self.worker = EvaluatorWorker(load_recipe(f"tests.recipes.{recipe}"), settings=settings,
                                      options=EvaluateOptions(supersede=False), fleet=fleet)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> EvaluateSummary:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.worker.summary


def decided(bootstrap: str, namespace: str) -> list[Publication]:
    """Every publication in the namespace, read to the end."""
    with PublicationLedger(bootstrap, namespace) as ledger:
        return ledger.catch_up()
