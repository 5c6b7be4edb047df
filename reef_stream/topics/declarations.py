"""Every topic reef-stream uses, declared once: name, partitions, retention, size limit.

Names live under a namespace (``REEF_NAMESPACE``, default ``reef``) so several
pipelines can share one cluster. ``reef topics create`` makes these topics and
refuses to use one that exists with different settings.

| topic | key | why these settings |
| --- | --- | --- |
| ``<ns>.generations`` | generation id (or group id) | the bulk of the data; co-partitioned with feedback so the processor joins locally |
| ``<ns>.feedback`` | same key as its generation | small records; same partition count as generations |
| ``<ns>.units.<recipe>`` | unit id | one topic per recipe, read by that recipe's trainer groups; broker timestamps (LogAppendTime) |
| ``<ns>.checkpoints`` | trainer group | one partition: checkpoint events are totally ordered |
| ``<ns>.publications`` | model (``<model>#rejected`` for rejections) | compacted: the latest promotion and the latest rejection per model are kept forever |
| ``<ns>.decision-requests`` | model | a person's decisions asked of the recipe's fenced evaluator (``reef approve`` / ``reject`` / ``rollback``); one partition: applied in the order asked |
| ``<ns>.decision-outcomes`` | request id | what the evaluator did with each request, in the transaction of the decision; read back by the command that asked |
| ``<ns>.metrics`` | stage | short retention |
| ``<ns>.dead-letters`` | source key | long retention; large records (the original bytes travel with the reason) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1024 * 1024
DAY_MS = 24 * 60 * 60 * 1000

#: Partitions of the topics that generations, feedback and units flow through, unless
#: the namespace's topics were created with another count (``reef topics create
#: --partitions``); they must be equal so that a generation and its feedback land in
#: the same one. Six lets up to six processors, or trainer ranks, share the work; a
#: one-node run needs fewer: the client sends one produce request per partition, so
#: the broker's CPU per record grows with the partitions a producer spreads its
#: records over (``reef demo`` uses 2, docs/benchmarks.md).
DATA_PARTITIONS = 6


@dataclass(frozen=True)
class Topic:
    """The declaration of one topic. ``config`` holds Kafka topic configs as strings."""

    name: str
    partitions: int
    #: None: as many copies as the cluster can hold, up to 3 (1 on a single broker).
    replication: int | None = None
    config: dict[str, str] = field(default_factory=dict)
    doc: str = ""

    @property
    def max_message_bytes(self) -> int:
        return int(self.config["max.message.bytes"])


def _delete(days: int, max_bytes: int) -> dict[str, str]:
    return {
        "cleanup.policy": "delete",
        "retention.ms": str(days * DAY_MS),
        "max.message.bytes": str(max_bytes),
    }


def generations(ns: str) -> str:
    return f"{ns}.generations"


def feedback(ns: str) -> str:
    return f"{ns}.feedback"


def units(ns: str, recipe: str) -> str:
    return f"{ns}.units.{recipe}"


def checkpoints(ns: str) -> str:
    return f"{ns}.checkpoints"


def publications(ns: str) -> str:
    return f"{ns}.publications"


def decision_requests(ns: str) -> str:
    return f"{ns}.decision-requests"


def decision_outcomes(ns: str) -> str:
    return f"{ns}.decision-outcomes"


def metrics(ns: str) -> str:
    return f"{ns}.metrics"


def dead_letters(ns: str) -> str:
    return f"{ns}.dead-letters"


def declare_topics(ns: str, recipes: tuple[str, ...] = (),
                   partitions: int = DATA_PARTITIONS) -> list[Topic]:
    """The topics of a namespace, with one units topic per recipe named; ``partitions``
    for each of the generations, feedback and units topics."""
    if partitions < 1:
        raise ValueError(f"a namespace's data topics need at least 1 partition, not {partitions}")
    topics = [
        Topic(generations(ns), partitions, config=_delete(7, 8 * MiB),
              doc="Generation events from serving replicas and imports"),
        Topic(feedback(ns), partitions, config=_delete(7, 1 * MiB),
              doc="Feedback events: rewards from workers, humans, environments, judges"),
        Topic(checkpoints(ns), 1, config=_delete(365, 1 * MiB),
              doc="Checkpoint events: one per acknowledged trainer step"),
        Topic(publications(ns), 1, config={
            "cleanup.policy": "compact",
            "max.message.bytes": str(1 * MiB),
            "min.compaction.lag.ms": str(DAY_MS),
        }, doc="Publication decisions, compacted by model"),
        Topic(decision_requests(ns), 1, config=_delete(30, 1 * MiB),
              doc="A person's decisions, asked of the recipe's fenced evaluator"),
        Topic(decision_outcomes(ns), 1, config=_delete(30, 1 * MiB),
              doc="What the evaluator did with each decision request: applied or refused"),
        Topic(metrics(ns), 3, config=_delete(3, 1 * MiB),
              doc="Metric events from every stage"),
        Topic(dead_letters(ns), 3, config=_delete(30, 16 * MiB),
              doc="Records that could not be processed, with the reason"),
    ]
    topics += [
        # LogAppendTime: the broker stamps each unit, so timestamps never go backwards
        # within a partition and the trainer can merge partitions in one order that
        # is a function of the log alone (reef_stream.engine.log_merge).
        Topic(units(ns, recipe), partitions,
              config={**_delete(7, 16 * MiB), "message.timestamp.type": "LogAppendTime"},
              doc=f"Typed units assembled by the processor of recipe {recipe!r}")
        for recipe in recipes
    ]
    return topics
