"""`reef demo --task tool` to its target, per method, in one invocation.

    python bench/demo_tool.py [--target 0.9] [--time-limit 600] [--only sao,grpo]

On one broker and Redis (``common.servers``: the configured ones, or started under a temporary
REEF_HOME) it runs ``reef demo --task tool`` once per method, each in a fresh namespace: the
multi-turn toy task (``reef_stream.demo.tool_task``: the policy calls the ``add`` tool, gets its
output as environment tokens, which are masked out of training, then answers) bound to SAO and
to GRPO (``reef_stream.demo.tool_recipes``). For each: whether it reached the target, the time
to target (the scorecard's: first generation -> first promoted version at the target), the
best promoted accuracy, the versions and the samples trained. The last lines are one per method:

    DEMO_TOOL method=... reached=... time_to_target_s=... accuracy=... versions=... trained=...

Figures, never assertions (not run in CI: ``tests/integration/test_demo_tool.py`` runs the
command short). Each run is a live loop of several processes: on a loaded machine its time to
target measures the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("sao", "grpo")


def main() -> int:
    from common import (chosen, demo_arguments, figure,  # bench/ is on sys.path
                        runs_per_variant, time_to_target)

    from reef_stream.demo.run import DemoOptions, DemoResult

    parser = argparse.ArgumentParser(prog="python bench/demo_tool.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_arguments(parser, time_limit=600.0)
    args, picked = chosen(parser, list(METHODS), "methods")

    def options_of(name: str, run_dir: Path, namespace: str) -> DemoOptions:
        return DemoOptions(recipe=f"methods.{name}", task="tool", replicas=args.replicas,
                           rate=args.rate, target=args.target, time_limit=args.time_limit,
                           run_dir=run_dir, namespace=namespace)

    def line_of(name: str, result: DemoResult) -> str:
        seconds = time_to_target(result)
        return (f"DEMO_TOOL method={name} reached={result.reached} "
                f"time_to_target_s={figure(seconds)} accuracy={figure(result.accuracy)} "
                f"versions={result.version} trained={result.ledger.get('trained')}")

    runs_per_variant("demo-tool", picked, options_of, lambda name: f"{name}, the tool task",
                     line_of)
    return 0


if __name__ == "__main__":
    from common import run

    run(main)
