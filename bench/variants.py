"""GRPO's loss and advantage variants on the demo task, to its target, in one invocation.

    python bench/variants.py [--target 0.9] [--time-limit 600] [--only clip_higher,dr_grpo]

Run from the repository root (the stages load the recipes below as ``bench.variants:<name>``).
On one broker and Redis (``common.servers``: the configured ones, or started under a temporary
REEF_HOME) it runs ``reef demo`` once per variant, each in a fresh namespace:

1. ``grpo``: the demo's GRPO as it is (PPO clip 0.2, group population std, token-mean);
2. ``clip_higher``: DAPO's clip-higher (epsilon 0.2 below, 0.28 above) with the token-level
   normalisation over the optimizer batch (``ClippedPolicyGradient(epsilon_high=0.28)``);
3. ``dr_grpo``: Dr. GRPO's advantages, ``r - group mean`` unscaled
   (``AdvantageNormalisation.NONE``).

For each: whether it reached the target, the time to target (the scorecard's: first generation
-> first promoted version at the target), the best promoted accuracy and the versions trained.
The last lines are one per variant:

    VARIANT name=... reached=... time_to_target_s=... accuracy=... versions=...

Figures, never assertions (not run in CI). Each run is a live loop of several processes: on a
loaded machine its time to target measures the machine.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.api.losses import ClippedPolicyGradient  # noqa: E402
from reef_stream.api.variants import AdvantageNormalisation  # noqa: E402
from reef_stream.demo.recipes import bind, method  # noqa: E402

#: DAPO's clip-higher: the ratio may rise to 1.28 before the clip, fall to 0.8.
clip_higher = bind(functools.partial(
    method("grpo").recipe, name="grpo_clip_higher",
    loss=ClippedPolicyGradient(epsilon=0.2, epsilon_high=0.28)))
#: Dr. GRPO's advantages: the group's centred rewards, not divided by its std.
dr_grpo = bind(functools.partial(
    method("grpo").recipe, name="grpo_dr", normalisation=AdvantageNormalisation.NONE))

#: Variant name -> the recipe path ``reef demo --recipe`` takes.
VARIANTS = {
    "grpo": "methods.grpo",
    "clip_higher": "bench.variants:clip_higher",
    "dr_grpo": "bench.variants:dr_grpo",
}


def main() -> int:
    from common import (chosen, demo_arguments, figure,  # bench/ is on sys.path
                        runs_per_variant, time_to_target)

    from reef_stream.demo.run import DemoOptions, DemoResult

    parser = argparse.ArgumentParser(prog="python bench/variants.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_arguments(parser, time_limit=600.0)
    args, picked = chosen(parser, list(VARIANTS), "variants")

    def options_of(name: str, run_dir: Path, namespace: str) -> DemoOptions:
        return DemoOptions(recipe=VARIANTS[name], replicas=args.replicas, rate=args.rate,
                           target=args.target, time_limit=args.time_limit, run_dir=run_dir,
                           namespace=namespace)

    def line_of(name: str, result: DemoResult) -> str:
        seconds = time_to_target(result)
        return (f"VARIANT name={name} reached={result.reached} "
                f"time_to_target_s={figure(seconds)} accuracy={figure(result.accuracy)} "
                f"versions={result.version}")

    runs_per_variant("variants", picked, options_of, lambda name: f"{name} ({VARIANTS[name]})",
                     line_of)
    return 0


if __name__ == "__main__":
    from common import run

    run(main)
