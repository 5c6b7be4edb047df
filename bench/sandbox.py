"""Sandboxed reward calls: what the pool costs, and whether a few hanging calls clog the pipe.

    python bench/sandbox.py [--calls 400] [--concurrency 8] [--generations 800] [--hang 0.03]
                            [--before REV [--rounds N]]

One invocation, two parts, each printed beside its baseline:

1. Calls (no broker): calls/s with ``--concurrency`` threads, and the per-call overhead (the
   mean latency of one call at a time, minus the in-thread one), through a ``SandboxPool``
   against calling the function on a thread, for a trivial reward and for one that sleeps
   50 ms (``tests.recipes.sandbox_rewards:hostile``, ``score`` and ``slow``); what the
   workers import and their size; the CPU one trivial call costs (the pool's process, its
   worker, the call's process) and the calls/s two cores would allow at that cost.
2. The pipe (a broker: REEF_BOOTSTRAP_SERVERS, or a throw-away one): a ``RewardWorker`` over
   ``--generations`` generations whose reward takes 50 ms, of which a fraction ``--hang``
   sleeps 60 s (past the 5-s timeout), in-thread and ``--sandbox process``: the healthy
   generations' feedback per second (first taken to last healthy feedback) with and without
   the hanging ones, and their ratio (the promise: at least 0.9). The baseline is the same
   worker without the slow lane and the adaptive deadline (``--slow-concurrency 0
   --fixed-timeout``): the reward worker before issue 17, stopped after ``--cap`` seconds.

With ``--before REV`` it runs as revision REV has it and as this tree has it, alternating
(``bench/trees.py``). Figures, never assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # the sandbox workers import tests.recipes.* as a fresh Python would

from reef_stream.core.settings import load_settings  # noqa: E402
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker  # noqa: E402
from reef_stream.intake.producer import RecordProducer  # noqa: E402
from reef_stream.servers.kafka_local import configured_or_throwaway  # noqa: E402
from reef_stream.consumers.reward.sandbox.categories import Limits  # noqa: E402
from reef_stream.consumers.reward.sandbox.pool import SandboxPool  # noqa: E402
from tests.faults.records import generation  # noqa: E402
from tests.recipes.sandbox_rewards import hostile  # noqa: E402
from tests.unit_log import create_topics  # noqa: E402
from trees import add_before, before_and_after  # noqa: E402

TARGET = "tests.recipes.sandbox_rewards:hostile"


def _gen(i: int, do: str, **metadata: str):
    return dataclasses.replace(generation(i), metadata={"do": do, **metadata})


# --------------------------------------------------------------------------- 1. calls

def _calls(call, generations, concurrency: int) -> tuple[float, float]:
    """calls/s with ``concurrency`` threads, and the mean seconds of one call at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as threads:
        list(threads.map(call, generations))
    rate = len(generations) / (time.perf_counter() - started)
    latencies = []
    for g in generations[: max(20, len(generations) // 10)]:
        began = time.perf_counter()
        call(g)
        latencies.append(time.perf_counter() - began)
    return rate, statistics.mean(latencies)


def part_calls(calls: int, concurrency: int) -> None:
    pool = SandboxPool(TARGET, size=concurrency, limits=Limits())
    began = time.perf_counter()
    pool.start()
    print(f"pool of {concurrency} sandbox workers started in {time.perf_counter() - began:.1f} s "
          f"(network {pool.network}); worker start p50 "
          f"{pool.stats().get('start_p50', float('nan')):.2f} s")
    pids = [worker.pid for worker in pool._live.values()]
    print(f"the workers import {pool.worker_target['target']}: RSS "
          f"{statistics.mean(_rss_mb(pid) for pid in pids):.0f} MB each, torch "
          f"{'imported' if pool.worker_torch else 'not imported'}")
    try:
        for label, do, extra in (("trivial", "score", {}),
                                 ("50 ms", "slow", {"seconds": "0.05"})):
            generations = [_gen(i, do, **extra) for i in range(calls)]
            thread_rate, thread_s = _calls(hostile.reward, generations, concurrency)
            cpu_before = _cpu(pids)
            pool_rate, pool_s = _calls(lambda g: pool.call(g, timeout=30), generations,
                                       concurrency)
            if label == "trivial":
                spent = [(after - before) * 1000 / (calls + max(20, calls // 10))
                         for before, after in zip(cpu_before, _cpu(pids))]
                print(f"CPU per sandboxed call: the pool's process {spent[0]:.2f} ms, its worker "
                      f"{spent[1]:.2f} ms, the call's process {spent[2]:.2f} ms: "
                      f"{sum(spent):.2f} ms, at most {2000 / sum(spent):.0f} calls/s on two cores")
            print(f"{label:8s} reward, {concurrency} threads: in-thread {thread_rate:8.0f} calls/s "
                  f"({1000 * thread_s:7.2f} ms/call) | sandbox {pool_rate:6.0f} calls/s "
                  f"({1000 * pool_s:7.2f} ms/call) | overhead {1000 * (pool_s - thread_s):6.2f} "
                  f"ms/call, throughput ratio {pool_rate / thread_rate:.2f}")
    finally:
        pool.close()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def _cpu(pids: list[int]) -> tuple[float, float, float]:
    """CPU seconds so far of this process, of the workers ``pids`` themselves, and of the
    calls' processes they reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    workers = calls = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        workers += (int(fields[11]) + int(fields[12])) / tick
        calls += (int(fields[13]) + int(fields[14])) / tick
    return own.user + own.system, workers, calls


# --------------------------------------------------------------------------- 2. the pipe

def _produce(bootstrap: str, ns: str, count: int, hang: float, workdir: Path) -> set[str]:
    """``count`` generations, every ``1/hang``-th one hanging; returns the healthy ids."""
    every = round(1 / hang) if hang > 0 else 0
    healthy = set()
    with RecordProducer(bootstrap, settings=load_settings(), namespace=ns,
                        spool_dir=workdir / f"spool-{uuid.uuid4().hex[:6]}") as producer:
        for i in range(count):
            hangs = every and i % every == every // 2
            g = _gen(i, "sleep") if hangs else _gen(i, "slow", seconds="0.05")
            if not hangs:
                healthy.add(g.generation_id)
            producer.send(g)
        assert producer.flush(60).complete
    return healthy


def _pipe_run(bootstrap: str, count: int, hang: float, concurrency: int, sandbox: str,
              lanes: bool, cap: float, workdir: Path) -> tuple[float, int, str]:
    """Healthy feedback per second (first record taken to the last healthy feedback), how
    many healthy generations were rewarded within ``cap`` seconds, and the summary line."""
    ns = f"benchsbx{uuid.uuid4().hex[:6]}"
    create_topics(bootstrap, ns)
    healthy = _produce(bootstrap, ns, count, hang, workdir)
    done: list[float] = []
    lock = threading.Lock()
    first = []

    def on_outcome(kind: str, event) -> None:
        now = time.perf_counter()
        with lock:
            first or first.append(now)
            if kind == "rewarded" and event.generation_id in healthy:
                done.append(now)
                if len(done) == len(healthy):
                    worker.stop(now=True)

    options = RewardOptions(concurrency=concurrency, timeout=5.0, retries=1, backoff=0.05,
                            grace=1.0, sandbox=sandbox, sandbox_target=TARGET,
                            slow_concurrency=None if lanes else 0, adaptive=lanes,
                            group=f"bench-{uuid.uuid4().hex[:6]}")
    worker = RewardWorker(hostile, bootstrap=bootstrap, namespace=ns, options=options,
                          spool_dir=workdir / f"spool-{uuid.uuid4().hex[:6]}",
                          on_outcome=on_outcome)
    timer = threading.Timer(cap, lambda: worker.stop(now=True))
    timer.start()
    began = time.perf_counter()
    try:
        summary = worker.run()
    finally:
        timer.cancel()
    start = first[0] if first else began
    end = done[-1] if done else time.perf_counter()
    line = summary.line()
    if worker._pool is not None:
        stats = worker._pool.stats()
        line += (f"\n    sandbox: restarts={stats['restarts']} recycled={stats['recycled']} "
                 f"cold_starts={stats['cold_starts']} call p50/p99="
                 f"{stats.get('call_p50', 0):.3f}/{stats.get('call_p99', 0):.3f} s "
                 f"failures={dict(worker._pool.failures)}")
    return len(done) / max(end - start, 1e-9), len(done), line


def part_pipe(bootstrap: str, count: int, hang: float, concurrency: int, cap: float,
              workdir: Path, sandboxes: list[str]) -> None:
    for sandbox in sandboxes:
        rates = {}
        for label, fault, lanes in (("no fault", 0.0, True), (f"{hang:.0%} hang", hang, True),
                                    (f"{hang:.0%} hang, no lanes (before)", hang, False)):
            rate, rewarded, line = _pipe_run(bootstrap, count, fault, concurrency, sandbox,
                                             lanes, cap, workdir)
            rates[label] = rate
            base = rates["no fault"]
            print(f"{sandbox:7s} {label:30s}: {rate:7.1f} healthy feedback/s ({rewarded} "
                  f"rewarded), {rate / base:.2f} of no fault\n    {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--generations", type=int, default=800)
    parser.add_argument("--hang", type=float, default=0.03)
    parser.add_argument("--cap", type=float, default=60.0,
                        help="Seconds a pipe run may take at most (the baseline clogs).")
    parser.add_argument("--skip-calls", action="store_true")
    parser.add_argument("--skip-pipe", action="store_true")
    parser.add_argument("--sandboxes", default="thread,process",
                        help="The pipe runs' --sandbox values, comma-separated.")
    add_before(parser)
    args = parser.parse_args()
    if args.before:
        return before_and_after(__file__, args.before, args.rounds)
    print(f"bench/sandbox.py: {os.cpu_count()} CPUs, concurrency {args.concurrency}", flush=True)
    if not args.skip_calls:
        part_calls(args.calls, args.concurrency)
    if args.skip_pipe:
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-sandbox-"))
    with configured_or_throwaway(load_settings(), workdir) as bootstrap:
        part_pipe(bootstrap, args.generations, args.hang, args.concurrency, args.cap, workdir,
                  args.sandboxes.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
