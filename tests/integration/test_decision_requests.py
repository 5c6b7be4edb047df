"""A person's decisions are requests the recipe's fenced evaluator applies, against the real
broker: every decision in ``<ns>.publications`` is written by the one fenced writer, in order.

- A decision built on a stale read (another person decided the version between the command's
  read of the ledger and its write) is refused with the reason, and the log holds one decision
  for the version. Before, ``reef reject`` produced its REJECTED publication after ann's
  PROMOTED one: two decisions for version 1.
- With no evaluator running, the command says the request stays queued and exits 1; the next
  evaluator of the recipe applies it, once, and a restarted one does not apply it again. The
  evaluator of another recipe whose evaluator has the same name (tests.recipes.promoting's,
  also ``held-out-score``) passes it over: the publication names its recipe. Before, it
  applied the request too, a second fenced writer deciding the model.
- A request that does not decode is a dead letter with its reason; the evaluator goes on.

The recipe is tests.recipes.approval (a promoted candidate waits for a person); the tests play
the trainer (checkpoints of the tiny model).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from confluent_kafka import Producer

from reef_stream.core.events import DeadLetter, Decision, DecisionOutcome
from reef_stream.core.failpoints import ENV as FAILPOINTS_ENV, RELEASE_ENV
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, decision_outcomes, decision_requests
from tests.helpers import consume_events, reef, wait_until
from tests.integration.publishing import (
    Running, create_topics, decided, fleet_of, produce_checkpoints, run_evaluator,
    settings_for, write_checkpoint,
)


@pytest.fixture
def setup(kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    return settings, fleet_of(redis_url, namespace)


def waiting_for_approval(kafka_bootstrap, namespace, store, version: int, settings) -> None:
    produce_checkpoints(kafka_bootstrap, namespace,
                        write_checkpoint(store, version, 0.5, recipe="approval"))
    run_evaluator("approval", settings, idle_exit=2.0)
    last = decided(kafka_bootstrap, namespace)[-1]
    assert (last.policy_version, last.decision, last.awaiting) == \
        (version, Decision.CANARY, "approval")


def test_a_decision_built_on_a_stale_read_is_refused_and_the_version_has_one_decision(
        setup, cli_env, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    waiting_for_approval(kafka_bootstrap, namespace, tmp_path / "ckpt", 1, settings)
    evaluator = Running("approval", settings, fleet)
    release = tmp_path / "release-bob"
    try:
        # bob's rejection, built on his read (version 1 waiting), stops before it is sent
        # (a failpoint); meanwhile ann approves version 1 in another process, so bob's read is
        # stale when his request goes out.
        bob = subprocess.Popen(
            [sys.executable, "-m", "reef_stream.cli", "reject", "tiny", "1", "--by", "bob",
             "--reason", "answers got longer"],
            env={**cli_env, "COLUMNS": "200", FAILPOINTS_ENV: "decide.before-request",
                 RELEASE_ENV: str(release)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: "failpoint decide.before-request reached" in
                       bob.stderr.readline(), 120, "bob's read of the ledger")
            raced = reef("approve", "tiny", "1", "--by", "ann", "--reason", "read 20 samples",
                         env=cli_env).stdout
            release.touch()
            out, err = bob.communicate(timeout=120)
        finally:
            bob.kill()
            bob.wait()
    finally:
        summary = evaluator.stop()

    assert "PROMOTED tiny version 1 by ann: approved by ann: read 20 samples" in raced
    events = decided(kafka_bootstrap, namespace)
    assert [(p.policy_version, p.decision, p.decided_by) for p in events] == [
        (1, Decision.CANARY, None), (1, Decision.PROMOTED, "ann")], events
    assert bob.returncode == 2, (bob.returncode, out, err)
    assert "the evaluator refused the decision: version 1 of model 'tiny' is not waiting " \
           "for a decision (nothing is; it serves version 1)" in " ".join(err.split())
    assert (summary.requests_applied, summary.requests_refused) == (1, 1)
    outcomes = consume_events(kafka_bootstrap, decision_outcomes(namespace), 2, DecisionOutcome)
    assert [(o.applied, o.policy_version) for o in outcomes] == [(True, 1), (False, None)]
    assert fleet.snapshot().model("tiny").published.version == 1


def test_a_request_no_evaluator_applied_in_time_stays_queued_and_is_applied_once(
        setup, cli_env, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    waiting_for_approval(kafka_bootstrap, namespace, tmp_path / "ckpt", 1, settings)

    queued = reef("approve", "tiny", "1", "--by", "ann", "--wait", "1", env=cli_env,
                  check=False)
    assert queued.returncode == 1, queued
    assert "no evaluator applied the decision on tiny version 1 within 1 s" in queued.stderr
    assert f"it stays queued on {namespace}.decision-requests" in queued.stderr
    assert [p.decision for p in decided(kafka_bootstrap, namespace)] == [Decision.CANARY]

    same_name = run_evaluator("promoting", settings, idle_exit=3.0)  # another recipe's evaluator
    assert (same_name.requests_applied, same_name.requests_refused) == (0, 0)
    assert [p.decision for p in decided(kafka_bootstrap, namespace)] == [Decision.CANARY]

    summary = run_evaluator("approval", settings, fleet=fleet, idle_exit=3.0)
    assert (summary.requests_applied, summary.requests_refused) == (1, 0)
    events = decided(kafka_bootstrap, namespace)
    assert [(p.policy_version, p.decision, p.decided_by) for p in events] == [
        (1, Decision.CANARY, None), (1, Decision.PROMOTED, "ann")]
    assert fleet.snapshot().model("tiny").published.version == 1

    # answered once: a restarted evaluator reads the requests on from the committed position
    again = run_evaluator("approval", settings, idle_exit=2.0)
    assert (again.requests_applied, again.requests_refused) == (0, 0)
    outcomes = consume_events(kafka_bootstrap, decision_outcomes(namespace), 1, DecisionOutcome)
    assert [(o.applied, o.text) for o in outcomes] == [
        (True, "PROMOTED tiny version 1 by ann: approved by ann")]


def test_an_undecodable_request_is_a_dead_letter_and_the_evaluator_goes_on(
        setup, cli_env, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    waiting_for_approval(kafka_bootstrap, namespace, tmp_path / "ckpt", 1, settings)
    producer = Producer(client_config(kafka_bootstrap))
    producer.produce(decision_requests(namespace), key=b"tiny", value=b"approve it, please")
    assert producer.flush(30) == 0
    evaluator = Running("approval", settings, fleet)
    try:
        out = reef("reject", "tiny", "1", "--by", "bob", "--reason", "answers got longer",
                   env=cli_env).stdout
    finally:
        summary = evaluator.stop()
    assert "REJECTED tiny version 1 by bob: rejected by bob: answers got longer" in out
    assert (summary.requests_applied, summary.requests_refused) == (1, 0)
    letters = consume_events(kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
    assert len(letters) == 1
    assert letters[0].reason.startswith("undecodable decision request: ")
    assert (letters[0].source_topic, letters[0].value, letters[0].stage) == \
        (decision_requests(namespace), b"approve it, please", "evaluator")
