"""The processor's state changelog: the compacted topic ``<ns>.processor-state.<recipe>``.

Partition p holds the state of input partition p (generations[p] + feedback[p]); key: the
state key as bytes (the processor encodes it), value: its snapshot, or a tombstone when the
key holds nothing any more. The processor writes it inside each batch's transaction (see
``ProcessorRuntime._commit``); on assignment, and after an aborted transaction, it reads
each assigned partition back to its end (``read_changelog``), ``read_committed``, so only
snapshots of committed transactions are restored.
"""

from __future__ import annotations

import time

from reef_stream.core.errors import FatalError
from reef_stream.topics.connect import new_consumer, watermarks
from reef_stream.topics.declarations import MiB, Topic
from reef_stream.topics.kafka import KafkaError, KafkaException, TopicPartition

#: How long reading the assigned changelog partitions to their end may take.
RESTORE_TIMEOUT_S = 120.0


def changelog(ns: str, recipe: str) -> str:
    """The compacted topic holding the processor state of ``recipe``, one partition per input partition."""
    return f"{ns}.processor-state.{recipe}"


def changelog_topic(ns: str, recipe: str, partitions: int) -> Topic:
    return Topic(changelog(ns, recipe), partitions, config={
        "cleanup.policy": "compact",
        "max.message.bytes": str(16 * MiB),
        "min.compaction.lag.ms": "0",
    }, doc=f"Changelog of the pending state of recipe {recipe!r}'s processor")


def read_changelog(bootstrap: str, group: str, topic: str, partitions: list[int], *,
                   timeout: float = RESTORE_TIMEOUT_S) -> dict[int, dict[bytes, bytes]]:
    """The latest snapshot of every live key of each of ``topic``'s ``partitions``, read
    ``read_committed`` to the end as of this call (a tombstone removes its key).

    Blocks; ``group`` is the reading consumer's group id (it commits nothing). Raises
    ``FatalError`` when the end is not reached within ``timeout`` seconds, ``KafkaException``
    for an error reading the topic."""
    tables: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
    if not partitions:
        return tables
    reader = new_consumer(bootstrap, group, {
        "isolation.level": "read_committed", "enable.partition.eof": True,
        "fetch.max.bytes": 64 * MiB})
    try:
        ends = {}
        for p in partitions:
            _, high = watermarks(reader, topic, p)  # reader assigned nothing yet: see there
            if high > 0:
                ends[p] = high
        reader.assign([TopicPartition(topic, p, 0) for p in ends])
        deadline = time.monotonic() + timeout
        while ends:
            if time.monotonic() > deadline:
                raise FatalError(f"could not read {topic} partitions {sorted(ends)} "
                                 f"to their end within {timeout:.0f} s")
            for message in reader.consume(5000, timeout=0.5):
                if message.error() is not None:
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(message.error())
                elif message.value() is None:
                    tables[message.partition()].pop(message.key(), None)
                else:
                    tables[message.partition()][message.key()] = message.value()
            for tp in reader.position([TopicPartition(topic, p) for p in list(ends)]):
                if tp.offset >= 0 and tp.offset >= ends[tp.partition]:
                    del ends[tp.partition]
    finally:
        reader.close()
    return tables
