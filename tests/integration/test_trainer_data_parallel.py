"""Data-parallel trainer ranks (torchrun, gloo on the CPU) own disjoint partitions of the units
topic, train one step together and commit together; the result is deterministic."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import torch
from confluent_kafka import Consumer, TopicPartition

from reef_stream.core.processes import free_ports
from reef_stream.engine.checkpoints import CheckpointStore, load
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import units
from tests.helpers import consume_all, reef
from tests.unit_log import create_topics, produce_units, rollout_unit

STEPS = 4


def _torchrun(cli_env, group: str, store, recipe: str = "tests.recipes.trainable_dp",
              timeout: float = 300, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_ports(1)[0]), "-m", "reef_stream.cli", "train",
         "--recipe", recipe, "--group", group, "--checkpoints", str(store),
         "--keep", "0", "--max-steps", str(STEPS), *options],
        env=cli_env, capture_output=True, text=True, timeout=timeout)


def spread_units(kafka_bootstrap: str, namespace: str) -> tuple[list, str, dict[str, int]]:
    """The topics, and STEPS * 4 + 2 units in the units topic: the units, the topic and each
    unit's partition. Spread evenly (unit i to partition i % 6), so neither rank waits for
    data; keyed by hash, a small log can leave a rank's partitions short, and the group
    waits for them."""
    create_topics(kafka_bootstrap, namespace)
    log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4 + 2)]
    produce_units(kafka_bootstrap, namespace, log, spread=True)
    topic = units(namespace, "trainable")
    return log, topic, {m.key().decode(): m.partition()
                        for m in consume_all(kafka_bootstrap, topic, len(log))}


def test_two_ranks_own_disjoint_partitions_and_commit_together(kafka_bootstrap, cli_env,
                                                               namespace, tmp_path):
    log, topic, partition_of = spread_units(kafka_bootstrap, namespace)

    runs = {group: _torchrun(cli_env, group, tmp_path / group) for group in ("dp1", "dp2")}
    for group, result in runs.items():
        assert result.returncode == 0, result.stderr[-4000:]
        assert "rank 0 of 2 owns partitions [0, 2, 4]" in result.stderr, result.stderr[-3000:]
        assert "rank 1 of 2 owns partitions [1, 3, 5]" in result.stderr, result.stderr[-3000:]
        assert result.stdout.count(f"now at step {STEPS}") == 2, result.stdout

    finals = {}
    for group in runs:
        stored = CheckpointStore(tmp_path / group).steps()
        assert [c.step for c in stored] == list(range(1, STEPS + 1))
        steps = [load(c.uri, c.sha256) for c in stored]
        trained = Counter(u for c in steps for u in c.step_units)
        assert len(trained) == STEPS * 4 and set(trained.values()) == {1}
        assert set(trained) <= {u.unit_id for u in log}
        for contents in steps:   # rank 0's half of a step from its partitions, rank 1's from its
            assert {partition_of[u] % 2 for u in contents.step_units[:2]} == {0}
            assert {partition_of[u] % 2 for u in contents.step_units[2:]} == {1}
        assert {k.split(".")[0] for k in steps[-1].rng} == {"rank0", "rank1"}
        # Rank 0 committed every partition, both ranks', at the last checkpoint's offsets.
        consumer = Consumer(client_config(kafka_bootstrap, {"group.id": group}))
        committed = consumer.committed([TopicPartition(topic, p) for p in range(6)], timeout=30)
        consumer.close()
        assert {(tp.partition, tp.offset) for tp in committed} == \
            {(o.partition, o.offset) for o in steps[-1].offsets}
        assert sum(o.offset for o in steps[-1].offsets) == STEPS * 4
        finals[group] = steps[-1].weights
    for name, tensor in finals["dp1"].items():
        assert torch.equal(tensor, finals["dp2"][name]), name


def test_two_ranks_checkpoint_together_every_few_steps_to_the_same_weights(
        kafka_bootstrap, cli_env, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4 + 2)]
    produce_units(kafka_bootstrap, namespace, log, spread=True)
    # Every 2 steps; the other group also once 1 ms has passed (rank 0's clock decides for both
    # ranks), which is after every step.
    cadences = {"every2": ("--set", "schedule.checkpoint_every=2"),
                "every2s": ("--set", "schedule.checkpoint_every=2",
                            "--checkpoint-every-s", "0.001")}
    runs = {group: _torchrun(cli_env, group, tmp_path / group, options=options)
            for group, options in {"every1": (), **cadences}.items()}
    steps = {}
    for group, result in runs.items():
        assert result.returncode == 0, result.stderr[-4000:]
        steps[group] = [load(c.uri, c.sha256) for c in CheckpointStore(tmp_path / group).steps()]
    assert [c.step for c in steps["every1"]] == [1, 2, 3, 4]
    assert [c.step for c in steps["every2"]] == [2, 4]
    assert [c.step for c in steps["every2s"]] == [1, 2, 3, 4]   # the clock came first
    every_step = [u for c in steps["every1"] for u in c.step_units]
    for group in cadences:
        assert [u for c in steps[group] for u in c.step_units] == every_step
        assert {k.split(".")[0] for k in steps[group][-1].rng} == {"rank0", "rank1"}
        for name, tensor in steps["every1"][-1].weights.items():
            assert torch.equal(tensor, steps[group][-1].weights[name]), (group, name)


def test_a_step_that_diverges_on_one_rank_is_abandoned_on_both(kafka_bootstrap, cli_env,
                                                                namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4 + 2)]
    produce_units(kafka_bootstrap, namespace, log, spread=True)
    # Step 1 trains units 0 and 2 on rank 0 and units 1 and 3 on rank 1; step 2 gives unit 5
    # (partition 5) to rank 1, whose advantages are then NaN while rank 0's are finite. Had
    # rank 1 raised alone, rank 0 would wait in the gradient all-reduce until the process
    # group's timeout (30 min), well past this run's.
    result = _torchrun(cli_env, "diverging", tmp_path / "ckpt", "tests.recipes.diverging_dp",
                       timeout=180)
    assert result.returncode != 0, result.stdout
    errors = " ".join(result.stderr.split())   # each rank's message, wrapped to the terminal
    assert f"error: step 2, units {log[5].unit_id}: the objective returned NaN or infinite " \
        "advantages for 4 of 8 samples" in errors, result.stderr[-4000:]
    assert "error: step 2: another data-parallel rank found the objective's advantages NaN " \
        "or infinite (that rank's error names its units; this is rank 0)" in errors, \
        result.stderr[-4000:]
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").steps()] == [1]


def test_a_data_parallel_recipe_refuses_to_run_on_one_process(cli_env, tmp_path):
    result = reef("train", "--recipe", "tests.recipes.trainable_dp", "--group", "solo",
                  "--checkpoints", str(tmp_path), env=cli_env, check=False)
    assert result.returncode == 2, result.stderr
    assert "declares data_parallel_size 2 but 1 trainer process(es) were launched" in \
        result.stderr, result.stderr
