"""Liveness after rejections, at the demo's scale: the loop stalls, rolls back, reaches its target.

    python bench/rollback.py [--replicas 2] [--rate 300] [--target 0.9] [--time-limit 600]

In one invocation, against one broker and Redis (started here unless REEF_BOOTSTRAP_SERVERS /
REEF_REDIS_URL are set), ``reef demo`` runs twice:

1. the default recipe (``methods.sao``), the baseline;
2. ``tests.recipes.demo_rejects_in_a_row``: the same recipe with an evaluator that rejects
   versions 2 to 21, twenty candidates in a row, more than SAO's ``max_staleness`` of 16.
   Replicas keep serving version 1; once the trainer is more than 16 versions past it, every
   sample is too stale and the loop has stalled for good. The trainer must roll back by
   itself (``reef_stream.publishing.rollback``): a checkpoint holding version 1's weights as
   its next version, which the evaluator promotes, and the loop learns on from there.

Each run's scorecard is printed when it ends; the last lines are one per run:

    ROLLBACK recipe=... reached=... time_to_target_s=... rejected=... rollbacks=... (v<N> = v<M>, ...)

Figures, never assertions; ``tests/integration/test_rollback.py`` is the short version that CI
runs (rejections, stall, rollback, training on; weights checked).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import demo_arguments, figure, live_run, run, servers  # first: it puts the project on sys.path

from reef_stream.core.settings import load_settings
from reef_stream.demo.run import DemoOptions, DemoResult
from reef_stream.topics.declarations import checkpoints, publications
from reef_stream.core.events import Checkpoint, Decision, Publication
from reef_stream.topics.reading import read_to_end
from reef_stream.core.serde import SchemaRegistry

RECIPES = ("methods.sao", "tests.recipes.demo_rejects_in_a_row")


def rollback_line(recipe: str, result: DemoResult, bootstrap: str, namespace: str) -> str:
    """One run's figures, its rollbacks and rejections read back from its topics."""
    registry = SchemaRegistry.default()
    made = [registry.decode(m.value(), m.headers(), Checkpoint)
            for m in read_to_end(bootstrap, checkpoints(namespace))]
    decided = [registry.decode(m.value(), m.headers(), Publication)
               for m in read_to_end(bootstrap, publications(namespace))]
    rollbacks = sorted({(c.policy_version, c.rolled_back_to) for c in made
                        if c.rolled_back_to is not None})
    rejected = sum(p.decision is Decision.REJECTED for p in decided)
    card = result.scorecard
    seconds = card.time_to_target_s if card is not None and result.reached else None
    return (f"ROLLBACK recipe={recipe} reached={result.reached} "
            f"time_to_target_s={figure(seconds)} rejected={rejected} rollbacks={len(rollbacks)}"
            + (f" ({', '.join(f'v{v} = v{to}' for v, to in rollbacks)})" if rollbacks else ""))


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/rollback.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_arguments(parser)
    parser.add_argument("--skip-baseline", action="store_true",
                        help="run only the rejecting recipe")
    args = parser.parse_args()
    recipes = RECIPES[1:] if args.skip_baseline else RECIPES

    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="reef-rollback-") as tmp:
        home = Path(tmp)
        settings = load_settings({**os.environ, "REEF_HOME": str(home)})
        with servers(settings, home) as at:
            for number, recipe in enumerate(recipes, 1):
                namespace = f"rb{number}{time.strftime('%H%M%S')}"
                options = DemoOptions(recipe=recipe, replicas=args.replicas, rate=args.rate,
                                      target=args.target, time_limit=args.time_limit,
                                      run_dir=home / f"run-{number}", namespace=namespace)
                result = live_run(options, settings, at, f"run {number}/{len(recipes)}, {recipe}")
                lines.append(rollback_line(recipe, result, at.bootstrap, namespace))
    print()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
