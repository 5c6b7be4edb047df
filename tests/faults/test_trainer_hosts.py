"""A data-parallel trainer's two ranks on two emulated hosts (``tests/cluster/ranks.py``):
``torchrun --nnodes 2`` with gloo, one rank on host ``rank-0`` and one on ``rank-1``, the
broker on host ``kafka``, the checkpoint store a directory both hosts see (as a shared
filesystem would be). The ranks meet at rank-0's address on the bridge and exchange their
gradients over it; they train to the same step, their committed checkpoints form one chain,
and the final weights are bitwise those of the same two-rank job on one host. Needs root
(``ip netns``)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
from collections import Counter

import pytest
import torch

from reef_stream.demo.verify import checkpoint_chain, committed_checkpoints
from reef_stream.engine.checkpoints import CheckpointStore, load
from tests.cluster.hosts import Hosts, links, namespaces
from tests.cluster.ranks import KAFKA_PORT, MASTER_PORT, RankJob, broker
from tests.unit_log import create_topics, produce_units, rollout_unit

STEPS = 4
RECIPE = "tests.recipes.trainable_dp"
#: Seconds a job may take on a loaded machine before the test gives up on it.
JOB_TIMEOUT_S = 300


def _made_here() -> tuple[list[str], list[str]]:
    """The namespaces and root links of this process's hosts (``Hosts`` names them by pid)."""
    pid = os.getpid()
    return ([n for n in namespaces() if n.startswith(f"reefh-{pid}-")],
            [n for n in links() if n.startswith(f"rh{pid}-")])


def _train_args(group: str, store) -> list[str]:
    return ["train", "--recipe", RECIPE, "--group", group, "--checkpoints", str(store),
            "--keep", "0", "--max-steps", str(STEPS)]


def _peers(hosts: Hosts, host: str) -> set[tuple[str, int]]:
    """The (address, port) of every established TCP connection's far end in ``host``."""
    out = subprocess.run([*hosts.wrap(host), "ss", "-tnH", "state", "established"],
                         capture_output=True, text=True).stdout
    peers = set()
    for line in out.splitlines():
        address, _, port = line.split()[-1].rpartition(":")
        ip = ipaddress.ip_address(address.strip("[]"))   # ss shows v4 on a v6 socket mapped
        peers.add((str(getattr(ip, "ipv4_mapped", None) or ip), int(port)))
    return peers


def _watch_peers(hosts: Hosts, host: str, stop: threading.Event) -> set[tuple[str, int]]:
    """Collects ``_peers`` of ``host`` on a thread every 0.2 s until ``stop`` is set; the set
    returned fills meanwhile."""
    seen: set[tuple[str, int]] = set()

    def watch() -> None:
        while not stop.wait(0.2):
            seen.update(_peers(hosts, host))

    threading.Thread(target=watch, name="reef-test-peers", daemon=True).start()
    return seen


def _reaches(wrap: list[str], port: int) -> bool:
    """A TCP connection to 127.0.0.1:``port`` from the namespace ``wrap`` runs in."""
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).close()"
    return subprocess.run([*wrap, "python3", "-c", code], capture_output=True).returncode == 0


@pytest.mark.timeout(900)
def test_two_ranks_on_two_hosts_train_the_weights_of_two_ranks_on_one(settings, tmp_path,
                                                                       namespace):
    # Network namespaces need root, as CI has it: without it this fails, never skips.
    assert os.geteuid() == 0, "the emulated-host tests make network namespaces: run as root"
    with Hosts(["kafka", "rank-0", "rank-1"], workdir=tmp_path / "hosts") as hosts:
        cluster = broker(hosts, "kafka", tmp_path / "kafka", settings.cache_dir)
        try:
            bootstrap = cluster.up(port=KAFKA_PORT)
            assert bootstrap == f"{hosts.address('kafka')}:{KAFKA_PORT}"
            create_topics(bootstrap, namespace)
            log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4 + 2)]
            produce_units(bootstrap, namespace, log, spread=True)
            env = dict(os.environ, REEF_BOOTSTRAP_SERVERS=bootstrap, REEF_NAMESPACE=namespace,
                       REEF_HOME=str(tmp_path / "home"))
            env.pop("REEF_REDIS_URL", None)
            shared = tmp_path / "shared"   # the store both hosts see

            # rank-1's host reaches the root namespace's loopback services not at all: a
            # listener on 127.0.0.1 here is reached from here, and not from rank-1.
            with socket.create_server(("127.0.0.1", 0)) as listener:
                port = listener.getsockname()[1]
                assert _reaches([], port)
                assert not _reaches(hosts.wrap("rank-1"), port)

            apart = RankJob(hosts, ["rank-0", "rank-1"], _train_args("apart", shared / "apart"),
                            env, tmp_path / "apart")
            assert apart.master_addr == hosts.address("rank-0")
            stop = threading.Event()
            peers = _watch_peers(hosts, "rank-1", stop)
            apart.start()
            codes = apart.wait(JOB_TIMEOUT_S)
            stop.set()
            assert codes == {"rank-0": 0, "rank-1": 0}, \
                f"{codes}\nrank-0:\n{apart.log('rank-0')[-3000:]}\n" \
                f"rank-1:\n{apart.log('rank-1')[-3000:]}"
            for host in ("rank-0", "rank-1"):
                assert apart.log(host).count(f"now at step {STEPS}") == 1, apart.log(host)[-3000:]
            assert "rank 0 of 2 owns partitions [0, 2, 4]" in apart.log("rank-0")
            assert "rank 1 of 2 owns partitions [1, 3, 5]" in apart.log("rank-1")
            # rank-1 talked to rank-0 at its bridge address: the rendezvous (torchrun's store
            # on MASTER_PORT) and gloo's pairs (other ports); to nothing but rank-0 and kafka.
            rank0 = hosts.address("rank-0")
            assert (rank0, MASTER_PORT) in peers, peers
            assert any(a == rank0 and p != MASTER_PORT for a, p in peers), peers
            assert {a for a, _ in peers} <= {rank0, hosts.address("kafka")}, peers

            # The same job, both ranks on one host (rank-0's), reading the same units.
            one = subprocess.run(
                [*hosts.wrap("rank-0"), sys.executable, "-m", "torch.distributed.run",
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(MASTER_PORT), "-m", "reef_stream.cli",
                 *_train_args("together", shared / "together")],
                env=dict(env, GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True,
                timeout=JOB_TIMEOUT_S)
            assert one.returncode == 0, one.stderr[-4000:]

            finals = {}
            for group in ("apart", "together"):
                stored = CheckpointStore(shared / group).steps()
                assert [c.step for c in stored] == list(range(1, STEPS + 1)), group
                steps = [load(c.uri, c.sha256) for c in stored]
                trained = Counter(u for c in steps for u in c.step_units)
                assert len(trained) == STEPS * 4 and set(trained.values()) == {1}, group
                assert {k.split(".")[0] for k in steps[-1].rng} == {"rank0", "rank1"}
                chain = checkpoint_chain(committed_checkpoints(bootstrap, namespace,
                                                               "trainable", group))
                assert chain == {"checkpoints": STEPS, "steps": STEPS, "forks": 0,
                                 "breaks": 0, "writers": 1}, (group, chain)
                finals[group] = steps
            assert [c.step_units for c in finals["apart"]] == \
                [c.step_units for c in finals["together"]]
            for name, tensor in finals["together"][-1].weights.items():
                assert torch.equal(tensor, finals["apart"][-1].weights[name]), name
        finally:
            cluster.down()
    # The hosts, their links and processes are gone (only this process's: other tests may make
    # hosts of their own meanwhile).
    assert _made_here() == ([], [])
