"""A supervised cluster: the trainer's host paused while a replacement starts on a spare host,
then resumed (a zombie), and the processor's host killed and replaced, under the demo's load.

One run of ``tests/cluster/scenario.py`` with its supervisor (``tests/cluster/supervisor.py``):
every process on ``trainer`` is stopped (SIGSTOP), the trainer starts on ``trainer-b`` against
the same broker, Redis and checkpoint store and trains, and the old one is resumed: it must be
fenced at its first write (the newer trainer's ``init_transactions`` fenced its producer),
exit, and commit no checkpoint after the replacement's first. Then every process on
``processor`` is killed and the processor starts on ``processor-b``. The log must show nothing
lost or trained twice, one chain of committed checkpoints with one writer after the other,
and the replica serving the newest promoted version. Needs root (``ip netns``)."""

from __future__ import annotations

import os

import pytest

from reef_stream.demo.run import DemoOptions
from tests.cluster.hosts import links, namespaces
from tests.cluster.scenario import Fault, run_cluster


@pytest.mark.timeout(900)
def test_a_paused_trainer_replaced_on_another_host_is_fenced_and_a_killed_processor_replaced(
        settings, tmp_path, namespace):
    # Network namespaces need root, as CI has it: without it this fails, never skips.
    assert os.geteuid() == 0, "the emulated-host scenario makes network namespaces: run as root"
    # This process's namespaces and links (others may be making theirs at the same time).
    mine = (f"reefh-{os.getpid()}-", f"rh{os.getpid()}-")
    before = ([n for n in namespaces() if n.startswith(mine[0])],
              [k for k in links() if k.startswith(mine[1])])
    run = run_cluster(
        [Fault("pause-replace", "trainer", seconds=10, at_s=5),
         Fault("kill", "processor", at_s=5)],
        settings=settings, workdir=tmp_path, versions_after=1,
        options=DemoOptions(replicas=1, rate=50.0, time_limit=600, drain_s=120,
                            namespace=namespace))
    print(run.result.line())
    print(run.verdict())
    print(run.counts(), f"recover_s={run.recover_s}", f"writers={run.writers}")
    assert run.passed, run.verdict()
    counts = run.counts()
    assert counts["acknowledged"] > 0 and counts["lost"] == 0
    assert counts["trained_twice"] == 0 and counts["forks"] == 0
    assert counts["fenced_writes"] >= 1
    # The zombie: resumed after its replacement trained, fenced at its first write, exited;
    # nothing is left on its host.
    zombie = run.replaced["trainer"]
    assert zombie.how == "pause" and zombie.resumed_at is not None
    assert zombie.old_fenced >= 1 and zombie.old_status not in (None, 0), zombie
    assert zombie.left_on_host == [], zombie
    assert run.replaced["processor"].new_started and run.replaced["processor"].left_on_host == []
    # One writer, then the replacement's, which trained after the zombie and never the
    # zombie again: its last step was before the replacement's first.
    blocks = [w for i, w in enumerate(run.writers) if i == 0 or w != run.writers[i - 1]]
    assert len(blocks) == 2 and run.writers.count(blocks[1]) >= 1, run.writers
    assert run.result.cpu_seconds.get("trainer-b", 0) > 0, run.result.cpu_seconds
    assert run.served == {"replica-0": run.newest_promoted}
    # The hosts, spares included, their links and processes are gone.
    assert ([n for n in namespaces() if n.startswith(mine[0])],
            [k for k in links() if k.startswith(mine[1])]) == before == ([], [])
