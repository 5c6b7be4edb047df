"""Staged publication against the real broker and Redis: the publication cadence; a canary on half
the replicas that live feedback rolls back when the candidate is worse and promotes when it is
better, decided again the same way by a restarted evaluator; a person's approval, rejection and
rollback recorded as events; `reef fleet` showing the version waiting.

The tests play the trainer (checkpoints of the tiny model, tests.recipes.evaluators) and the
serving fleet's traffic (generations carrying the version each replica served, and their
feedback); replicas are real ``Follower``s with numbered canary slots.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from confluent_kafka import Producer

from reef_stream.api.canary import Action
from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.canary import CanaryWatch
from reef_stream.core.events import (
    Decision, SamplingParams, now_ms,
)
from reef_stream.core.serde import encode
from reef_stream.ops.trace import trace_generation
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.serving.follower import Follower
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import feedback, generations
from tests import factories
from tests.helpers import reef
from tests.integration.publishing import (
    Loads, Running, create_topics, decided, eventually, fleet_of, produce_checkpoints,
    publication_keys, read_publications, run_evaluator, settings_for, write_checkpoint,
)


@pytest.fixture
def setup(kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    return settings, fleet_of(redis_url, namespace)


def test_at_most_one_promotion_per_publish_every_seconds_of_the_trainers_clock(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, _ = setup
    t0 = now_ms()
    events = [dataclasses.replace(write_checkpoint(tmp_path / "ckpt", step, alpha),
                                  created_at=t0 + offset_s * 1000)
              for step, alpha, offset_s in ((1, 0.5, 0), (2, 0.6, 10), (3, 0.7, 59), (4, 0.8, 61))]
    produce_checkpoints(kafka_bootstrap, namespace, *events)

    summary = run_evaluator("promoting", settings, supersede=False, publish_every_s=60.0)

    decisions = read_publications(kafka_bootstrap, namespace, 4)
    assert [(p.policy_version, p.decision) for p in decisions] == [
        (1, Decision.PROMOTED), (2, Decision.REJECTED), (3, Decision.REJECTED),
        (4, Decision.PROMOTED)]
    assert decisions[1].reason.startswith("publication cadence: version 1 was published from a "
                                          "checkpoint 10.0 s older")
    assert decisions[1].measurement == {}  # not measured
    assert decisions[3].checkpoint_created_at == t0 + 61_000
    assert (summary.promoted, summary.rejected) == (2, 2)

    # without the setting, every promoted candidate is published
    more = [dataclasses.replace(write_checkpoint(tmp_path / "ckpt", step, alpha),
                                created_at=t0 + 62_000) for step, alpha in ((5, 0.85), (6, 0.9))]
    produce_checkpoints(kafka_bootstrap, namespace, *more)
    run_evaluator("promoting", settings, supersede=False)
    assert [p.decision for p in read_publications(kafka_bootstrap, namespace, 6)[4:]] == \
        [Decision.PROMOTED, Decision.PROMOTED]


class Traffic:
    """The fleet's traffic: generations of a version, each with one reward from source
    ``exact`` (1 with probability ``p``), produced acknowledged."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        self.namespace = namespace
        self.producer = Producer(client_config(bootstrap, {"acks": "all",
                                                           "enable.idempotence": True}))
        self.sent = 0

    def serve(self, version: int, n: int, p: float, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(n):
            self.sent += 1
            gid = f"gen-{version}-{seed}-{self.sent}"
            generation = factories.generation(
                gid, request_id=gid, prompt_id=f"p{self.sent % 7}", policy_version=version,
                replica_id="r", prompt_token_ids=factories.ids([1, 2]),
                completion_token_ids=factories.ids([3]),
                completion_logprobs=factories.logprobs([-0.5]),
                sampling=SamplingParams(max_tokens=1), created_at=now_ms())
            reward = factories.feedback(gid, feedback_id=f"fb-{gid}", source="exact",
                                        reward=float(rng.random() < p), created_at=now_ms())
            for topic, event in ((generations(self.namespace), generation),
                                 (feedback(self.namespace), reward)):
                value, headers = encode(event)
                self.producer.produce(topic, key=gid.encode(), value=value, headers=headers)
        assert self.producer.flush(30) == 0


def test_a_worse_candidate_is_rolled_back_by_its_canary_and_a_better_one_promoted(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    store = tmp_path / "ckpt"
    produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 1, 0.5,
                                                                     recipe="canary"))
    evaluator = Running("canary", settings, fleet)
    eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 1, 30, "version 1's decision")
    loads = [Loads() for _ in range(4)]
    replicas = [Follower("tiny", on_version=loads[i], settings=settings, fleet=fleet,
                         replica_id=f"replica-{i}", canary_slot=i / 4, heartbeat_s=0.5).start()
                for i in range(4)]
    try:
        for replica in replicas:
            replica.wait_for_version(1, 30)

        # version 2 is better offline (alpha 0.8 > 0.5): a canary on half the replicas
        produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 2, 0.8,
                                                                         recipe="canary"))
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 2, 30, "the canary")
        canary = decided(kafka_bootstrap, namespace)[1]
        assert (canary.decision, canary.share, canary.awaiting, canary.incumbent_version) == \
            (Decision.CANARY, 0.5, "canary", 1)
        eventually(lambda: sorted(r.policy_version for r in replicas) == [1, 1, 2, 2], 30,
                   "two of four replicas on the canary")
        eventually(lambda: sorted(r.state for r in fleet.snapshot().model("tiny").replicas)
                   == ["canary", "canary", "serving", "serving"], 15, "the fleet's view")
        staged = fleet.snapshot().model("tiny").staged
        assert (staged.version, staged.share, staged.awaiting) == (2, 0.5, "canary")
        assert fleet.snapshot().model("tiny").published.version == 1

        # live feedback, worse on the canary; too little for a decision, then a restart
        traffic = Traffic(kafka_bootstrap, namespace)
        traffic.serve(2, 20, 0.2, seed=1)
        traffic.serve(1, 20, 0.8, seed=2)
        with pytest.raises(AssertionError):
            eventually(lambda: len(decided(kafka_bootstrap, namespace)) > 2, 4, "no decision")
        evaluator.stop()
        traffic.serve(2, 40, 0.2, seed=3)
        traffic.serve(1, 40, 0.8, seed=4)
        evaluator = Running("canary", settings, fleet)
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 3, 30, "the rollback")
        rolled = decided(kafka_bootstrap, namespace)[2]
        assert (rolled.decision, rolled.policy_version, rolled.rolled_back_to) == \
            (Decision.ROLLED_BACK, 2, 1)
        assert rolled.reason.startswith("canary rolled back: canary v2 mean")
        assert rolled.measurement["canary_count"] >= 40
        assert rolled.measurement["canary_mean"] < rolled.measurement["incumbent_mean"]
        assert rolled.measurement["upper"] < -0.05
        assert rolled.measurement["score"] == canary.measurement["score"]  # the offline one too
        eventually(lambda: [r.policy_version for r in replicas] == [1, 1, 1, 1], 30,
                   "every replica back on version 1")
        assert [lv.versions for lv in loads if 2 in lv.versions] and \
            all(lv.versions[-1] == 1 for lv in loads)
        eventually(lambda: fleet.snapshot().model("tiny").staged is None, 10, "nothing staged")
        published = settings.home / "published" / namespace / "tiny"
        eventually(lambda: not (published / "v2").exists(), 10, "the canary's copy deleted")
        assert (published / "v1").exists()
        canary_links = [link.text for link in trace_generation(
            kafka_bootstrap, namespace, "gen-2-1-1").links if link.kind == "canary"]
        assert len(canary_links) == 2
        assert canary_links[0].startswith("version 2 staged on a share of 0.5 of the replicas, "
                                          "awaiting canary")
        assert canary_links[1].startswith("version 2 ROLLED_BACK: canary rolled back")

        # the decision is a function of the log: read again from the canary's start, the same
        with PublicationLedger(kafka_bootstrap, namespace) as ledger:
            ledger.catch_up()
            incumbent = ledger.incumbent("tiny")
        watch = CanaryWatch(kafka_bootstrap, namespace, canary, incumbent,
                            load_recipe("tests.recipes.canary").evaluator.canary)
        try:
            eventually(lambda: watch.step(0.5) is not None, 30, "the same verdict")
            assert watch.verdict.action is Action.ROLL_BACK
        finally:
            watch.close()

        # version 3: better offline and live: promoted by its canary
        produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 3, 0.9,
                                                                         recipe="canary"))
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 4, 30, "the canary of v3")
        eventually(lambda: sorted(r.policy_version for r in replicas) == [1, 1, 3, 3], 30,
                   "two replicas on version 3")
        traffic.serve(3, 60, 0.95, seed=5)
        traffic.serve(1, 60, 0.6, seed=6)
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 5, 30, "the promotion")
        promoted = decided(kafka_bootstrap, namespace)[4]
        assert (promoted.decision, promoted.policy_version, promoted.share) == \
            (Decision.PROMOTED, 3, None)
        assert promoted.reason.startswith("canary passed: canary v3 mean")
        assert promoted.measurement["lower"] >= -0.05
        eventually(lambda: [r.policy_version for r in replicas] == [3, 3, 3, 3], 30,
                   "every replica on version 3")
        summary = evaluator.stop()
        assert (summary.promoted, summary.rolled_back, summary.canaries) == (1, 1, 1)
    finally:
        for replica in replicas:
            replica.stop()
        if evaluator.thread.is_alive():
            evaluator.stop()
    # a restarted evaluator finds every decision made: nothing more
    again = Running("canary", settings, None)
    with pytest.raises(AssertionError):
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) > 5, 3, "nothing new")
    again.stop()
    assert publication_keys(kafka_bootstrap, namespace, 5) == [
        b"tiny", b"tiny#canary", b"tiny#canary", b"tiny#canary", b"tiny"]


def test_a_person_approves_rejects_and_rolls_back_and_each_decision_is_an_event(
        setup, cli_env, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    store = tmp_path / "ckpt"
    evaluator = Running("approval", settings, fleet)  # applies the person's decisions

    def candidate(step: int, alpha: float) -> None:
        before = len(decided(kafka_bootstrap, namespace))
        produce_checkpoints(kafka_bootstrap, namespace,
                            write_checkpoint(store, step, alpha, recipe="approval"))
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == before + 1, 30,
                   f"the decision on version {step}")

    candidate(1, 0.5)
    waiting = json.loads(reef("fleet", "--json", env=cli_env).stdout)["models"][0]
    assert waiting["published"] is None
    assert waiting["staged"]["version"] == 1 and waiting["staged"]["awaiting"] == "approval"
    assert "waiting for a decision: tiny version 1 (share 0, awaiting approval)" in \
        reef("fleet", env=cli_env).stdout
    assert "waiting for a decision: tiny v1 awaiting approval" in \
        reef("top", "--once", env=cli_env).stdout
    fleet.client.delete(f"reef:{namespace}:staged:tiny")  # Redis lost it: rebuilt from Kafka
    rebuilt = json.loads(reef("fleet", "--rebuild", "--json", env=cli_env).stdout)["models"][0]
    assert rebuilt["staged"]["version"] == 1 and rebuilt["staged"]["awaiting"] == "approval"
    refused = reef("approve", "tiny", "2", "--by", "ann", env=cli_env, check=False)
    assert refused.returncode == 2 and "version 2 of model 'tiny' is not waiting" in \
        refused.stderr
    out = reef("approve", "tiny", "1", "--by", "ann", "--reason", "read 20 samples",
               env=cli_env).stdout
    assert "PROMOTED tiny version 1 by ann: approved by ann: read 20 samples" in out

    loads = Loads()
    with Follower("tiny", on_version=loads, settings=settings, fleet=fleet,
                  heartbeat_s=0.5) as replica:
        replica.wait_for_version(1, 30)
        candidate(2, 0.8)
        reef("reject", "tiny", "2", "--by", "bob", "--reason", "answers got longer",
             env=cli_env)
        candidate(3, 0.9)
        reef("approve", "tiny", "3", "--by", "ann", env=cli_env)
        replica.wait_for_version(3, 30)
        assert fleet.snapshot().model("tiny").published.version == 3
        out = reef("rollback", "tiny", "--by", "carl", "--reason", "users report regressions",
                   env=cli_env).stdout
        assert "ROLLED_BACK tiny version 3 by carl" in out and "serve version 1 again" in out
        eventually(lambda: replica.policy_version == 1, 30, "the replica back on version 1")
        assert fleet.snapshot().model("tiny").published.version == 1
    assert loads.versions == [1, 3, 1]
    summary = evaluator.stop()
    assert (summary.requests_applied, summary.requests_refused) == (4, 0)

    events = read_publications(kafka_bootstrap, namespace, 7)
    assert [(p.policy_version, p.decision, p.decided_by) for p in events] == [
        (1, Decision.CANARY, None), (1, Decision.PROMOTED, "ann"), (2, Decision.CANARY, None),
        (2, Decision.REJECTED, "bob"), (3, Decision.CANARY, None), (3, Decision.PROMOTED, "ann"),
        (3, Decision.ROLLED_BACK, "carl")]
    assert events[3].reason == "rejected by bob: answers got longer"
    assert events[6].reason == "rolled back by carl: users report regressions"
    assert events[6].rolled_back_to == 1 and events[6].uri == events[1].uri
    assert all(p.created_at >= events[0].created_at for p in events)
    with PublicationLedger(kafka_bootstrap, namespace) as ledger:
        ledger.catch_up()
        assert ledger.incumbent("tiny").policy_version == 1 and ledger.waiting("tiny") is None
