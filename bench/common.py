"""What the loop benchmarks share: a timestamped line, a figure, the servers, a live run, the
entry point.

    from common import live_run, run, say, servers   # bench/ is on sys.path when a bench runs

    with servers(settings, home) as at:
        result = live_run(DemoOptions(...), settings, at, "live run 1/3")
    run(main)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, NoReturn, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.cli.demo import DemoProgress  # noqa: E402
from reef_stream.core.settings import Settings, load_settings  # noqa: E402
from reef_stream.demo.run import Demo, DemoOptions, DemoResult  # noqa: E402
from reef_stream.servers.kafka_local import LocalCluster  # noqa: E402
from reef_stream.core.processes import free_ports, interrupt_on_sigterm  # noqa: E402
from reef_stream.servers.redis_local import LocalRedis  # noqa: E402

V = TypeVar("V")


def say(text: str) -> None:
    """``text`` on stdout, after the time of day, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def figure(value: float | None) -> str:
    """A figure for a result line: three significant digits below 100, "na" when unknown."""
    return "na" if value is None else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


class Servers(NamedTuple):
    bootstrap: str
    redis_url: str
    #: The pids of the brokers started here (their CPU counts in a scorecard); None when the
    #: configured cluster is used.
    broker_pids: list[int] | None


def time_to_target(result: DemoResult) -> float | None:
    """A demo run's time to target: the scorecard's (first generation -> first promoted version
    at the target) where it has one, else the run's seconds; None when it did not reach it."""
    if not result.reached:
        return None
    card = result.scorecard
    if card is not None and card.time_to_target_s is not None:
        return card.time_to_target_s
    return result.seconds


@contextmanager
def servers(settings: Settings, home: Path) -> Iterator[Servers]:
    """The configured Kafka cluster and Redis (REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL), or a
    one-node broker and a Redis started under ``home`` for the ``with`` block, then stopped."""
    cluster = redis = None
    try:
        bootstrap, broker_pids = settings.bootstrap_servers, None
        if bootstrap is None:
            cluster = LocalCluster(home / "kafka", settings.cache_dir)
            bootstrap = cluster.up(port=0, progress=say)
            broker_pids = [node.pid for node in cluster.nodes]
        redis_url = settings.redis_url
        if redis_url is None:
            redis = LocalRedis(home / "redis")
            redis_url = redis.up(port=free_ports(1)[0])
        yield Servers(bootstrap, redis_url, broker_pids)
    finally:
        if redis is not None:
            redis.down()
        if cluster is not None:
            cluster.down()


def demo_arguments(parser: argparse.ArgumentParser, *, rate: float | None = None,
                   time_limit: float = 600.0) -> None:
    """The options every live-loop bench takes: ``--replicas``, ``--rate`` (default ``rate``,
    else the demo's), ``--target``, ``--time-limit`` (seconds each run gets)."""
    rate = DemoOptions.rate if rate is None else rate
    parser.add_argument("--replicas", type=int, default=DemoOptions.replicas,
                        help=f"serving replicas (default {DemoOptions.replicas})")
    parser.add_argument("--rate", type=float, default=rate,
                        help=f"generations/s per replica (default {rate:g})")
    parser.add_argument("--target", type=float, default=0.9,
                        help="held-out accuracy to reach (default 0.9)")
    parser.add_argument("--time-limit", type=float, default=time_limit, metavar="S",
                        help=f"seconds each run gets (default {time_limit:g})")


def chosen(parser: argparse.ArgumentParser, names: Sequence[str],
           what: str) -> tuple[argparse.Namespace, list[str]]:
    """Add ``--only`` (comma-separated ``what`` to run, default all of ``names``), parse the
    arguments, and return them with the chosen names in order; an unknown name is the
    parser's usage error. Call last, after every other option is added."""
    parser.add_argument("--only", default=",".join(names),
                        help=f"comma-separated {what} to run (default all: {','.join(names)})")
    args = parser.parse_args()
    picked = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in picked if name not in names]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(names)}")
    return args, picked


def live_run(options: DemoOptions, settings: Settings, at: Servers, label: str) -> DemoResult:
    """One ``reef demo`` run on ``at``: its progress every 15 s, then its result line and its
    scorecard, each said under ``label``."""
    demo = Demo(options, settings=settings, bootstrap=at.bootstrap, redis_url=at.redis_url,
                show=DemoProgress(every_s=15.0), broker_pids=at.broker_pids)
    command = " ".join(["reef demo --recipe", options.recipe,
                        *(f"--set {o}" for o in options.overrides)])
    say(f"{label}: {command} (namespace {demo.ns}, {options.replicas} replicas x "
        f"{options.rate:g}/s)")
    return run_and_say(demo, label)


def run_and_say(demo: Demo, label: str) -> DemoResult:
    """``demo.run()``, then its result line and its scorecard, each said under ``label``."""
    result = demo.run()
    say(f"{label}: {result.line()}")
    if result.scorecard is not None:
        print("\n".join(result.scorecard.lines()), flush=True)
    return result


def runs_per_variant(name: str, variants: Sequence[V],
                     options_of: Callable[[V, Path, str], DemoOptions],
                     label_of: Callable[[V], str],
                     line_of: Callable[[V, DemoResult], str]) -> None:
    """``reef demo`` once per variant, in one invocation, on one broker and Redis
    (``servers``, under a temporary home), each in a fresh namespace: ``options_of(variant,
    run_dir, namespace)`` says how; each run is said under ``label_of(variant)``. Then one
    ``line_of(variant, result)`` per variant, in order (the first is the others' baseline)."""
    results: list[tuple[V, DemoResult]] = []
    with tempfile.TemporaryDirectory(prefix=f"reef-{name}-") as tmp:
        home = Path(tmp)
        settings = load_settings({**os.environ, "REEF_HOME": str(home)})
        with servers(settings, home) as at:
            for number, variant in enumerate(variants, 1):
                options = options_of(variant, home / f"run-{number}",
                                     f"{name[:5]}{number}{time.strftime('%H%M%S')}")
                results.append((variant, live_run(
                    options, settings, at,
                    f"run {number}/{len(variants)}, {label_of(variant)}")))
    print()
    for variant, result in results:
        print(line_of(variant, result), flush=True)


def run(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status; a ``kill`` (SIGTERM) or Ctrl-C stops the stages and the
    servers started (``main``'s ``finally`` blocks run) and exits 130."""
    interrupt_on_sigterm()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
