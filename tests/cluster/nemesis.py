"""A seeded nemesis: a reproducible sequence of faults for one run of the cluster scenario.

    faults = schedule(seed=7, count=4, brokers=["kafka-1", "kafka-2", "kafka-3"],
                      stages=["reward", "processor", "trainer", "evaluator", "replica-0"])
    print(describe(faults))

The same seed, count and hosts give the same faults, on any machine (``random.Random(seed)``,
nothing else drawn from it). Each fault is one of:

- ``partition``: a host's link down, both ways (a broker's or a stage's host);
- ``partition-out`` / ``partition-in``: a one-way partition, the host's packets to every other
  host dropped, or those from them (nftables in the host);
- ``kill``: SIGKILL of every process on a broker's host, its node restarted ``seconds`` later
  (no stage's host is killed, unless ``supervised``: see below);
- ``pause``: SIGSTOP of every process on a broker's or a stage's host, SIGCONT ``seconds``
  later;
- with an object store's host (``store=``; checkpoints at ``s3://`` URLs), also ``isolate``:
  a stage's host cut off from the brokers' hosts only, both ways, for ``seconds`` (it still
  reaches the store); and the store's host among those partitioned, paused and killed (its
  S3Proxy restarted ``seconds`` later). Without it the draws are those of the kinds above,
  so a seed gives the schedule it gave before the store existed.

With ``supervised=True`` (the scenario's supervisor, ``tests.cluster.supervisor``, replaces a
stage whose host is lost) it also draws ``pause-replace`` (the host of the processor, the
trainer or the evaluator paused, the stage started on a spare host, the old one resumed
``seconds`` later: a zombie) and kills of those hosts, each such stage at most once (one
spare each). Without it the draws are the same as before the option existed.

Faults come one after another, never together: each ``at_s`` seconds after the trainer
stepped again after the one before (the first: after every stage reported running), so every
fault meets a pipeline that recovered, and each has a recovery time of its own. Redis is never
a target: it holds projections only, and the scenario checks the log. Pure: no broker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tests.cluster.faults import Fault, supervised as is_supervised

#: The kinds a nemesis draws from, in the order ``random.choice`` sees them.
NEMESIS_KINDS = ("partition", "partition-out", "partition-in", "kill", "pause")
#: The kinds drawn from when the scenario has an object store's host.
STORE_NEMESIS_KINDS = (*NEMESIS_KINDS, "isolate")
#: Seconds a partition or a pause lasts: from shorter than the consumer groups' session
#: timeout (librdkafka's 45 s) to past it.
HOLD_S = (20, 60)
#: Seconds before a killed broker's node is restarted.
KILL_S = (5, 20)
#: Seconds between the pipeline's recovery from one fault and the next fault.
GAP_S = (10, 30)
#: The kinds a supervised nemesis draws besides ``NEMESIS_KINDS``.
SUPERVISED_KINDS = ("pause-replace",)


def schedule(seed: int, count: int, *, brokers: Sequence[str],
             stages: Sequence[str], store: str | None = None,
             supervised: bool = False) -> tuple[Fault, ...]:
    """``count`` faults drawn from ``seed`` over the hosts ``brokers`` (whose host may be
    killed), ``stages`` (partitioned, paused and, with ``store``, isolated; with
    ``supervised`` the supervised stages' hosts also killed or paused for a replacement, once
    each) and ``store`` (the object store's host, or None: none; it may be killed); see the
    module docstring. Pure and deterministic: the same arguments give the same faults."""
    if count < 1:
        raise ValueError(f"a nemesis injects at least one fault, not {count}")
    if not brokers:
        raise ValueError("a nemesis needs the brokers' hosts")
    draw = random.Random(seed)
    stored = [store] if store else []
    hosts = [*brokers, *stages, *stored]
    base = STORE_NEMESIS_KINDS if store else NEMESIS_KINDS
    kinds = base + (SUPERVISED_KINDS if supervised else ())
    replaceable = [s for s in stages if is_supervised(s)] if supervised else []
    faults = []
    for _ in range(count):
        kind = draw.choice(kinds if replaceable else base)
        if kind == "pause-replace":
            host = draw.choice(replaceable)
            replaceable.remove(host)
            seconds = draw.randint(*HOLD_S)
        elif kind == "kill":
            host = draw.choice([*brokers, *stored, *replaceable])
            if host in replaceable:
                replaceable.remove(host)
            seconds = draw.randint(*KILL_S)
        elif kind == "isolate":
            host, seconds = draw.choice(list(stages)), draw.randint(*HOLD_S)
        else:
            host, seconds = draw.choice(hosts), draw.randint(*HOLD_S)
        faults.append(Fault(kind, host, seconds=float(seconds),
                            at_s=float(draw.randint(*GAP_S))))
    return tuple(faults)


def describe(faults: Sequence[Fault]) -> str:
    """The schedule, one line a fault: its number, the gap before it, what and how long."""
    return "\n".join(f"{i:>2}. after {f.at_s:.0f} s: {f.name()}"
                     for i, f in enumerate(faults, 1))
