"""The demo's pipeline on emulated hosts (``tests/cluster/scenario.py``), short: each part on
a network namespace of its own (broker, Redis, the object store, two reward workers, two
processors, the trainer, the evaluator and its standby, two replicas), the trainer's checkpoints
and the evaluator's published copies at ``s3://`` URLs on S3Proxy's host. Two faults, one
after the other: the trainer's host partitioned away for 50 s (past the consumer groups' 45 s
session timeout) and healed, then the trainer isolated for 30 s from the broker but not from
the store (it writes a checkpoint it cannot acknowledge, aborts the step and writes it again
after the heal) and healed. Then every promise is checked from the log: every acknowledged
generation in its topic with exactly one outcome, no unit trained twice or lost, one chain of
committed checkpoints, each of them an object in the bucket (listed through the S3 API), the
trainer training again after each heal, the replicas serving the newest promoted version after
them, the store's secret in no log line or URI, both processors and both reward workers at
work (units committed, generations scored) and exactly one evaluator deciding.
``bench/cluster.py --store s3 --replicas 2 --processors 2 --reward-workers 2 --evaluators 2``
runs the same with its table. Needs root (``ip netns``) and nft.
"""

from __future__ import annotations

import os

import pytest

from reef_stream.demo.run import DemoOptions
from tests.cluster.hosts import PREFIX, links, namespaces
from tests.cluster.scenario import BUCKET, Fault, run_cluster


@pytest.mark.timeout(600)
def test_a_trainer_partitioned_then_cut_off_from_the_broker_loses_and_repeats_nothing(
        settings, tmp_path, namespace):
    # Network namespaces need root, as CI has it: without it this fails, never skips.
    assert os.geteuid() == 0, "the emulated-host scenario makes network namespaces: run as root"
    run = run_cluster(
        [Fault("partition", "trainer", seconds=50, at_s=15),
         Fault("isolate", "trainer", seconds=30, at_s=5)], settings=settings,
        workdir=tmp_path, versions_after=2, store="s3",
        options=DemoOptions(replicas=2, rate=50.0, time_limit=420, drain_s=120,
                            namespace=namespace, processors=2, reward_workers=2,
                            evaluators=2))
    print(run.result.line())
    print(run.verdict())
    print(run.counts(), f"recover_s={run.recover_s}")
    assert run.passed, run.verdict()
    counts = run.counts()
    assert counts["acknowledged"] > 0 and counts["lost"] == 0
    assert counts["trained_twice"] == 0 and counts["forks"] == 0
    assert run.served == {"replica-0": run.newest_promoted, "replica-1": run.newest_promoted}
    # The trainer trained again once the isolation from the broker was healed.
    isolated = run.injected[1]
    assert isolated.fault.kind == "isolate" and isolated.undone_at is not None
    assert isolated.recover_s is not None and run.steps_after > 0
    # Every committed checkpoint is an object in S3Proxy's bucket, as its S3 API lists them.
    assert run.committed_uris and all(u.startswith(f"s3://{BUCKET}/") for u in run.committed_uris)
    assert set(run.committed_uris) <= run.stored and run.secret_leaks == 0
    # Each member of the processors' and the reward workers' groups did its share, and of the
    # evaluators only one decided: the standby holds no fence while the active one lives.
    assert set(run.work) == {"processor", "processor-2", "reward", "reward-2"}, run.work
    assert all(n > 0 for n in run.work.values()), run.work
    assert sorted(run.decisions) == ["evaluator", "evaluator-2"], run.decisions
    assert sorted(n > 0 for n in run.decisions.values()) == [False, True], run.decisions
    # The hosts, their links and processes are gone. Only this process's: another harness on
    # the machine (a bench, another checkout's test) may have hosts of its own meanwhile.
    assert [n for n in namespaces() if n.startswith(f"{PREFIX}-{os.getpid()}-")] == []
    assert [n for n in links() if n.startswith(f"rh{os.getpid()}-")] == []
