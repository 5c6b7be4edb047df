"""The demo's pipeline on emulated hosts, under faults one after another, checked from the log.

    run = run_cluster([Fault("partition", "trainer", seconds=50)], settings=settings,
                      workdir=Path("/tmp/cluster-run"))
    print(run.verdict())

Each part runs on a host of its own (``tests.cluster.hosts``): a KRaft broker on ``kafka``,
Redis on ``redis``, and the demo's stages (``reef_stream.demo.run.Demo``) on ``reward``,
``processor``, ``trainer``, ``evaluator`` and ``replica-<i>``, each reaching the others only
through the bridge. The demo runs the recipe ``reef_stream.demo.recipes:sao`` with target 0.
The faults come in order, never together: the first ``at_s`` seconds after every stage
reported running and the trainer's first step, each later one ``at_s`` seconds after the
trainer stepped again after the one before (or ``RECOVER_WAIT_S`` after its end, if it did
not). Kinds:

- ``partition``: the host's link goes down, both ways, for ``seconds``, then comes back;
- ``partition-out`` / ``partition-in``: a one-way partition for ``seconds`` (nftables in the
  host drops its packets to every other host, or those from them), then healed;
- ``pause``: SIGSTOP of every process on the host for ``seconds``, then SIGCONT;
- ``kill``: SIGKILL of every process on the host. A broker's host (``kafka-<i>`` of three)
  gets its node restarted ``seconds`` later; a replica's and the reward worker's host stay
  dead; the processor's, the trainer's or the evaluator's is answered by the supervisor
  (``tests.cluster.supervisor``), which starts the stage on a spare host ``<host>-b``;
- ``pause-replace``: SIGSTOP of every process on a supervised stage's host, the stage started
  on its spare host (and, the trainer's and the evaluator's, holding its fence), and
  ``seconds`` later SIGCONT of the old one: a zombie its stage's fence must stop at its first
  write, or, an evaluator, that its group tells to stand by (``ClusterRun.replaced`` says
  what became of it).
- ``isolate``: the host cut off from the brokers' hosts only, both ways (nftables drops its
  packets to them and theirs to it) for ``seconds``, then healed; its links to the object
  store, Redis and the other stages work on (a trainer that reaches the store but not the
  brokers: it writes a checkpoint it cannot acknowledge);
- ``kill`` of ``store`` (with ``store="s3"``): S3Proxy SIGKILLed, perhaps in the middle of a
  checkpoint, and started again ``seconds`` later on the same data directory.

``tests.cluster.nemesis`` draws such a sequence from a seed. With ``brokers=3`` the broker is
three KRaft nodes on hosts ``kafka-1`` to ``kafka-3`` (replication 3,
``min.insync.replicas=2``), else one on ``kafka``. With ``store="s3"`` S3Proxy runs on a host
``store`` and the trainer's checkpoints and the evaluator's published copies are at
``s3://reef/<namespace>/...`` on it; the stages (and this process, which reads the checkpoints
back) take its credentials from the environment, never from a URL, and the run checks that
every committed checkpoint is an object in the bucket (listed through the S3 API) and that
no stage's log carries the secret.

The run stops once every fault was undone, ``versions_after`` versions were promoted since
the last, and every replica's heartbeat says it serves the newest promoted version (or
``SERVED_WAIT_S`` passed without that); the replicas stop, the other stages drain, and the
checks are: every acknowledged generation is in its topic and has exactly one outcome; no
unit trained twice or lost (``run.unit_ledger``); the trainer's committed checkpoints form
one chain (``verify.checkpoint_chain``); the trainer trained again after every fault
(recovery: from the fault's end to its next step, in seconds); after the last fault, the
replicas served the newest promoted version; and, where the supervisor replaced a stage,
``ClusterRun.replacement_checks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import fsspec

from reef_stream.core.events import Decision, Publication
from reef_stream.core.settings import Settings
from reef_stream.demo.faults import Checked
from reef_stream.demo.run import GROUP, MODEL, Demo, DemoOptions, DemoResult, member_of
from reef_stream.demo.verify import checkpoint_chain, committed_checkpoints
from reef_stream.engine.checkpoints import MANIFEST
from reef_stream.publishing.fleet import Fleet
from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.servers.redis_local import LocalRedis
from reef_stream.servers.s3_local import LocalS3
from tests.cluster.faults import STORE_HOST, Fault, broker_hosts, stage_hosts, supervised
from tests.cluster.hosts import KAFKA_PORT, Hosts
from tests.cluster.supervisor import SUPERVISED, Replacement, Supervisor, spare_hosts

#: Seconds the next fault waits, at most, for the trainer to step again after one.
RECOVER_WAIT_S = 180.0
#: Seconds the run waits, at most, after its other stop conditions held, for every replica to
#: serve the newest promoted version.
SERVED_WAIT_S = 60.0
REDIS_PORT = 6379
S3_PORT = 9000
#: The object store's bucket (``store="s3"``).
BUCKET = "reef"
#: A write refused by a fence, as the stages' logs say it: the trainer's ``TrainerFenced`` and
#: the evaluator's ``EvaluatorFenced`` ("was fenced at"), a processor's fence past its rejoins
#: or of its transactional id, the stage loop's rejoin after one. Not the evaluator's start
#: line ("any older evaluator of the recipe is fenced"), which every run has.
#: An evaluator's committed decision, as its log says it (``Evaluator``'s line after the
#: decision's transaction committed).
DECIDED = re.compile(r"\b(?:PROMOTED|REJECTED) version \d+ of model\b")
FENCED = re.compile(r"\bwas fenced\b|\bfenced \d+ times\b|\bis fenced too\b|"
                    r"rejoining with a new consumer", re.IGNORECASE)


@dataclass
class Injected:
    """One fault of a run as it happened: seconds since the injector started (None: not yet,
    or never)."""

    fault: Fault
    injected_at: float | None = None
    undone_at: float | None = None
    #: Seconds from the fault's end (its injection for a kill) to the trainer's next step.
    recover_s: float | None = None
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Injected, undone where it is undone, and the trainer stepped again after it."""
        return (self.error is None and self.injected_at is not None
                and (not _restarted(self.fault) or self.undone_at is not None)
                and self.recover_s is not None)

    def line(self) -> str:
        return (f"{self.fault.name()} at {_seconds(self.injected_at)}, undone at "
                f"{_seconds(self.undone_at)}, recovered {_seconds(self.recover_s)} later"
                + (f"; injector failed: {self.error}" if self.error else ""))


@dataclass
class ClusterRun(Checked):
    """A scenario's result: the demo's, each fault's timing, the trainer's chain and the
    version served at the end."""

    faults: tuple[Fault, ...]
    result: DemoResult
    #: The demo's options (its members of each group: ``member_checks``); None: not known.
    options: DemoOptions | None = None
    injected: list[Injected] = field(default_factory=list)
    steps_after: int = 0
    promoted_after: int = 0
    chain: dict[str, int] = field(default_factory=dict)
    fenced_writes: int = 0
    acknowledged: int = 0
    #: The newest promoted version and what each replica's heartbeat said it served, when the
    #: run stopped waiting for them to agree (None: it never looked).
    newest_promoted: int | None = None
    served: dict[str, int | None] | None = None
    #: ``store="s3"``: the committed checkpoints' URIs, the step directories holding a manifest
    #: in the bucket (listed through the S3 API at the end), and the lines of the stages' logs
    #: and the URIs that carry the store's secret. None: checkpoints in a directory.
    committed_uris: list[str] = field(default_factory=list)
    stored: set[str] | None = None
    secret_leaks: int | None = None
    #: The stages the supervisor replaced, by host (``tests.cluster.supervisor``).
    replaced: dict[str, Replacement] = field(default_factory=dict)
    #: The writer of each committed checkpoint, in log order (a replaced trainer's, then its
    #: replacement's).
    writers: list[str] = field(default_factory=list)
    #: Checkpoints with more than one committed PROMOTED or REJECTED publication.
    decided_twice: int = 0
    #: What each processor and reward worker did (``Demo.work``: units committed,
    #: generations scored) and the decisions each evaluator's log says it committed
    #: (``DECIDED``), by stage; the checks on them only with several members of a group.
    work: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def recover_s(self) -> float | None:
        """The slowest recovery of the run (None: some fault was not recovered from)."""
        times = [i.recover_s for i in self.injected]
        return None if not times or None in times else max(times)

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
            ("every fault was injected and undone, and the trainer trained after each",
             len(self.injected) == len(self.faults)
             and all(i.complete for i in self.injected),
             "; ".join(i.line() for i in self.injected) or "none injected"),
            *r.log_checks(self.acknowledged),
            ("the committed checkpoints form one chain",
             self.chain.get("steps", 0) > 0 and self.chain.get("forks") == 0
             and self.chain.get("breaks") == 0, str(self.chain)),
            ("the trainer trained again after the last fault", self.steps_after > 0,
             f"{self.steps_after} steps, {self.promoted_after} versions promoted after it"),
            ("the replicas serve the newest promoted version after the faults",
             self.newest_promoted is not None and bool(self.served)
             and all(v == self.newest_promoted for v in self.served.values()),
             f"newest promoted {self.newest_promoted}, served {self.served}"),
            *self._store_checks(),
            *self.replacement_checks(),
            *self.member_checks(),
        ]

    def member_checks(self) -> list[tuple[str, bool, str]]:
        """With several members of a group (``DemoOptions.processors``, ``reward_workers``,
        ``evaluators``): every processor committed units and every reward worker scored
        generations; and, where no fault touched an evaluator's host, exactly one evaluator
        decided (a standby decides nothing while the active one lives)."""
        options, checks = self.options, []
        if options is None:
            return []
        if options.processors > 1 or options.reward_workers > 1:
            checks.append(("every processor committed units and every reward worker scored "
                           "generations", bool(self.work) and all(self.work.values()),
                           str(self.work)))
        if options.evaluators > 1 and not any(member_of(f.host) == "evaluator"
                                              for f in self.faults):
            deciders = [name for name, n in self.decisions.items() if n]
            checks.append(("exactly one evaluator decided, the standby nothing",
                           len(deciders) == 1, f"decisions by evaluator: {self.decisions}"))
        return checks

    def replacement_checks(self) -> list[tuple[str, bool, str]]:
        """What the supervisor's replacements must show (none without one): each replacement
        started and each old stage settled (``Replacement.settled``: gone, or a resumed
        zombie fenced at its first write, or an evaluator standing by); the committed
        checkpoints have one writer after another, none writing again once replaced; and no
        candidate was decided twice."""
        if not self.replaced:
            return []
        blocks = [w for i, w in enumerate(self.writers) if i == 0 or w != self.writers[i - 1]]
        return [
            (("every replaced stage's replacement started, its old process is gone and left "
              "nothing on its host, a resumed zombie fenced (an evaluator: fenced or standing "
              "by)"), all(r.settled() for r in self.replaced.values()),
             "; ".join(r.line() for r in self.replaced.values())),
            ("no trainer commits a checkpoint once another took over",
             len(blocks) == len(set(blocks)) and bool(blocks),
             f"writers in log order: {blocks}"),
            ("no candidate was decided twice", self.decided_twice == 0,
             f"{self.decided_twice} checkpoints with more than one committed decision"),
        ]

    def _store_checks(self) -> list[tuple[str, bool, str]]:
        """With the object store: the committed checkpoints are its objects, no secret shown."""
        if self.stored is None:
            return []
        missing = [u for u in self.committed_uris if u not in self.stored]
        return [("every committed checkpoint is an object in the store's bucket",
                 bool(self.committed_uris) and not missing,
                 f"{len(self.committed_uris)} committed, {len(self.stored)} in the bucket, "
                 f"missing {missing[:3]}"),
                ("no stage's log and no checkpoint URI carries the store's secret",
                 self.secret_leaks == 0, f"{self.secret_leaks} lines")]


def _restarted(fault: Fault) -> bool:
    """Whether the fault is undone: all but the kill of a stage's host (a supervised stage's
    is replaced instead)."""
    return fault.kind != "kill" or fault.host.startswith("kafka") or fault.host == STORE_HOST


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _decided_twice(publications: list[tuple[float, Publication]]) -> int:
    """Checkpoints with more than one PROMOTED or REJECTED publication among
    ``publications`` (the demo's, read committed): a zombie evaluator's decision that counted."""
    decided = Counter(p.checkpoint_id for _, p in publications
                      if p.decision in (Decision.PROMOTED, Decision.REJECTED))
    return sum(1 for n in decided.values() if n > 1)


def _decided(log: Path) -> int:
    """Lines of an evaluator's log that say it committed a decision (``DECIDED``)."""
    return len(DECIDED.findall(log.read_text(errors="replace"))) if log.exists() else 0


def _fenced(log: Path) -> int:
    """Lines of a stage's log that say a write of it was fenced (``FENCED``)."""
    return len(FENCED.findall(log.read_text(errors="replace")))


def newest_promoted(publications: list[tuple[float, Publication]]) -> int | None:
    """The version of the last PROMOTED publication in log order (what followers converge
    on: a rollback's is older than the one before it), or None."""
    for _, publication in reversed(publications):
        if publication.decision is Decision.PROMOTED:
            return publication.policy_version
    return None


class Injector:
    """Injects ``faults`` one after another on a thread of its own (see the module
    docstring); ``done`` is set once the last was undone (or one failed: its ``error``).
    Watches ``demo.steps`` for the trainer's first step after each fault."""

    def __init__(self, hosts: Hosts, demo: Demo, faults: tuple[Fault, ...],
                 say: Callable[[str], None], restart: Callable[[], None],
                 restart_store: Callable[[], object] | None = None,
                 supervisor: Supervisor | None = None) -> None:
        """``restart``: what brings a killed broker's host back (``LocalCluster.up``);
        ``restart_store``: the object store's (``LocalS3.up``); ``supervisor``: what replaces a
        supervised stage whose host is killed or paused."""
        self.hosts, self.demo, self.faults, self.say = hosts, demo, faults, say
        self.restart, self.restart_store = restart, restart_store
        self.supervisor = supervisor
        self.done, self._stop = threading.Event(), threading.Event()
        #: Promoted versions when the last fault ended (``promoted_after`` counts from there).
        self.promoted_at_end: int | None = None
        self.started = time.monotonic()
        self.injected: list[Injected] = []
        self.steps_at_end = 0
        self._thread = threading.Thread(target=self._run, name="reef-cluster-fault", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(max(f.seconds for f in self.faults) + 30)

    @property
    def recovered(self) -> bool:
        """Every fault injected and the trainer stepped after the last."""
        return (len(self.injected) == len(self.faults)
                and self.injected[-1].recover_s is not None)

    def promoted(self) -> int:
        """Versions promoted so far (the demo's watcher appends them)."""
        return sum(1 for _, p in list(self.demo.publications)
                   if p.decision is Decision.PROMOTED)

    def promoted_after(self) -> int:
        """Versions promoted since the last fault ended."""
        return 0 if self.promoted_at_end is None else self.promoted() - self.promoted_at_end

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _run(self) -> None:
        # Every stage reported running and the trainer acknowledged a step: the first fault
        # meets a pipeline at work, however slowly a loaded machine started it.
        while not self.demo.pipeline_runs() or self.demo.steps < 1:
            if self._stop.wait(0.5):
                self.done.set()
                return
        try:
            for fault in self.faults:
                if self._stop.wait(fault.at_s):
                    return
                one = Injected(fault)
                self.injected.append(one)
                try:
                    self._one(one)
                except BaseException as error:  # noqa: BLE001 - reported by the run
                    one.error = repr(error)
                    return
                if self._stop.is_set():
                    return
        finally:
            self.done.set()

    def _one(self, one: Injected) -> None:
        """Inject ``one.fault``, undo it, and wait (up to ``RECOVER_WAIT_S``) for the trainer's
        next step."""
        f, hosts = one.fault, self.hosts
        pids = hosts.pids(f.host)
        one.injected_at = self._now()
        self.say(f"fault: {f.name()} at {one.injected_at:.0f} s")
        if f.kind == "partition":
            hosts.partition(f.host)
        elif f.kind in ("partition-out", "partition-in"):
            hosts.partition_one_way(f.host, direction=f.kind.split("-")[1])
        elif f.kind == "isolate":
            isolate(hosts, f.host)
        elif f.kind == "pause":
            for pid in pids:
                hosts.pause(pid)
        elif self._supervised(f):
            self._replace(f)
        else:
            hosts.kill_host(f.host)
        if _restarted(f):
            self._stop.wait(f.seconds)
            if f.kind.startswith("partition") or f.kind == "isolate":
                hosts.heal(f.host)
            elif f.kind == "pause":
                for pid in pids:
                    hosts.resume(pid)
            elif f.host == STORE_HOST and self.restart_store is not None:
                self.restart_store()   # blocks until S3Proxy answers
            elif f.kind == "pause-replace":
                self.supervisor.resume(f.host)
            else:
                self.restart()   # blocks until every node answers
            one.undone_at = self._now()
            self.say(f"fault undone at {one.undone_at:.0f} s")
        self.steps_at_end = self.demo.steps
        self.promoted_at_end = self.promoted()
        end = time.monotonic()
        while not self._stop.wait(0.2):
            if self.demo.steps > self.steps_at_end:
                one.recover_s = time.monotonic() - end
                self.say(f"the trainer stepped again {one.recover_s:.1f} s after the fault")
                return
            if time.monotonic() - end > RECOVER_WAIT_S:
                self.say(f"the trainer did not step in the {RECOVER_WAIT_S:.0f} s after the "
                         "fault")
                return

    def _supervised(self, fault: Fault) -> bool:
        return fault.kind in ("kill", "pause-replace") and supervised(fault.host)

    def _replace(self, fault: Fault) -> None:
        """A supervised stage's host killed or paused, the stage replaced on its spare."""
        if self.supervisor is None:
            raise RuntimeError(f"{fault.name()} needs a supervisor to replace the stage")
        if fault.kind == "kill":
            self.supervisor.kill(fault.host)
        else:
            self.supervisor.pause(fault.host)


def isolate(hosts: Hosts, host: str) -> None:
    """Drop ``host``'s packets to the brokers' hosts and theirs to it (nftables inside the host,
    ``Hosts.heal`` undoes it); every other link of the host works on."""
    brokers = [n for n in hosts.names if n.startswith("kafka")]
    hosts.partition_one_way(host, brokers, direction="out")
    hosts.partition_one_way(host, brokers, direction="in")


class Served:
    """Whether every replica's heartbeat (the fleet projection in Redis) names the newest
    promoted version the demo has read; remembers what it saw last."""

    def __init__(self, demo: Demo, redis_url: str, replicas: list[str]) -> None:
        import redis

        self.demo, self.replicas = demo, replicas
        self.fleet = Fleet(redis.Redis.from_url(redis_url, socket_timeout=5,
                                                socket_connect_timeout=5,
                                                decode_responses=True), demo.ns)
        self.newest: int | None = None
        self.served: dict[str, int | None] | None = None

    def agree(self) -> bool:
        """Look once: True when every replica serves the newest promoted version. Blocks for
        one Redis round trip; a Redis error counts as not yet."""
        self.newest = newest_promoted(list(self.demo.publications))
        try:
            seen = {r.replica_id: r.version for r in self.fleet.replicas(MODEL)}
        except Exception:  # noqa: BLE001 - Redis unreachable: look again later
            return False
        self.served = {name: seen.get(name) for name in self.replicas}
        return self.newest is not None and all(v == self.newest for v in self.served.values())


@contextlib.contextmanager
def object_store(hosts: Hosts, data_dir: Path, settings: Settings) -> Iterator[LocalS3]:
    """S3Proxy on the host ``store`` with the bucket ``BUCKET``, its client environment
    (``LocalS3.environment``: endpoint, credentials) set in this process's for the block (the
    stages inherit it, as after ``eval $(reef s3 env)``; this process reads the checkpoints
    back), then S3Proxy stopped and the environment as it was."""
    s3 = LocalS3(data_dir, settings.cache_dir, address=hosts.address(STORE_HOST),
                 wrap=hosts.wrap(STORE_HOST))
    saved: dict[str, str | None] = {}
    try:
        s3.up(port=S3_PORT)
        s3.create_bucket(BUCKET)
        for name, value in s3.environment().items():
            saved[name] = os.environ.get(name)
            os.environ[name] = value
        fsspec.filesystem("s3").clear_instance_cache()   # none made for another endpoint
        yield s3
    finally:
        s3.down()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        fsspec.filesystem("s3").clear_instance_cache()


def stored_checks(run: ClusterRun, s3: LocalS3, events: list, demo: Demo) -> None:
    """Fill ``run``'s store fields: the committed checkpoints' URIs, the step directories with
    a manifest in ``BUCKET`` (``ListObjectsV2`` through S3Proxy, not its directory) and the
    stage log lines and URIs that carry the secret."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    run.stored = {f"s3://{BUCKET}/{item['Key'].rsplit('/', 1)[0]}" for page in pages
                  for item in page.get("Contents", ()) if item["Key"].endswith(f"/{MANIFEST}")}
    run.committed_uris = [event.uri for event in events]
    secret = s3.environment()["AWS_SECRET_ACCESS_KEY"]
    lines = [line for stage in demo.stages.values() if stage.log.exists()
             for line in stage.log.read_text(errors="replace").splitlines()]
    run.secret_leaks = sum(secret in line for line in [*lines, *run.committed_uris])


def run_cluster_fault(fault: Fault, **options) -> ClusterRun:
    """``run_cluster`` with the one fault ``fault``."""
    return run_cluster((fault,), **options)


def run_cluster(faults: tuple[Fault, ...] | list[Fault], *, settings: Settings, workdir: Path,
                options: DemoOptions | None = None, versions_after: int = 3,
                brokers: int = 1, say: Callable[[str], None] = print,
                store: str = "dir") -> ClusterRun:
    """Make the hosts, start the broker and Redis on theirs, run the demo with ``faults`` one
    after another, stop everything and remove the hosts; see the module docstring.
    ``options``: the demo's (target, drain, run_dir and, with ``store="s3"``, store are set
    here). ``store``: ``"dir"`` (checkpoints in the run directory) or ``"s3"`` (S3Proxy on a
    host ``store``)."""
    if store not in ("dir", "s3"):
        raise ValueError(f"a cluster run's store is 'dir' or 's3', not {store!r}")
    faults = tuple(faults)
    if not faults:
        raise ValueError("a cluster run injects at least one fault")
    options = options or DemoOptions(replicas=1, rate=50.0, time_limit=600)
    options = dataclasses.replace(options, recipe="reef_stream.demo.recipes:sao", target=0.0,
                                  drain_s=options.drain_s or 240, run_dir=workdir / "run")
    stages = stage_hosts(options.replicas, processors=options.processors,
                         reward_workers=options.reward_workers, evaluators=options.evaluators)
    kafka = broker_hosts(brokers)
    extra = [STORE_HOST] if store == "s3" else []
    for fault in faults:
        if fault.host not in (*kafka, "redis", *extra, *stages):
            raise ValueError(f"no host {fault.host!r} in this scenario")
        if fault.kind == "kill" and fault.host not in (*kafka, *extra) \
                and not supervised(fault.host) and member_of(fault.host) != "reward" \
                and not fault.host.startswith("replica-"):
            raise ValueError("a kill of a host whose stage the demo does not restart ends the "
                             "run; kill a broker's, a replica's, the reward worker's, a "
                             "supervised stage's or the object store's host")
        if fault.kind == "pause-replace" and not supervised(fault.host):
            raise ValueError(f"pause-replace pauses a supervised stage's host "
                             f"({', '.join(SUPERVISED)} or another member of their groups), "
                             f"not {fault.host!r}")
    spares = spare_hosts(faults)
    settings = dataclasses.replace(settings, home=workdir / "home")
    (workdir / "hosts").mkdir(parents=True, exist_ok=True)
    replicas = [s for s in stages if s.startswith("replica-")]
    with Hosts([*kafka, "redis", *extra, *stages, *spares], workdir=workdir / "hosts") as hosts, \
            contextlib.ExitStack() as stack:
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
            s3 = None
            if store == "s3":
                s3 = stack.enter_context(object_store(hosts, workdir / "s3", settings))
                options = dataclasses.replace(options, store=f"s3://{BUCKET}/{options.namespace}"
                                              if options.namespace else f"s3://{BUCKET}/run")
                say(f"object store at {s3.endpoint}, checkpoints under {options.store}")
            demo = Demo(options, settings=settings, bootstrap=bootstrap, redis_url=redis_url,
                        broker_pids=(), wrap=hosts.wrap)
            supervisor = Supervisor(hosts, demo, say)
            injector = Injector(hosts, demo, faults, say, restart=cluster.up,
                                restart_store=None if s3 is None else s3.up,
                                supervisor=supervisor)
            served = Served(demo, redis_url, replicas)
            settled: list[float] = []   # when the other stop conditions first held

            def may_stop() -> bool:
                # Every fault is over, and the pipeline went on (or did not recover from one,
                # which fails the run: no use waiting longer).
                if not injector.done.is_set() or (
                        injector.recovered and injector.promoted_after() < versions_after):
                    return False
                if not settled:
                    settled.append(time.monotonic())
                return served.agree() or time.monotonic() - settled[0] > SERVED_WAIT_S

            injector.start()
            try:
                result = demo.run(may_stop=may_stop)
            finally:
                injector.stop()
            run = ClusterRun(faults, result, options=options,
                             injected=list(injector.injected),
                             steps_after=max(demo.steps - injector.steps_at_end, 0)
                             if injector.done.is_set() else 0,
                             promoted_after=injector.promoted_after(),
                             newest_promoted=served.newest, served=served.served)
            committed = committed_checkpoints(bootstrap, demo.ns, demo.recipe.name, GROUP)
            run.chain = checkpoint_chain(committed)
            if s3 is not None:
                stored_checks(run, s3, committed, demo)
            run.writers = [e.uri.rstrip("/").rsplit("/", 1)[-1].partition(".")[2]
                           for e in committed]
            run.fenced_writes = sum(_fenced(stage.log) for stage in demo.stages.values()
                                    if stage.log.exists())
            run.replaced = supervisor.finish(_fenced)
            run.decided_twice = _decided_twice(list(demo.publications))
            run.work = demo.work()
            run.decisions = {name: _decided(stage.log) for name, stage in demo.stages.items()
                             if member_of(name) == "evaluator"}
            run.acknowledged = sum(len(path.read_text().split())
                                   for path in (workdir / "run").glob("acknowledged-*.txt"))
            return run
        finally:
            redis.down()
            cluster.down()
