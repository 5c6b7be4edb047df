"""``reef demo``: the whole loop, every stage a separate process, until the policy has learned.

    demo = Demo(DemoOptions(recipe="methods.sao", replicas=2, target=0.9, time_limit=900),
                settings=settings, bootstrap=bootstrap)
    result = demo.run()          # blocks; result.reached, result.scorecard, result.report

What runs (each a child process with its log under ``<run dir>/logs``):

    replicas (N)     sample from the newest promoted version, emit Generations through the SDK
    reward worker    reef reward: exact-match reward -> Feedback
    processor        reef process: generations + feedback -> units
    trainer          reef train: units -> checkpoints (every one kept: the ledger reads them)
    evaluator        reef evaluate: held-out accuracy; promotes only what does not regress

``processors``, ``reward_workers`` and ``evaluators`` run that many members of the stage's
consumer group, each a stage of its own (``members``: ``processor``, ``processor-2``, ...;
the processors with distinct ``--instance`` ids); the evaluators after the first stand by
until the group hands them the checkpoints.

With ``engine="vllm"`` the replicas are one process (``reef_stream.demo.vllm_replica``) that
drives and samples a vLLM server the demo starts on a Hugging Face model and stops at the end
(``reef_stream.demo.vllm_serving``); the example methods are bound to that model by
``reef_stream.demo.vllm_recipes``. With ``via_proxy`` its requests go through ``reef intake
proxy`` (the ``proxy`` stage) in front of the server, and the proxy records them.

The replicas start last, once every other stage has reported that it runs (its first
``process_cpu_seconds`` metric, written when its stage loop has joined or resumed; at most
``READY_WAIT_S``): traffic meets a pipeline that is up, as in production, and the
scorecard's clock, which starts at the first generation, does not count the stages'
start-up (imports, a model built, a checkpoint resumed) any more than the synchronous
loop's does.

The demo itself only watches: it reads ``<ns>.publications`` (held-out
accuracy per promoted version), ``<ns>.metrics`` (reward, steps) and the
topics' end offsets (throughput), shows them live, and stops when the newest
promoted version reaches the target accuracy or the time limit passes. With
``chaos`` it SIGKILLs the trainer or the processor at random moments and
restarts it. At the end it checks the unit ledger (no unit trained twice, none
lost), reads the run's scorecard from its topics (``reef_stream.ops.scorecard``; the stages
report their own CPU time, the demo samples its replicas' and the brokers' it was given every
``CPU_SAMPLE_S``) and writes ``report.html`` (``reef_stream.demo.report``): the scorecard and
PNG plots.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from reef_stream.core.events import DeadLetter, Decision, Metric, Publication, RolloutUnit
from reef_stream.core.metric_names import (
    CONSUMER_LAG, PROCESS_CPU_SECONDS, PROCESSOR_UNITS, REWARD_REWARDED, REWARD_SATURATED_SLOTS,
    STAGE_PROCESSOR, STAGE_REWARD, TRAINER_STALENESS_MEAN, TRAINER_STEPS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings
from reef_stream.demo.devices import DEVICE_DIR_ENV, DEVICE_MODEL_ENV, DeviceModel
from reef_stream.demo.report import measured_accuracy, write_report
from reef_stream.demo.verify import GenerationOutcomes, ledger_counts, letter_unit
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import new_admin, new_consumer
from reef_stream.topics.fencing import EXIT_RESTART
from reef_stream.topics.kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from reef_stream.topics.reading import read_to_end

#: The model name the trainer, evaluator and replicas of a demo share.
MODEL = "policy"
#: The trainer's consumer group.
GROUP = "demo"
#: Generations per second per replica by default (``DemoOptions.rate``, ``reef demo --rate``).
DEFAULT_RATE = 400.0
#: Seconds a stage gets to stop on SIGTERM before it is killed.
STOP_GRACE_S = 15.0
#: Seconds of history ``Demo.overloaded`` compares the units emitted and trained over.
OVERLOAD_WINDOW_S = 30.0
#: Seconds between two samples of the CPU time of the demo's processes.
CPU_SAMPLE_S = 0.5
#: The longest the replicas wait for the other stages to report that they run.
READY_WAIT_S = 120.0
#: The metric stages that must report before the replicas start (each as many processes as
#: it has members: ``Demo.expected``).
PIPELINE = ("reward", "processor", "trainer", "evaluator")


@dataclass(frozen=True)
class DemoOptions:
    """What ``reef demo`` was asked for (see ``reef demo --help``)."""

    #: An example method (``methods.sao``: bound to the demo task, ``reef_stream.demo.recipes``)
    #: or any bound recipe path.
    recipe: str = "methods.sao"
    #: ``FIELD=VALUE`` overrides of the recipe (``--set``), given to every stage alike.
    overrides: tuple[str, ...] = ()
    replicas: int = 2
    #: Generations per second per replica. Two replicas at 400/s are a little more than the
    #: trainer trains on two cores (about 780 samples a second, three steps of 256): as on
    #: live traffic, serving may outrun training, and the recipe's backlog bound (SAO's: 2
    #: steps) sheds the surplus so the trainer takes fresh samples at its own pace. Unbounded,
    #: the surplus only waits until it is too stale (figures: ``docs/history.md``, "The
    #: demo's rates").
    rate: float = DEFAULT_RATE
    #: Partitions of the run's generations, feedback and units topics. The demo runs one
    #: processor and one trainer, and the client sends one produce request per partition: at
    #: 2 x 300/s, 6 partitions cost the broker 2.5x the CPU of 2 (docs/benchmarks.md).
    partitions: int = 2
    target: float = 0.9
    time_limit: float = 900.0
    chaos: bool = False
    chaos_every: tuple[float, float] = (8.0, 20.0)
    run_dir: Path | None = None
    namespace: str | None = None
    seed: int = 0
    #: Fault runs: after the target is reached, stop the replicas first and give the other
    #: stages up to this many seconds to give every generation its outcome, then check it
    #: (``DemoResult.outcomes``) and that every generation a replica saw acknowledged is in the
    #: topic (``DemoResult.missing_acknowledged``). 0: stop every stage at once, check neither.
    drain_s: float = 0.0
    #: What serves the policy: ``"toy"`` (the project's replica processes sampling the toy
    #: transformer) or ``"vllm"`` (a real vLLM server on a Hugging Face model, driven and
    #: sampled by one replica process: ``reef_stream.demo.vllm_serving``; ``replicas`` must
    #: be 1 and an example method is bound by ``reef_stream.demo.vllm_recipes``).
    engine: str = "toy"
    #: Prompts per request to the engine (``engine="vllm"``).
    engine_prompts: int = 32
    #: ``engine="vllm"``: the replica's requests go through a recording proxy (``reef intake
    #: proxy``, a stage of its own, ``proxy``) in front of the server, which records them;
    #: the replica produces nothing (``reef demo --via-proxy``).
    via_proxy: bool = False
    #: The toy task: ``"arithmetic"`` (one-token answers to ``a+b=``) or ``"tool"``
    #: (``reef_stream.demo.tool_task``: a tool call, the tool's output as environment tokens,
    #: the answer; an example method is bound by ``reef_stream.demo.tool_recipes``).
    task: str = "arithmetic"
    #: Canary publication (``reef demo --canary SHARE``): the evaluator publishes what it
    #: promotes as a CANARY on this share of the replicas (``reef evaluate --canary-share``;
    #: replica i of n has the canary slot i / n) and live feedback decides. None: no canary.
    canary: float | None = None
    #: Where the reward worker runs the reward function (``reef reward --sandbox``):
    #: ``"thread"`` or ``"process"`` (a pool of sandbox processes, ``reef_stream.consumers.reward.sandbox``).
    sandbox: str = "thread"
    #: Faults injected into the reward function (``reef reward --faults``:
    #: ``reef_stream.demo.reward_faults``), or None. An ``outage=START:SECONDS`` counts from
    #: the demo's start (the reward stage is given ``outage_at``, a unix time).
    reward_faults: str | None = None
    #: The modelled accelerators (``reef demo --device-model``: ``gen_ms=G,train_ms=T[,batch=B]``,
    #: ``reef_stream.demo.devices``) of the replicas and the trainer; each writes its busy time
    #: to ``<run_dir>/devices/<stage>.json``. The trainer's waits come with the demo's own
    #: bindings (``demo.recipes``, ``demo.tool_recipes``); a bound recipe of one's own waits
    #: when built with ``demo.recipes.timed``. The toy engine only. None: none (the default).
    device_model: str | None = None
    #: Where the trainer keeps its checkpoints (``<store>/checkpoints``) and the evaluator its
    #: published copies (``<store>/published``): any fsspec URL, e.g. ``s3://bucket/run``,
    #: whose credentials the stages take from the environment. None: the run directory's
    #: ``checkpoints`` and ``$REEF_HOME/published``.
    store: str | None = None
    #: Members of the processors' consumer group (stages ``processor``, ``processor-2``, ...,
    #: with ``--instance`` 0, 1, ...), of the reward workers' (``reward``, ``reward-2``, ...)
    #: and of the evaluators' (``evaluator``, ``evaluator-2``, ...: one decides, the others
    #: stand by until the group hands them the checkpoints).
    processors: int = 1
    reward_workers: int = 1
    evaluators: int = 1


def members(stage: str, count: int) -> list[str]:
    """The demo's stage names of ``count`` members of ``stage``'s group: ``stage`` first, then
    ``stage-2``, ``stage-3``, ..."""
    return [stage, *(f"{stage}-{i}" for i in range(2, count + 1))]


def member_of(name: str) -> str:
    """The stage a member's name belongs to: ``processor-2`` -> ``processor``; any other
    name (``trainer``, ``replica-0``) as it is."""
    base, _, number = name.rpartition("-")
    return base if base in PIPELINE and number.isdigit() else name


#: The engines ``DemoOptions.engine`` may name.
ENGINES = ("toy", "vllm")
#: The tasks ``DemoOptions.task`` may name.
TASKS = ("arithmetic", "tool")


@dataclass
class Sample:
    """One observation of the pipeline, taken about once a second."""

    at: float
    offsets: dict[str, int]
    steps: int = 0
    #: The trainer's lag on the units topic (its ``consumer_lag`` metrics, summed).
    trainer_lag: int = 0


@dataclass
class DemoResult:
    """How the run ended. ``reached``: the target accuracy was met in time."""

    reached: bool
    seconds: float
    accuracy: float | None
    version: int | None
    report: Path
    kills: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)
    ledger: dict[str, int] = field(default_factory=dict)
    stalled: str | None = None
    #: The last time the run was overloaded (``Demo.overloaded``), what it said; None: never.
    overloaded: str | None = None
    #: With ``drain_s``: ``verify.GenerationOutcomes.counts`` after the drain, and how many
    #: acknowledged generations the topic lacks (None: not checked).
    outcomes: dict[str, int] = field(default_factory=dict)
    missing_acknowledged: int | None = None
    #: The run's ``reef_stream.ops.scorecard.Scorecard`` (read from its topics at the end).
    scorecard: Any = None
    #: CPU seconds the demo measured from outside, by stage: every child process (restarts
    #: added up) and the broker(s) it was given (``Demo.cpu_seconds``).
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        got = "n/a" if self.accuracy is None else f"{self.accuracy:.3f}"
        how = "reached the target" if self.reached else "did NOT reach the target"
        kills = f"; chaos kills {dict(self.kills)}" if self.kills else ""
        kills += f"; restarted on request {dict(self.restarts)}" if self.restarts else ""
        checked = "" if self.missing_acknowledged is None else (
            f"; generation outcomes {self.outcomes}; acknowledged but missing "
            f"{self.missing_acknowledged}")
        return (f"{how} in {self.seconds:.0f} s: held-out accuracy {got} at published version "
                f"{self.version}{kills}; ledger {self.ledger}{checked}; report {self.report}"
                + ("" if self.reached or not self.stalled else f"\n{self.stalled}")
                + ("" if self.reached or not self.overloaded else f"\n{self.overloaded}"))

    def log_checks(self, acknowledged: int | None = None) -> list[tuple[str, bool, str]]:
        """``(what, held, detail)`` of what the log must show after a drained run with faults:
        every acknowledged generation in its topic (of ``acknowledged``, when known), exactly
        one outcome per generation, no unit trained twice or lost."""
        outcomes, ledger = self.outcomes, self.ledger
        of = "" if acknowledged is None else f" of {acknowledged}"
        return [
            ("every acknowledged generation is in its topic", self.missing_acknowledged == 0,
             f"{self.missing_acknowledged} missing{of}"),
            ("every generation has exactly one outcome",
             bool(outcomes) and outcomes["no_outcome"] == 0 and outcomes["more_than_one"] == 0,
             str(outcomes)),
            ("no unit trained twice, none lost",
             ledger.get("trained_twice") == 0 and ledger.get("lost") == 0
             and ledger.get("trained", 0) > 0, str(ledger)),
        ]


class Stage:
    """One child process of the demo, restartable. Its output goes to ``log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.process: subprocess.Popen | None = None
        self.starts = 0
        #: The pid of each process it started, in order (a wrapped one's own: ``ip netns exec``
        #: execs it), which the stages' ``<host>.<pid>`` metric labels name.
        self.pids: list[int] = []
        #: Start number -> the last CPU seconds sampled of that process (``sample_cpu``).
        self._cpu: dict[int, float] = {}

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "a") as out:
            out.write(f"\n==== start {self.starts} at {time.strftime('%H:%M:%S')}: "
                      f"{' '.join(self.argv)}\n")
            out.flush()
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.pids.append(self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def sample_cpu(self) -> None:
        """Note the CPU time the running process has used so far (user + system, its waited-for
        children's too). Callable from any thread; a process gone already is skipped."""
        process, start = self.process, self.starts
        if process is not None and process.poll() is None:
            used = process_cpu_seconds(process.pid)
            if used is not None:
                self._cpu[start] = used

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of every process this stage ran, as last sampled, added up."""
        return sum(self._cpu.values())

    def kill(self) -> None:
        """SIGKILL, the way a machine dies: no cleanup runs."""
        self.sample_cpu()
        if self.alive:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
        if not self.alive:
            return
        self.sample_cpu()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


class Demo:
    """One demo run; see the module docstring. ``run`` blocks; call it once."""

    def __init__(self, options: DemoOptions, *, settings: Settings, bootstrap: str,
                 redis_url: str, show: Callable[[dict[str, Any]], None] | None = None,
                 broker_pids: Sequence[int] | None = None,
                 wrap: Callable[[str], Sequence[str]] | None = None) -> None:
        """``broker_pids``: the processes of the broker(s) the run uses, whose CPU time during
        the run counts in the scorecard (``cpu_seconds``); None: those of this user listening
        on ``bootstrap`` on this host (``local_broker_pids``; none for a remote broker, whose
        CPU is then not counted). ``wrap``: the argv prefix each stage is started under, by
        stage name (``reward``, ``processor``, ``trainer``, ``evaluator``, ``replica-<i>``, and
        ``members`` past the first, e.g. ``processor-2``):
        ``ip netns exec NS`` puts it on an emulated host; None: none."""
        from reef_stream.api.recipe import load_recipe
        from reef_stream.core.errors import ConfigurationError
        from reef_stream.demo.recipes import stage_recipe
        from reef_stream.demo.reward_faults import RewardFaults

        self.options, self.settings, self.bootstrap = options, settings, bootstrap
        if options.engine not in ENGINES:
            raise ConfigurationError(f"the demo's engine is one of {', '.join(ENGINES)}, not "
                                     f"{options.engine!r}")
        if options.engine == "vllm" and options.device_model:
            raise ConfigurationError("--device-model models the toy engine's devices: a vLLM "
                                     "server has its own (leave --device-model out)")
        if options.engine == "vllm" and (options.replicas != 1 or options.drain_s):
            raise ConfigurationError(
                "with the vllm engine the demo runs one replica process, which drives the one "
                "vLLM server's reloads and orders its requests against them (--replicas 1), "
                "and no drain check")
        if options.via_proxy and options.engine != "vllm":
            raise ConfigurationError("--via-proxy puts a recording proxy in front of the vLLM "
                                     "server: give --engine vllm")
        if options.task not in TASKS or (options.task == "tool" and options.engine != "toy"):
            raise ConfigurationError(f"the demo's task is one of {', '.join(TASKS)} (tool: with "
                                     f"the toy engine), not {options.task!r} on "
                                     f"{options.engine!r}")
        if min(options.processors, options.reward_workers, options.evaluators) < 1:
            raise ConfigurationError(f"the demo runs at least one of each stage, not "
                                     f"{options.processors} processors, {options.reward_workers} "
                                     f"reward workers, {options.evaluators} evaluators")
        if options.canary is not None and (not 0 < options.canary <= 1
                                           or options.engine != "toy"):
            raise ConfigurationError(f"the demo's canary share is in (0, 1] on the toy engine, "
                                     f"not {options.canary} on {options.engine!r}")
        #: What every stage loads: the demo's binding of an example method, or the path given.
        self.recipe_path = stage_recipe(options.recipe, options.engine)
        if options.task == "tool":
            from reef_stream.demo.tool_recipes import stage_recipe as tool_stage_recipe

            self.recipe_path = tool_stage_recipe(options.recipe)
        if options.engine == "vllm":   # the engine's model, built before the recipe loads it
            from reef_stream.demo.vllm_model import demo_model_dir, ensure_demo_model

            ensure_demo_model(demo_model_dir(settings.home))
        self.device = DeviceModel.parse(options.device_model) if options.device_model else None
        self.recipe = load_recipe(self.recipe_path, overrides=options.overrides, complete=True)
        if options.engine == "vllm" and self.recipe.group_size > 1:
            raise ConfigurationError(f"recipe {self.recipe.name!r} samples groups of "
                                     f"{self.recipe.group_size}; the vllm replica samples one "
                                     "completion per prompt (use methods.sao)")
        self.ns = options.namespace or f"demo{time.strftime('%Y%m%d%H%M%S')}"
        self.run_dir = options.run_dir or settings.home / "demo" / self.ns
        #: Where the modelled devices write their busy time (``DemoOptions.device_model``).
        self.device_dir = self.run_dir / "devices"
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.store: Path | str = self.run_dir / "checkpoints" if options.store is None \
            else f"{options.store.rstrip('/')}/checkpoints"
        # The stages share the demo's settings: its cluster, Redis, namespace and home (where
        # the evaluator keeps published copies and the replicas their spools).
        self.env = {**os.environ, "REEF_BOOTSTRAP_SERVERS": bootstrap, "REEF_REDIS_URL": redis_url,
                    "REEF_NAMESPACE": self.ns, "REEF_HOME": str(settings.home),
                    "REEF_STUCK_COMMIT_S": f"{settings.stuck_commit_s:g}",
                    "PYTHONUNBUFFERED": "1"}
        if options.engine == "vllm":
            # The stages share two cores with the vLLM server: with torch's default of a thread
            # per core, every parallel region of a busy trainer waits for a descheduled thread.
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env.pop(DEVICE_MODEL_ENV, None)
        if self.device is not None:   # the trainer's recipe reads them (demo.recipes.timed)
            self.env.update({DEVICE_MODEL_ENV: self.device.spec(),
                             DEVICE_DIR_ENV: str(self.device_dir)})
        self.show = show or (lambda status: None)
        self.registry = SchemaRegistry.default()
        self.rng = random.Random(options.seed)
        self.topics = {
            "generations": declarations.generations(self.ns),
            "feedback": declarations.feedback(self.ns),
            "units": declarations.units(self.ns, self.recipe.name),
            "checkpoints": declarations.checkpoints(self.ns),
            "publications": declarations.publications(self.ns),
        }
        self.publications: list[tuple[float, Publication]] = []
        #: The metric stages that reported running (``_await_pipeline``), and the processes
        #: (``process`` label) of each that did.
        self.running: set[str] = set()
        self.reporting: dict[str, set[str]] = {}
        #: Each reward worker process's running count of scored generations, by ``instance``
        #: label (``<host>.<pid>``; ``work``).
        self.rewarded: dict[str, int] = {}
        self.rewards: list[tuple[float, float]] = []
        #: The reward workers' call slots busy past their p99 (``saturated_slots``), by instance.
        self.saturated: dict[str, float] = {}
        self.steps = 0
        self.staleness: float | None = None  # mean over the newest step's samples
        self.samples: list[Sample] = []
        #: Units the processors committed (their running ``units`` metric), by ``instance``
        #: label: (the units of its earlier runs, the running total of the current one). The
        #: units topic's end offsets would also count transaction markers.
        self.units_committed: dict[str, tuple[int, int]] = {}
        self.kills: Counter = Counter()
        self.restarts: Counter = Counter()   # stages that exited with EXIT_RESTART
        self.last_status: dict[str, Any] = {}
        self.was_overloaded: str | None = None   # the last ``overloaded`` diagnosis
        self.trainer_lag: dict[str, int] = {}     # partition -> the trainer's lag on the units
        self.broker_pids = tuple(local_broker_pids(bootstrap) if broker_pids is None
                                 else broker_pids)
        self._broker_cpu: dict[int, list[float]] = {}  # pid -> [first sample, last sample]
        self.engine = None   # the vLLM server of engine="vllm" (``vllm_serving.DemoEngine``)
        if options.engine == "vllm":
            from reef_stream.demo.vllm_serving import DemoEngine

            self.engine = DemoEngine(settings, self.run_dir / "engine",
                                     progress=lambda line: self.show({"line": line}))
        #: The reward stage's ``--faults``: the options' spec, its outage anchored now.
        self.reward_faults = "" if not options.reward_faults else \
            RewardFaults.parse(options.reward_faults).anchored(time.time()).text()
        self.wrap = wrap or (lambda name: ())
        #: Each stage's command without its ``wrap`` (``supersede`` runs it elsewhere).
        self.commands: dict[str, list[str]] = {}
        #: Each processor stage's ``--instance`` (its ``units`` metrics' label).
        self.instances: dict[str, str] = {}
        self.stages = self._stages()
        #: Stages an orchestrator replaced (``supersede``): no longer supervised here (a dead
        #: one is no failure, a lingering one may be a zombie), still stopped at the end, their
        #: CPU and logs still counted.
        self.retired: set[str] = set()
        self._arriving: list[Stage] = []   # replacements the demo's loop starts next
        self._arriving_lock = threading.Lock()

    # ----------------------------------------------------------------- the stages

    def _stages(self) -> dict[str, Stage]:
        reef = [sys.executable, "-m", "reef_stream.cli"]
        recipe = ["--recipe", self.recipe_path,
                  *(arg for item in self.options.overrides for arg in ("--set", item))]
        logs = self.run_dir / "logs"
        reward = [*reef, "reward", *recipe, *(
            ("--sandbox", self.options.sandbox) if self.options.sandbox != "thread" else ()),
            *(("--faults", self.reward_faults) if self.reward_faults else ())]
        evaluate = [*reef, "evaluate", *recipe, *(
            ("--canary-share", str(self.options.canary)) if self.options.canary else ()), *(
            ("--publish-to", f"{self.options.store.rstrip('/')}/published")
            if self.options.store else ())]
        argvs = {name: reward for name in members("reward", self.options.reward_workers)}
        for i, name in enumerate(members("processor", self.options.processors)):
            # Distinct members of one group: a processor's instance is its static membership
            # and transactional id (the first keeps the default, 0).
            argvs[name] = [*reef, "process", *recipe, *(("--instance", str(i)) if i else ())]
            self.instances[name] = str(i)
        argvs["trainer"] = [*reef, "train", *recipe, "--group", GROUP, "--model", MODEL,
                            "--checkpoints", str(self.store), "--keep", "0"]
        argvs.update({name: evaluate for name in members("evaluator", self.options.evaluators)})
        stages = {name: Stage(name, list(argv), self.env, logs / f"{name}.log")
                  for name, argv in argvs.items()}
        for i in range(self.options.replicas if self.engine is None else 0):
            argv = [sys.executable, "-m", "reef_stream.demo.replica", "--model", MODEL,
                    *recipe,
                    "--replica-id", f"replica-{i}", "--seed", str(self.recipe.schedule.seed),
                    "--sample-seed", str(1000 + i), "--rate", str(self.options.rate)]
            if self.options.drain_s:
                argv += ["--acked-log", str(self._acked_log(i))]
            if self.recipe.group_size > 1:
                argv += ["--grouped", "--group-size", str(self.recipe.group_size)]
            if self.options.task != "arithmetic":
                argv += ["--task", self.options.task]
            if self.device is not None:
                argv += ["--device-model", self.device.spec(), "--device-report",
                         str(self.device_dir / f"replica-{i}.json")]
            env = self.env if not self.options.canary else {
                **self.env, "REEF_CANARY_SLOT": str(i / self.options.replicas)}
            stages[f"replica-{i}"] = Stage(f"replica-{i}", argv, env,
                                           logs / f"replica-{i}.log")
        for name, stage in stages.items():
            self.commands[name] = stage.argv
            stage.argv = [*self.wrap(name), *stage.argv]
        return stages

    def retire(self, name: str) -> None:
        """Supervise stage ``name`` no more: it may die or linger (see ``retired``), as a stage
        whose host an orchestrator lost. Thread-safe, idempotent."""
        self.retired.add(name)

    def supersede(self, name: str, by: str, wrap: Sequence[str]) -> Stage:
        """Replace stage ``name`` by a new stage ``by`` running the same command under
        ``wrap`` (another host, reaching the same broker, Redis and checkpoint store), as an
        orchestrator does once it lost the old one's host. Thread-safe, returns at once:
        ``name`` is retired now (``retire``), and the demo's loop starts ``by`` at its
        next check of the stages (its ``starts`` turns 1), then supervises it like the
        others. Returns the new stage; its log is ``<by>.log`` beside the old one's."""
        old = self.stages[name]
        stage = Stage(by, [*wrap, *self.commands[name]], old.env, old.log.with_name(f"{by}.log"))
        self.commands[by] = self.commands[name]
        self.retire(name)
        with self._arriving_lock:
            self._arriving.append(stage)
        return stage

    def _engine_replica(self, url: str) -> None:
        """Add the replica that drives and samples the vLLM server at ``url``; with
        ``via_proxy``, start the recording proxy in front of it first (it is stopped after
        the replica: the stages stop in the order they were added)."""
        from reef_stream.core.processes import free_ports
        from reef_stream.demo.vllm_serving import REPLICA_ID

        assert self.engine is not None
        via = None
        if self.options.via_proxy:
            listen = f"127.0.0.1:{free_ports(1)[0]}"
            via = f"http://{listen}"
            proxy = Stage("proxy", self.engine.proxy_argv(url, listen, model=MODEL), self.env,
                          self.run_dir / "logs" / "proxy.log")
            proxy.start()
            self._await_answer(proxy, via + "/reef/stats")
        argv = self.engine.replica_argv(url, model=MODEL, rate=self.options.rate,
                                        prompts=self.options.engine_prompts, via=via)
        self.stages["replica-0"] = Stage("replica-0", argv, self.env,
                                         self.run_dir / "logs" / f"{REPLICA_ID}.log")
        if via is not None:
            self.stages["proxy"] = proxy

    @staticmethod
    def _await_answer(stage: Stage, url: str, timeout: float = READY_WAIT_S) -> None:
        """Wait until ``url`` (a stage's HTTP endpoint) answers; RuntimeError with the stage's
        log when it exits or does not answer within ``timeout``."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5):
                    return
            except OSError:
                pass
            if not stage.alive or time.monotonic() > deadline:
                stage.stop()
                raise RuntimeError(f"the {stage.name} stage did not answer at {url}; its log "
                                   f"{stage.log} ends:\n{stage.tail()}")
            time.sleep(0.2)

    # ----------------------------------------------------------------- the run

    def run(self, may_stop: Callable[[], bool] = lambda: True) -> DemoResult:
        """Run until the target is reached (once ``may_stop()`` also says so) or the time limit
        passes; see the module docstring."""
        ensure_topics(new_admin(self.bootstrap),
                      declarations.declare_topics(self.ns, (self.recipe.name,),
                                                  self.options.partitions))
        watcher = new_consumer(self.bootstrap, f"{self.ns}.demo-watch")
        watcher.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in (
            self.topics["publications"],)] + [TopicPartition(declarations.metrics(self.ns), p,
                                                             OFFSET_BEGINNING) for p in range(3)])
        self._sample_cpu()   # the brokers' CPU so far, not the run's
        sampling = threading.Event()
        sampler = threading.Thread(target=self._sample_cpu_until, args=(sampling,),
                                   name="demo-cpu", daemon=True)
        started = time.monotonic()
        next_chaos = started + self.rng.uniform(*self.options.chaos_every)
        reached = False
        try:
            if self.engine is not None:
                self.engine.prepare()
                self.engine.start()   # on a thread, while the stages start
            for name, stage in self.stages.items():
                if not name.startswith("replica-"):
                    stage.start()
            sampler.start()
            self._await_pipeline(watcher, started)
            if self.engine is not None:
                self._engine_replica(self.engine.wait())
            for name, stage in self.stages.items():
                if name.startswith("replica-"):
                    stage.start()
            while time.monotonic() - started < self.options.time_limit:
                self._watch(watcher, started)
                self._check_stages()
                accuracy, version = self.accuracy()
                self.last_status = self.status(started)
                self.show(self.last_status)
                if accuracy is not None and accuracy >= self.options.target and may_stop():
                    reached = True
                    break
                if self.options.chaos and time.monotonic() >= next_chaos:
                    victim = self.rng.choice(["trainer", *members(
                        "processor", self.options.processors)])
                    self.stages[victim].kill()
                    self.kills[victim] += 1
                    self.stages[victim].start()
                    next_chaos = time.monotonic() + self.rng.uniform(*self.options.chaos_every)
                time.sleep(1.0)
            seconds = time.monotonic() - started
            outcomes, missing = self._drain() if self.options.drain_s else ({}, None)
        finally:
            sampling.set()
            if sampler.is_alive():
                sampler.join()
            for stage in self.stages.values():
                stage.stop()   # samples its CPU first
            if self.engine is not None:
                self.engine.stop()
            self._sample_cpu()
            watcher.close()
        accuracy, version = self.accuracy()
        ledger = unit_ledger(self.bootstrap, self.ns, self.recipe.name, self.store, GROUP)
        scorecard = self.scorecard(ledger)
        report = write_report(self, seconds, ledger, scorecard)
        return DemoResult(reached=reached, seconds=seconds, accuracy=accuracy, version=version,
                          report=report, kills=self.kills, restarts=self.restarts,
                          ledger=ledger, stalled=self.stalled(), overloaded=self.was_overloaded,
                          outcomes=outcomes, missing_acknowledged=missing, scorecard=scorecard,
                          cpu_seconds=self.cpu_seconds())

    # ----------------------------------------------------------------- the scorecard

    def scorecard(self, ledger: dict[str, int]) -> Any:
        """The run's scorecard, read from its topics (``reef_stream.ops.scorecard``): the stages
        report their own CPU time as metrics; the replicas' and the brokers' come from here.

        A replica's follower runs on the stage loop inside the replica's process, so its
        ``process_cpu_seconds`` is that whole process's CPU: the same seconds as ``replica``,
        measured here from outside (from the process's start, not the follower's). They count
        once, as ``replica``."""
        from reef_stream.core.metric_names import STAGE_FOLLOWER
        from reef_stream.ops.scorecard import read_scorecard

        cpu = self.cpu_seconds()
        extra = {"replica": sum(v for k, v in cpu.items() if k.startswith("replica-"))}
        if "broker" in cpu:   # not counted (absent) when the broker is not on this host
            extra["broker"] = cpu["broker"]
        if "engine" in cpu:   # the vLLM server (engine="vllm")
            extra["engine"] = cpu["engine"]
        if "proxy" in cpu:   # the recording proxy in front of it (via_proxy)
            extra["proxy"] = cpu["proxy"]
        card = read_scorecard(self.bootstrap, self.ns, self.recipe.name,
                              target=self.options.target, measure="accuracy", extra_cpu=extra,
                              ledger=ledger)
        card.cpu_seconds.pop(STAGE_FOLLOWER, None)
        return card

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used during the run, measured from outside: per stage (each process it
        ran, restarts added up) and ``broker`` (the ``broker_pids`` since the run began)."""
        used = {name: stage.cpu_seconds for name, stage in self.stages.items()}
        if self.engine is not None:
            used["engine"] = self.engine.cpu_seconds
        if self.broker_pids:
            used["broker"] = sum(last - first for first, last in self._broker_cpu.values())
        return used

    def _sample_cpu(self) -> None:
        for stage in list(self.stages.values()):
            stage.sample_cpu()
        if self.engine is not None:
            self.engine.sample_cpu()
        for pid in self.broker_pids:
            used = process_cpu_seconds(pid)
            if used is not None:
                self._broker_cpu.setdefault(pid, [used, used])[1] = used

    def _sample_cpu_until(self, stop: threading.Event) -> None:
        """Sample every ``CPU_SAMPLE_S`` seconds until ``stop`` is set (the sampling thread)."""
        while not stop.wait(CPU_SAMPLE_S):
            self._sample_cpu()

    def _acked_log(self, replica: int) -> Path:
        return self.run_dir / f"acknowledged-replica-{replica}.txt"

    def _drain(self) -> tuple[dict[str, int], int]:
        """Stop the replicas (each writes its acknowledged ids), then wait up to ``drain_s``
        seconds for every generation to have its outcome. Returns the last count and how many
        acknowledged generations the topic lacks."""
        for name, stage in self.stages.items():
            if name.startswith("replica-"):
                stage.stop()
        deadline = time.monotonic() + self.options.drain_s
        tally = GenerationOutcomes(self.bootstrap, self.ns, self.recipe)
        try:
            while True:
                self._check_stages(replicas=False)   # e.g. a processor restarting (status 75)
                outcomes = tally.update()
                self.show({**self.last_status, "draining": outcomes})
                if outcomes["no_outcome"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(5.0)
            acknowledged = [gid for i in range(self.options.replicas)
                            for gid in self._acked_log(i).read_text().split()]
            return outcomes, len(tally.missing(acknowledged))
        finally:
            tally.close()

    def expected(self) -> dict[str, int]:
        """Processes of each ``PIPELINE`` stage that run at once: its members."""
        return {"reward": self.options.reward_workers, "processor": self.options.processors,
                "trainer": 1, "evaluator": self.options.evaluators}

    def pipeline_runs(self) -> bool:
        """Whether every member of every ``PIPELINE`` stage has reported that it runs (as many
        processes of each stage as ``expected``; a restarted one counts again)."""
        return all(len(self.reporting.get(stage, ())) >= count
                   for stage, count in self.expected().items())

    def _await_pipeline(self, watcher: Consumer, started: float) -> None:
        """Until every member of every stage of ``PIPELINE`` has reported that it runs (at most
        ``READY_WAIT_S``; the replicas are not started yet). Blocks."""
        deadline = time.monotonic() + min(READY_WAIT_S, self.options.time_limit)
        while not self.pipeline_runs() and time.monotonic() < deadline:
            self._watch(watcher, started)
            self._check_stages(replicas=False)
            self.last_status = self.status(started)
            self.show(self.last_status)

    def _check_stages(self, replicas: bool = True) -> None:
        """A stage that exited on its own is a failure of the demo (say which and why), but for
        one that asked to be restarted (``EXIT_RESTART``), as a supervisor would. Without
        ``replicas``: the replicas are not started yet, or were stopped on purpose; the others
        are still supervised. Starts the replacements ``supersede`` asked for first, and
        leaves the stages it retired alone."""
        with self._arriving_lock:
            arriving, self._arriving = self._arriving, []
        for stage in arriving:
            self.stages[stage.name] = stage
            stage.start()
        for stage in self.stages.values():
            if (not replicas and stage.name.startswith("replica-")) or stage.name in self.retired:
                continue
            if not stage.alive and stage.process.returncode == EXIT_RESTART:
                self.restarts[stage.name] += 1
                stage.start()
            elif not stage.alive:
                raise RuntimeError(f"the {stage.name} stage exited (status "
                                   f"{stage.process.returncode}); its log {stage.log} ends:\n"
                                   f"{stage.tail()}")

    def _watch(self, watcher: Consumer, started: float) -> None:
        now = time.monotonic() - started
        for message in watcher.consume(5000, timeout=0.2):
            if message.error() is not None or message.value() is None:
                continue
            try:
                event = self.registry.decode(message.value(), message.headers())
            except Exception:  # noqa: BLE001 - the demo only watches
                continue
            if isinstance(event, Metric) and event.name == PROCESS_CPU_SECONDS:
                self.running.add(event.stage)
                self.reporting.setdefault(event.stage, set()).add(
                    event.labels.get("process", ""))
            if isinstance(event, Publication):
                self.publications.append((now, event))
            elif isinstance(event, Metric) and event.stage == STAGE_PROCESSOR:
                if event.name == PROCESSOR_UNITS:
                    self.count_units(event.labels.get("instance", ""), int(event.value))
            elif isinstance(event, Metric) and event.stage == STAGE_REWARD:
                if event.name == REWARD_SATURATED_SLOTS:
                    self.saturated[event.labels.get("instance", "")] = event.value
                elif event.name == REWARD_REWARDED:
                    self.rewarded[event.labels.get("instance", "")] = int(event.value)
            elif isinstance(event, Metric) and event.stage == "trainer":
                if event.name == "objective.reward_mean":
                    self.rewards.append((now, event.value))
                elif event.name == TRAINER_STEPS:
                    self.steps = max(self.steps, int(event.value))
                elif event.name == TRAINER_STALENESS_MEAN:
                    self.staleness = event.value
                elif event.name == CONSUMER_LAG and event.labels.get("topic") == \
                        self.topics["units"]:
                    self.trainer_lag[event.labels.get("partition", "")] = int(event.value)
        # Records per topic for the rates; units are counted by the processors (above).
        offsets = {name: end_offset(watcher, self.topics[name])
                   for name in ("generations", "feedback")}
        if self.samples:   # a failed read keeps the last known figure
            offsets = {k: v if v >= 0 else self.samples[-1].offsets[k] for k, v in offsets.items()}
        offsets["units"] = self.units()
        self.samples.append(Sample(now, {k: max(v, 0) for k, v in offsets.items()}, self.steps,
                                   sum(self.trainer_lag.values())))

    def count_units(self, instance: str, value: int) -> None:
        """A processor's running ``units`` metric. A restarted processor counts from 0 again
        under the same instance label: a value below the last one starts a new run (the rule
        of ``ops.scorecard.counter_total``)."""
        before, last = self.units_committed.get(instance, (0, 0))
        self.units_committed[instance] = (before + last if value < last else before, value)

    def units(self) -> int:
        """Units the processors committed so far, over their restarts."""
        return sum(before + last for before, last in self.units_committed.values())

    def work(self) -> dict[str, int]:
        """What each processor and reward worker stage did so far, from their metrics: units a
        processor committed (its ``instance``, over its restarts), generations a reward worker
        scored (``rewarded`` of each process it ran, by the pid in its ``instance`` label).
        A processor's replacement (``supersede``) is not counted: it shares the instance."""
        done = {}
        for name, stage in list(self.stages.items()):
            base = member_of(name)
            if base == "processor" and name in self.instances:
                before, last = self.units_committed.get(self.instances[name], (0, 0))
                done[name] = before + last
            elif base == "reward":
                pids = {str(pid) for pid in stage.pids}
                done[name] = sum(n for instance, n in self.rewarded.items()
                                 if instance.rpartition(".")[2] in pids)
        return done

    def accuracy(self) -> tuple[float | None, int | None]:
        """Held-out accuracy and version of the newest promoted publication."""
        promoted = [p for _, p in self.publications if p.decision is Decision.PROMOTED]
        if not promoted:
            return None, None
        newest = max(promoted, key=lambda p: p.policy_version)
        return measured_accuracy(newest), newest.policy_version

    def status(self, started: float) -> dict[str, Any]:
        accuracy, version = self.accuracy()
        rates = {}
        if len(self.samples) >= 2:
            old = next((s for s in self.samples if s.at >= self.samples[-1].at - 10),
                       self.samples[0])
            span = max(self.samples[-1].at - old.at, 1e-6)
            rates = {k: (self.samples[-1].offsets[k] - old.offsets[k]) / span
                     for k in ("generations", "feedback", "units")}
        return {"elapsed": time.monotonic() - started, "version": version, "accuracy": accuracy,
                "reward": self.rewards[-1][1] if self.rewards else None, "steps": self.steps,
                "rejected": sum(p.decision is Decision.REJECTED for _, p in self.publications),
                "staleness": self.staleness, "rates": rates, "kills": dict(self.kills),
                "saturated": sum(self.saturated.values()) if self.saturated else None,
                "stalled": self.stalled(), "overloaded": self.overloaded()}

    def overloaded(self) -> str | None:
        """Whether units arrive faster than the trainer trains them, so that what it trains
        has waited until nearly too stale; None if not.

        The trainer takes units in log order. When they arrive faster than it trains, its lag
        on the units topic grows (by more than a step of units over ``OVERLOAD_WINDOW_S``) and
        every unit it reaches has waited about ``max_staleness`` versions: it trains only the
        stalest samples it may and dead-letters the rest as too stale. Nothing is lost or
        silent, but learning from samples that stale is slow, and a fault's backlog never
        drains. The cures: fewer generations, more CPU for the trainer, or a bound on the
        queue (``schedule.max_backlog_steps``).
        """
        limit = self.recipe.schedule.max_staleness
        if self.staleness is None or self.staleness < 0.75 * limit or not self.samples:
            return None
        newest = self.samples[-1]
        old = next(s for s in self.samples if s.at >= newest.at - OVERLOAD_WINDOW_S)
        if newest.at - old.at < OVERLOAD_WINDOW_S / 2 \
                or newest.trainer_lag - old.trainer_lag <= self.recipe.schedule.units_per_step:
            return None
        self.was_overloaded = (f"overloaded: the trainer's lag on the units topic grew from "
                               f"{old.trainer_lag} to {newest.trainer_lag} records in "
                               f"{newest.at - old.at:.0f} s, so the units it reaches have waited "
                               f"until nearly too stale (mean staleness {self.staleness:.1f}, "
                               f"max_staleness {limit}); lower the replicas' rate, give the "
                               "trainer more CPU, or bound the queue (schedule."
                               "max_backlog_steps)")
        return self.was_overloaded

    def stalled(self) -> str | None:
        """Why the loop cannot learn any more, or None.

        Replicas serve only promoted versions. When the trainer is more than the schedule's
        ``max_staleness`` steps past the newest one (the evaluator kept rejecting), every new
        generation is too stale to train: no new checkpoint comes, so nothing is evaluated again.
        """
        _, version = self.accuracy()
        limit = self.recipe.schedule.max_staleness
        lead = self.steps - (version or 0)
        if lead <= limit:
            return None
        streak = 0
        for _, publication in reversed(self.publications):
            if publication.decision is not Decision.REJECTED:
                break
            streak += 1
        return (f"stalled: the trainer is at version {self.steps}, {lead} past the newest "
                f"promoted version {version or 0} (max_staleness {limit}), so every new generation "
                f"is too stale to train; the evaluator rejected the last {streak} candidates")


# --------------------------------------------------------------------------- helpers


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds ``pid`` has used (user + system of all its threads, and of its children it
    waited for; ``/proc/<pid>/stat``), or None when it is gone or unreadable."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system + times.children_user + times.children_system


def local_broker_pids(bootstrap: str) -> list[int]:
    """The processes of this user listening on ``bootstrap``'s loopback addresses (the local
    broker's nodes), found from the host's TCP sockets; [] for a broker elsewhere. A broker
    shared with other runs at the same time counts their load too."""
    ports = set()
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        if host.strip("[]") in ("127.0.0.1", "localhost", "::1") and port.isdigit():
            ports.add(int(port))
    if not ports:
        return []
    try:
        sockets = psutil.net_connections("tcp")
    except psutil.Error:
        return []
    return sorted({s.pid for s in sockets if s.pid and s.status == psutil.CONN_LISTEN
                   and s.laddr and s.laddr.port in ports})


def end_offset(consumer: Consumer, topic: str) -> int:
    """Records in ``topic`` so far (sum of its partitions' high watermarks)."""
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        total = 0
        for p in metadata.partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            total += max(high, 0)
        return total
    except KafkaException:  # e.g. a leader moving right after the topic was created
        return -1


def unit_ledger(bootstrap: str, ns: str, recipe: str, store: Path | str,
                group: str | None = None) -> dict[str, int]:
    """Every unit the trainer acknowledged, against every unit in the log before its offsets:
    reads the checkpoints in ``store``, the units topic up to the newest one's offsets and the
    trainer's dead letters, and returns ``verify.ledger_counts`` of them (``trained_twice`` and
    ``lost`` must be 0). With ``group`` (the trainer's), only the checkpoints whose
    ``Checkpoint`` event of that group committed count: a fenced zombie's or a crashed
    trainer's last checkpoint is written but never acknowledged, and its units were trained
    again by the trainer that took over.
    """
    from reef_stream.demo.verify import committed_checkpoints
    from reef_stream.engine.checkpoints import CheckpointStore, load

    steps = CheckpointStore(store).steps()
    if group is not None:
        def name(uri: str) -> str:   # step-<N>.<writer>: one directory of the store
            return uri.rstrip("/").rsplit("/", 1)[-1]

        committed = {name(e.uri) for e in committed_checkpoints(bootstrap, ns, recipe, group)}
        steps = [c for c in steps if name(c.uri) in committed]
    if not steps:
        return {"trained": 0, "trained_twice": 0, "lost": 0}
    contents = [load(c.uri, c.sha256) for c in steps]
    offsets = {o.partition: o.offset for o in contents[-1].offsets}
    topic = declarations.units(ns, recipe)
    registry = SchemaRegistry.default()
    logged = [registry.decode(message.value(), message.headers(), RolloutUnit).unit_id
              for message in read_to_end(bootstrap, topic, until=offsets)]
    return ledger_counts((c.step_units for c in contents), logged,
                         _dropped_units(bootstrap, ns, topic))


def _dropped_units(bootstrap: str, ns: str, units_topic: str) -> set[str]:
    """Ids of the units the trainer dead-lettered (too stale, or untrainable)."""
    registry = SchemaRegistry.default()
    letters = (registry.decode(message.value(), message.headers(), DeadLetter)
               for message in read_to_end(bootstrap, declarations.dead_letters(ns)))
    return {unit for letter in letters
            if (unit := letter_unit(letter, units_topic, registry)) is not None}
