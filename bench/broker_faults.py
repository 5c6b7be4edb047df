"""Broker faults under the demo's load on a three-node cluster: what was injected, what held.

    python bench/broker_faults.py [--target 0.9] [--rate 50] [--time-limit 1200]
                                  [--first 60] [--gap 20] [--down 10] [--pause 15] [--drain 180]

Starts a throwaway three-node KRaft cluster (replication 3, min.insync.replicas 2) and a
Redis under a temporary directory, runs the demo pipeline on them (every stage a process)
and injects, one after the other: SIGKILL of a broker (restarted), SIGSTOP of a broker for
longer than the brokers' session timeout (then SIGCONT), SIGKILL of the controller's node
(restarted). When the policy has reached the target after the last fault, the replicas stop,
the other stages settle every generation, and it prints each check
(``reef_stream.demo.faults``): every acknowledged generation in its topic, exactly one
outcome per generation, no unit trained twice or lost, the target reached. Exit status 0
when all hold. Needs 2 cores and about 4 GiB; takes about 5-10 minutes.

The default rate is a third of the single-node demo's: on 2 cores the three brokers take
about 60% of the CPU, and at 150 generations/s per replica units arrive faster than the
trainer trains them, so every sample it trains has waited nearly ``max_staleness`` versions
and the policy learns slowly (the demo says "overloaded"). At 50/s the trainer keeps up
(staleness about 1 outside the faults) and the SAO demo reaches 0.9 in about 160 versions.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from common import run  # first: it puts the project on sys.path

from reef_stream.cli.demo import DemoProgress
from reef_stream.core.settings import load_settings
from reef_stream.demo.faults import Timeline, run_broker_faults
from reef_stream.demo.run import DemoOptions
from reef_stream.topics.connect import KAFKA_LOGGER


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="methods.sao")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rate", type=float, default=50.0,
                        help="generations/s per replica (see the module docstring)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach")
    parser.add_argument("--time-limit", type=float, default=1200.0, metavar="S")
    parser.add_argument("--first", type=float, default=60.0, metavar="S",
                        help="seconds from the start to the first fault")
    parser.add_argument("--gap", type=float, default=20.0, metavar="S",
                        help="seconds between one fault undone and the next")
    parser.add_argument("--down", type=float, default=10.0, metavar="S",
                        help="seconds a killed broker stays down")
    parser.add_argument("--pause", type=float, default=15.0, metavar="S",
                        help="seconds a broker stays stopped (SIGSTOP)")
    parser.add_argument("--drain", type=float, default=180.0, metavar="S",
                        help="seconds the stages get to settle every generation at the end")
    parser.add_argument("--no-faults", action="store_true",
                        help="the baseline: the same cluster, load and checks, no fault injected")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the cluster's data and the run's logs here [default: a "
                             "temporary directory, removed]")
    args = parser.parse_args()

    settings = load_settings()
    # Brokers die here on purpose: the clients' connection errors are expected, not news.
    logging.getLogger(KAFKA_LOGGER.name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="reef-faults-") as tmp:
        workdir = args.workdir or Path(tmp)
        options = DemoOptions(recipe=args.recipe, replicas=args.replicas, rate=args.rate,
                              target=args.target, time_limit=args.time_limit,
                              drain_s=args.drain, run_dir=workdir / "run")
        timeline = Timeline(first_s=args.first, gap_s=args.gap, down_s=args.down,
                            pause_s=args.pause)
        run = run_broker_faults(options, settings=settings, workdir=workdir,
                                timeline=None if args.no_faults else timeline,
                                show=DemoProgress(every_s=10.0))
        print()
        print(run.result.line())
        print(run.verdict())
        return 0 if run.passed else 1


if __name__ == "__main__":
    run(main)
