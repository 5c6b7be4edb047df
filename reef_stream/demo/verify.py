"""What a fault run checks after the fact, from the log alone.

- ``generation_outcomes``: every generation in ``<ns>.generations`` ended in
  exactly one unit of the recipe or one of the processor's dead letters
  (expired, too stale, invalid), and none in more than one;
- ``missing_acknowledged``: of the generation ids a producer saw acknowledged
  (the replicas' ``--acked-log`` files), those the topic does not hold.

Both read the topics to their current end (committed records only) with
consumers assigned by hand: no group, nothing committed. The trainer's side,
no unit trained twice or lost, is ``reef_stream.demo.run.unit_ledger``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from reef_stream.connect import client_config
from reef_stream.errors import InvalidRecord
from reef_stream.events import DeadLetter, Generation
from reef_stream.metrics import STAGE_PROCESSOR
from reef_stream.topics import declarations
from reef_stream.topics.serde import SchemaRegistry
from reef_stream.training import unit_members

def read_to_end(bootstrap: str, topic: str, timeout: float = 120.0) -> Iterator[Any]:
    """Every committed record of ``topic`` up to the end it has now (``timeout`` seconds at
    most: ``TimeoutError`` after that)."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": "reef-verify", "enable.auto.commit": False,
        "isolation.level": "read_committed"}))
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {}
        for p in partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            if high > 0:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(ends)} not read to their end "
                                   f"within {timeout:.0f} s")
            for message in consumer.consume(5000, timeout=1.0):
                if message.error() is not None:
                    continue
                p = message.partition()
                if p in ends:
                    yield message
                    if message.offset() + 1 >= ends[p]:
                        del ends[p]
            # the last records of a partition may be transaction markers, never delivered
            for tp in consumer.position([TopicPartition(topic, p) for p in list(ends)]):
                if tp.offset >= ends[tp.partition]:
                    del ends[tp.partition]
    finally:
        consumer.close()


def generation_outcomes(bootstrap: str, namespace: str, recipe: Any) -> dict[str, int]:
    """Counts over the distinct generation ids of ``<ns>.generations``: ``generations``,
    ``in_units``, ``dead_lettered``, ``no_outcome`` and ``more_than_one`` (the last two must be
    0 once the processor has caught up); ``undecodable`` records are the processor's invalid
    input (dead-lettered as such, with no id to match)."""
    registry = SchemaRegistry.default()
    ids: set[str] = set()
    undecodable = 0
    for message in read_to_end(bootstrap, declarations.generations(namespace)):
        try:
            ids.add(registry.decode(message.value(), message.headers(), Generation).generation_id)
        except InvalidRecord:
            undecodable += 1
    outcomes: Counter[str] = Counter()
    unit_type = recipe.objective.unit_type
    for message in read_to_end(bootstrap, declarations.units(namespace, recipe.name)):
        unit = registry.decode(message.value(), message.headers(), unit_type)
        outcomes.update({m.generation_id for m in unit_members(unit)})
    in_units = set(outcomes)
    generations_topic = declarations.generations(namespace)
    for message in read_to_end(bootstrap, declarations.dead_letters(namespace)):
        # The processor's dead letters of generations: an outcome (expired, too stale, invalid),
        # a unit too large to emit, or a record that failed validation; each carries the record.
        letter = registry.decode(message.value(), message.headers(), DeadLetter)
        if letter.stage != STAGE_PROCESSOR or letter.source_topic != generations_topic \
                or letter.value is None:
            continue
        try:
            generation = registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                                         Generation)
        except InvalidRecord:
            continue  # an undecodable record: counted in ``undecodable`` above
        outcomes[generation.generation_id] += 1
    return {"generations": len(ids), "in_units": len(in_units & ids),
            "dead_lettered": len((set(outcomes) - in_units) & ids),
            "no_outcome": len(ids - set(outcomes)),
            "more_than_one": sum(1 for gid, n in outcomes.items() if n > 1),
            "undecodable": undecodable}


def missing_acknowledged(bootstrap: str, namespace: str, acknowledged: Iterable[str]) -> set[str]:
    """The ids in ``acknowledged`` that no record of ``<ns>.generations`` carries."""
    wanted = set(acknowledged)
    registry = SchemaRegistry.default()
    for message in read_to_end(bootstrap, declarations.generations(namespace)):
        try:
            wanted.discard(registry.decode(message.value(), message.headers(),
                                           Generation).generation_id)
        except InvalidRecord:
            continue
    return wanted
