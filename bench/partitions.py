"""What a namespace's partition count costs: the live loop for a fixed time, once per count.

    python bench/partitions.py [--partitions 6,2,1] [--seconds 60] [--replicas 2] [--rate 300]
                               [--recipe methods.sao]

The generations, feedback and units topics have as many partitions as the namespace was
created with (``reef topics create --partitions``; ``reef demo --partitions``, default 2).
Records are keyed (a generation and its feedback share a key), so a replica spreads its
records over every partition, and the client (librdkafka) sends one produce request per
partition per batch: at a given rate, more partitions mean smaller batches and more requests
for the broker to serve, and a processor transaction that touches more partitions (units,
changelog, offsets, one commit marker each).

In one invocation, against one broker and Redis (started here unless REEF_BOOTSTRAP_SERVERS /
REEF_REDIS_URL are set), ``reef demo`` runs for ``--seconds`` at ``--replicas`` x ``--rate``
generations/s once per partition count, each in a fresh namespace (it is stopped by its time
limit, not by a target: every run gets the same traffic). The first count is the baseline of
the others. Each run's scorecard is printed; the last lines are one per count:

    PARTITIONS n=... generated=... trained=... cpu_ms_per_generation=... broker=... processor=...
    reward=... replica=... trainer=... evaluator=... infra_cpu_share=... staleness_mean=...

(per-stage figures are milliseconds of CPU per generation). Figures, never assertions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import demo_arguments, figure, run, runs_per_variant  # first: it sets sys.path

from reef_stream.demo.run import DemoOptions, DemoResult

STAGES = ("broker", "processor", "reward", "replica", "trainer", "evaluator")


def partitions_line(count: int, result: DemoResult) -> str:
    """One partition count's figures (see the module docstring)."""
    card = result.scorecard
    if card is None or not card.generated:
        return f"PARTITIONS n={count} scorecard=none"
    per_generation_ms = {stage: 1000 * card.cpu_seconds.get(stage, 0.0) / card.generated
                         for stage in STAGES}
    figures = {
        "generated": card.generated, "trained": card.trained,
        "cpu_ms_per_generation": _ms(card.cpu_per_generation), **per_generation_ms,
        "infra_cpu_share": card.infra_cpu_share,
        "staleness_mean": card.staleness_versions.mean,
    }
    return f"PARTITIONS n={count} " + " ".join(f"{k}={figure(v)}" for k, v in figures.items())


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/partitions.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_arguments(parser, time_limit=60.0)
    parser.add_argument("--partitions", default="6,2,1",
                        help="partition counts, comma-separated; the first is the baseline "
                             "(default 6,2,1)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="how long each run lasts (the same as --time-limit; default 60)")
    parser.add_argument("--recipe", default="methods.sao", help="the demo's recipe")
    args = parser.parse_args()
    try:
        counts = [int(c) for c in args.partitions.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--partitions: {args.partitions!r} is not a list of whole numbers")
    if not counts or min(counts) < 1:
        parser.error("--partitions: give at least one count, each 1 or more")
    seconds = args.seconds or args.time_limit

    def options_of(count: int, run_dir: Path, namespace: str) -> DemoOptions:
        # A target no run reaches: each runs its full time, so each gets the same traffic.
        return DemoOptions(recipe=args.recipe, replicas=args.replicas, rate=args.rate,
                           partitions=count, target=1.0, time_limit=seconds, run_dir=run_dir,
                           namespace=namespace)

    runs_per_variant("partitions", counts, options_of, lambda c: f"{c} partitions",
                     partitions_line)
    return 0


if __name__ == "__main__":
    run(main)
