"""A paused evaluator that wakes up after its replacement took over is fenced by Kafka itself.

Evaluator A of recipe ``gated`` (tests.recipes.gated) is stopped (SIGSTOP, as a paused
container or a long GC would be) in the middle of its first decision, while it measures
version 1; a replacement B of the same recipe starts, fences A (``init_transactions`` with the
recipe's transactional id, when it is assigned the checkpoints), and decides every candidate;
then A is resumed (SIGCONT). A fails at its first write, says so in one line and exits
non-zero. Every candidate has exactly one committed decision, and nothing A wrote after the
fence is visible to a read_committed reader. Before decisions were transactions, A published
its decision on version 1 when it woke, and on every later candidate, a second one each.

B is started in a consumer group of its own so that it need not wait out A's session
(librdkafka's 45 s): the fence is the recipe's, not the group's, so a replacement in A's group
fences A the same way once the group hands it the checkpoints.

A person's decision is fenced the same way: it is a request the active evaluator applies in
its transaction, so a paused evaluator that wakes after its replacement applied a request, and
reads the same request, fails at that write; the request has one outcome and one decision.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter


from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
from reef_stream.core.events import DecisionOutcome, Publication
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.topics.declarations import decision_outcomes, publications
from tests.faults.test_trainer_kills import started  # noqa: F401 - the fixture
from tests.helpers import events_to_end, reef, wait_until
from tests.integration.publishing import (
    create_topics, produce_checkpoints, run_evaluator, settings_for, write_checkpoint,
)

RECIPE = "tests.recipes.gated"
VERSIONS = 4


def _start(env: dict[str, str], *args: str, started: list) -> subprocess.Popen:  # noqa: F811
    """A `reef evaluate` process of the gated recipe; its stderr lines are collected in
    ``process.lines`` by a thread."""
    process = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "evaluate", "--recipe", RECIPE,
         "--no-supersede", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.lines = []
    process.reader = threading.Thread(target=lambda: process.lines.extend(process.stderr),
                                      daemon=True)
    process.reader.start()
    started.append(process)
    return process


def test_a_paused_evaluator_is_fenced_by_its_replacement_and_publishes_nothing_more(
        kafka_bootstrap, cli_env, namespace, tmp_path, started):  # noqa: F811
    create_topics(kafka_bootstrap, namespace)
    candidates = [write_checkpoint(tmp_path / "ckpt", v, 0.5 + v / 10, recipe="gated")
                  for v in range(1, VERSIONS + 1)]
    produce_checkpoints(kafka_bootstrap, namespace, *candidates)
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**cli_env, "REEF_TEST_GATE": str(gate), "COLUMNS": "1000"}  # errors unwrapped

    zombie = _start(env, "--idle-exit", "5", started=started)
    wait_until(lambda: (gate / "measuring-v1").exists() or zombie.poll() is not None,
               timeout=60, message=lambda: "evaluator A never measured version 1:\n"
                                           + "".join(zombie.lines)[-3000:])
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        assert zombie.poll() is None, "".join(zombie.lines)[-3000:]
        (gate / "go").touch()
        replacement = _start(env, "--group", f"{namespace}.evaluate.replacement",
                             "--max-candidates", str(VERSIONS), started=started)
        replacement.wait(timeout=120)
        replacement.reader.join(5)
        said_b = "".join(replacement.lines)
        assert replacement.returncode == 0, said_b[-3000:]
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    zombie.wait(timeout=60)
    zombie.reader.join(5)
    said = "".join(zombie.lines)

    # What every reader sees (read_committed): one decision per candidate, B's.
    decided = events_to_end(kafka_bootstrap, publications(namespace), Publication)
    per_candidate = Counter(p.checkpoint_id for p in decided)
    assert per_candidate == Counter({c.checkpoint_id: 1 for c in candidates}), \
        [(p.policy_version, p.decision.value, p.created_at) for p in decided]
    assert [p.policy_version for p in decided] == list(range(1, VERSIONS + 1))
    with PublicationLedger(kafka_bootstrap, namespace) as ledger:  # as followers read them
        ledger.catch_up()
        assert ledger.read == VERSIONS and ledger.incumbent("tiny").policy_version == VERSIONS
    # A stopped at its first write, with one line that says why, and a non-zero status.
    assert zombie.returncode == 1, said[-3000:]
    fenced = [line for line in said.splitlines() if "was fenced" in line]
    assert len(fenced) == 1 and "newer evaluator of recipe gated" in fenced[0], said[-3000:]


def test_a_paused_evaluator_cannot_apply_a_persons_decision_after_its_replacement_started(
        kafka_bootstrap, cli_env, redis_url, namespace, tmp_path, started):  # noqa: F811
    """Evaluator A of recipe ``approval`` holds the fence and reads the decision requests; it
    is paused (SIGSTOP); B starts in a group of its own and fences A; ann's ``reef approve`` is
    applied by B. A, resumed, reads the same request and fails at its first write: one decision
    and one outcome for the request, both B's."""
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    produce_checkpoints(kafka_bootstrap, namespace,
                        write_checkpoint(tmp_path / "ckpt", 1, 0.5, recipe="approval"))
    run_evaluator("approval", settings, idle_exit=2.0)  # version 1 waits for a person
    env = {**cli_env, "COLUMNS": "1000"}

    zombie = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "evaluate", "--recipe",
         "tests.recipes.approval", "--no-supersede"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    zombie.lines = []
    zombie.reader = threading.Thread(target=lambda: zombie.lines.extend(zombie.stderr),
                                     daemon=True)
    zombie.reader.start()
    started.append(zombie)
    wait_until(lambda: "reads a person's decision requests" in "".join(zombie.lines)
               or zombie.poll() is not None, timeout=60,
               message=lambda: "evaluator A never read the requests:\n"
                               + "".join(zombie.lines)[-3000:])
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        assert zombie.poll() is None, "".join(zombie.lines)[-3000:]
        replacement = EvaluatorWorker(
            load_recipe("tests.recipes.approval"), settings=settings,
            options=EvaluateOptions(group=f"{namespace}.evaluate.replacement", supersede=False))
        thread = threading.Thread(target=replacement.run, daemon=True)
        thread.start()
        try:
            out = reef("approve", "tiny", "1", "--by", "ann", env=env).stdout
            assert "PROMOTED tiny version 1 by ann: approved by ann" in out
        finally:
            replacement.stop()
            thread.join(60)
        assert (replacement.summary.requests_applied, replacement.summary.requests_refused) \
            == (1, 0)
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    zombie.wait(timeout=120)
    zombie.reader.join(5)
    said = "".join(zombie.lines)

    assert zombie.returncode == 1, said[-3000:]
    fenced = [line for line in said.splitlines() if "was fenced" in line]
    assert len(fenced) == 1 and "newer evaluator of recipe approval" in fenced[0], said[-3000:]
    assert "was fenced at the approve request" in fenced[0], fenced[0]
    decided = events_to_end(kafka_bootstrap, publications(namespace), Publication)
    assert [(p.policy_version, p.decision.value, p.decided_by) for p in decided] == [
        (1, "CANARY", None), (1, "PROMOTED", "ann")]
    outcomes = events_to_end(kafka_bootstrap, decision_outcomes(namespace), DecisionOutcome)
    assert [(o.applied, o.evaluator_group) for o in outcomes] == [
        (True, f"{namespace}.evaluate.replacement")]
