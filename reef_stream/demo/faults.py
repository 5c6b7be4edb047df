"""Broker faults under the demo's load, on a three-node cluster, and what must still hold.

    outcome = run_broker_faults(DemoOptions(target=0.9, drain_s=180), settings=settings,
                                workdir=Path("/tmp/faults"), timeline=Timeline())
    print(outcome.verdict())

A throwaway three-node KRaft cluster (replication factor 3,
``min.insync.replicas=2``) and a Redis server are started under ``workdir``;
the demo's pipeline runs on them (every stage a process) while a thread
injects, ``timeline.gap_s`` seconds apart:

1. SIGKILL of a broker that is not the controller, restarted ``down_s`` later;
2. SIGSTOP of a broker for ``pause_s`` seconds, longer than the brokers'
   session timeout (``broker.session.timeout.ms``, 9 s), then SIGCONT;
3. SIGKILL of the node of the active controller, restarted ``down_s`` later.

The demo may stop on its target only once every fault was injected and
undone. Then the replicas stop, the other stages settle every generation
(``DemoOptions.drain_s``), and the checks are, from the log alone
(``reef_stream.demo.verify``, ``run.unit_ledger``): every generation a
replica saw acknowledged is in its topic; every generation has exactly one
outcome; no unit was trained twice or lost; and the policy reached the target.
``bench/broker_faults.py`` is the command; ``tests/faults/test_broker_faults.py``
runs it short in CI.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reef_stream.core.events import Decision
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import Settings
from reef_stream.demo.run import Demo, DemoOptions, DemoResult
from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.servers.redis_local import LocalRedis


@dataclass(frozen=True)
class Timeline:
    """When the faults come: the first ``first_s`` after the stages start, then each ``gap_s``
    after the previous one was undone."""

    first_s: float = 60.0
    gap_s: float = 20.0
    down_s: float = 10.0
    pause_s: float = 15.0


@dataclass
class Injected:
    """One fault: what was done to which node, when (seconds since the injector started)."""

    kind: str
    node: int
    at: float
    undone_at: float | None = None

    def line(self) -> str:
        undone = "" if self.undone_at is None else f", undone at {self.undone_at:.0f} s"
        return f"{self.kind} node {self.node} at {self.at:.0f} s{undone}"


class BrokerFaults:
    """Injects the three faults of the module docstring, in order, on a thread of its own;
    ``done`` is set once the last was undone (or the injector failed: ``error``). ``stop`` ends
    the wait between faults."""

    def __init__(self, cluster: LocalCluster, timeline: Timeline,
                 say: Callable[[str], None] = print) -> None:
        self.cluster, self.timeline, self.say = cluster, timeline, say
        self.injected: list[Injected] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="reef-broker-faults", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float = 120.0) -> None:
        """End the waits, and the thread once the fault in progress is undone."""
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        t = self.timeline
        try:
            if self._wait(t.first_s):
                self._kill_and_restart(self._not_controller(), "SIGKILL broker")
            if self._wait(t.gap_s):
                self._pause(self._not_controller())
            if self._wait(t.gap_s):
                self._kill_and_restart(self._controller(), "SIGKILL controller")
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            self.error = error
        finally:
            self.done.set()

    def _now(self) -> float:
        return time.monotonic() - self._started

    def _wait(self, seconds: float) -> bool:
        return not self._stopping.wait(seconds)

    def _controller(self) -> int:
        deadline = time.monotonic() + 60
        while (controller := self.cluster.controller()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster has no active controller")
            time.sleep(0.5)
        return controller

    def _not_controller(self) -> int:
        controller = self._controller()
        return next(n.node_id for n in self.cluster.nodes if n.node_id != controller)

    def _note(self, kind: str, node: int) -> Injected:
        fault = Injected(kind, node, self._now())
        self.injected.append(fault)
        self.say(f"fault: {fault.line()}")
        return fault

    def _kill_and_restart(self, node: int, kind: str) -> None:
        fault = self._note(kind, node)
        self.cluster.kill(node)
        self._wait(self.timeline.down_s)
        self.cluster.up()          # restarts the dead node and waits until every node is ready
        fault.undone_at = self._now()
        self.say(f"fault undone: node {node} restarted at {fault.undone_at:.0f} s")

    def _pause(self, node: int) -> None:
        fault = self._note("SIGSTOP broker", node)
        self.cluster.kill(node, signal.SIGSTOP)
        try:
            self._wait(self.timeline.pause_s)
        finally:
            self.cluster.kill(node, signal.SIGCONT)
        fault.undone_at = self._now()
        self.say(f"fault undone: node {node} resumed (SIGCONT) at {fault.undone_at:.0f} s")


class Checked:
    """A run judged by its ``checks()``, ``(what, held, detail)`` each: ``passed`` when all
    held, and the ``verdict``, one line per check."""

    def checks(self) -> list[tuple[str, bool, str]]:
        raise NotImplementedError

    @property
    def passed(self) -> bool:
        return all(held for _, held, _ in self.checks())

    def verdict(self) -> str:
        return "\n".join(f"{'ok  ' if held else 'FAIL'} {what}: {detail}"
                         for what, held, detail in self.checks())


@dataclass
class FaultRun(Checked):
    """A broker-fault run's result: the demo's and the faults'."""

    result: DemoResult
    injected: list[Injected] = field(default_factory=list)
    injector_error: str | None = None
    #: Versions promoted after the last fault was undone (the loop went on).
    promoted_after_faults: int = 0
    #: A baseline: the same run with no fault injected (``timeline=None``).
    baseline: bool = False

    def checks(self) -> list[tuple[str, bool, str]]:
        """``(what, held, detail)`` for every promise the run checks."""
        r = self.result
        complete = (self.injector_error is None and len(self.injected) == 3
                    and all(f.undone_at is not None for f in self.injected))
        faults = [] if self.baseline else [
            ("every fault injected and undone", complete,
             "; ".join(f.line() for f in self.injected) + (
                 f"; injector failed: {self.injector_error}" if self.injector_error else "")),
            ("the loop went on after the faults", self.promoted_after_faults > 0,
             f"{self.promoted_after_faults} versions promoted after the last fault was undone"),
        ]
        return [
            *faults,
            *r.log_checks(),
            ("the policy reached the target", r.reached,
             f"held-out accuracy {r.accuracy} at version {r.version} in {r.seconds:.0f} s"),
        ]


def run_broker_faults(options: DemoOptions, *, settings: Settings, workdir: Path,
                      timeline: Timeline | None = Timeline(), versions_after: int = 0,
                      say: Callable[[str], None] = print,
                      show: Callable[[dict[str, Any]], None] | None = None) -> FaultRun:
    """Start the cluster and Redis under ``workdir``, run the demo with the faults, stop both;
    see the module docstring. ``options.drain_s`` must be set (the checks need the drain).
    The demo may stop (on its target) once the faults are undone and ``versions_after``
    versions were promoted since: ``options.target=0`` makes that the stopping rule.
    ``timeline=None``: the baseline, the same run and checks with no fault injected."""
    if not options.drain_s:
        raise ValueError("a broker-fault run needs DemoOptions.drain_s (the checks follow it)")
    # Everything of the run under workdir, the stages' home too (published copies, spools).
    settings = dataclasses.replace(settings, home=workdir / "home")
    cluster = LocalCluster(workdir / "kafka", settings.cache_dir)
    redis = LocalRedis(workdir / "redis")
    try:
        bootstrap = cluster.up(nodes=3, port=0)
        say(f"three-node cluster at {bootstrap}")
        redis_url = redis.up(port=free_ports(1)[0])
        demo = Demo(options, settings=settings, bootstrap=bootstrap, redis_url=redis_url,
                    show=show)
        if timeline is None:
            return FaultRun(demo.run(), baseline=True)
        faults = BrokerFaults(cluster, timeline, say)

        def promoted_after() -> int:
            last = max((f.undone_at or 0.0 for f in faults.injected), default=0.0)
            return sum(1 for at, p in demo.publications
                       if at > last and p.decision is Decision.PROMOTED)

        faults.start()
        try:
            result = demo.run(may_stop=lambda: faults.done.is_set()
                              and promoted_after() >= versions_after)
        finally:
            faults.stop()
        return FaultRun(result, faults.injected,
                        None if faults.error is None else repr(faults.error), promoted_after())
    finally:
        redis.down()
        cluster.down()
