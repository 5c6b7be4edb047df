"""The embedded default broker: Apache Kafka 3.9 in KRaft mode, run from jars.

``LocalCluster(data_dir).up()`` is what ``reef kafka up`` does:

1. check Java (17 or newer);
2. resolve the broker's classpath with Maven from ``infra/kafka/pom.xml``
   (jars land in ``~/.m2`` once; the classpath is cached in ``REEF_CACHE_DIR``);
3. on first start, pick ports, write each node's ``server.properties`` from
   ``infra/kafka/server.properties.template`` and format its storage
   (``kafka.tools.StorageTool``); later starts reuse the data directory, so
   every record survives a restart;
4. start each node (``kafka.Kafka``) as a background process of its own
   session, so it outlives the command that started it;
5. wait until the cluster answers through the AdminClient with every broker,
   failing early with the tail of a node's log if one exits.

Everything about a cluster (cluster id, ports, pids) is kept in
``<data>/cluster.json``; ``down``, ``status`` and the fault tests read it.
Each node is a broker and a controller (combined mode); three nodes form a
controller quorum and keep three copies of every partition.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import string
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.processes import free_ports, log_tail, port_is_free, process_matches, reap
from reef_stream.core.settings import KAFKA_INFRA_DIR, Settings
from reef_stream.servers.maven import maven_classpath

KAFKA_VERSION = "3.9.2"
DEFAULT_PORT = 19092
#: Heap of each broker JVM: small enough for three nodes on a 2-core, 24 GiB machine.
JAVA_HEAP = "512m"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class BrokerStartError(FatalError):
    """A broker process exited or did not answer while the cluster was starting."""


@dataclass
class Node:
    """One broker+controller process of the local cluster."""

    node_id: int
    port: int
    controller_port: int
    pid: int | None = None
    #: Where the node listens and what it advertises.
    address: str = "127.0.0.1"

    def directory(self, data_dir: Path) -> Path:
        return data_dir / f"node-{self.node_id}"


@dataclass
class NodeStatus:
    node_id: int
    port: int
    controller_port: int
    pid: int | None
    alive: bool


@dataclass
class ClusterStatus:
    """What ``reef kafka status`` shows."""

    data_dir: Path
    bootstrap: str
    nodes: list[NodeStatus]
    #: Broker ids that answered a metadata request (empty if none answered).
    brokers: list[int]
    #: The active KRaft controller (raft leader) as the nodes record it, if known.
    controller: int | None
    #: Topic name -> number of partitions, reef's and Kafka's internal ones alike.
    topics: dict[str, int]
    error: str | None = None


# --------------------------------------------------------------------------- Java and Maven


def check_java() -> str:
    """Return the path of a Java 17+ executable, or raise ConfigurationError saying what to do."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise ConfigurationError(
            "Java was not found: the local Kafka broker needs Java 17 or newer. "
            "Install it (Debian: apt-get install openjdk-17-jre-headless) or set JAVA_HOME."
        )
    result = subprocess.run([java, "-version"], capture_output=True, text=True)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if not match:
        raise ConfigurationError(f"Could not read the version of {java}: {result.stderr.strip()}")
    major = int(match.group(1))
    if major == 1:  # "1.8.0" style
        major = int(match.group(2) or 0)
    if major < 17:
        raise ConfigurationError(
            f"{java} is Java {major}; the local Kafka broker needs Java 17 or newer. "
            "Install a newer JDK or point JAVA_HOME at one."
        )
    return java


def kafka_classpath(cache_dir: Path, progress: Progress = _quiet) -> str:
    """The broker's Java classpath (``infra/kafka/pom.xml``), resolved by Maven once and cached
    (``servers.maven.maven_classpath``)."""
    return maven_classpath(KAFKA_INFRA_DIR / "pom.xml", cache_dir,
                           f"Apache Kafka {KAFKA_VERSION}'s jars",
                           instead="set REEF_BOOTSTRAP_SERVERS to use an existing Kafka cluster",
                           progress=progress)


# --------------------------------------------------------------------------- the cluster


class LocalCluster:
    """A Kafka cluster of 1 or 3 KRaft nodes on this host, kept in ``data_dir``.

    Methods block until their work is done. ``up`` and ``down`` are idempotent.
    """

    def __init__(self, data_dir: Path, cache_dir: Path,
                 hosts: Sequence[tuple[str, Sequence[str]]] = ()):
        """``hosts``: one ``(address, wrap)`` per node, for the emulated-hosts tests: where
        node i+1 listens and what it advertises (kept when the cluster is created), and the
        argv prefix its process is started under (``ip netns exec NS``, which execs the node:
        the recorded pid is the node's own). Empty: every node on 127.0.0.1, no prefix."""
        self.data_dir = Path(data_dir).resolve()
        self.cache_dir = Path(cache_dir)
        self.state_file = self.data_dir / "cluster.json"
        self.hosts = [(address, list(wrap)) for address, wrap in hosts]
        #: The node processes this object started, by node id.
        self._children: dict[int, subprocess.Popen] = {}

    @classmethod
    def from_settings(cls, settings: Settings, data_dir: Path | None = None) -> "LocalCluster":
        return cls(data_dir or settings.kafka_dir, settings.cache_dir)

    # ----------------------------------------------------------------- state

    def exists(self) -> bool:
        return self.state_file.exists()

    def _load(self) -> tuple[str, list[Node]]:
        state = json.loads(self.state_file.read_text())
        return state["cluster_id"], [Node(**node) for node in state["nodes"]]

    def _save(self, cluster_id: str, nodes: list[Node]) -> None:
        state = {
            "kafka_version": KAFKA_VERSION,
            "cluster_id": cluster_id,
            "bootstrap": self._bootstrap(nodes),
            "nodes": [asdict(node) for node in nodes],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    @staticmethod
    def _bootstrap(nodes: list[Node]) -> str:
        return ",".join(f"{node.address}:{node.port}" for node in nodes)

    def _wrap(self, node: Node) -> list[str]:
        return self.hosts[node.node_id - 1][1] if self.hosts else []

    @property
    def bootstrap(self) -> str:
        """The bootstrap address of a cluster that has been created."""
        return self._bootstrap(self._load()[1])

    @property
    def nodes(self) -> list[Node]:
        return self._load()[1]

    def _marker(self, node: Node) -> str:
        return str(node.directory(self.data_dir) / "server.properties")

    def is_alive(self, node: Node) -> bool:
        return process_matches(node.pid, self._marker(node))

    # ----------------------------------------------------------------- up

    def up(self, nodes: int | None = None, port: int = DEFAULT_PORT, timeout: float = 90.0,
           progress: Progress = _quiet) -> str:
        """Start the cluster (creating it on first use) and return its bootstrap address.

        ``nodes`` (default 1) and ``port`` apply when the cluster is created;
        node i listens on ``port + 2i`` and its controller on ``port + 2i + 1``
        (``port=0`` picks free ports). A later ``up`` restarts the nodes as
        they were created; a running cluster is left as it is.
        """
        if nodes not in (None, 1, 3):
            raise ConfigurationError(f"--nodes must be 1 or 3, not {nodes}")
        java = check_java()
        classpath = kafka_classpath(self.cache_dir, progress)

        if self.exists():
            cluster_id, members = self._load()
            if nodes is not None and len(members) != nodes:
                raise ConfigurationError(
                    f"{self.data_dir} holds a {len(members)}-node cluster, not {nodes}: "
                    "use another --data directory for a cluster of another size"
                )
        else:
            cluster_id, members = self._create(java, classpath, nodes or 1, port, progress)

        to_start = [node for node in members if not self.is_alive(node)]
        if not to_start:
            progress(f"Kafka is already running at {self._bootstrap(members)}; nothing to do")
            return self._bootstrap(members)
        self._check_ports_free(to_start)
        for node in to_start:
            node.pid = self._spawn(java, classpath, node)
            progress(f"Started Kafka node {node.node_id} (pid {node.pid}) on port {node.port}")
        self._save(cluster_id, members)
        self.wait_ready(members, timeout, progress)
        return self._bootstrap(members)

    def _create(self, java: str, classpath: str, count: int, port: int,
                progress: Progress) -> tuple[str, list[Node]]:
        ports = free_ports(2 * count) if port == 0 else list(range(port, port + 2 * count))
        if self.hosts and len(self.hosts) != count:
            raise ConfigurationError(f"{len(self.hosts)} hosts for a {count}-node cluster")
        members = [Node(node_id=i + 1, port=ports[2 * i], controller_port=ports[2 * i + 1],
                        address=self.hosts[i][0] if self.hosts else "127.0.0.1")
                   for i in range(count)]
        self._check_ports_free(members)
        cluster_id = _kafka_cluster_id()
        voters = ",".join(f"{n.node_id}@{n.address}:{n.controller_port}" for n in members)
        template = string.Template((KAFKA_INFRA_DIR / "server.properties.template").read_text())
        progress(f"Creating a {count}-node Kafka cluster in {self.data_dir}")
        for node in members:
            directory = node.directory(self.data_dir)
            (directory / "log").mkdir(parents=True, exist_ok=True)
            (directory / "server.properties").write_text(template.substitute(
                node_id=node.node_id, port=node.port, controller_port=node.controller_port,
                voters=voters, log_dir=directory / "log", address=node.address,
                replication=3 if count == 3 else 1, min_isr=2 if count == 3 else 1,
            ))
            result = subprocess.run(
                [java, *self._jvm_flags(node), "-cp", classpath, "kafka.tools.StorageTool",
                 "format", "--ignore-formatted", f"--cluster-id={cluster_id}",
                 "-c", str(directory / "server.properties")],
                capture_output=True, text=True,
            )
            if result.returncode != 0:
                raise BrokerStartError(
                    f"Formatting the storage of node {node.node_id} failed:\n"
                    f"{result.stdout}{result.stderr}"
                )
        self._save(cluster_id, members)
        return cluster_id, members

    def _check_ports_free(self, members: list[Node]) -> None:
        # A node in another network namespace (wrapped): this host's ports say nothing of its.
        taken = [p for node in members for p in (node.port, node.controller_port)
                 if not self._wrap(node) and not port_is_free(p)]
        if taken:
            raise ConfigurationError(
                f"Port(s) {', '.join(map(str, taken))} on 127.0.0.1 are already in use by another "
                f"process, so Kafka cannot listen there. Stop that process, or create the cluster "
                f"in another --data directory with another --port."
            )

    def _jvm_flags(self, node: Node) -> list[str]:
        directory = node.directory(self.data_dir)
        return [
            f"-Xms{JAVA_HEAP}", f"-Xmx{JAVA_HEAP}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{KAFKA_INFRA_DIR / 'log4j.properties'}",
            f"-Dkafka.logs.dir={directory}",
        ]

    def _spawn(self, java: str, classpath: str, node: Node) -> int:
        directory = node.directory(self.data_dir)
        with open(directory / "stdout.log", "ab") as out:
            process = subprocess.Popen(
                [*self._wrap(node), java, *self._jvm_flags(node), "-cp", classpath, "kafka.Kafka",
                 str(directory / "server.properties")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=directory,
            )
        self._children[node.node_id] = process
        return process.pid

    def wait_ready(self, members: list[Node] | None = None, timeout: float = 90.0,
                   progress: Progress = _quiet) -> None:
        """Block until every node is a live broker answering metadata requests."""
        from reef_stream.topics.connect import new_admin

        members = members or self.nodes
        # The nodes listen in plaintext (the template); REEF_KAFKA_* is for other clusters.
        admin = new_admin(self._bootstrap(members), {"socket.connection.setup.timeout.ms": 2000},
                          security=False)
        deadline = time.monotonic() + timeout
        expected = {node.node_id for node in members}
        while True:
            for node in members:
                child = self._children.get(node.node_id)
                exited = child.poll() is not None if child else not self.is_alive(node)
                if exited:
                    reap(node.pid)
                    directory = node.directory(self.data_dir)
                    raise BrokerStartError(
                        f"Kafka node {node.node_id} exited while starting. Its log is "
                        f"{directory / 'server.log'} (and {directory / 'stdout.log'}); last lines:\n"
                        f"{log_tail(directory / 'server.log')}\n{log_tail(directory / 'stdout.log', 10)}"
                    )
            try:
                metadata = admin.list_topics(timeout=2)
                if expected <= set(metadata.brokers):
                    progress(f"Kafka is ready at {self._bootstrap(members)}")
                    return
            except Exception:  # noqa: BLE001 - not answering yet is the normal case here
                pass
            if time.monotonic() > deadline:
                raise BrokerStartError(
                    f"Kafka did not answer within {timeout:.0f}s at {self._bootstrap(members)}. "
                    f"Logs are in {self.data_dir}/node-*/server.log"
                )
            time.sleep(0.5)

    # ----------------------------------------------------------------- down, kill, status

    def down(self, timeout: float = 60.0, progress: Progress = _quiet) -> None:
        """Stop every node cleanly (SIGTERM, controlled shutdown); SIGKILL after ``timeout``."""
        if not self.exists():
            progress(f"No Kafka cluster in {self.data_dir}; nothing to stop")
            return
        cluster_id, members = self._load()
        running = [node for node in members if self.is_alive(node)]
        if not running:
            progress("Kafka is not running")
        for node in running:
            os.kill(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in running:
            while self.is_alive(node) and time.monotonic() < deadline:
                reap(node.pid)
                time.sleep(0.2)
            if self.is_alive(node):
                progress(f"Node {node.node_id} did not stop within {timeout:.0f}s; killing it")
                self.kill(node.node_id)
            else:
                progress(f"Stopped Kafka node {node.node_id}")
        for node in members:
            node.pid = None
        self._save(cluster_id, members)

    def kill(self, node_id: int, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to one node (fault tests: SIGKILL, SIGSTOP, SIGCONT)."""
        node = next(n for n in self.nodes if n.node_id == node_id)
        if not self.is_alive(node):
            raise FatalError(f"Kafka node {node_id} is not running")
        os.kill(node.pid, sig)
        if sig == signal.SIGKILL:
            while process_matches(node.pid, self._marker(node)):
                reap(node.pid)
                time.sleep(0.05)

    def controller(self) -> int | None:
        """The active controller (KRaft leader) as the nodes' quorum-state files record it."""
        best: tuple[int, int] | None = None
        for node in self.nodes:
            state_path = node.directory(self.data_dir) / "log" / "__cluster_metadata-0" / "quorum-state"
            try:
                data = json.loads(state_path.read_text())
            except (OSError, ValueError):
                continue
            leader, epoch = data.get("leaderId", -1), data.get("leaderEpoch", -1)
            if leader >= 0 and (best is None or epoch > best[1]):
                best = (leader, epoch)
        return best[0] if best else None

    def status(self) -> ClusterStatus:
        from reef_stream.topics.connect import new_admin

        members = self.nodes
        nodes = [NodeStatus(n.node_id, n.port, n.controller_port, n.pid, self.is_alive(n))
                 for n in members]
        bootstrap = self._bootstrap(members)
        brokers: list[int] = []
        topics: dict[str, int] = {}
        error = None
        if any(node.alive for node in nodes):
            try:
                admin = new_admin(bootstrap, security=False)
                metadata = admin.list_topics(timeout=5)
                brokers = sorted(metadata.brokers)
                topics = {name: len(t.partitions) for name, t in sorted(metadata.topics.items())}
            except Exception as exc:  # noqa: BLE001 - shown to the user as the status
                error = f"the cluster did not answer: {exc}"
        return ClusterStatus(self.data_dir, bootstrap, nodes, brokers, self.controller(),
                             topics, error)


@contextmanager
def configured_or_throwaway(settings, workdir: Path) -> Iterator[str]:
    """The bootstrap address of the configured cluster (``settings.bootstrap_servers``), or
    of a single-node cluster started under ``workdir`` on a free port and stopped on exit.
    For benchmarks and one-off scripts."""
    if settings.bootstrap_servers:
        yield settings.bootstrap_servers
        return
    cluster = LocalCluster(workdir / "kafka", settings.cache_dir)
    try:
        yield cluster.up(port=0)
    finally:
        cluster.down()


def _kafka_cluster_id() -> str:
    """A Kafka cluster id: a random UUID in URL-safe base64 without padding (22 chars).

    Like Kafka's own ``Uuid.randomUuid``, never one starting with '-', which
    command-line parsers would take for an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
