"""`reef demo`, shortened: the whole loop learns the toy task from reward alone, through Kafka.

Each test runs the real command (replicas, reward worker, processor, trainer and evaluator as
separate processes on the session's broker and Redis) and then checks what it claims on its
own: the newest promoted version's weights, loaded and verified from the publication, score
at least 0.9 held-out accuracy where the initial policy scores at most chance; the report and
its plots exist; the unit ledger (checked by the command) shows no unit lost or trained twice;
the scorecard the command prints agrees with counts made here; and for GRPO, `reef trace`
follows a real generation and `reef dashboard` charts the run. A few minutes each.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from reef_stream.api.recipe import load_recipe
from reef_stream.core.events import (
    Checkpoint, Decision, Feedback, Generation, Metric, Publication, RolloutUnit,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.recipes import stage_recipe
from reef_stream.demo.task import accuracy, initial_policy, policy_model
from reef_stream.engine.checkpoints import CheckpointStore, load_weights
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import generations, publications, units
from tests.helpers import consume_all, consume_events, reef
from tests.integration.dashboard_check import check_dashboard

TARGET = 0.9
#: The demo's default rate (2 x 300/s, about twice what the trainer trains on two cores; SAO's
#: backlog bound sheds the surplus, GRPO's queue drops what waits too long as too stale).
DEMO_ARGS = ("--replicas", "2", "--target-accuracy", str(TARGET), "--time-limit", "420")


def _run_demo(cli_env, tmp_path, recipe: str, *extra: str):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = reef("demo", "--recipe", recipe, *DEMO_ARGS, "--run-dir", str(run_dir), *extra,
                  env=cli_env, timeout=600, check=False)
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    print(f"\n{recipe} {' '.join(extra)}: {seconds:.0f} s\n{result.stdout[-3000:]}")
    assert result.returncode == 0, output[-6000:]
    namespace = re.search(r"^demo (\S+):", result.stdout, re.M).group(1)
    return run_dir, namespace, result.stdout


def _claimed_publication(kafka_bootstrap, namespace, stdout) -> Publication:
    """The promoted publication of the version the demo says reached the target (the evaluator
    may promote later ones, within its tolerance, before the demo stops it)."""
    claimed = int(re.search(r"at published version (\d+)", stdout).group(1))
    chosen = [p for p in consume_events(kafka_bootstrap, publications(namespace), 1, Publication)
              if p.decision is Decision.PROMOTED and p.policy_version == claimed]
    assert len(chosen) == 1, claimed
    return chosen[0]


def _check_learned(kafka_bootstrap, namespace, recipe: str, run_dir, stdout) -> float:
    seed = load_recipe(stage_recipe(recipe)).schedule.seed
    assert accuracy(initial_policy(seed)) <= 0.1
    newest = _claimed_publication(kafka_bootstrap, namespace, stdout)
    # Its published copy may be pruned by now; the trainer's store keeps every checkpoint.
    stored = [c for c in CheckpointStore(run_dir / "checkpoints").steps()
              if c.sha256 == newest.sha256]
    assert len(stored) == 1, newest
    model = policy_model()
    model.load_state_dict(load_weights(stored[0].uri, stored[0].sha256))  # verified
    learned = accuracy(model)
    assert learned >= TARGET, (newest.policy_version, learned)
    assert learned == pytest.approx(newest.measurement["accuracy"])
    for name in ("report.html", "accuracy.png", "reward.png", "staleness.png", "throughput.png"):
        assert (run_dir / name).stat().st_size > 0, name
    return learned


def _check_scorecard(kafka_bootstrap, namespace, stdout) -> None:
    """The scorecard printed last against what is counted here: the generations topic read
    whole, the ledger clean, no more trained than generated, the CPU of every stage (their own
    metrics) and of the replicas and the broker (measured by the demo)."""
    def figure(label: str) -> str:
        found = re.search(rf"^  {re.escape(label)}: (.*)$", stdout, re.M)
        assert found is not None, (label, stdout[-3000:])
        return found.group(1)

    def pairs(text: str) -> dict[str, str]:
        return dict(item.rsplit(" ", 1) for item in text.split(", "))

    generated = int(figure("generations"))
    assert generated == len(consume_all(kafka_bootstrap, generations(namespace), generated))
    assert 0 < int(figure("samples trained")) <= generated
    ledger = pairs(figure("unit ledger"))
    assert ledger["trained_twice"] == "0" and ledger["lost"] == "0", ledger
    cpu = {stage: float(seconds) for stage, seconds in pairs(figure("CPU by stage, s")).items()}
    # The session's broker runs on this host unless the tests were given one (or Docker's).
    ours = not (os.environ.get("REEF_BOOTSTRAP_SERVERS") or os.environ.get("REEF_TEST_DOCKER"))
    expected = {"reward", "processor", "trainer", "evaluator", "replica"}
    assert expected | ({"broker"} if ours else set()) <= cpu.keys(), cpu
    assert "follower" not in cpu, cpu   # the replicas' processes, counted once as "replica"
    assert all(seconds > 0 for seconds in cpu.values()), cpu


# SAO, the default recipe, learns in the README's main-job test (tests/integration/
# test_readme.py), on the embedded default broker; here GRPO, and SAO under chaos.
@pytest.mark.parametrize("recipe", ["methods.grpo"])
def test_the_demo_learns_from_chance_to_the_target(kafka_bootstrap, cli_env, tmp_path, recipe):
    run_dir, namespace, stdout = _run_demo(cli_env, tmp_path, recipe)
    assert "reached the target" in stdout
    ledger = re.search(r"ledger (\{.*?\})", stdout).group(1)
    assert "'trained_twice': 0" in ledger and "'lost': 0" in ledger, ledger
    _check_learned(kafka_bootstrap, namespace, recipe, run_dir, stdout)
    _check_scorecard(kafka_bootstrap, namespace, stdout)
    _check_trace(kafka_bootstrap, cli_env, namespace, recipe.rpartition(".")[2])
    # `reef dashboard` on the run's metrics: the page's charts render with its data in headless
    # Chromium (screenshot: test-artifacts/dashboard-grpo.png).
    check_dashboard(cli_env, namespace, f"dashboard-{recipe.rpartition('.')[2]}")


def _record_at(bootstrap, topic, partition, offset):
    consumer = Consumer(client_config(bootstrap, {"group.id": "trace-check"}))
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        message = consumer.consume(1, timeout=10)[0]
        assert message.error() is None and message.offset() == offset
        return SchemaRegistry.default().decode(message.value(), message.headers())
    finally:
        consumer.close()


def _check_trace(kafka_bootstrap, cli_env, namespace, recipe_name):
    """`reef trace` of a generation of the run's first unit: the whole chain, and every link
    that names a record points to that record."""
    unit = consume_events(kafka_bootstrap, units(namespace, recipe_name), 1, RolloutUnit)[0]
    generation_id = unit.members[0].generation_id
    result = reef("trace", generation_id, "--json", env={**cli_env, "REEF_NAMESPACE": namespace},
                  timeout=300)
    lineage = json.loads(result.stdout)
    assert lineage["complete"], lineage
    kinds = [link["kind"] for link in lineage["links"]]
    assert kinds[:3] == ["generation", "feedback", "unit"], kinds
    assert {"step", "publication", "replica"} <= set(kinds), kinds
    for link in lineage["links"]:
        event = _record_at(kafka_bootstrap, link["topic"], link["partition"], link["offset"])
        if link["kind"] == "generation":
            assert isinstance(event, Generation) and event.generation_id == generation_id
        elif link["kind"] == "feedback":
            assert isinstance(event, Feedback) and event.generation_id == generation_id
        elif link["kind"] == "unit":
            assert isinstance(event, RolloutUnit) and event.unit_id == unit.unit_id
        elif link["kind"] == "step":
            assert isinstance(event, Checkpoint) and f"step {event.step} " in link["text"]
        elif link["kind"] == "publication":
            assert isinstance(event, Publication) and event.decision is Decision.PROMOTED
        elif link["kind"] == "replica":
            assert isinstance(event, Metric) and event.labels["replica"] in link["text"]


def test_the_demo_converges_under_chaos_and_loses_no_unit(kafka_bootstrap, cli_env, tmp_path):
    run_dir, namespace, stdout = _run_demo(cli_env, tmp_path, "methods.sao", "--chaos",
                                           "--seed", "3")
    kills = re.search(r"chaos kills (\{.*?\})", stdout)
    assert kills is not None and re.search(r"'trainer': [1-9]", kills.group(1)), stdout[-2000:]
    ledger = re.search(r"ledger (\{.*?\})", stdout).group(1)
    assert "'trained_twice': 0" in ledger and "'lost': 0" in ledger, ledger
    assert int(re.search(r"'trained': (\d+)", ledger).group(1)) > 0
    _check_learned(kafka_bootstrap, namespace, "methods.sao", run_dir, stdout)
    _check_scorecard(kafka_bootstrap, namespace, stdout)
