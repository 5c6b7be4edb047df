"""The Redis fleet projection against real Redis and Kafka: heartbeats expire, the serving version
follows the live replicas, and `reef fleet --rebuild` restores everything after Redis lost it."""

from __future__ import annotations

import dataclasses
import json
import time

from reef_stream.core.events import Decision, now_ms
from reef_stream.publishing.fleet import ReplicaStatus
from reef_stream.serving.follower import Follower
from tests.helpers import reef, wait_until
from tests.integration.publishing import (
    Loads, create_topics, eventually, fleet_of, produce_checkpoints, promoted, run_evaluator,
    settings_for, write_checkpoint,
)


def test_the_serving_version_follows_the_live_replicas(redis_url, namespace, tmp_path):
    fleet = fleet_of(redis_url, namespace, ttl_s=1.5)

    def beat(replica: str, version: int | None) -> None:
        fleet.heartbeat(ReplicaStatus(replica_id=replica, model="m", version=version,
                                      host="h", last_seen=now_ms()))

    beat("new", 3)
    beat("old", 2)
    beat("fresh", None)
    assert fleet.serving_version("m") == 3
    assert [(r.replica_id, r.version) for r in fleet.replicas("m")] == [
        ("fresh", None), ("new", 3), ("old", 2)]

    fleet.leave("new", "m")  # the last replica of version 3 stopped
    assert [r.replica_id for r in fleet.replicas("m")] == ["fresh", "old"]

    def old_sets_2() -> bool:  # v3 expires; the next heartbeat of "old" sets 2
        beat("old", 2)
        return fleet.serving_version("m") == 2

    wait_until(old_sets_2, 10, "serving version 2 once version 3 expired", poll_s=0.2)
    last_beat = time.monotonic()
    # Nobody heartbeats: every replica and the serving version expire (after the 1.5-s TTL).
    wait_until(lambda: fleet.replicas("m") == [] and fleet.serving_version("m") is None, 10,
               "every replica and the serving version to expire")
    assert time.monotonic() - last_beat >= 1.0, "expired before its TTL"

    # The published version only moves forward; a rejection only names the model.
    v5, v4 = (write_checkpoint(tmp_path, step, 0.5) for step in (5, 4))
    assert fleet.record_publication(promoted(v5))
    assert not fleet.record_publication(promoted(v4))
    assert not fleet.record_publication(dataclasses.replace(
        promoted(v5), model="judged", decision=Decision.REJECTED))
    assert fleet.published("tiny").version == 5
    assert {m.model: m.published for m in fleet.snapshot().models}["judged"] is None


def test_fleet_rebuild_restores_the_projection_after_redis_lost_it(
        kafka_bootstrap, redis_url, namespace, tmp_path, cli_env):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    # Heartbeats every 30 s, so every reader here counts a replica live for 180 s: `reef fleet
    # --json` with its default TTL (20 s) once found both replicas' last heartbeats older
    # than that, on a loaded CI machine, and listed none.
    fleet = fleet_of(redis_url, namespace, ttl_s=180)
    produce_checkpoints(kafka_bootstrap, namespace,
                        *(write_checkpoint(tmp_path / "ckpt", step, alpha)
                          for step, alpha in ((1, 0.5), (2, 0.3), (3, 0.7))))
    assert run_evaluator("promoting", settings, fleet=fleet).promoted == 2

    def replica(name: str, model: str = "tiny") -> Follower:
        # Long heartbeats: nothing rewrites Redis behind the test's back while it checks.
        return Follower(model, on_version=Loads(), settings=settings, fleet=fleet,
                        replica_id=name, heartbeat_s=30, ttl_s=180)

    with replica("serving-a") as a, replica("serving-b") as b, \
            replica("waiting-c", model="unpublished") as c:
        gone = replica("gone-d").start()
        assert gone.wait_ready(30) == 3
        gone.stop()  # a clean stop leaves the fleet: the rebuild must not bring it back
        for follower in (a, b, c):
            follower.wait_ready(30)
        eventually(lambda: {r.replica_id: r.version for m in fleet.snapshot().models
                            for r in m.replicas} == {"serving-a": 3, "serving-b": 3,
                                                     "waiting-c": None},
                   what="the three heartbeats")
        before = fleet.snapshot()
        assert before.model("tiny").published.version == 3
        assert before.model("tiny").serving == 3

        assert fleet.clear() > 0  # Redis lost the namespace's keys
        assert fleet.snapshot().models == ()
        shown = reef("fleet", env=cli_env)
        assert "no models in the fleet projection" in shown.stdout

        rebuilt = reef("fleet", "--rebuild", "--ttl", "180", env=cli_env)
        assert "3 publications" in rebuilt.stdout and "3 live replicas" in rebuilt.stdout
        after = fleet.snapshot()
        assert after.models == before.models

        for row in ("serving-a", "serving-b", "waiting-c", "unpublished", "held-out-score"):
            assert row in rebuilt.stdout
        as_json = json.loads(reef("fleet", "--json", "--model", "tiny", "--ttl", "180",
                                  env=cli_env).stdout)
        (tiny,) = as_json["models"]
        assert tiny["published"]["version"] == 3 and tiny["serving"] == 3
        assert {r["replica"]: r["version"] for r in tiny["replicas"]} == {
            "serving-a": 3, "serving-b": 3}
        assert all(0 <= r["age_s"] < 180 for r in tiny["replicas"])
