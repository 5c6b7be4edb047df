"""The demo's pipeline on emulated hosts under faults: a table, a CLUSTER line.

    python bench/cluster.py [--faults partition:trainer:50,pause:trainer:50] [--rate 50]
                            [--brokers 1|3] [--at 30] [--versions-after 3] [--drain 240]
                            [--store dir|s3] [--workdir DIR]
                            [--processors N] [--reward-workers N] [--evaluators N]
    python bench/cluster.py --faults pause-replace:trainer:20+kill:processor   # one run, two
    python bench/cluster.py --nemesis SEED [--faults-count 4] [--brokers 3] [--supervised] ...

Every part of the pipeline runs on a host of its own, a Linux network namespace joined to the
others by a bridge (``tests/cluster/hosts.py``; needs root): a KRaft broker, Redis, the reward
worker, the processor, the trainer, the evaluator and the replicas (the recipe
``reef_stream.demo.recipes:sao``). For each fault of ``--faults`` (``KIND:HOST[:SECONDS]``;
KIND is ``partition`` (the host's link down, both ways), ``partition-out`` or
``partition-in`` (one way, nftables), ``pause`` (SIGSTOP of every process on the host) or
``kill`` (SIGKILL of every process on it: a broker's host, ``kafka-<i>`` with ``--brokers
3``, whose node is restarted after SECONDS; a replica's or the reward worker's; the
processor's, the trainer's or the evaluator's, whose stage the scenario's supervisor starts
again on a spare host ``<host>-b``; ``store`` with ``--store s3``, whose S3Proxy is restarted
after SECONDS on the same data), ``pause-replace`` (SIGSTOP of every process on the
processor's, the trainer's or the evaluator's host, the stage started on the spare, the old
one resumed SECONDS later: a zombie that must be fenced at its first write) or ``isolate``
(the host cut off from the brokers' hosts only, both ways, e.g. ``isolate:trainer:50``: a
trainer that reaches the store but not the broker)) a fresh cluster runs the demo, injects
the fault ``--at`` seconds after every stage reported running, undoes it after SECONDS, and
stops once the trainer stepped again, ``--versions-after`` versions were promoted since and
the replicas serve the newest. Then the replicas stop, the other stages drain, and the log is
checked (``tests/cluster/scenario.py``). Faults joined by ``+``
(``pause-replace:trainer:20+kill:processor``) are one run, one after another. With ``--store
s3`` S3Proxy runs on a host ``store`` of its own, the trainer's checkpoints and the
evaluator's published copies are at ``s3://`` URLs on it (credentials from the environment),
and the run also checks that every committed checkpoint is an object in its bucket.

With ``--nemesis SEED`` there is one run instead, under ``--faults-count`` faults one after
another that ``tests/cluster/nemesis.py`` draws from SEED (partitions both ways and one way,
pauses, kills of a broker's host; with ``--store s3`` also isolations of a stage's host from
the brokers, and the store's host among the targets); the schedule is printed first, and the
same SEED (with the same ``--faults-count``, ``--brokers``, ``--replicas``, ``--store`` and
members of each group) gives the same schedule. Each fault
comes once the pipeline recovered from the one before; the run ends with the same checks.
With ``--supervised`` the nemesis also draws ``pause-replace`` and kills of the processor's,
the trainer's and the evaluator's hosts (each stage replaced at most once).

``--processors``, ``--reward-workers`` and ``--evaluators`` run that many members of each
stage's consumer group, each on a host of its own named after its stage (``processor-2``,
``reward-2``, ``evaluator-2``: a fault may name them; the evaluators after the first stand by
until the group hands them the checkpoints). With more than one, the run also checks that
each processor committed units and each reward worker scored generations and, unless a fault
touched an evaluator's host, that exactly one evaluator decided.

One row per run: acknowledged (generations the replicas saw acknowledged), trained (units),
shed (generations and units dead-lettered with a reason: expired, too stale, shed), lost
(acknowledged but not in the topic, without an outcome, or logged units neither trained nor
dropped), trained twice, forks (steps with two committed checkpoints), fenced writes (lines
of the stages' logs that say a write was fenced) and seconds to recover (from the fault's
end to the trainer's next step; the slowest of a nemesis run, whose faults also get a row
each). The last line:

    CLUSTER faults=N acknowledged=N lost=N trained_twice=N forks=N fenced_writes=N recover_p50_s=X

Exit status 0 when every check of every run held. The default partition of 50 s outlasts the
consumer groups' session timeout (librdkafka's default, 45 s). About 3-4 minutes a fault on
2 cores. No latency or packet loss: this kernel has no netem.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from common import run  # first: it puts the project on sys.path

from reef_stream.core.settings import load_settings
from reef_stream.demo.run import DemoOptions
from reef_stream.topics.connect import KAFKA_LOGGER
from tests.cluster.faults import STORE_HOST, Fault, broker_hosts, stage_hosts
from tests.cluster.nemesis import describe, schedule
from tests.cluster.scenario import RECOVER_WAIT_S, ClusterRun, run_cluster

COLUMNS = ("acknowledged", "trained", "shed", "lost", "trained_twice", "forks",
           "fenced_writes")


def table(runs: list[ClusterRun]) -> str:
    """One row per run: its faults, ``ClusterRun.counts`` and the seconds to recover."""
    head = ["faults", *COLUMNS, "recover_s", "checks"]
    rows = [[", ".join(f.name() for f in r.faults), *(str(r.counts()[c]) for c in COLUMNS),
             "-" if r.recover_s is None else f"{r.recover_s:.1f}",
             "ok" if r.passed else "FAIL"] for r in runs]
    return _aligned([head, *rows])


def fault_table(run: ClusterRun) -> str:
    """One row per fault of ``run``: when it came and went (seconds since the injector
    started) and the seconds to recover."""
    head = ["#", "fault", "injected_s", "undone_s", "recover_s"]
    rows = [[str(i), one.fault.name(), *("-" if v is None else f"{v:.1f}" for v in
                                          (one.injected_at, one.undone_at, one.recover_s))]
            for i, one in enumerate(run.injected, 1)]
    return _aligned([head, *rows])


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def summary(runs: list[ClusterRun]) -> str:
    """The CLUSTER line."""
    total = {c: sum(r.counts()[c] for r in runs) for c in COLUMNS}
    recovered = [i.recover_s for r in runs for i in r.injected if i.recover_s is not None]
    p50 = f"{statistics.median(recovered):.1f}" if recovered else "nan"
    return (f"CLUSTER faults={sum(len(r.faults) for r in runs)} "
            f"acknowledged={total['acknowledged']} "
            f"lost={total['lost']} trained_twice={total['trained_twice']} "
            f"forks={total['forks']} fenced_writes={total['fenced_writes']} "
            f"recover_p50_s={p50}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="partition:trainer:50",
                        help="comma-separated KIND:HOST[:SECONDS], one run each; faults "
                             "joined by + are one run [default: %(default)s]")
    parser.add_argument("--nemesis", type=int, default=None, metavar="SEED",
                        help="one run under faults drawn from SEED (instead of --faults)")
    parser.add_argument("--faults-count", type=int, default=4, metavar="N",
                        help="faults the nemesis draws [default: 4]")
    parser.add_argument("--supervised", action="store_true",
                        help="the nemesis also draws pause-replace and kills of the "
                             "supervised stages' hosts (tests/cluster/supervisor.py)")
    parser.add_argument("--at", type=float, default=30.0, metavar="S",
                        help="seconds after every stage reported running [default: 30]")
    parser.add_argument("--brokers", type=int, choices=(1, 3), default=1,
                        help="KRaft nodes, each on a host of its own (kafka-1..3 with 3; "
                             "replication 3, min.insync.replicas 2) [default: 1, on kafka]")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--processors", type=int, default=1, metavar="N",
                        help="processors in the group, hosts processor, processor-2, ... "
                             "[default: 1]")
    parser.add_argument("--reward-workers", type=int, default=1, metavar="N",
                        help="reward workers in the group, hosts reward, reward-2, ... "
                             "[default: 1]")
    parser.add_argument("--evaluators", type=int, default=1, metavar="N",
                        help="evaluators in the group, hosts evaluator, evaluator-2, ...: one "
                             "decides, the others stand by [default: 1]")
    parser.add_argument("--store", choices=("dir", "s3"), default="dir",
                        help="where checkpoints live: the run directory, or S3Proxy on a host "
                             "'store' of its own [default: %(default)s]")
    parser.add_argument("--rate", type=float, default=50.0,
                        help="generations/s per replica [default: 50]")
    parser.add_argument("--versions-after", type=int, default=3,
                        help="promoted versions after the fault before the run stops")
    parser.add_argument("--time-limit", type=float, default=600.0, metavar="S",
                        help="seconds a run may take [default: 600; a nemesis run gets at "
                             "least what its schedule needs]")
    parser.add_argument("--drain", type=float, default=240.0, metavar="S",
                        help="seconds the stages get to settle every generation at the end")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs' data and logs here [default: a temporary "
                             "directory, removed at the end]")
    args = parser.parse_args()
    KAFKA_LOGGER.setLevel(logging.CRITICAL)
    if args.nemesis is not None:
        faults = schedule(args.nemesis, args.faults_count, brokers=broker_hosts(args.brokers),
                          stages=stage_hosts(args.replicas, processors=args.processors,
                                             reward_workers=args.reward_workers,
                                             evaluators=args.evaluators),
                          store=STORE_HOST if args.store == "s3" else None,
                          supervised=args.supervised)
        print(f"nemesis seed {args.nemesis}, {len(faults)} faults:\n{describe(faults)}",
              flush=True)
        runs_of = [faults]
        # Start-up, then each fault's gap, length and (at most) its wait for recovery.
        need = 180 + sum(f.at_s + f.seconds + RECOVER_WAIT_S for f in faults)
        time_limit = max(args.time_limit, need)
    else:
        runs_of = [tuple(Fault.parse(one.strip(), at_s=args.at) for one in text.split("+"))
                   for text in args.faults.split(",")]
        time_limit = args.time_limit
    settings = load_settings()
    options = DemoOptions(replicas=args.replicas, rate=args.rate, time_limit=time_limit,
                          drain_s=args.drain, processors=args.processors,
                          reward_workers=args.reward_workers, evaluators=args.evaluators)
    runs = []
    with tempfile.TemporaryDirectory(prefix="reef-cluster-") as tmp:
        root = args.workdir or Path(tmp)
        for i, faults in enumerate(runs_of):
            print(f"== {', '.join(f.name() for f in faults)}", flush=True)
            one = run_cluster(faults, settings=settings, workdir=root / f"run-{i}",
                              options=options, versions_after=args.versions_after,
                              brokers=args.brokers, store=args.store,
                              say=lambda line: print(f"   {line}", flush=True))
            print(one.verdict(), flush=True)
            runs.append(one)
    print()
    if args.nemesis is not None:
        print(fault_table(runs[0]))
        print()
    print(table(runs))
    print(summary(runs))
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    run(main)
