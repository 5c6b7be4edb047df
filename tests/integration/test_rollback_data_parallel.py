"""Liveness after rejections with a data-parallel trainer: two ranks (torchrun, gloo on the CPU),
a real evaluator that rejects versions 2 to 5, a replica that follows what is published, and
this test as the fleet (each unit carries the version the replica serves; units alternate
between the two ranks' partitions).

As in ``test_rollback``: version 1 promoted, 2, 3 and 4 rejected, ``max_staleness`` 2, so at
step 4 every unit is too stale. Rank 0 sees the stall; the ranks agree on it at a meeting, rank
0 acknowledges version 1's weights as version 5, every rank resumes from it (one model on every
rank: checked by the digests the recipe's model writes before each forward pass), and the
ranks train on past it to step ``TARGET_STEP``."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from confluent_kafka import Producer

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
from reef_stream.core.events import Checkpoint, DeadLetter, Decision, Publication
from reef_stream.core.processes import free_ports
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.checkpoints import CheckpointStore, load
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.serving.follower import Follower
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import checkpoints, dead_letters, publications, units
from tests.helpers import consume_events, wait_until
from tests.integration.publishing import Loads, settings_for
from tests.unit_log import create_topics, rollout_unit

RECIPE = "rejects_in_a_row_dp"
GROUP = "rbdp"   # the recipe names no model: the group's name is the model's
TARGET_STEP = 8  # three steps past the rollback (version 5)


def test_data_parallel_ranks_stalled_by_rejections_roll_back_together_and_train_on(
        kafka_bootstrap, redis_url, namespace, tmp_path, cli_env):
    create_topics(kafka_bootstrap, namespace, recipe=RECIPE)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    recipe = load_recipe(f"tests.recipes.{RECIPE}")
    store, digests = tmp_path / "ckpt", tmp_path / "digests"
    digests.mkdir()
    # Each candidate decided on its own (not superseded by a newer one waiting with it).
    evaluator = EvaluatorWorker(recipe, settings=settings,
                                options=EvaluateOptions(keep_published=0, supersede=False))
    evaluating = threading.Thread(target=evaluator.run, daemon=True)
    evaluating.start()
    trainer = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_ports(1)[0]), "-m", "reef_stream.cli", "train",
         "--recipe", f"tests.recipes.{RECIPE}", "--group", GROUP, "--checkpoints", str(store),
         "--keep", "0", "--max-steps", str(TARGET_STEP)],
        env={**cli_env, "REEF_TEST_DIGESTS": str(digests)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    registry, topic = SchemaRegistry.default(), units(namespace, RECIPE)
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all",
                                                        "enable.idempotence": True}))
    loads, produced = Loads(), []
    try:
        with Follower(GROUP, on_version=loads, settings=settings, replica_id="r1",
                      fleet=None) as replica:
            def one_more_unit_until_the_target() -> bool:
                latest = CheckpointStore(store).latest()
                if (latest is not None and latest.step >= TARGET_STEP) \
                        or trainer.poll() is not None:
                    return True
                unit = rollout_unit(len(produced), recipe=RECIPE,
                                    policy_version=replica.policy_version or 0)
                value, headers = registry.encode(unit)   # partition n % 6: ranks alternate
                producer.produce(topic, key=unit.unit_id.encode(), value=value,
                                 headers=headers, partition=len(produced) % 6)
                assert producer.flush(30) == 0
                produced.append(unit)
                return False

            wait_until(one_more_unit_until_the_target, 150,
                       f"the ranks to reach step {TARGET_STEP} past four rejections",
                       poll_s=0.1)
            out, err = trainer.communicate(timeout=60)
            served = loads.versions
        with PublicationLedger(kafka_bootstrap, namespace) as ledger:
            wait_until(lambda: ledger.catch_up() is not None
                       and (ledger.decided_version(GROUP) or 0) >= TARGET_STEP, 60,
                       f"the evaluator to decide version {TARGET_STEP}")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        evaluator.stop()
        evaluating.join(60)
    assert trainer.returncode == 0, err[-4000:]
    assert not evaluating.is_alive()
    # Both ranks rolled back once and stopped at the target.
    assert out.count(f"now at step {TARGET_STEP}") == 2, out
    assert out.count("rolled back 1 times") == 2, out
    assert "rank 1 of 2 owns partitions [1, 3, 5]" in err, err[-3000:]

    # The decisions: 1 promoted, 2-4 rejected by the evaluator's rule, 5 the rollback, then on.
    decided = {p.policy_version: p for p in consume_events(
        kafka_bootstrap, publications(namespace), TARGET_STEP, Publication)}
    assert [decided[v].decision for v in range(1, TARGET_STEP + 1)] == [Decision.PROMOTED] + \
        [Decision.REJECTED] * 3 + [Decision.PROMOTED] * (TARGET_STEP - 4)
    assert decided[5].reason.startswith("rollback:"), decided[5].reason
    assert 5 in served and max(served) >= 6, served

    # Version 5, written by rank 0, is the rollback: version 1's weights at step 4's offsets.
    events = {c.policy_version: c for c in consume_events(
        kafka_bootstrap, checkpoints(namespace), TARGET_STEP, Checkpoint)}
    assert sorted(events) == list(range(1, TARGET_STEP + 1))
    assert {v: c.rolled_back_to for v, c in events.items() if c.rolled_back_to is not None} \
        == {5: 1}
    contents = {v: load(c.uri, c.sha256) for v, c in events.items()}
    rolled, first, fourth = contents[5], contents[1], contents[4]
    assert rolled.rolled_back_to == 1 and rolled.step_units == ()
    assert rolled.offsets == fourth.offsets
    assert set(rolled.weights) == set(first.weights)
    for name, tensor in first.weights.items():
        assert torch.equal(rolled.weights[name], tensor), name
    assert any(not torch.equal(fourth.weights[n], t) for n, t in first.weights.items())
    assert {k.split(".")[0] for k in rolled.rng} == {"rank0", "rank1"}

    # One model on both ranks at every forward pass, before and after the rollback.
    ranks = [(digests / f"rank{r}").read_text().split() for r in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) >= 2 * (TARGET_STEP - 1), \
        [len(r) for r in ranks]

    # Nothing lost: every unit is trained once (one of each rank's per step), or dead-lettered
    # as too stale, or came after the last one its rank trained (not taken when it stopped).
    trained = [u for c in contents.values() for u in c.step_units]
    assert len(trained) == len(set(trained)) == 2 * (TARGET_STEP - 1)
    stale = {letter.reason.split()[1] for letter in consume_events(
        kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
        if letter.error_type == "TooStale"}
    assert stale and not stale & set(trained)
    unaccounted = {u.unit_id for u in produced} - set(trained) - stale
    index = {u.unit_id: i for i, u in enumerate(produced)}   # rank: index % 2
    for rank in (0, 1):
        last = max(index[u] for u in trained if index[u] % 2 == rank)
        assert all(index[u] > last for u in unaccounted if index[u] % 2 == rank), \
            (rank, last, sorted(index[u] for u in unaccounted))
