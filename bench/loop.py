"""The loop against its lower bound: the synchronous loop over several seeds, then the live
loop N times.

    python bench/loop.py [--runs 3] [--sync-seeds 5] [--recipe methods.sao] [--target 0.9]

In one invocation, on this machine:

1. the synchronous loop (``reef_stream.demo.sync``): the naive one-process loop over the same
   bound recipe -- sample a step's worth, score, build units with the recipe's processor,
   train, measure -- until the recipe's evaluator measures the target. Its stopwatch pauses
   while measuring and nothing is published or served: the lower bound. It runs first, before
   any server is up, so nothing else takes its CPU, once per seed (``--sync-seeds``, 0 to
   N-1), and its figures are the medians: the samples one seed needs vary by more than two to
   one;
2. one local Kafka broker and one Redis in a temporary REEF_HOME, for the whole invocation
   (REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL, when set, are used instead and nothing is
   started; the broker's CPU then counts only if it runs on this host, as this user);
3. the live loop, ``reef demo`` with its defaults (every stage a process, 2 replicas at
   400 generations/s, or ``--replicas`` x ``--rate``), ``--runs`` times, each in a fresh namespace; each run's scorecard
   (``reef_stream.ops.scorecard``, defined in docs/metrics.md) is printed when it ends.

The last line is

    SCORECARD sync_s=... live_s=... ratio=... staleness_mean=... goodput=... infra_cpu_share=...
    checkpoint_to_serving_p50_s=...

(one line): ``sync_s`` the synchronous loop's seconds to the target (median over the seeds),
``live_s`` the median
over the live runs of the scorecard's time to target (first generation -> first promoted
version measured at the target), ``ratio`` = live_s / sync_s; the other figures are medians
over the live runs of the scorecards' figures (``infra_cpu_share``: the CPU of the reward
worker, the processor and the broker over all the CPU of the loop's processes: every stage,
the replicas and the broker). A run that does not reach the target within ``--time-limit``
prints its figures, counts as the time limit in the median and is flagged in a NOTE line
above the SCORECARD line. Figures, never assertions: nothing here is tuned.

With ``--device-model [gen_ms=G,train_ms=T[,batch=B]]`` (no value: the default,
``reef_stream.demo.devices.DEFAULT_SPEC``) both loops run on the modelled accelerators
(``reef demo --device-model``; the synchronous loop uses the same ``--replicas`` devices and the
trainer's in turn; its devices' time is counted on its stopwatch, not slept, which is the
same figure for a loop that does nothing while they wait), raw Kafka is measured after the live
runs on the same (by then warm) broker, and the last line is

    SCORECARD device_model=G/T sync_s=... live_s=... speedup=... bound=... overlap_efficiency=...
    samples_ratio=... trainer_busy=... staleness_mean=... goodput=... infra_cpu_vs_raw=...

(one line; the line above it gives ``replicas_busy``, ``samples_per_s_speedup`` -- samples
trained per second, live over sync: the speedup with sample efficiency left out -- and the CPU
figures in ms): ``speedup`` = sync_s / live_s;
``bound`` = (g + t) / max(g, t), the most overlap can give, with g a step's generation on the
``--replicas`` devices (``ceil(samples / (replicas x B)) x G``) and t its training (samples x T)
(``DeviceModel.overlap_bound``; one replica device of batch B: the issue's ``(G+T)/max(G,T)``
per step's work); ``overlap_efficiency`` = speedup / bound; ``samples_ratio`` = samples trained
to the target, live (the scorecard's, median over the live runs) over sync (median over the
seeds); ``trainer_busy`` and ``replicas_busy``: each
modelled device's waits over the span from its first wait to its last (the replicas': their
mean), median over the live runs; ``infra_cpu_vs_raw``: the CPU of the reward worker, the
processor and the broker per generation (median over the live runs) over raw Kafka's CPU per
record carrying the same traffic: records of a generation's encoded size through the same
broker at the live runs' median generations a second, in the replicas' rounds from one
producer per replica, read back as they come, for ``--raw-seconds``, broker plus client CPU
(``bench/raw.py``). The line above also gives raw Kafka's burst figure (``--raw-records``
sent as fast as they go, then read: its best case, which moves with the broker's JIT) and
the ratio against it, ``infra_cpu_vs_raw_burst``.
``--quick``: one live run to accuracy ``QUICK_TARGET`` within ``QUICK_TIME_LIMIT`` s each
(minutes, not a figure to compare against the full run's).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import Servers, demo_arguments, figure, live_run, run, say, servers  # first: it puts the project on sys.path

from raw import paced_raw_cpu_per_record, raw_cpu_per_record

from reef_stream.api.recipe import load_recipe
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.settings import load_settings
from reef_stream.demo.devices import DEFAULT_SPEC, DeviceModel, read_reports
from reef_stream.demo.recipes import stage_recipe
from reef_stream.demo.replica import round_prompts
from reef_stream.demo.run import DemoOptions, DemoResult
from reef_stream.demo.sync import SyncResult, run_synchronous
from reef_stream.ops.scorecard import INFRA

#: ``--quick``: the target and the time limit of each loop (one live run).
QUICK_TARGET = 0.5
QUICK_TIME_LIMIT = 600.0


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def live_seconds(result: DemoResult, time_limit: float) -> float:
    """A run's time to target: the scorecard's (first generation -> first promoted version at
    the target), the demo's own when the scorecard has none; the time limit when not reached."""
    if not result.reached:
        return time_limit
    seconds = result.scorecard.time_to_target_s if result.scorecard is not None else None
    return seconds if seconds is not None else result.seconds


@dataclass(frozen=True)
class Synchronous:
    """The synchronous loop's runs, one per seed, and their medians: how many samples a seed
    needs to reach the target varies by more than two to one (80 to 220 steps to 0.5 over
    seeds 0-8 of the demo's SAO), so one seed is no baseline."""

    runs: tuple[SyncResult, ...]
    time_limit: float

    @property
    def seconds(self) -> float:
        """The median time to target, a run that did not reach it counting as the limit."""
        return statistics.median(r.seconds if r.reached else self.time_limit for r in self.runs)

    @property
    def samples(self) -> float:
        """The median samples to the target (or to the limit)."""
        return statistics.median(r.samples for r in self.runs)

    @property
    def reached(self) -> bool:
        return all(r.reached for r in self.runs)

    def spread(self) -> str:
        steps = sorted(r.steps for r in self.runs)
        return (f"{len(self.runs)} seeds: steps to target {', '.join(map(str, steps))}; median "
                f"{statistics.median(steps):g} steps, {self.samples:g} samples, "
                f"{self.seconds:.1f} s")


def scorecard_line(sync: Synchronous, runs: list[DemoResult], time_limit: float) -> str:
    """The last line (see the module docstring)."""
    sync_s = sync.seconds
    live_s = statistics.median(live_seconds(r, time_limit) for r in runs)
    cards = [r.scorecard for r in runs if r.scorecard is not None]
    figures = {
        "sync_s": sync_s, "live_s": live_s, "ratio": live_s / sync_s if sync_s else None,
        "staleness_mean": _median([c.staleness_versions.mean for c in cards]),
        "goodput": _median([c.goodput for c in cards]),
        "infra_cpu_share": _median([c.infra_cpu_share for c in cards]),
        "checkpoint_to_serving_p50_s": _median([c.checkpoint_to_serving_s.p50 for c in cards]),
    }
    return "SCORECARD " + " ".join(f"{k}={figure(v)}" for k, v in figures.items())


def device_figures(result: DemoResult, run_dir: Path) -> dict[str, float | None]:
    """A live run's modelled devices (``<run_dir>/devices``): the trainer's busy fraction and
    the replicas' mean, None when a device never waited."""
    reports = read_reports(run_dir / "devices")
    replicas = [r["busy_fraction"] for name, r in reports.items()
                if name.startswith("replica-") and r["busy_fraction"] is not None]
    return {"trainer_busy": reports.get("trainer", {}).get("busy_fraction"),
            "replicas_busy": statistics.mean(replicas) if replicas else None}


def infra_cpu_per_generation(result: DemoResult) -> float | None:
    """The reward worker's, the processor's and the broker's CPU seconds over the run's
    generations (``reef_stream.ops.scorecard.INFRA``)."""
    card = result.scorecard
    if card is None or not card.generated:
        return None
    return sum(card.cpu_seconds.get(k, 0.0) for k in INFRA) / card.generated


def raw_kafka(at: Servers, runs: list[DemoResult], recipe: Any,
              args: argparse.Namespace) -> tuple[float | None, float]:
    """Raw Kafka's CPU per record on ``at``'s broker: carrying the live runs' traffic (their
    median generations a second, in the replicas' rounds; None when no run has a scorecard),
    and its burst (see the module docstring)."""
    stamp = time.strftime("%H%M%S")
    rate = _median([c.generated / c.seconds for c in (r.scorecard for r in runs)
                    if c is not None and c.seconds > 0])
    paced = None
    if rate:
        group = max(recipe.group_size, 1)
        round_size = round_prompts(group) * group
        paced = paced_raw_cpu_per_record(
            at.bootstrap, f"rawpaced{stamp}", rate=rate, seconds=args.raw_seconds,
            round_size=round_size, producers=args.replicas, broker_pids=at.broker_pids or [])
        say(f"raw Kafka at the live runs' rate: {1000 * paced:.3f} ms of CPU per record (broker "
            f"plus client; {rate:.0f} records a second in rounds of {round_size} from "
            f"{args.replicas} producers for {args.raw_seconds:g} s)")
    burst = raw_cpu_per_record(at.bootstrap, f"rawburst{stamp}", args.raw_records,
                               at.broker_pids or [])
    say(f"raw Kafka's burst: {1000 * burst:.3f} ms of CPU per record ({args.raw_records} "
        f"records as fast as they go, then read)")
    return paced, burst


def device_scorecard_line(device: DeviceModel, bound: float, sync: Synchronous,
                          runs: list[DemoResult], devices: list[dict[str, float | None]],
                          raw_per_record: float | None, time_limit: float) -> str:
    """The last line with a device model (see the module docstring)."""
    sync_s = sync.seconds
    live_s = statistics.median(live_seconds(r, time_limit) for r in runs)
    cards = [r.scorecard for r in runs if r.scorecard is not None]
    speedup = sync_s / live_s if live_s else None
    infra = _median([infra_cpu_per_generation(r) for r in runs])
    trained = _median([float(c.trained) for c in cards])
    figures = {
        "sync_s": sync_s, "live_s": live_s, "speedup": speedup, "bound": bound,
        "overlap_efficiency": speedup / bound if speedup is not None else None,
        "samples_ratio": trained / sync.samples if trained is not None and sync.samples else None,
        "trainer_busy": _median([d["trainer_busy"] for d in devices]),
        "staleness_mean": _median([c.staleness_versions.mean for c in cards]),
        "goodput": _median([c.goodput for c in cards]),
        "infra_cpu_vs_raw": (infra / raw_per_record if infra is not None and raw_per_record
                             else None),
    }
    return (f"SCORECARD device_model={device.label()} "
            + " ".join(f"{k}={figure(v)}" for k, v in figures.items()))


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/loop.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="live runs (default 3)")
    parser.add_argument("--recipe", default="methods.sao",
                        help="the demo's recipe, for both loops (default methods.sao; "
                             "methods.grpo, or any bound recipe path)")
    parser.add_argument("--device-model", nargs="?", const=DEFAULT_SPEC, default=None,
                        metavar="gen_ms=G,train_ms=T[,batch=B]",
                        help=f"model the accelerators in both loops (no value: {DEFAULT_SPEC}); "
                             "ends with the device SCORECARD line")
    parser.add_argument("--quick", action="store_true",
                        help=f"one live run, target {QUICK_TARGET:g}, at most "
                             f"{QUICK_TIME_LIMIT:g} s per loop (overrides --runs, --target, "
                             "--time-limit)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="override a field of the recipe in both loops (repeatable), e.g. "
                             "--recipe methods.grpo --set objective.normalisation=rloo; the "
                             "loss options of issue 29 (rollout importance weights) need a bound "
                             "recipe path built with them (docs/design-notes.md)")
    parser.add_argument("--sync-seeds", type=int, default=5,
                        help="seeds of the synchronous loop, whose medians are the baseline "
                             "(default 5: one seed's samples to the target vary by more than "
                             "two to one)")
    parser.add_argument("--raw-seconds", type=float, default=30.0,
                        help="seconds of raw Kafka at the live runs' rate (--device-model; "
                             "default 30)")
    parser.add_argument("--raw-records", type=int, default=20000,
                        help="records of raw Kafka's burst (--device-model; default 20000)")
    demo_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.target, args.time_limit = 1, QUICK_TARGET, QUICK_TIME_LIMIT
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.sync_seeds < 1:
        parser.error("--sync-seeds must be at least 1")
    try:
        device = DeviceModel.parse(args.device_model) if args.device_model else None
    except ConfigurationError as error:
        parser.error(str(error))
    recipe = load_recipe(stage_recipe(args.recipe), overrides=args.overrides, complete=True)
    bound = None
    if device is not None:
        samples = recipe.schedule.units_per_step * max(recipe.group_size, 1)
        g, t = device.step_ms(samples, args.replicas, recipe.schedule.epochs)
        bound = device.overlap_bound(samples, args.replicas, recipe.schedule.epochs)
        say(f"device model {device.spec()}: a step of {samples} samples is {g:.0f} ms of "
            f"generation on {args.replicas} replica devices and {t:.0f} ms of training "
            f"({100 * g / (g + t) if g + t else math.nan:.0f} % generation); bound {bound:.3g}")

    say(f"synchronous loop: {args.recipe} to {args.target:g} (at most {args.time_limit:g} s), "
        f"seeds 0-{args.sync_seeds - 1}" + ("" if device is None else
                                           ", device time counted on the stopwatch"))
    results = []
    for seed in range(args.sync_seeds):
        # The synchronous loop does nothing while its devices wait: counting their time on
        # its stopwatch gives the slept figure without sleeping it (reef_stream.demo.sync).
        result = run_synchronous(recipe, target=args.target, time_limit=args.time_limit,
                                 seed=seed, device=device, replicas=args.replicas,
                                 sleep_device=False)
        results.append(result)
        say(f"seed {seed}: {result.line()}")
        if device is not None and result.seconds:
            say(f"  devices: generation {result.generation_busy_s:.1f} s, training "
                f"{result.training_busy_s:.1f} s of {result.seconds:.1f} s (trainer busy "
                f"{result.training_busy_s / result.seconds:.2f})")
        print("  curve (step, s, accuracy): " + ", ".join(
            f"({s}, {t:.1f}, {a:.2f})"
            for s, t, a in result.curve[::max(len(result.curve) // 12, 1)]))
    sync = Synchronous(tuple(results), args.time_limit)
    say(f"synchronous loop, {sync.spread()}")

    runs: list[DemoResult] = []
    devices: list[dict[str, float | None]] = []
    raw_per_record = raw_burst = None
    with tempfile.TemporaryDirectory(prefix="reef-loop-") as tmp:
        home = Path(tmp)
        environ = {**os.environ, "REEF_HOME": str(home)}
        settings = load_settings(environ)
        with servers(settings, home) as at:
            say(f"broker {at.bootstrap}, redis {at.redis_url}, REEF_HOME {home}")
            for number in range(1, args.runs + 1):
                options = DemoOptions(recipe=args.recipe, overrides=tuple(args.overrides),
                                      target=args.target,
                                      replicas=args.replicas, rate=args.rate,
                                      time_limit=args.time_limit, run_dir=home / f"run-{number}",
                                      namespace=f"loop{number}{time.strftime('%H%M%S')}",
                                      device_model=device.spec() if device else None)
                result = live_run(options, settings, at, f"live run {number}/{args.runs}")
                runs.append(result)
                if device is not None:
                    assert options.run_dir is not None
                    devices.append(device_figures(result, options.run_dir))
                    infra = infra_cpu_per_generation(result)
                    say(f"live run {number}: trainer busy {figure(devices[-1]['trainer_busy'])}, "
                        f"replicas busy {figure(devices[-1]['replicas_busy'])}, infra CPU "
                        f"{figure(None if infra is None else 1000 * infra)} ms per generation")
                if not result.reached:
                    say(f"live run {number} did NOT reach {args.target:g}: it counts as the time "
                        f"limit, {args.time_limit:g} s")
            if device is not None:
                raw_per_record, raw_burst = raw_kafka(at, runs, recipe, args)

    unreached = [i for i, r in enumerate(runs, 1) if not r.reached]
    print()
    print("live runs (time to target, s): " + ", ".join(
        f"{live_seconds(r, args.time_limit):.0f}" + ("" if r.reached else " (NOT reached)")
        for r in runs))
    notes = []
    if not sync.reached:
        notes.append(f"a synchronous seed did not reach {args.target:g}: it counts as the time "
                     "limit")
    if unreached:
        notes.append(f"live run(s) {unreached} did not reach {args.target:g}: each counts as "
                     f"{args.time_limit:g} s")
    if notes:
        print("NOTE: " + "; ".join(notes))
    if device is None:
        print(scorecard_line(sync, runs, args.time_limit), flush=True)
        return 0
    assert bound is not None
    trained = _median([float(r.scorecard.trained) for r in runs if r.scorecard is not None])
    infra = _median([infra_cpu_per_generation(r) for r in runs])
    live_s = statistics.median(live_seconds(r, args.time_limit) for r in runs)
    sync_s = sync.seconds
    # Samples per second, live over sync: the speedup with the samples' efficiency left out.
    rate_speedup = (trained / live_s) / (sync.samples / sync_s) if trained and sync.samples \
        and live_s and sync_s else None
    print(f"replicas_busy={figure(_median([d['replicas_busy'] for d in devices]))} "
          f"samples_per_s_speedup={figure(rate_speedup)} "
          f"raw_cpu_ms_per_record={figure(None if raw_per_record is None else 1000 * raw_per_record)} "
          f"raw_burst_cpu_ms_per_record={figure(None if raw_burst is None else 1000 * raw_burst)} "
          f"infra_cpu_ms_per_generation={figure(None if infra is None else 1000 * infra)} "
          f"infra_cpu_vs_raw_burst={figure(infra / raw_burst if infra and raw_burst else None)}")
    print(device_scorecard_line(device, bound, sync, runs, devices, raw_per_record,
                                args.time_limit), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
