"""One order over a topic's partitions that is a function of the log alone.

A trainer must build the same steps from the same log whether it ran without
stopping or was killed and restarted ten times, so the units of a step cannot
depend on which partition librdkafka happened to fetch first. ``PartitionMerge``
hands records over in the order ``(timestamp, partition, offset)``, where the
timestamp is the broker's (the units topic is ``LogAppendTime``, so it never
goes backwards within a partition).

A record is handed over only once nothing can still arrive before it in that
order. For every *other* partition, either

- a record of that partition is already buffered (its head sorts after the
  candidate, by construction), or
- the partition has been read to its end (an end-of-partition event, with
  nothing since) and everything librdkafka fetched up to ``grace_ms`` after
  the candidate's timestamp has been handed to us (the caller passes
  ``drained_at_ms``: a time before which every fetched record has been
  consumed from the client). A record appended to that partition at or before
  the candidate's timestamp would have been fetched within the grace and so
  be buffered.

The assumptions, stated: a broker clock and this host's clock differ by less
than ``grace_ms`` minus the fetch latency (``fetch.wait.max.ms`` plus a round
trip), and the consumer keeps fetching every partition. At the end of a
finite log the last records wait ``grace_ms`` for this; while data flows on
every partition they go at once.

Pure: no Kafka in here (the trainer feeds it), so it is tested without a broker.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: How long past a record's timestamp the other, idle, partitions are given to show
#: an earlier record. Must exceed the fetch latency plus any broker/host clock skew.
GRACE_MS = 1_000


@dataclass(frozen=True, slots=True)
class Ordered:
    """A record handed over in order: where it came from, its timestamp, and what the caller
    attached."""

    partition: int
    offset: int
    timestamp_ms: int
    item: Any


class PartitionMerge:
    """Buffers records per partition and hands them over in ``(timestamp, partition, offset)``
    order once that order is settled (see the module docstring). Not thread-safe."""

    def __init__(self, partitions: Iterable[int], *, grace_ms: int = GRACE_MS) -> None:
        self._queues: dict[int, deque[Ordered]] = {p: deque() for p in partitions}
        self._at_end: dict[int, bool] = dict.fromkeys(self._queues, False)
        self._heads: list[tuple[int, int, int]] = []   # (timestamp, partition, offset) of heads
        self.grace_ms = grace_ms

    def add(self, partition: int, offset: int, timestamp_ms: int, item: Any) -> None:
        """Buffer a record; records of one partition must come in offset order."""
        queue = self._queues[partition]
        if queue and (offset <= queue[-1].offset or timestamp_ms < queue[-1].timestamp_ms):
            raise ValueError(
                f"partition {partition}: offset {offset} at {timestamp_ms} ms after offset "
                f"{queue[-1].offset} at {queue[-1].timestamp_ms} ms (offsets must increase and "
                "timestamps must not decrease: is the topic LogAppendTime?)")
        record = Ordered(partition, offset, timestamp_ms, item)
        if not queue:
            heapq.heappush(self._heads, (timestamp_ms, partition, offset))
        queue.append(record)
        self._at_end[partition] = False

    def at_end(self, partition: int) -> None:
        """The consumer reached the end of ``partition`` (nothing after what was added)."""
        self._at_end[partition] = True

    def pop(self, drained_at_ms: int) -> Ordered | None:
        """The next record in order if it is settled, else None.

        ``drained_at_ms``: wall-clock milliseconds such that every record the
        client fetched before then has been passed to ``add`` / ``at_end``.
        """
        if not self._heads:
            return None
        timestamp, partition, _ = self._heads[0]
        for other, queue in self._queues.items():
            if other == partition or queue:
                continue
            if not self._at_end[other] or drained_at_ms < timestamp + self.grace_ms:
                return None
        heapq.heappop(self._heads)
        queue = self._queues[partition]
        record = queue.popleft()
        if queue:
            head = queue[0]
            heapq.heappush(self._heads, (head.timestamp_ms, head.partition, head.offset))
        return record

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_on(self) -> list[int]:
        """The partitions the next record waits for (empty and not read to their end)."""
        return sorted(p for p, q in self._queues.items() if not q and not self._at_end[p])
