"""The demo's pipeline on emulated hosts (``tests/cluster/scenario.py``), short: each part on
a network namespace of its own (broker, Redis, reward worker, processor, trainer, evaluator,
a replica), the trainer's host partitioned away for 50 s (past the consumer groups' 45 s
session timeout) and healed, then every promise checked from the log: every acknowledged
generation in its topic with exactly one outcome, no unit trained twice or lost, one chain of
committed checkpoints, the trainer training again after the heal, and the replica serving
the newest promoted version after it.
``bench/cluster.py`` runs the same with its table. Needs root (``ip netns``)."""

from __future__ import annotations

import os

import pytest

from reef_stream.demo.run import DemoOptions
from tests.cluster.hosts import links, namespaces
from tests.cluster.scenario import Fault, run_cluster_fault


@pytest.mark.timeout(600)
def test_a_partitioned_trainer_host_heals_and_nothing_is_lost_or_trained_twice(
        settings, tmp_path, namespace):
    # Network namespaces need root, as CI has it: without it this fails, never skips.
    assert os.geteuid() == 0, "the emulated-host scenario makes network namespaces: run as root"
    before = (sorted(namespaces()), sorted(links()))
    run = run_cluster_fault(
        Fault("partition", "trainer", seconds=50, at_s=15), settings=settings,
        workdir=tmp_path, versions_after=2,
        options=DemoOptions(replicas=1, rate=50.0, time_limit=420, drain_s=120,
                            namespace=namespace))
    print(run.result.line())
    print(run.verdict())
    print(run.counts(), f"recover_s={run.recover_s}")
    assert run.passed, run.verdict()
    counts = run.counts()
    assert counts["acknowledged"] > 0 and counts["lost"] == 0
    assert counts["trained_twice"] == 0 and counts["forks"] == 0
    assert run.served == {"replica-0": run.newest_promoted}
    # The hosts, their links and processes are gone.
    assert (sorted(namespaces()), sorted(links())) == before
