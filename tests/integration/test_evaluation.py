"""Candidate evaluation against the real broker and Redis: exactly one decision per checkpoint,
only promoted versions reach replicas, and a late replica converges on the newest one. Of the
candidates waiting together only the newest is measured (``supersede``, once a model has an
incumbent); a test about each candidate's own decision turns that off.

The tests write real checkpoints of a tiny model (tests.recipes.evaluators) and produce their
Checkpoint events themselves (no trainer); the evaluator runs in this process or as `reef
evaluate`; replicas are ``Follower``s in this process. Records on the publications topic that
do not decode are dead-lettered by the evaluator, keyed by where they are, at every reading.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest
import torch

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import (
    EvaluateOptions, EvaluatorWorker, coordinates_key,
)
from reef_stream.consumers.evaluator.superseding import superseded_reason
from reef_stream.core.events import DeadLetter, Decision, Metric
from reef_stream.core.metric_names import (
    CONSUMER_LAG, EVALUATOR_CANDIDATE_VERSION, EVALUATOR_CANDIDATES_SUPERSEDED,
    EVALUATOR_MEASUREMENT, STAGE_EVALUATOR,
)
from reef_stream.engine.checkpoints import CheckpointStore, load_weights
from reef_stream.serving.follower import Follower
from reef_stream.topics.declarations import checkpoints, dead_letters, metrics
from tests.helpers import consume_events, reef
from tests.integration.publishing import (
    Loads, create_topics, eventually, fleet_of, produce_checkpoints, promoted, publication_keys,
    read_publications, run_evaluator, settings_for, write_checkpoint,
)
from tests.integration.undecodable import (
    GARBAGE, decodable_publications, letters, other_schema, publish_raw,
)
from tests.recipes.counting_evaluator import CountingScore
from tests.recipes.evaluators import score, weights


@pytest.fixture
def setup(kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    return settings, fleet_of(redis_url, namespace)


def test_a_rejecting_evaluator_never_promotes_and_replicas_never_load(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    events = [write_checkpoint(tmp_path / "ckpt", step, alpha, recipe="rejecting")
              for step, alpha in ((1, 0.5), (2, 0.8), (3, 0.99))]
    other = write_checkpoint(tmp_path / "other", 4, 0.9, recipe="another-recipe")
    produce_checkpoints(kafka_bootstrap, namespace, *events, other)

    summary = run_evaluator("rejecting", settings, fleet=fleet)

    assert (summary.rejected, summary.promoted, summary.skipped) == (3, 0, 1)
    decisions = read_publications(kafka_bootstrap, namespace, 3)
    assert [p.policy_version for p in decisions] == [1, 2, 3]
    for publication, event in zip(decisions, events):
        assert publication.decision is Decision.REJECTED
        assert publication.evaluator == "unreachable-threshold" and publication.evaluated
        assert "below the threshold" in publication.reason
        assert publication.measurement["score"] == pytest.approx(
            score(load_weights(event.uri, event.sha256)))
        assert publication.incumbent_version is None
        assert publication.uri == event.uri  # a rejected checkpoint is not copied
    assert set(publication_keys(kafka_bootstrap, namespace, 3)) == {b"tiny#rejected"}
    assert not (settings.home / "published").exists()

    loads = Loads()
    with Follower("tiny", on_version=loads, settings=settings, fleet=fleet,
                  heartbeat_s=0.5) as replica:
        assert replica.wait_ready(30) is None
        eventually(lambda: fleet.snapshot().model("tiny").replicas, what="a heartbeat")
        model = fleet.snapshot().model("tiny")
    assert loads.versions == []
    assert model.published is None and model.serving is None
    assert [(r.replica_id, r.version, r.state) for r in model.replicas] == \
        [(replica.replica_id, None, "waiting")]


def test_a_promoting_evaluator_and_a_late_replica_converge_on_the_newest_version(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    store = tmp_path / "ckpt"
    first = [write_checkpoint(store, step, alpha)
             for step, alpha in ((1, 0.5), (2, 0.2), (3, 0.8))]  # v2 is worse than v1
    produce_checkpoints(kafka_bootstrap, namespace, *first)

    summary = run_evaluator("promoting", settings, fleet=fleet, supersede=False)

    assert (summary.promoted, summary.rejected) == (2, 1)
    decisions = read_publications(kafka_bootstrap, namespace, 3)
    assert [(p.policy_version, p.decision, p.incumbent_version) for p in decisions] == [
        (1, Decision.PROMOTED, None), (2, Decision.REJECTED, 1), (3, Decision.PROMOTED, 1)]
    assert all(p.evaluator == "held-out-score" and p.evaluated for p in decisions)
    assert "does not beat version 1" in decisions[1].reason
    assert decisions[2].measurement["score"] > decisions[0].measurement["score"]
    # Each decision's candidate and measurement are Metric events too, in order, and the
    # evaluator's lag on the checkpoints topic ends at 0.
    written = [m for m in consume_events(kafka_bootstrap, metrics(namespace), 6, Metric)
               if m.stage == STAGE_EVALUATOR]
    assert [(m.value, m.labels["decision"]) for m in written
            if m.name == EVALUATOR_CANDIDATE_VERSION] == \
        [(1, "PROMOTED"), (2, "REJECTED"), (3, "PROMOTED")]
    assert [(m.value, m.labels["measure"], m.labels["model"]) for m in written
            if m.name == EVALUATOR_MEASUREMENT] == \
        [(p.measurement["score"], "score", "tiny") for p in decisions]
    lags = {m.labels["partition"]: m.value for m in written if m.name == CONSUMER_LAG}
    assert lags and set(lags.values()) == {0}
    published = settings.home / "published" / namespace / "tiny"
    assert decisions[2].uri == str(published / "v3") and decisions[2].sha256 == first[2].sha256
    assert sorted(p.name for p in published.iterdir()) == ["v1", "v3"]

    # The trainer's retention deletes its own checkpoints: what is served lives on.
    CheckpointStore(store).prune(keep=0)
    shutil.rmtree(store)

    loads = Loads()
    with Follower("tiny", on_version=loads, settings=settings, fleet=fleet,
                  heartbeat_s=0.5) as late:
        assert late.wait_ready(30) == 3
        assert loads.versions == [3]  # straight to the newest: v1 is never loaded
        for name, tensor in weights(0.8).items():
            assert torch.equal(loads.weights[3][name], tensor)

        eventually(lambda: fleet.snapshot().model("tiny").serving == 3, what="serving 3")
        model = fleet.snapshot().model("tiny")
        assert model.published.version == 3 and model.published.evaluated
        assert [(r.replica_id, r.version) for r in model.replicas] == [(late.replica_id, 3)]

        # A newer promoted version reaches the running replica, and Redis shows it.
        produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 4, 0.95))
        assert run_evaluator("promoting", settings, fleet=fleet).promoted == 1
        assert late.wait_for_version(4, 30) == 4
        eventually(lambda: fleet.snapshot().model("tiny").serving == 4, what="serving 4")
        model = fleet.snapshot().model("tiny")
        assert model.published.version == 4 and model.replicas[0].version == 4
    assert loads.versions == [3, 4]


def test_a_reemitted_checkpoint_gets_no_second_decision(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, fleet = setup
    v1 = write_checkpoint(tmp_path / "ckpt", 1, 0.5)
    v2 = write_checkpoint(tmp_path / "ckpt", 2, 0.6)
    produce_checkpoints(kafka_bootstrap, namespace, v1, v2, v1)  # a trainer crash re-emits v1
    first = run_evaluator("promoting", settings)
    assert (first.promoted, first.duplicates) == (2, 1)

    # The trainer restarted from an older checkpoint and emits v2 again (same id), and a
    # different checkpoint with an already decided version.
    again = write_checkpoint(tmp_path / "replayed", 2, 0.9)
    assert again.checkpoint_id != v2.checkpoint_id
    produce_checkpoints(kafka_bootstrap, namespace, v2, again)
    second = run_evaluator("promoting", settings)
    assert (second.checkpoints, second.decided, second.duplicates) == (2, 0, 2)

    # An evaluator that crashed before committing anything reads every event again (a new
    # group has no committed offsets): the ledger of publications holds its decisions.
    replay = run_evaluator("promoting", settings, group=f"{namespace}.evaluate.fresh")
    assert (replay.checkpoints, replay.decided, replay.duplicates) == (5, 0, 5)

    decisions = read_publications(kafka_bootstrap, namespace, 2)
    assert [(p.policy_version, p.decision) for p in decisions] == [
        (1, Decision.PROMOTED), (2, Decision.PROMOTED)]


def test_a_tampered_candidate_or_a_failing_measure_is_rejected_with_the_reason(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, _ = setup
    tampered = write_checkpoint(tmp_path / "ckpt", 1, 0.9)
    weights_file = Path(tampered.uri) / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    good = write_checkpoint(tmp_path / "ckpt", 2, 0.5)
    broken = write_checkpoint(tmp_path / "broken", 1, 0.5, model="judged",
                              recipe="broken-measure")
    produce_checkpoints(kafka_bootstrap, namespace, tampered, good, broken)

    assert run_evaluator("promoting", settings).decided == 2
    summary = run_evaluator("broken_measure", settings, retries=1, backoff=0.01)
    assert (summary.rejected, summary.failed_measures) == (1, 2)

    first, second, third = read_publications(kafka_bootstrap, namespace, 3)
    assert first.decision is Decision.REJECTED and "failed verification" in first.reason
    assert "model.safetensors does not match its sha256" in first.reason
    assert second.decision is Decision.PROMOTED and second.incumbent_version is None
    assert third.decision is Decision.REJECTED and third.model == "judged"
    assert "measure failed on every one of 2 tries" in third.reason
    assert "RuntimeError: the judge is down" in third.reason


def waiting(kafka_bootstrap, namespace, store, versions) -> list:
    """Ever better checkpoints of the ``counting`` recipe, on the topic before an evaluator
    starts: they all wait together."""
    events = [write_checkpoint(store, version, 0.5 + version / 20, recipe="counting")
              for version in versions]
    produce_checkpoints(kafka_bootstrap, namespace, *events)
    return events


def counting_worker(settings, evaluator: CountingScore, **options) -> EvaluatorWorker:
    recipe = dataclasses.replace(load_recipe("tests.recipes.counting_evaluator"),
                                 evaluator=evaluator)
    return EvaluatorWorker(recipe, settings=settings,
                           options=EvaluateOptions(idle_exit=3, **options))


def test_of_the_candidates_waiting_together_only_the_newest_is_measured(
        setup, kafka_bootstrap, namespace, tmp_path, cli_env):
    settings, _ = setup
    evaluator = CountingScore()
    # With no incumbent yet, a candidate is measured whatever waits after it (v1); once there is
    # one, the older of the waiting candidates are superseded (v2).
    waiting(kafka_bootstrap, namespace, tmp_path / "ckpt", (1, 2, 3))
    first = counting_worker(settings, evaluator).run()
    assert evaluator.measured == [1, 3]
    assert (first.promoted, first.rejected, first.superseded) == (2, 1, 1)

    events = waiting(kafka_bootstrap, namespace, tmp_path / "ckpt", (4, 5, 6, 7, 8))
    summary = counting_worker(settings, evaluator).run()

    assert evaluator.measured == [1, 3, 8]
    assert (summary.checkpoints, summary.promoted, summary.rejected, summary.superseded) == \
        (5, 1, 4, 4)
    decisions = read_publications(kafka_bootstrap, namespace, 8)[3:]
    assert [(p.policy_version, p.decision) for p in decisions] == \
        [(v, Decision.REJECTED) for v in (4, 5, 6, 7)] + [(8, Decision.PROMOTED)]
    for publication, event in zip(decisions[:4], events):
        assert publication.reason == superseded_reason(8) and publication.incumbent_version == 3
        assert publication.measurement == {} and publication.uri == event.uri  # not copied
    assert decisions[4].measurement["score"] == pytest.approx(score(weights(0.9)))
    superseded = [m.value for m in consume_events(kafka_bootstrap, metrics(namespace), 1, Metric)
                  if m.stage == STAGE_EVALUATOR and m.name == EVALUATOR_CANDIDATES_SUPERSEDED]
    assert superseded == [1, 1, 2, 3, 4]
    # The operator sees them apart from the candidates measured and found worse.
    top = reef("top", "--once", env=cli_env).stdout
    assert "5 (5 superseded)" in top, top

    # An evaluator that crashed before committing reads all eight again (a new group has no
    # committed offsets): each is found decided, superseded ones included; nothing is measured.
    replay = counting_worker(settings, evaluator, group=f"{namespace}.evaluate.fresh").run()
    assert (replay.checkpoints, replay.decided, replay.duplicates) == (8, 0, 8)
    assert evaluator.measured == [1, 3, 8]


def test_without_supersede_every_waiting_candidate_is_measured(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, _ = setup
    waiting(kafka_bootstrap, namespace, tmp_path / "ckpt", (1, 2, 3, 4, 5))
    evaluator = CountingScore()

    summary = counting_worker(settings, evaluator, supersede=False).run()

    assert evaluator.measured == [1, 2, 3, 4, 5]
    assert (summary.promoted, summary.rejected, summary.superseded) == (5, 0, 0)
    decisions = read_publications(kafka_bootstrap, namespace, 5)
    assert [(p.policy_version, p.incumbent_version) for p in decisions] == \
        [(1, None), (2, 1), (3, 2), (4, 3), (5, 4)]


def test_reef_evaluate_warns_about_accept_everything_and_marks_publications_unevaluated(
        cli_env, kafka_bootstrap, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    event = write_checkpoint(tmp_path / "ckpt", 7, 0.5, recipe="good")
    produce_checkpoints(kafka_bootstrap, namespace, event)
    from confluent_kafka import Producer

    from reef_stream.topics.connect import client_config
    garbage = Producer(client_config(kafka_bootstrap))
    garbage.produce(checkpoints(namespace), key=b"trainer-a", value=b"not avro")
    assert garbage.flush(30) == 0
    produce_checkpoints(kafka_bootstrap, namespace,
                        write_checkpoint(tmp_path / "ckpt", 8, 0.6, recipe="good"))

    result = reef("evaluate", "--recipe", "tests.recipes.good", "--idle-exit", "3",
                      env=cli_env)

    assert "AcceptEverything" in result.stderr and "WITHOUT evaluation" in result.stderr
    # v8 waited with v7, but what measures nothing supersedes nothing: both are promoted.
    assert "checkpoints=3 promoted=2 rejected=0 superseded=0 duplicates=0 skipped=0 " \
        "undecodable=1" in result.stdout
    decisions = read_publications(kafka_bootstrap, namespace, 2)
    assert [p.policy_version for p in decisions] == [7, 8]
    for publication in decisions:
        assert publication.decision is Decision.PROMOTED and not publication.evaluated
        assert publication.evaluator == "accept-everything (unevaluated)"
        assert publication.uri.endswith(f"published/{namespace}/tiny/v{publication.policy_version}")
        load_weights(publication.uri, publication.sha256)
    (letter,) = consume_events(kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
    assert letter.stage == "evaluator" and letter.value == b"not avro"
    assert "undecodable checkpoint event" in letter.reason

    shown = reef("fleet", env=cli_env)
    assert "tiny" in shown.stdout and "UNEVALUATED" in shown.stdout



def test_undecodable_publications_are_dead_lettered_by_the_evaluator_under_a_stable_key(
        setup, kafka_bootstrap, namespace, tmp_path):
    settings, _ = setup
    v1, v2 = (write_checkpoint(tmp_path / "ckpt", step, alpha) for step, alpha in ((1, 0.5),
                                                                                   (2, 0.8)))
    # Around v1's promotion (the incumbent): bytes that are no Avro and carry no header, and a
    # valid event of another schema. Then v2's checkpoint event, to decide on.
    garbage_at, _, foreign_at = publish_raw(kafka_bootstrap, namespace, GARBAGE, promoted(v1),
                                            other_schema())
    produce_checkpoints(kafka_bootstrap, namespace, v2)

    summary = run_evaluator("promoting", settings)

    # The evaluator went on: v1 was read as the incumbent and v2 beat it.
    assert (summary.promoted, summary.undecodable_publications) == (1, 2)
    decided = decodable_publications(kafka_bootstrap, namespace, 2)
    assert [(p.policy_version, p.decision, p.incumbent_version) for p in decided] == [
        (1, Decision.PROMOTED, None), (2, Decision.PROMOTED, 1)]
    written = letters(kafka_bootstrap, namespace, 2, stage=STAGE_EVALUATOR)
    assert set(written) == {garbage_at, foreign_at}
    for where, raw in ((garbage_at, GARBAGE), (foreign_at, other_schema())):
        ((key, letter),) = written[where]
        assert key == coordinates_key(*where) == f"{where[0]}/{where[1]}/{where[2]}".encode()
        assert letter.value == raw.value and letter.key == raw.key
        assert letter.reason.startswith("undecodable publication: ")
    assert "no 'reef-schema-fp' header" in written[garbage_at][0][1].reason
    assert written[garbage_at][0][1].error_type == "UnknownSchemaError"
    assert "reef.events.Metric" in written[foreign_at][0][1].reason
    assert "cannot be read as reef.events.Publication" in written[foreign_at][0][1].reason

    # A replica reading the same topic goes on too, to the newest promoted version.
    loads = Loads()
    with Follower("tiny", on_version=loads, settings=settings, fleet=None) as replica:
        assert replica.wait_ready(30) == 2 and loads.versions == [2]
        assert replica.undecodable == 2

    # A restarted evaluator reads the topic from its beginning and letters both again, under
    # the same keys (at least once, with a stable key); one that is running and idle letters
    # a new bad record as it arrives, with no checkpoint event to decide on.
    worker = EvaluatorWorker(load_recipe("tests.recipes.promoting"), settings=settings)
    running = threading.Thread(target=worker.run, daemon=True)
    running.start()
    try:
        eventually(lambda: worker.summary.undecodable_publications == 2, 30,
                   "the letters of the restarted evaluator")
        (late_at,) = publish_raw(kafka_bootstrap, namespace, GARBAGE)
        eventually(lambda: worker.summary.undecodable_publications == 3, 30,
                   "the letter of a bad record written while the evaluator is idle")
    finally:
        worker.stop()
        running.join(30)
    assert worker.summary.decided == 0 and not running.is_alive()
    written = letters(kafka_bootstrap, namespace, 5, stage=STAGE_EVALUATOR)
    assert {where: [key for key, _ in pairs] for where, pairs in written.items()} == {
        garbage_at: [coordinates_key(*garbage_at)] * 2,
        foreign_at: [coordinates_key(*foreign_at)] * 2,
        late_at: [coordinates_key(*late_at)]}
