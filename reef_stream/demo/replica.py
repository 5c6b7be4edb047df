"""A serving replica of the demo: sample the toy task from the newest promoted version, emit it.

    python -m reef_stream.demo.replica --model demo-grpo --grouped --group-size 16 --seed 7
    python -m reef_stream.demo.replica --model demo-sao --recipe reef_stream.demo.recipes:sao

or, in Python, ``run_replica("demo-grpo", grouped=True, group_size=16, seed=7,
stop_event=event)``. The replica:

1. builds the policy as the trainer does (``torch.manual_seed(seed)``, then the recipe's model
   factory, ``policy_model`` by default: ``reef_stream.demo.task.initial_policy(seed)``) and
   serves it as version 0;
2. follows the model's publications (``Follower``, ``initial_version=0``), and waits until it
   read them to their end, so a replica started late serves the newest promoted version at
   once; every newer promoted version is verified, loaded into a fresh copy of the policy on
   the follower's thread, and swapped in between two sampling rounds;
3. samples continuously: each round draws ``prompts`` training problems and, ungrouped, one
   completion each (``group_id=None``, ``group_size=1``) or, grouped, ``group_size``
   completions each sharing a fresh ``group_id``; every completion becomes a ``Generation``
   stamped with the version it was sampled from and sent through ``RecordProducer(guard=
   follower)``, so it cannot carry a version this replica never served;
4. stops when ``stop_event`` is set (SIGTERM / Ctrl-C for the command), after
   ``max_generations``, or when its follower fails; then flushes what it sent, leaves the
   fleet projection and returns a ``ReplicaReport`` (the command prints it as one JSON line).

``rate`` caps generations per second (None: as fast as sampling goes); rounds are paced at the
rate, and a replica that fell behind it (starved of CPU, or held up by a broker fault) makes up
at most ``CATCH_UP_S`` seconds of it: it does not come back with a burst of everything it
missed, which the pipeline would have to absorb on top of the steady load. When the producer pushes back (its spool stayed
full for its ``block_timeout``) the round's remaining generations are not sent -- nothing
downstream ever saw them, so nothing is lost; a group cut short that way stays incomplete, for
the processor's completion rule to settle -- and the replica pauses for a second.

With a device model (``device``, ``reef_stream.demo.devices``) each round also waits its
modelled device time after sampling: ``device.generation_ms`` of the round's completions, off
the CPU, counted on the replica's ``DeviceClock`` (written to ``device_report`` when given).
The samples are the same with it and without it.

Each replica has its own spool directory (``$REEF_HOME/spool/<ns>/replica-<id>``): give a
restarted replica the same ``replica_id`` and it replays what it spooled before it stopped.

Threads: ``run_replica`` blocks the calling thread (sampling, sending); the follower uses two
more (publications, heartbeats) and the producer one (delivery reports).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.processes import stop_on_signals
from reef_stream.core.settings import Settings, load_settings
from reef_stream.demo.devices import DeviceClock, DeviceModel
from reef_stream.demo.task import (
    DEMO_SEED, ProblemStream, make_generation, policy_model, prompt_tensor, sample,
)
from reef_stream.demo.tool_task import TOOL_GENERATION, sample_tool
from reef_stream.intake.producer import DeliveryState, RecordProducer, SendHandle, SpoolFull
from reef_stream.serving.follower import AUTO, Follower, LoadedVersion, default_replica_id

__all__ = ["ReplicaReport", "main", "replica_spool_dir", "run_replica"]

log = logging.getLogger("reef_stream.demo.replica")  # also under python -m

#: What a replica samples for each task: the sampler, and make_generation's extra arguments
#: (the tool task's rollouts call the tool: ``reef_stream.demo.tool_task``).
TASKS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "arithmetic": (sample, {}), "tool": (sample_tool, TOOL_GENERATION)}

#: Seconds a replica pauses after the producer pushed back.
BACKPRESSURE_PAUSE_S = 1.0
#: Seconds of generations a replica that fell behind its rate makes up (see the docstring).
CATCH_UP_S = 1.0
#: Completions a sampling round draws at least (by default): sampling the toy policy costs
#: 0.20 ms of CPU per completion in rounds of 8, 0.08 ms in rounds of 32 (one torch thread).
ROUND_COMPLETIONS = 32


def round_prompts(group_size: int = 1) -> int:
    """Prompts a sampling round draws by default: enough for ``ROUND_COMPLETIONS``
    completions of ``group_size`` each (1: ungrouped), at least 8."""
    return max(8, -(-ROUND_COMPLETIONS // group_size))


class Pacer:
    """Paces rounds at ``rate`` items per second, making up at most ``catch_up_s`` seconds of
    items after falling behind (a stall is not followed by a burst of everything missed)."""

    def __init__(self, rate: float, catch_up_s: float = CATCH_UP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.catch_up_s, self.clock = rate, catch_up_s, clock
        self.due = clock()      # when the items sent so far were due, at the rate

    def wait_after(self, sent: int) -> float:
        """Seconds to wait, after sending ``sent`` more items, before the next round."""
        now = self.clock()
        self.due = max(self.due, now - self.catch_up_s) + sent / self.rate
        return max(0.0, self.due - now)


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a replica did: generations handed to the producer (``sent``, and per policy
    version in ``by_version``), sampling ``rounds``, generations not sent because the producer
    pushed back (``backpressured``), the version served at the end, and the producer's final
    counts (``acknowledged`` and ``failed`` by the broker; ``unflushed``: still pending or
    spooled when it closed -- spooled ones are replayed by the next replica of this id)."""

    replica_id: str
    model: str
    sent: int
    by_version: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    backpressured: int = 0
    final_version: int = 0
    acknowledged: int = 0
    failed: int = 0
    unflushed: int = 0

    def to_json(self) -> str:
        """One line of JSON (version keys as strings)."""
        record = asdict(self)
        record["by_version"] = {str(k): v for k, v in sorted(self.by_version.items())}
        return json.dumps(record, sort_keys=True)


class RoundSender:
    """Hands a replica's generations to its producer round by round and counts them: what the
    toy replica and the vLLM replica (``reef_stream.demo.vllm_replica``) share.

    ``send_round`` sends one round's generations, made lazily by the iterable it is given
    (``count_round`` only counts a round another process records: ``producer`` None); when
    the producer pushes back (``SpoolFull``) the rest of the round is dropped (counted in
    ``backpressured``) and the sender pauses ``BACKPRESSURE_PAUSE_S``; then it waits what
    ``pacer`` asks. ``on_sent(handle, generation)``, when given, sees every send. Blocks in its
    waits, which ``stop_event`` cuts short. Not thread-safe: one replica loop drives it.
    """

    def __init__(self, producer: RecordProducer | None, replica_id: str,
                 stop_event: threading.Event,
                 pacer: Pacer | None = None,
                 on_sent: Callable[[SendHandle, Any], None] | None = None) -> None:
        self.producer, self.replica_id, self.stop_event = producer, replica_id, stop_event
        self.pacer, self.on_sent = pacer, on_sent
        self.sent = self.rounds = self.backpressured = 0
        self.by_version: dict[int, int] = {}

    def send_round(self, version: int, generations: Iterable[Any], size: int) -> int:
        """Send ``generations`` (``size`` of them, all of policy ``version``); returns how
        many the producer took."""
        self.rounds += 1
        round_sent = 0
        try:
            for generation in generations:
                handle = self.producer.send(generation)
                if self.on_sent is not None:
                    self.on_sent(handle, generation)
                round_sent += 1
        except SpoolFull as full:
            self.backpressured += size - round_sent
            log.warning("replica %s: the producer pushes back (%s); pausing %.0f s",
                        self.replica_id, full, BACKPRESSURE_PAUSE_S)
            self.stop_event.wait(BACKPRESSURE_PAUSE_S)
        finally:
            self.sent += round_sent
            if round_sent:
                self.by_version[version] = self.by_version.get(version, 0) + round_sent
        if self.pacer is not None:
            self.stop_event.wait(self.pacer.wait_after(round_sent))
        return round_sent

    def count_round(self, version: int, size: int) -> None:
        """Count a round of ``size`` generations of ``version`` that something else records
        (the recording proxy in front of the engine), then wait what ``pacer`` asks."""
        self.rounds += 1
        self.sent += size
        if size:
            self.by_version[version] = self.by_version.get(version, 0) + size
        if self.pacer is not None:
            self.stop_event.wait(self.pacer.wait_after(size))

    def report(self, model: str, final_version: int, flushed: Any) -> ReplicaReport:
        """The replica's report, with the producer's final counts (``flushed``: what its
        ``close`` returned, or None when it never started)."""
        return ReplicaReport(
            replica_id=self.replica_id, model=model, sent=self.sent,
            by_version=dict(self.by_version), rounds=self.rounds,
            backpressured=self.backpressured, final_version=final_version,
            acknowledged=flushed.acknowledged if flushed else 0,
            failed=flushed.failed if flushed else 0,
            unflushed=(flushed.pending + flushed.spooled) if flushed else 0)


class _ServedPolicy:
    """The policy the sampling thread uses and the version it holds.

    ``on_version`` runs on the follower's thread: it loads the weights into a fresh model
    (raising, so the follower refuses the version, when they do not fit) and leaves it
    pending. ``current`` runs on the sampling thread before each round: it swaps the pending
    model in once the follower serves its version -- the follower counts a version as served
    only after ``on_version`` returned, so every generation's version is one the follower
    (the producer's guard) knows this replica served.
    """

    def __init__(self, model: nn.Module, factory: Callable[[], nn.Module]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._pending: tuple[int, nn.Module] | None = None
        self.version, self.model = 0, model.eval()

    def on_version(self, loaded: LoadedVersion) -> None:
        model = self._factory()
        model.load_state_dict(dict(loaded.weights))
        model.eval()
        with self._lock:
            self._pending = (loaded.policy_version, model)

    def current(self, served: int | None) -> tuple[int, nn.Module]:
        with self._lock:
            pending = self._pending
            if pending is not None and pending[0] == served and served != self.version:
                self.version, self.model = pending
                self._pending = None
                log.info("sampling from version %d now", self.version)
            return self.version, self.model


def replica_spool_dir(settings: Settings, namespace: str, replica_id: str) -> Path:
    """``$REEF_HOME/spool/<namespace>/replica-<id>``: one spool per replica (two live producers
    must not share one); characters other than letters, digits, ``.``, ``_``, ``-`` in the id
    become ``_``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", replica_id)
    return settings.home / "spool" / namespace / f"replica-{safe}"


def _note_acknowledged(into: list[str], generation_id: str, handle: SendHandle) -> None:
    if handle.state is DeliveryState.ACKNOWLEDGED:
        into.append(generation_id)


def _noting_acknowledged(into: list[str]) -> Callable[[SendHandle, Any], None]:
    """A ``RoundSender`` ``on_sent`` that appends each generation's id to ``into`` once the
    broker acknowledged it."""
    def on_sent(handle: SendHandle, generation: Any) -> None:
        handle.add_done_callback(functools.partial(_note_acknowledged, into,
                                                   generation.generation_id))
    return on_sent


def _seed_of(replica_id: str) -> int:
    return int.from_bytes(hashlib.sha256(replica_id.encode()).digest()[:4], "little")


def run_replica(model_name: str, *, grouped: bool, group_size: int = 16,
                prompts: int | None = None,
                rate: float | None = None, temperature: float = 1.0, seed: int = DEMO_SEED,
                sampling_seed: int | None = None,
                model_factory: Callable[[], nn.Module] = policy_model,
                bootstrap: str | None = None, namespace: str | None = None,
                settings: Settings | None = None, replica_id: str | None = None,
                stop_event: threading.Event | None = None, max_generations: int | None = None,
                ready_timeout: float = 60.0, heartbeat_s: float = 2.0,
                fleet: Any = AUTO, spool_dir: Path | None = None,
                flush_timeout: float = 30.0, acked_log: Path | None = None,
                task: str = "arithmetic", device: DeviceModel | None = None,
                device_report: Path | None = None) -> ReplicaReport:
    """Serve ``model_name`` until ``stop_event`` is set or ``max_generations`` were sent
    (grouped: whole groups, so up to a group more); see the module docstring. Returns what it
    did. Blocks; call from one thread (the signal handlers of the command set ``stop_event``).

    ``grouped``: ``group_size`` completions per prompt sharing a group id (``group_size`` is
    ignored when ungrouped). ``prompts``: prompts per sampling round (default: enough for
    ``ROUND_COMPLETIONS`` completions, at least 8). ``rate``: generations per
    second at most. ``seed``: the trainer's ``schedule.seed`` (version 0 is
    ``model_factory()`` built under it, as the trainer builds it). ``sampling_seed``: seeds the
    prompts and the samples (default: derived from the replica id). ``fleet``: as for
    ``Follower``. ``acked_log``: at the end, the ids of the generations the broker acknowledged
    are written there, one a line (fault runs check that each one is in the topic). ``task``:
    what to sample (``TASKS``): the arithmetic task's one-token answers, or the tool task's
    trajectories (call, the tool's output as environment tokens, answer). ``device``: the
    modelled device each round waits on (None: none); ``device_report``: where its clock
    writes its busy time. Raises
    ``ConfigurationError`` for bad arguments or a missing publications topic, ``TimeoutError``
    when the publications could not be read within ``ready_timeout``, and whatever stopped
    the follower.
    """
    problems = []
    if prompts is None:
        prompts = round_prompts(group_size if grouped else 1)
    if group_size < 1 or (grouped and group_size < 2):
        problems.append(f"group_size must be at least 2 for grouped sampling, not {group_size}")
    if prompts < 1:
        problems.append(f"prompts per round must be at least 1, not {prompts}")
    if rate is not None and not rate > 0:
        problems.append(f"rate must be more than 0 generations per second, not {rate}")
    if not temperature > 0:
        problems.append(f"temperature must be more than 0, not {temperature}")
    if task not in TASKS:
        problems.append(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    if problems:
        raise ConfigurationError(problems)
    settings = settings or load_settings()
    namespace = namespace or settings.namespace
    replica_id = replica_id or default_replica_id()
    stop_event = stop_event or threading.Event()
    per_prompt = group_size if grouped else 1
    sampling_seed = _seed_of(replica_id) if sampling_seed is None else sampling_seed
    sampler, turns = TASKS[task]
    clock = DeviceClock(replica_id, device_report) if device is not None else None

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        served = _ServedPolicy(model_factory(), model_factory)
    follower = Follower(model_name, on_version=served.on_version, bootstrap=bootstrap,
                        settings=settings, namespace=namespace, replica_id=replica_id,
                        initial_version=0, fleet=fleet, heartbeat_s=heartbeat_s)
    stream = ProblemStream(sampling_seed)
    generator = torch.Generator().manual_seed(sampling_seed)
    acknowledged: list[str] = []  # appended on the producer's thread (acked_log only)
    producer: RecordProducer | None = None
    follower.start()
    try:
        follower.wait_ready(ready_timeout)
        producer = RecordProducer(follower.bootstrap, settings=settings, namespace=namespace,
                                  spool_dir=spool_dir or replica_spool_dir(settings, namespace,
                                                                           replica_id),
                                  guard=follower, client="replica")
        log.info("replica %s serves %s (version %s), %s sampling, %d prompts a round%s",
                 replica_id, model_name, follower.policy_version,
                 f"grouped ({group_size} per prompt)" if grouped else "ungrouped", prompts,
                 f", at most {rate:g} generations/s" if rate else "")
        sender = RoundSender(producer, replica_id, stop_event,
                             Pacer(rate) if rate is not None else None,
                             _noting_acknowledged(acknowledged) if acked_log else None)
        while not stop_event.is_set() and (max_generations is None
                                           or sender.sent < max_generations):
            if follower.error is not None:
                raise follower.error
            version, model = served.current(follower.policy_version)
            batch = stream.take(prompts)
            if max_generations is not None:
                batch = batch[:max(1, -(-(max_generations - sender.sent) // per_prompt))]
            prompts_ids = prompt_tensor([p for p in batch for _ in range(per_prompt)])
            began = time.time()
            completions = sampler(model, prompts_ids, temperature=temperature,
                                  generator=generator)
            if clock is not None and device is not None:   # the sampling counts toward it
                clock.pad_ms(device.generation_ms(len(prompts_ids)), began)

            def generations(batch=batch, version=version, completions=completions):
                for i, problem in enumerate(batch):
                    group_id = uuid.uuid4().hex if grouped else None
                    for row in range(i * per_prompt, (i + 1) * per_prompt):
                        yield make_generation(
                            model=model_name, policy_version=version, replica_id=replica_id,
                            problem=problem, token_ids=completions.token_ids[row],
                            logprobs=completions.logprobs[row], temperature=temperature,
                            group_id=group_id, group_size=per_prompt, **turns)

            sender.send_round(version, generations(), len(batch) * per_prompt)
    finally:
        flushed = producer.close(flush_timeout) if producer is not None else None
        follower.stop()
        if clock is not None:
            clock.write()
        if acked_log is not None:
            acked_log.write_text("".join(f"{gid}\n" for gid in acknowledged))
    report = sender.report(model_name, served.version, flushed)
    log.info("replica %s stopped: %d generations sent (%s)", replica_id, report.sent,
             ", ".join(f"version {v}: {n}" for v, n in sorted(report.by_version.items()))
             or "none")
    return report


# --------------------------------------------------------------------------- the command


@click.command()
@click.option("--model", "-m", "model_name", required=True,
              help="The model to serve (what its trainer's Checkpoint events call it).")
@click.option("--grouped/--ungrouped", default=False, show_default=True,
              help="Grouped: --group-size completions per prompt sharing a group id; "
                   "ungrouped: one completion per prompt.")
@click.option("--group-size", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=None,
              help="Prompts per sampling round [default: enough for 32 completions, at "
                   "least 8].")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="PER_SECOND", help="Generations per second at most [default: no cap].")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help=f"The trainer's schedule seed: version 0 is the policy built under it "
                   f"[default: the recipe's, else {DEMO_SEED}].")
@click.option("--recipe", default=None, metavar="MODULE[:ATTRIBUTE]",
              help="Take the seed and the model factory from this recipe "
                   "(reef_stream.demo.recipes:sao).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="Override a field of --recipe, as the other stages do (repeatable).")
@click.option("--sample-seed", "--sampling-seed", "sampling_seed", type=click.IntRange(min=0),
              default=None,
              help="Seeds prompts and samples [default: derived from the replica id].")
@click.option("--replica-id", default=None,
              help="This replica's name (fleet, spool) [default: <host>-<pid>-<random>].")
@click.option("--max-generations", type=click.IntRange(min=1), default=None,
              help="Stop once this many were sent (grouped: whole groups, so up to a group "
                   "more).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch CPU threads.")
@click.option("--heartbeat", type=click.FloatRange(min=0, min_open=True), default=2.0,
              show_default=True, metavar="SECONDS")
@click.option("--acked-log", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="At the end, write the ids of the generations the broker acknowledged to this "
                   "file, one a line (fault runs check each one is in the topic).")
@click.option("--task", type=click.Choice(sorted(TASKS)), default="arithmetic",
              show_default=True,
              help="What to sample: one-token answers to a+b=, or the tool task's trajectories "
                   "(a call, the tool's output as environment tokens, the answer).")
@click.option("--device-model", "device_spec", default=None, metavar="gen_ms=G,train_ms=T[,batch=B]",
              help="Wait a modelled accelerator's time after each round (reef_stream.demo."
                   "devices) [default: none].")
@click.option("--device-report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the modelled device's busy time to this JSON file.")
def main(model_name: str, grouped: bool, group_size: int, prompts: int | None,
         rate: float | None, temperature: float, seed: int | None, recipe: str | None,
         sampling_seed: int | None, replica_id: str | None, max_generations: int | None,
         threads: int, heartbeat: float, acked_log: Path | None, overrides: tuple[str, ...] = (),
         task: str = "arithmetic", device_spec: str | None = None,
         device_report: Path | None = None) -> None:
    """A demo serving replica: sample the toy task from the newest promoted version of MODEL and
    send every completion as a Generation (REEF_* variables name the cluster and namespace).

    Stops on SIGTERM or Ctrl-C (after the round in progress, flushing what it sent) or after
    --max-generations; prints a JSON summary line last.
    """
    torch.set_num_threads(threads)
    factory: Callable[[], nn.Module] = policy_model
    if recipe is not None:
        from reef_stream.api.recipe import load_recipe

        loaded = load_recipe(recipe, overrides=overrides)
        if loaded.backend.model is not None:
            factory = loaded.backend.model
        seed = loaded.schedule.seed if seed is None else seed
    stop = threading.Event()
    with stop_on_signals(stop.set):
        report = run_replica(model_name, grouped=grouped, group_size=group_size, prompts=prompts,
                             rate=rate, temperature=temperature,
                             seed=DEMO_SEED if seed is None else seed, sampling_seed=sampling_seed,
                             model_factory=factory, replica_id=replica_id, stop_event=stop,
                             max_generations=max_generations, heartbeat_s=heartbeat,
                             acked_log=acked_log, task=task,
                             device=DeviceModel.parse(device_spec) if device_spec else None,
                             device_report=device_report)
    click.echo(report.to_json())


if __name__ == "__main__":
    from reef_stream.cli.common import run_standalone

    run_standalone(main, "python -m reef_stream.demo.replica", "reef_stream")
