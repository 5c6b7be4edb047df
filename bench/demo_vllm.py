"""`reef demo --engine vllm` to its target, beside the toy demo, in one invocation.

    python bench/demo_vllm.py [--target 0.9] [--time-limit 900] [--rate 100] [--skip-toy]

On one broker and Redis (``common.servers``: the configured ones, or started under a temporary
REEF_HOME) it runs ``reef demo`` twice, each in a fresh namespace:

1. the toy demo at its defaults (2 replicas x 400/s of the toy transformer);
2. ``reef demo --engine vllm``: the tiny Qwen2-style Hugging Face policy served by a real
   vLLM server the demo starts (``reef_stream.demo.vllm_serving``), one replica at ``--rate``.

For each: time to target (the scorecard's: first generation -> first promoted version at the
target), samples trained, versions. For the vLLM run also: the engine's reload seconds (p50
and p99 of ``VllmEngine.reload``, from the replica's report) and the trainer's same-version
logprob gap (``logprob_gap.same_version``: mean |trainer - vLLM| logprob over the samples the
trainer's own version generated; mean and max over the steps that had such samples) beside
the older samples' gap. The last line is

    DEMO_VLLM toy_s=... vllm_s=... vllm_accuracy=... reload_p50_s=... reload_p99_s=...
    gap_same_mean=... gap_same_max=... gap_older_mean=...

Figures, never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import (  # first: it puts the project on sys.path
    figure,
    live_run,
    run,
    say,
    servers,
    time_to_target,
)

from reef_stream.cli.demo import VLLM_RATE
from reef_stream.core.settings import load_settings
from reef_stream.demo.run import DemoOptions
from reef_stream.core.metric_names import (
    TRAINER_LOGPROB_GAP_OLDER, TRAINER_LOGPROB_GAP_SAME_VERSION,
)
from reef_stream.topics.declarations import metrics
from reef_stream.core.events import Metric
from reef_stream.topics.reading import read_to_end
from reef_stream.core.serde import SchemaRegistry


def gaps(bootstrap: str, namespace: str) -> tuple[list[float], list[float]]:
    """The trainer's same-version and older-sample logprob gaps, one per step that had any."""
    registry = SchemaRegistry.default()
    same, older = [], []
    for message in read_to_end(bootstrap, metrics(namespace)):
        event = registry.decode(message.value(), message.headers(), Metric)
        if event.stage == "trainer" and event.name == TRAINER_LOGPROB_GAP_SAME_VERSION:
            same.append(event.value)
        elif event.stage == "trainer" and event.name == TRAINER_LOGPROB_GAP_OLDER:
            older.append(event.value)
    return same, older


def reloads(run_dir: Path) -> list[float]:
    """The engine's reload seconds from the replica's report (its log's last line)."""
    try:
        last = (run_dir / "logs" / "vllm-0.log").read_text().strip().splitlines()[-1]
        return list(json.loads(last)["engine_reloads"])
    except (OSError, ValueError, KeyError, IndexError):
        return []


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def shown(value: float | None) -> str:
    """A figure; a small one (a logprob gap) in scientific notation."""
    if value is not None and 0 < abs(value) < 0.01:
        return f"{value:.2e}"
    return figure(value)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/demo_vllm.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--time-limit", type=float, default=900.0, metavar="S",
                        help="seconds each run gets (default 900)")
    parser.add_argument("--rate", type=float, default=VLLM_RATE,
                        help=f"the vLLM replica's generations/s (default {VLLM_RATE:g}, the "
                             "demo's)")
    parser.add_argument("--skip-toy", action="store_true", help="run the vLLM demo only")
    args = parser.parse_args()

    figures: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="reef-demo-vllm-") as tmp:
        home = Path(tmp)
        settings = load_settings({**os.environ, "REEF_HOME": str(home)})
        with servers(settings, home) as at:
            say(f"broker {at.bootstrap}, redis {at.redis_url}, REEF_HOME {home}")
            if not args.skip_toy:
                toy = live_run(DemoOptions(target=args.target, time_limit=args.time_limit,
                                           run_dir=home / "toy",
                                           namespace=f"toy{time.strftime('%H%M%S')}"),
                               settings, at, "toy demo")
                figures["toy_s"] = time_to_target(toy)
            namespace = f"vllm{time.strftime('%H%M%S')}"
            result = live_run(DemoOptions(target=args.target, time_limit=args.time_limit,
                                          replicas=1, rate=args.rate, engine="vllm",
                                          run_dir=home / "vllm", namespace=namespace),
                              settings, at, "vLLM demo")
            same, older = gaps(at.bootstrap, namespace)
            seconds = reloads(home / "vllm")
    figures.update({
        "vllm_s": time_to_target(result), "vllm_accuracy": result.accuracy,
        "vllm_versions": result.version,
        "reload_p50_s": quantile(seconds, 0.5), "reload_p99_s": quantile(seconds, 0.99),
        "reloads": len(seconds),
        "gap_same_mean": statistics.fmean(same) if same else None,
        "gap_same_max": max(same) if same else None,
        "gap_same_steps": len(same),
        "gap_older_mean": statistics.fmean(older) if older else None,
    })
    print()
    if not result.reached:
        print(f"NOTE: the vLLM demo did not reach {args.target:g} in {args.time_limit:g} s "
              f"(best promoted accuracy {figure(result.accuracy)})")
    print("DEMO_VLLM " + " ".join(f"{k}={shown(v)}" for k, v in figures.items()), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
