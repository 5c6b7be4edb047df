"""The faults a cluster scenario injects, and the hosts it has: data only, no broker, no hosts.

    fault = Fault.parse("partition:trainer:50")    # Fault("partition", "trainer", 50.0)
    Fault.parse("isolate:trainer:20")             # cut off from the brokers, not the store
    broker_hosts(3), stage_hosts(1)               # the names of a scenario's hosts
    stage_hosts(1, processors=2)                  # ... with a host for processor-2

``tests.cluster.scenario`` injects them, ``tests.cluster.nemesis`` draws them from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

from reef_stream.demo.run import member_of, members

#: The fault kinds ``Fault.kind`` may name.
KINDS = ("partition", "partition-out", "partition-in", "pause", "kill", "isolate",
         "pause-replace")
#: The stages' hosts whose kill (or ``pause-replace``) the scenario's supervisor answers with
#: a replacement on a spare host (``tests.cluster.supervisor``).
SUPERVISED = ("processor", "trainer", "evaluator")


def supervised(host: str) -> bool:
    """Whether ``host`` is a supervised stage's: a member of ``SUPERVISED``'s groups
    (``processor-2``, ``evaluator-2``, ... too)."""
    return member_of(host) in SUPERVISED


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (``KINDS``) of ``host``, ``at_s`` seconds after the pipeline ran
    (the first of a run) or recovered from the fault before, undone ``seconds`` later (a kill
    only on a broker's host or the object store's: its server is restarted; the kill of a
    supervised stage's host is answered by a replacement on a spare host,
    ``tests.cluster.supervisor``, as is ``pause-replace``, whose paused processes are resumed
    ``seconds`` after the replacement started; ``isolate``: the host cut off from the brokers'
    hosts only, both ways). Kinds and what undoing means: ``tests.cluster.scenario``."""

    kind: str
    host: str
    seconds: float = 50.0
    at_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a fault's kind is one of {', '.join(KINDS)}, not {self.kind!r}")

    @classmethod
    def parse(cls, text: str, **defaults: float) -> Fault:
        """``KIND:HOST`` or ``KIND:HOST:SECONDS``, e.g. ``partition:trainer:50``."""
        kind, _, rest = text.partition(":")
        host, _, seconds = rest.partition(":")
        if not host:
            raise ValueError(f"a fault is KIND:HOST[:SECONDS], not {text!r}")
        if seconds:
            defaults = {**defaults, "seconds": float(seconds)}
        return cls(kind, host, **defaults)

    def name(self) -> str:
        return f"{self.kind} {self.host}" + ("" if self.kind == "kill" and not
                                             self.host.startswith("kafka") and
                                             self.host != STORE_HOST else
                                             f" {self.seconds:.0f}s")


#: The object store's host (S3Proxy) of a scenario whose checkpoints are at ``s3://`` URLs.
STORE_HOST = "store"


def broker_hosts(brokers: int) -> list[str]:
    """The brokers' hosts of a scenario with ``brokers`` KRaft nodes."""
    return ["kafka"] if brokers == 1 else [f"kafka-{i}" for i in range(1, brokers + 1)]


def stage_hosts(replicas: int, *, processors: int = 1, reward_workers: int = 1,
                evaluators: int = 1) -> list[str]:
    """The stages' hosts of a scenario with ``replicas`` replicas and that many members of
    the processors', reward workers' and evaluators' groups: one host each, named after its
    stage (``reef_stream.demo.run.members``: ``processor``, ``processor-2``, ...)."""
    return [*members("reward", reward_workers), *members("processor", processors), "trainer",
            *members("evaluator", evaluators), *(f"replica-{i}" for i in range(replicas))]
