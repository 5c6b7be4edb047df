"""The loop against its lower bound: the synchronous loop once, then the live loop N times.

    python bench/loop.py [--runs 3] [--recipe methods.sao] [--target 0.9] [--time-limit 600]

In one invocation, on this machine:

1. the synchronous loop (``reef_stream.demo.sync``): the naive one-process loop over the same
   bound recipe -- sample a step's worth, score, build units with the recipe's processor,
   train, measure -- until the recipe's evaluator measures the target. Its stopwatch pauses
   while measuring and nothing is published or served: the lower bound. It runs first, before
   any server is up, so nothing else takes its CPU;
2. one local Kafka broker and one Redis in a temporary REEF_HOME, for the whole invocation
   (REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL, when set, are used instead and nothing is
   started; the broker's CPU then counts only if it runs on this host, as this user);
3. the live loop, ``reef demo`` with its defaults (every stage a process, 2 replicas at
   300 generations/s, or ``--replicas`` x ``--rate``), ``--runs`` times, each in a fresh namespace; each run's scorecard
   (``reef_stream.ops.scorecard``, defined in docs/metrics.md) is printed when it ends.

The last line is

    SCORECARD sync_s=... live_s=... ratio=... staleness_mean=... goodput=... infra_cpu_share=...
    checkpoint_to_serving_p50_s=...

(one line): ``sync_s`` the synchronous loop's seconds to the target, ``live_s`` the median
over the live runs of the scorecard's time to target (first generation -> first promoted
version measured at the target), ``ratio`` = live_s / sync_s; the other figures are medians
over the live runs of the scorecards' figures (``infra_cpu_share``: the CPU of the reward
worker, the processor and the broker over all the CPU of the loop's processes: every stage,
the replicas and the broker). A run that does not reach the target within ``--time-limit``
prints its figures, counts as the time limit in the median and is flagged in a NOTE line
above the SCORECARD line. Figures, never assertions: nothing here is tuned.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import demo_arguments, figure, live_run, run, say, servers  # first: it puts the project on sys.path

from reef_stream.core.settings import load_settings
from reef_stream.demo.recipes import stage_recipe
from reef_stream.demo.run import DemoOptions, DemoResult
from reef_stream.demo.sync import SyncResult, run_synchronous


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


def scorecard_line(sync: SyncResult, runs: list[DemoResult], time_limit: float) -> str:
    """The last line (see the module docstring)."""
    sync_s = sync.seconds if sync.reached else time_limit
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


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/loop.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="live runs (default 3)")
    parser.add_argument("--recipe", default="methods.sao",
                        help="the demo's recipe, for both loops (default methods.sao; "
                             "methods.grpo, or any bound recipe path)")
    demo_arguments(parser)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    say(f"synchronous loop: {args.recipe} to {args.target:g} (at most {args.time_limit:g} s)")
    sync = run_synchronous(stage_recipe(args.recipe), target=args.target,
                           time_limit=args.time_limit, seed=0)
    say(sync.line())
    print("  curve (step, s, accuracy): " + ", ".join(
        f"({s}, {t:.1f}, {a:.2f})" for s, t, a in sync.curve[::max(len(sync.curve) // 12, 1)]))

    runs: list[DemoResult] = []
    with tempfile.TemporaryDirectory(prefix="reef-loop-") as tmp:
        home = Path(tmp)
        environ = {**os.environ, "REEF_HOME": str(home)}
        settings = load_settings(environ)
        with servers(settings, home) as at:
            say(f"broker {at.bootstrap}, redis {at.redis_url}, REEF_HOME {home}")
            for number in range(1, args.runs + 1):
                options = DemoOptions(recipe=args.recipe, target=args.target,
                                      replicas=args.replicas, rate=args.rate,
                                      time_limit=args.time_limit, run_dir=home / f"run-{number}",
                                      namespace=f"loop{number}{time.strftime('%H%M%S')}")
                result = live_run(options, settings, at, f"live run {number}/{args.runs}")
                runs.append(result)
                if not result.reached:
                    say(f"live run {number} did NOT reach {args.target:g}: it counts as the time "
                        f"limit, {args.time_limit:g} s")

    unreached = [i for i, r in enumerate(runs, 1) if not r.reached]
    print()
    print("live runs (time to target, s): " + ", ".join(
        f"{live_seconds(r, args.time_limit):.0f}" + ("" if r.reached else " (NOT reached)")
        for r in runs))
    notes = []
    if not sync.reached:
        notes.append(f"the synchronous loop did not reach {args.target:g}: sync_s is its time "
                     "limit")
    if unreached:
        notes.append(f"live run(s) {unreached} did not reach {args.target:g}: each counts as "
                     f"{args.time_limit:g} s")
    if notes:
        print("NOTE: " + "; ".join(notes))
    print(scorecard_line(sync, runs, args.time_limit), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
