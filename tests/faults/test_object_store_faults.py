"""The object store killed in the middle of a checkpoint, and down for a while: the trainer
neither exits nor loses a step, and what it committed is one chain of checkpoints that read
back and verify (issue 27).

A ``reef train`` process writes its checkpoints to S3Proxy (``reef s3 up``). At step 3 it
stops between two of the checkpoint's files (the ``checkpoint.mid-write`` failpoint, released
by a file); the store is SIGKILLed there, then the trainer goes on and meets it dead. It must
abort the step, say so, and keep trying while the store stays down; once the store is back
(``reef s3 up`` again, on the same data), it trains to the end. Every step has exactly one
committed ``Checkpoint`` event, in order, and each one verifies against its sha256.

The evaluator meets a store that is down when it verifies a candidate: it waits the outage
out and decides once the store is back, instead of rejecting the candidate for a store it
could not reach (which it did: the cluster scenario's ``kill:store`` saw version 4 rejected,
"failed verification: ... Could not connect to the endpoint URL").
"""

from __future__ import annotations

import logging
import os
import signal
import time

import fsspec

from reef_stream.core.events import Decision
from reef_stream.engine.checkpoints import verify
from tests.faults.test_trainer_kills import _start, _wait_for_line, lineage, started  # noqa: F401
from tests.integration.test_object_store import (  # noqa: F401 - the fixtures
    BUCKET, _reef, _store, s3_env, store_home,
)
from tests.integration.publishing import (
    Running, decided, eventually, produce_checkpoints, settings_for, write_checkpoint,
)
from tests.integration.publishing import create_topics as create_all_topics
from tests.unit_log import create_topics, produce_units, rollout_unit

STEPS = 6
GROUP = "stored"
DOWN_S = 4


def test_the_store_killed_in_the_middle_of_a_checkpoint_costs_no_step_and_no_fork(
        kafka_bootstrap, cli_env, namespace, tmp_path, started, s3_env,  # noqa: F811
        store_home, request):  # noqa: F811
    create_topics(kafka_bootstrap, namespace)
    produce_units(kafka_bootstrap, namespace,
                  [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4)])
    url = f"s3://{BUCKET}/{request.node.name}"
    release = tmp_path / "release"
    # s3fs retries a refused connection for long by itself: fail in seconds instead.
    env = {**cli_env, **s3_env, "REEF_FAILPOINT_RELEASE": str(release), "AWS_MAX_ATTEMPTS": "1"}
    trainer = _start(env, GROUP, url, started=started, max_steps=STEPS,
                     failpoints="checkpoint.mid-write@3")
    assert _wait_for_line(trainer, r"failpoint checkpoint.mid-write reached \(step 3\)", 180), \
        "".join(trainer.lines)[-3000:]

    pid = _store(store_home).status().pid
    os.kill(pid, signal.SIGKILL)
    release.touch()
    try:
        assert _wait_for_line(trainer, r"aborted \(could not write checkpoint step 3", 120), \
            "".join(trainer.lines)[-3000:]
        time.sleep(DOWN_S)  # the store stays down: the trainer keeps trying, it does not exit
        assert trainer.poll() is None, "".join(trainer.lines)[-3000:]
    finally:
        assert _reef(store_home, "s3", "up").returncode == 0
    out, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, "".join(trainer.lines)[-3000:]
    assert f"now at step {STEPS}" in out, out

    events = lineage(kafka_bootstrap, namespace, GROUP)
    assert [e.step for e in events] == list(range(1, STEPS + 1)), [e.step for e in events]
    for event in events:
        assert event.uri.startswith(f"s3://{BUCKET}/")
        assert set(verify(event.uri, event.sha256)) >= {"model.safetensors", "meta.json"}


def test_the_evaluator_waits_out_a_store_outage_instead_of_rejecting_the_candidate(
        kafka_bootstrap, redis_url, namespace, tmp_path, s3_env, store_home, request,  # noqa: F811
        monkeypatch, caplog):
    create_all_topics(kafka_bootstrap, namespace)
    candidate = write_checkpoint(f"s3://{BUCKET}/{request.node.name}", 1, 0.5)
    assert _reef(store_home, "s3", "down").returncode == 0
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # s3fs retries for long by itself otherwise
    fsspec.filesystem("s3").clear_instance_cache()
    caplog.set_level(logging.WARNING, logger="reef_stream.consumers.evaluator")
    evaluator = Running("promoting", settings_for(kafka_bootstrap, redis_url, namespace,
                                                  tmp_path / "home"), None)
    try:
        produce_checkpoints(kafka_bootstrap, namespace, candidate)
        eventually(lambda: any("the store cannot be reached" in r.getMessage()
                               for r in caplog.records), 60, "the evaluator meeting the outage")
        assert decided(kafka_bootstrap, namespace) == []
        assert _reef(store_home, "s3", "up").returncode == 0
        eventually(lambda: decided(kafka_bootstrap, namespace), 120, "the decision")
    finally:
        _reef(store_home, "s3", "up")   # for the module's other tests, had this one failed
        summary = evaluator.stop()
    [publication] = decided(kafka_bootstrap, namespace)
    assert (publication.policy_version, publication.decision) == (1, Decision.PROMOTED), \
        publication.reason
    assert (summary.promoted, summary.rejected) == (1, 0)
