"""The demo's pipeline on emulated hosts, under one fault per run, checked from the log.

    run = run_cluster_fault(Fault("partition", "trainer", seconds=50), settings=settings,
                            workdir=Path("/tmp/cluster-run"))
    print(run.verdict())

Each part runs on a host of its own (``tests.cluster.hosts``): a KRaft broker on ``kafka``,
Redis on ``redis``, and the demo's stages (``reef_stream.demo.run.Demo``) on ``reward``,
``processor``, ``trainer``, ``evaluator`` and ``replica-<i>``, each reaching the others only
through the bridge. The demo runs the recipe ``reef_stream.demo.recipes:sao`` with target 0;
``at_s`` seconds after every stage reported running and the trainer's first step, the fault
comes:

- ``partition``: the host's link goes down, both ways, for ``seconds``, then comes back;
- ``pause``: SIGSTOP of every process on the host for ``seconds``, then SIGCONT;
- ``kill``: SIGKILL of every process on the host. A broker's host (``kafka-<i>`` of three)
  gets its node restarted ``seconds`` later; the demo restarts no stage, so of the stages'
  hosts only a replica's and the reward worker's may be killed (the others are left for a
  scenario with a supervisor).

With ``brokers=3`` the broker is three KRaft nodes on hosts ``kafka-1`` to ``kafka-3``
(replication 3, ``min.insync.replicas=2``), else one on ``kafka``.

The run stops once the fault was undone and ``versions_after`` versions were promoted since;
the replicas stop, the other stages drain, and the checks are: every acknowledged generation
is in its topic and has exactly one outcome; no unit trained twice or lost
(``run.unit_ledger``); the trainer's committed checkpoints form one chain
(``verify.checkpoint_chain``); and the trainer trained again after the fault (recovery: from
the fault's end to its next step, in seconds).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reef_stream.core.events import Decision
from reef_stream.core.settings import Settings
from reef_stream.demo.faults import Checked
from reef_stream.demo.run import GROUP, PIPELINE, Demo, DemoOptions, DemoResult
from reef_stream.demo.verify import checkpoint_chain, committed_checkpoints
from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.servers.redis_local import LocalRedis
from tests.cluster.hosts import Hosts

#: The fault kinds ``Fault.kind`` may name.
KINDS = ("partition", "pause", "kill")
#: The port the broker listens on inside its host (its controller on the next one).
KAFKA_PORT = 9092
REDIS_PORT = 6379
#: A fenced process says so in its log with this (the trainer's ``TrainerFenced``).
FENCED = re.compile(r"fenced", re.IGNORECASE)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (``KINDS``) of ``host``, ``at_s`` seconds after every stage
    reported running, undone ``seconds`` later (a kill only on a broker's host: its node is
    restarted)."""

    kind: str
    host: str
    seconds: float = 50.0
    at_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a fault's kind is one of {', '.join(KINDS)}, not {self.kind!r}")

    @classmethod
    def parse(cls, text: str, **defaults: float) -> Fault:
        """``KIND:HOST`` or ``KIND:HOST:SECONDS``, e.g. ``partition:trainer:50``."""
        kind, _, rest = text.partition(":")
        host, _, seconds = rest.partition(":")
        if not host:
            raise ValueError(f"a fault is KIND:HOST[:SECONDS], not {text!r}")
        if seconds:
            defaults = {**defaults, "seconds": float(seconds)}
        return cls(kind, host, **defaults)

    def name(self) -> str:
        return f"{self.kind} {self.host}" + ("" if self.kind == "kill" and not
                                             self.host.startswith("kafka") else
                                             f" {self.seconds:.0f}s")


@dataclass
class ClusterRun(Checked):
    """A scenario's result: the demo's, the fault's timing, and the trainer's chain."""

    fault: Fault
    result: DemoResult
    injected_at: float | None = None
    undone_at: float | None = None
    #: Seconds from the fault's end (its injection for a kill) to the trainer's next step.
    recover_s: float | None = None
    steps_after: int = 0
    promoted_after: int = 0
    chain: dict[str, int] = field(default_factory=dict)
    fenced_writes: int = 0
    acknowledged: int = 0
    injector_error: str | None = None

    def counts(self) -> dict[str, int]:
        """The row of ``bench/cluster.py``'s table."""
        r, outcomes = self.result, self.result.outcomes
        return {"acknowledged": self.acknowledged,
                "trained": r.ledger.get("trained", 0),
                "shed": outcomes.get("dead_lettered", 0) + r.ledger.get("dropped", 0),
                "lost": (r.missing_acknowledged or 0) + outcomes.get("no_outcome", 0)
                + r.ledger.get("lost", 0),
                "trained_twice": r.ledger.get("trained_twice", 0)
                + outcomes.get("more_than_one", 0),
                "forks": self.chain.get("forks", 0),
                "fenced_writes": self.fenced_writes}

    def checks(self) -> list[tuple[str, bool, str]]:
        """``(what, held, detail)`` for every promise the run checks."""
        r = self.result
        return [
            ("the fault was injected and undone",
             self.injector_error is None and self.injected_at is not None
             and (not _restarted(self.fault) or self.undone_at is not None),
             (f"{self.fault.name()} at {_seconds(self.injected_at)}, undone at "
              f"{_seconds(self.undone_at)}")
             + (f"; injector failed: {self.injector_error}" if self.injector_error else "")),
            *r.log_checks(self.acknowledged),
            ("the committed checkpoints form one chain",
             self.chain.get("steps", 0) > 0 and self.chain.get("forks") == 0
             and self.chain.get("breaks") == 0, str(self.chain)),
            ("the trainer trained again after the fault", self.steps_after > 0,
             (f"{self.steps_after} steps, {self.promoted_after} versions promoted after it; "
              f"the first {_seconds(self.recover_s)} after the fault ended")),
        ]


def _restarted(fault: Fault) -> bool:
    """Whether the fault is undone: all but the kill of a stage's host."""
    return fault.kind != "kill" or fault.host.startswith("kafka")


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


class Injector:
    """Injects ``fault`` on a thread of its own once ``ready`` is set and ``at_s`` passed;
    ``done`` is set once it was undone (or failed: ``error``). Watches ``demo.steps`` for the
    trainer's first step after the fault."""

    def __init__(self, hosts: Hosts, demo: Demo, fault: Fault, say: Callable[[str], None],
                 restart: Callable[[], None]) -> None:
        """``restart``: what brings a killed broker's host back (``LocalCluster.up``)."""
        self.hosts, self.demo, self.fault, self.say = hosts, demo, fault, say
        self.restart = restart
        self.done, self._stop = threading.Event(), threading.Event()
        #: Promoted versions when the fault ended (``promoted_after`` counts from there).
        self.promoted_at_end: int | None = None
        self.started = time.monotonic()
        self.injected_at: float | None = None
        self.undone_at: float | None = None
        self.recover_s: float | None = None
        self.steps_at_end = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reef-cluster-fault", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.fault.seconds + 30)

    def promoted(self) -> int:
        """Versions promoted so far (the demo's watcher appends them)."""
        return sum(1 for _, p in list(self.demo.publications)
                   if p.decision is Decision.PROMOTED)

    def promoted_after(self) -> int:
        """Versions promoted since the fault ended."""
        return 0 if self.promoted_at_end is None else self.promoted() - self.promoted_at_end

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _run(self) -> None:
        f, hosts = self.fault, self.hosts
        try:
            # Every stage reported running and the trainer acknowledged a step: the fault
            # meets a pipeline at work, however slowly a loaded machine started it.
            while not set(PIPELINE) <= self.demo.running or self.demo.steps < 1:
                if self._stop.wait(0.5):
                    return
            if self._stop.wait(f.at_s):
                return
            pids = hosts.pids(f.host)
            self.injected_at = self._now()
            self.say(f"fault: {f.name()} at {self.injected_at:.0f} s")
            if f.kind == "partition":
                hosts.partition(f.host)
            elif f.kind == "pause":
                for pid in pids:
                    hosts.pause(pid)
            else:
                hosts.kill_host(f.host)
            if _restarted(f):
                self._stop.wait(f.seconds)
                if f.kind == "partition":
                    hosts.heal(f.host)
                elif f.kind == "pause":
                    for pid in pids:
                        hosts.resume(pid)
                else:
                    self.restart()   # blocks until every node answers
                self.undone_at = self._now()
                self.say(f"fault undone at {self.undone_at:.0f} s")
            self.steps_at_end = self.demo.steps
            self.promoted_at_end = self.promoted()
            end = time.monotonic()
            self.done.set()
            while not self._stop.wait(0.2):
                if self.demo.steps > self.steps_at_end:
                    self.recover_s = time.monotonic() - end
                    self.say(f"the trainer stepped again {self.recover_s:.1f} s after the fault")
                    return
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            self.error = error
        finally:
            self.done.set()


def run_cluster_fault(fault: Fault, *, settings: Settings, workdir: Path,
                      options: DemoOptions | None = None, versions_after: int = 3,
                      brokers: int = 1, say: Callable[[str], None] = print) -> ClusterRun:
    """Make the hosts, start the broker and Redis on theirs, run the demo with ``fault``, stop
    everything and remove the hosts; see the module docstring. ``options``: the demo's
    (target, drain and run_dir are set here)."""
    options = options or DemoOptions(replicas=1, rate=50.0, time_limit=600)
    options = dataclasses.replace(options, recipe="reef_stream.demo.recipes:sao", target=0.0,
                                  drain_s=options.drain_s or 240, run_dir=workdir / "run")
    stages = ["reward", "processor", "trainer", "evaluator",
              *(f"replica-{i}" for i in range(options.replicas))]
    kafka = ["kafka"] if brokers == 1 else [f"kafka-{i}" for i in range(1, brokers + 1)]
    if fault.host not in (*kafka, "redis", *stages):
        raise ValueError(f"no host {fault.host!r} in this scenario")
    if fault.kind == "kill" and fault.host not in ("reward", *kafka) \
            and not fault.host.startswith("replica-"):
        raise ValueError("a kill of a host whose stage the demo does not restart ends the run; "
                         "kill a broker's, a replica's or the reward worker's host")
    settings = dataclasses.replace(settings, home=workdir / "home")
    (workdir / "hosts").mkdir(parents=True, exist_ok=True)
    with Hosts([*kafka, "redis", *stages], workdir=workdir / "hosts") as hosts:
        say(f"hosts on {hosts.address('redis').rsplit('.', 1)[0]}.0/24: "
            + ", ".join(f"{n} {hosts.address(n)}" for n in hosts.names))
        cluster = LocalCluster(workdir / "kafka", settings.cache_dir,
                               hosts=[(hosts.address(n), hosts.wrap(n)) for n in kafka])
        redis = LocalRedis(workdir / "redis", address=hosts.address("redis"),
                           wrap=hosts.wrap("redis"))
        try:
            bootstrap = cluster.up(nodes=brokers, port=KAFKA_PORT)
            say(f"broker at {bootstrap}")
            redis_url = redis.up(port=REDIS_PORT)
            demo = Demo(options, settings=settings, bootstrap=bootstrap, redis_url=redis_url,
                        broker_pids=(), wrap=hosts.wrap)
            injector = Injector(hosts, demo, fault, say, restart=cluster.up)

            def may_stop() -> bool:
                return injector.done.is_set() and injector.recover_s is not None \
                    and injector.promoted_after() >= versions_after

            injector.start()
            try:
                result = demo.run(may_stop=may_stop)
            finally:
                injector.stop()
            run = ClusterRun(fault, result, injector.injected_at, injector.undone_at,
                             injector.recover_s,
                             steps_after=max(demo.steps - injector.steps_at_end, 0)
                             if injector.done.is_set() else 0,
                             promoted_after=injector.promoted_after(),
                             injector_error=None if injector.error is None
                             else repr(injector.error))
            run.chain = checkpoint_chain(committed_checkpoints(bootstrap, demo.ns,
                                                               demo.recipe.name, GROUP))
            run.fenced_writes = sum(len(FENCED.findall(stage.log.read_text(errors="replace")))
                                    for stage in demo.stages.values() if stage.log.exists())
            run.acknowledged = sum(len(path.read_text().split())
                                   for path in (workdir / "run").glob("acknowledged-*.txt"))
            return run
        finally:
            redis.down()
            cluster.down()
