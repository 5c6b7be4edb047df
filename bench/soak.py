"""Soak: the demo pipeline at a steady offered load for a while; does anything grow?

    python bench/soak.py [--minutes 10] [--every 60] [--rate 150] [--replicas 2]

Runs the demo's pipeline (replicas, reward worker, processor, trainer, evaluator, every one
a process; ``reef_stream.demo.run``) with a target it never reaches, so the load stays what
the replicas offer (``--rate`` generations/s each) for ``--minutes``. Every ``--every``
seconds it prints the records/s per topic, the lag of each consumer group of the run, and
each process's resident memory and open file descriptors. At the end, for every process and
figure, whether it grew without bound: "GROWING" when it rose in each of the last three
intervals and by more than 10% (memory) or 16 (descriptors) over the second half of the
run, else "steady". Uses REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL if set, otherwise a
throw-away single-node broker and Redis. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from common import run, servers  # first: it puts the project on sys.path

from reef_stream.core.settings import load_settings
from reef_stream.demo.run import Demo, DemoOptions
from reef_stream.topics.cursors import lag

MiB = 1 << 20


class Soak:
    """Samples the run's processes and groups every ``every`` seconds (the demo's ``show``)."""

    def __init__(self, every: float) -> None:
        self.every, self.demo, self.last = every, None, 0.0
        #: figure ("<stage> rss MiB", "<stage> fds") -> [(elapsed s, value)]
        self.series: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def __call__(self, status: dict[str, Any]) -> None:
        if self.demo is None or time.monotonic() - self.last < self.every:
            return
        self.last = time.monotonic()
        elapsed = status["elapsed"]
        rates = "  ".join(f"{k} {v:6.0f}/s" for k, v in status["rates"].items())
        print(f"--- {elapsed / 60:5.1f} min  version {status['version']}  "
              f"accuracy {status['accuracy']}  steps {status['steps']}  {rates}")
        try:
            groups = [g for g in lag(self.demo.bootstrap)
                      if any(p.topic.startswith(f"{self.demo.ns}.") for p in g.partitions)]
            print("    lag: " + ", ".join(f"{g.group} {g.total}" for g in groups))
        except Exception as error:  # noqa: BLE001 - a figure missing, not a failure
            print(f"    lag: not read ({error})")
        for name, stage in self.demo.stages.items():
            if not stage.alive:
                print(f"    {name:<10} not running")
                continue
            try:
                process = psutil.Process(stage.process.pid)
                rss, fds = process.memory_info().rss / MiB, process.num_fds()
            except psutil.Error as error:
                print(f"    {name:<10} not measured ({error})")
                continue
            self.series[f"{name} rss MiB"].append((elapsed, rss))
            self.series[f"{name} fds"].append((elapsed, fds))
            print(f"    {name:<10} rss {rss:7.1f} MiB  fds {fds:4d}")

    def verdict(self) -> list[str]:
        lines = []
        for figure, points in sorted(self.series.items()):
            values = [v for _, v in points]
            if len(values) < 4:
                lines.append(f"{figure:<24} too few samples ({len(values)})")
                continue
            half = values[len(values) // 2:]
            rise = half[-1] - half[0]
            limit = 16 if figure.endswith("fds") else 0.10 * half[0]
            rising = all(b > a for a, b in zip(values[-4:], values[-3:]))
            grows = rising and rise > limit
            lines.append(f"{figure:<24} {values[0]:8.1f} -> {values[-1]:8.1f} "
                         f"({rise:+.1f} over the second half): "
                         f"{'GROWING' if grows else 'steady'}")
        return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=60.0, metavar="S",
                        help="seconds between two samples")
    parser.add_argument("--rate", type=float, default=150.0, help="generations/s per replica")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--recipe", default="methods.sao")
    args = parser.parse_args()

    settings = load_settings()
    soak = Soak(args.every)
    with tempfile.TemporaryDirectory(prefix="reef-soak-") as tmp, \
            servers(settings, Path(tmp)) as (bootstrap, redis_url, _):
        options = DemoOptions(recipe=args.recipe, replicas=args.replicas, rate=args.rate,
                              target=2.0, time_limit=args.minutes * 60,
                              run_dir=Path(tmp) / "run")
        soak.demo = Demo(options, settings=settings, bootstrap=bootstrap,
                         redis_url=redis_url, show=soak)
        result = soak.demo.run()
    print(f"\nran {result.seconds / 60:.1f} min; ledger {result.ledger}; "
          f"held-out accuracy {result.accuracy} at version {result.version}")
    print("\n".join(soak.verdict()))
    return 0


if __name__ == "__main__":
    run(main)
