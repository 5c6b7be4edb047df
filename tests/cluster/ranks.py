"""A data-parallel trainer's ranks on emulated hosts (``tests.cluster.hosts``): a KRaft broker on
a host of its own, and one ``torchrun`` node per rank host, which rendezvous at the first rank
host's address on the bridge.

    with Hosts(["kafka", "rank-0", "rank-1"]) as hosts:
        cluster = broker(hosts, "kafka", workdir / "kafka", settings.cache_dir)
        bootstrap = cluster.up(port=KAFKA_PORT)
        job = RankJob(hosts, ["rank-0", "rank-1"], train_args, env, workdir / "logs")
        job.start(); codes = job.wait(300)

Each node runs ``torchrun --nnodes N --nproc-per-node 1 --node-rank R --master-addr
<first host's address>``; gloo is told to use the host's ``eth0`` (``GLOO_SOCKET_IFNAME``):
by default it binds the address the machine's hostname resolves to, 127.0.0.1 here
(``/etc/hosts``), and each rank then tells the other to reach it there: gloo's connect is
refused ("Gloo connectFullMesh failed ... remote=[127.0.0.1]").
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from reef_stream.servers.kafka_local import LocalCluster
from tests.cluster.hosts import Hosts

#: The ranks' rendezvous port on the first rank host (torchrun's own default).
MASTER_PORT = 29500


def broker(hosts: Hosts, host: str, data_dir: Path, cache_dir: Path) -> LocalCluster:
    """A one-node KRaft cluster that runs inside ``host`` and listens on its address (``up``
    starts it, ``down`` stops it), as ``tests.cluster.scenario`` makes its brokers."""
    return LocalCluster(data_dir, cache_dir, hosts=[(hosts.address(host), hosts.wrap(host))])


class RankJob:
    """One ``torchrun`` job whose nodes are ``rank_hosts``, one process per node, each running
    ``python -m reef_stream.cli <train_args>``; each node's output to ``<logs>/<host>.log``."""

    def __init__(self, hosts: Hosts, rank_hosts: Sequence[str], train_args: Sequence[str],
                 env: dict[str, str], logs: Path, master_port: int = MASTER_PORT) -> None:
        self.hosts, self.rank_hosts = hosts, list(rank_hosts)
        self.train_args, self.logs = list(train_args), logs
        self.env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
        #: Where the ranks meet: the first rank host's address on the bridge.
        self.master_addr = hosts.address(self.rank_hosts[0])
        self.master_port = master_port
        self.processes: dict[str, subprocess.Popen] = {}

    def argv(self, node_rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(len(self.rank_hosts)), "--nproc-per-node", "1",
                "--node-rank", str(node_rank), "--master-addr", self.master_addr,
                "--master-port", str(self.master_port),
                "-m", "reef_stream.cli", *self.train_args]

    def start(self) -> None:
        """Start every node on its host; returns once each is inside it."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for rank, host in enumerate(self.rank_hosts):
            self.processes[host] = self.hosts.spawn(host, self.argv(rank),
                                                    self.logs / f"{host}.log", env=self.env)

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Each node's exit code, waiting up to ``timeout`` seconds in all (None: still
        running then; it is left running, and the hosts' ``close`` kills it)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for host, process in self.processes.items():
            try:
                codes[host] = process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[host] = None
        return codes

    def log(self, host: str) -> str:
        path = self.logs / f"{host}.log"
        return path.read_text(errors="replace") if path.exists() else ""
