"""When traffic outruns training: the live loop at an overloading rate, one run per backlog policy.

    python bench/overload.py [--replicas 2] [--rate 400] [--bounds none,1,4]
                             [--recipe methods.sao] [--target 0.9] [--time-limit 400]

Serving cannot be slowed down for the trainer, so on live traffic replicas make more samples
than the trainer can train. What the recipe's schedule then chooses decides what is trained:

- ``none`` (no ``max_backlog_steps``): every unit is queued for the trainer; the trainer, in
  log order, reaches units later and later, trains them nearly ``max_staleness`` versions
  old, and the rest is dead-lettered too stale;
- ``K`` (``schedule.max_backlog_steps=K``): the processor sheds (dead-letters, reason
  ``shed``) every unit that completes while K steps of units already wait for the trainer,
  so the queue stays short and what is trained stays fresh.

In one invocation, against one broker and Redis (started here unless REEF_BOOTSTRAP_SERVERS /
REEF_REDIS_URL are set), each policy runs ``reef demo`` once at ``--replicas`` x ``--rate``
generations/s, in a fresh namespace; its scorecard (docs/metrics.md) is printed when it ends.
The first policy is the baseline of the others. The last lines are one per policy:

    OVERLOAD bound=none time_to_target_s=... generated=... trained=... shed=... too_stale=...
    goodput=... staleness_mean=... staleness_p99=... sample_age_p50_s=...

Figures, never assertions. Where the bench says a bound helps or not, the scorecards show why:
how old the trained samples were (versions and seconds) and how many were thrown away, and by
whom (the processor's shed against the trainer's and processor's too stale).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import demo_arguments, figure, run, runs_per_variant  # first: it sets sys.path

from reef_stream.demo.run import DemoOptions, DemoResult


def overload_line(bound: str, result: DemoResult) -> str:
    """One policy's figures (see the module docstring)."""
    card = result.scorecard
    if card is None:
        return f"OVERLOAD bound={bound} scorecard=none reached={result.reached}"
    figures = {
        "time_to_target_s": card.time_to_target_s if result.reached else None,
        "generated": card.generated, "trained": card.trained, "shed": sum(card.shed.values()),
        "too_stale": card.too_stale_samples, "goodput": card.goodput,
        "staleness_mean": card.staleness_versions.mean,
        "staleness_p99": card.staleness_versions.p99,
        "sample_age_p50_s": card.staleness_seconds.p50,
    }
    return f"OVERLOAD bound={bound} " + " ".join(f"{k}={figure(v)}" for k, v in figures.items())


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/overload.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_arguments(parser, rate=400.0, time_limit=400.0)  # 400/s: ~twice what trains
    parser.add_argument("--bounds", default="none,1,4",
                        help="backlog policies, comma-separated: none, or a number of steps "
                             "(schedule.max_backlog_steps); the first is the baseline "
                             "(default none,1,4)")
    parser.add_argument("--recipe", default="methods.sao", help="the demo's recipe")
    args = parser.parse_args()
    bounds = [b.strip() for b in args.bounds.split(",") if b.strip()]
    for bound in bounds:
        if bound != "none" and not (bound.isdigit() and int(bound) >= 1):
            parser.error(f"--bounds: {bound!r} is neither 'none' nor a number of steps >= 1")

    def options_of(bound: str, run_dir: Path, namespace: str) -> DemoOptions:
        overrides = () if bound == "none" else (f"schedule.max_backlog_steps={bound}",)
        return DemoOptions(recipe=args.recipe, overrides=overrides, replicas=args.replicas,
                           rate=args.rate, target=args.target, time_limit=args.time_limit,
                           run_dir=run_dir, namespace=namespace)

    runs_per_variant("overload", bounds, options_of, lambda b: f"backlog bound {b}",
                     overload_line)
    return 0


if __name__ == "__main__":
    run(main)
