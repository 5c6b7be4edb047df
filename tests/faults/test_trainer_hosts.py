"""A data-parallel trainer's two ranks on two emulated hosts (``tests/cluster/ranks.py``):
``torchrun --nnodes 2`` with gloo, one rank on host ``rank-0`` and one on ``rank-1``, the
broker on host ``kafka``, the checkpoint store a directory both hosts see (as a shared
filesystem would be). The ranks meet at rank-0's address on the bridge and exchange their
gradients over it; they train to the same step, their committed checkpoints form one chain,
and the final weights are bitwise those of the same two-rank job on one host. With rank-1's
host cut off, the job fails within the ranks' timeout (``reef train --ranks-timeout-s``), and
once healed a restarted job resumes from the newest committed checkpoint to the weights of a
job that never stopped. Needs root (``ip netns``)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from reef_stream.demo.verify import checkpoint_chain, committed_checkpoints
from reef_stream.engine.checkpoints import CheckpointStore, load
from tests.cluster.hosts import KAFKA_PORT, Hosts, links, namespaces
from tests.cluster.ranks import MASTER_PORT, RankJob, broker
from tests.helpers import wait_until
from tests.unit_log import create_topics, produce_units, rollout_unit

STEPS = 4
RECIPE = "tests.recipes.trainable_dp"
#: Seconds a job may take on a loaded machine before the test gives up on it.
JOB_TIMEOUT_S = 300
#: Seconds an exchange between the ranks waits for the other (``--ranks-timeout-s``) in the
#: fault test: a rank whose peer's host is cut off raises past it, and so the job fails. With
#: room for what one rank may do while the other waits on a loaded machine: start up (the
#: rendezvous has the same timeout), open its transactional producer on a fresh broker, write
#: and acknowledge a checkpoint of the tiny model (under a second when quiet).
RANKS_TIMEOUT_S = 30
#: The units of the whole run: STEPS steps of 4, and 2 more.
UNITS = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4 + 2)]


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
    return subprocess.run([*wrap, sys.executable, "-c", code],
                          capture_output=True).returncode == 0


@contextmanager
def _cluster(settings, tmp_path, namespace) -> Iterator[tuple[Hosts, str, dict[str, str]]]:
    """Hosts ``kafka``, ``rank-0`` and ``rank-1``, a broker on ``kafka`` with the namespace's
    topics: the hosts, the bootstrap address and the trainer's environment. Everything made is
    removed on the way out, also when the block raised."""
    # Network namespaces need root, as CI has it: without it this fails, never skips.
    assert os.geteuid() == 0, "the emulated-host tests make network namespaces: run as root"
    with Hosts(["kafka", "rank-0", "rank-1"], workdir=tmp_path / "hosts") as hosts:
        cluster = broker(hosts, "kafka", tmp_path / "kafka", settings.cache_dir)
        try:
            bootstrap = cluster.up(port=KAFKA_PORT)
            assert bootstrap == f"{hosts.address('kafka')}:{KAFKA_PORT}"
            create_topics(bootstrap, namespace)
            env = dict(os.environ, REEF_BOOTSTRAP_SERVERS=bootstrap, REEF_NAMESPACE=namespace,
                       REEF_HOME=str(tmp_path / "home"))
            env.pop("REEF_REDIS_URL", None)   # the trainer needs none
            yield hosts, bootstrap, env
        finally:
            cluster.down()
    # The hosts, their links and processes are gone (only this process's: other tests may make
    # hosts of their own meanwhile).
    assert _made_here() == ([], [])


def _failed(job: RankJob, codes) -> str:
    return (f"{codes}\nrank-0:\n{job.log('rank-0')[-3000:]}\n"
            f"rank-1:\n{job.log('rank-1')[-3000:]}")


def _steps(bootstrap: str, namespace: str, group: str) -> list[int]:
    """The steps of ``group``'s committed checkpoint events, in log order."""
    return [c.step for c in committed_checkpoints(bootstrap, namespace, "trainable", group)]


@pytest.mark.timeout(900)
def test_two_ranks_on_two_hosts_train_the_weights_of_two_ranks_on_one(settings, tmp_path,
                                                                       namespace):
    with _cluster(settings, tmp_path, namespace) as (hosts, bootstrap, env):
        produce_units(bootstrap, namespace, UNITS, spread=True)
        shared = tmp_path / "shared"   # the store both hosts see

        # rank-1's host reaches the root namespace's loopback services not at all: a listener
        # on 127.0.0.1 here is reached from here, and not from rank-1.
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            assert _reaches([], port)
            assert not _reaches(hosts.wrap("rank-1"), port)

        apart = RankJob(hosts, ["rank-0", "rank-1"], _train_args("apart", shared / "apart"),
                        env, tmp_path / "apart")
        assert apart.master_addr == hosts.address("rank-0")
        stop = threading.Event()
        peers = _watch_peers(hosts, "rank-1", stop)
        try:
            apart.start()
            codes = apart.wait(JOB_TIMEOUT_S)
        finally:
            stop.set()
        assert codes == {"rank-0": 0, "rank-1": 0}, _failed(apart, codes)
        for host in ("rank-0", "rank-1"):
            assert apart.log(host).count(f"now at step {STEPS}") == 1, apart.log(host)[-3000:]
        assert "rank 0 of 2 owns partitions [0, 2, 4]" in apart.log("rank-0")
        assert "rank 1 of 2 owns partitions [1, 3, 5]" in apart.log("rank-1")
        # rank-1 talked to rank-0 at its bridge address: the rendezvous (torchrun's store on
        # MASTER_PORT) and gloo's pairs (other ports); to nothing but rank-0 and kafka.
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


@pytest.mark.timeout(900)
def test_a_rank_host_cut_off_fails_the_job_and_a_restart_resumes_from_the_newest_checkpoint(
        settings, tmp_path, namespace):
    ranks, shared = ["rank-0", "rank-1"], tmp_path / "shared"
    bounded = ("--ranks-timeout-s", str(RANKS_TIMEOUT_S))
    with _cluster(settings, tmp_path, namespace) as (hosts, bootstrap, env):
        # Units for 3 steps (12: a multiple of the 6 partitions, so the rest, produced later,
        # land on the partitions one call would have put them on).
        produce_units(bootstrap, namespace, UNITS[:12], spread=True)
        first = RankJob(hosts, ranks, [*_train_args("cut", shared / "cut"), *bounded], env,
                        tmp_path / "first")
        first.start()
        wait_until(lambda: _steps(bootstrap, namespace, "cut") == [1, 2, 3], JOB_TIMEOUT_S,
                   lambda: f"steps 1 to 3 committed, not {_steps(bootstrap, namespace, 'cut')}"
                           f"\n{first.log('rank-0')[-3000:]}", poll_s=1)

        # Waiting for step 4's units, the ranks meet every second; rank-1's host cut off, each
        # rank's next meeting waits RANKS_TIMEOUT_S for the other and raises, and torchrun
        # fails the job on both hosts (rank 0 also gets step 4's units, produced now).
        hosts.partition("rank-1")
        cut_at = time.monotonic()
        produce_units(bootstrap, namespace, UNITS[12:], spread=True)
        codes = first.wait(RANKS_TIMEOUT_S + 120)
        failed_after = time.monotonic() - cut_at
        assert None not in codes.values() and 0 not in codes.values(), _failed(first, codes)
        for host in ranks:   # gloo's own words, with the bound the job was given
            assert f"Timed out waiting {RANKS_TIMEOUT_S * 1000}ms" in first.log(host), \
                first.log(host)[-3000:]
        hosts.heal("rank-1")
        assert _steps(bootstrap, namespace, "cut") == [1, 2, 3]

        # Restarted (a new rendezvous port: the old one's sockets may linger), it resumes from
        # step 3 and trains step 4 alone.
        second = RankJob(hosts, ranks, [*_train_args("cut", shared / "cut"), *bounded], env,
                         tmp_path / "second", master_port=MASTER_PORT + 1)
        second.start()
        codes = second.wait(JOB_TIMEOUT_S)
        assert codes == {"rank-0": 0, "rank-1": 0}, _failed(second, codes)
        for host in ranks:
            assert "group cut at step 3 " in second.log(host), second.log(host)[-3000:]

        # A job that never stopped, for the weights.
        whole = RankJob(hosts, ranks, _train_args("whole", shared / "whole"), env,
                        tmp_path / "whole", master_port=MASTER_PORT + 2)
        whole.start()
        codes = whole.wait(JOB_TIMEOUT_S)
        assert codes == {"rank-0": 0, "rank-1": 0}, _failed(whole, codes)

        chain = checkpoint_chain(committed_checkpoints(bootstrap, namespace, "trainable", "cut"))
        assert (chain["checkpoints"], chain["steps"], chain["forks"], chain["breaks"]) == \
            (STEPS, STEPS, 0, 0), chain
        finals = {}
        for group in ("cut", "whole"):
            steps = [load(c.uri, c.sha256) for c in CheckpointStore(shared / group).steps()]
            assert [c.step for c in steps] == list(range(1, STEPS + 1)), group
            trained = Counter(u for c in steps for u in c.step_units)
            assert len(trained) == STEPS * 4 and set(trained.values()) == {1}, group
            finals[group] = steps
        assert [c.step_units for c in finals["cut"]] == [c.step_units for c in finals["whole"]]
        for name, tensor in finals["whole"][-1].weights.items():
            assert torch.equal(tensor, finals["cut"][-1].weights[name]), name
        print(f"the job failed {failed_after:.1f} s after rank-1's host was cut off")
