"""One timestamp order over several sources of a Kafka log, handed over once it is settled.

Two consumers merge records read from several sources into one order: the trainer the
partitions of the units topic, the processor the two topics (generations[p], feedback[p]) of
a partition pair. ``LogMerge`` does it for both. It buffers each source's records in the
order they were read and hands over the head that sorts first by ``(timestamp, index of its
source in sources)``, so at equal timestamps the first source goes first. Within a source
the records go in the order they were read (their offsets).

The trainer's order is a function of the log alone. A trainer must build the same steps
from the same log whether it ran without stopping or was killed and restarted ten times, so
the units of a step cannot depend on which partition librdkafka happened to fetch first. The
units topic is ``LogAppendTime``: the broker stamps each record, so timestamps never go
backwards within a partition (``log_append_time=True`` refuses a record that does) and the
order is ``(timestamp, partition, offset)`` over the whole log.

The processor's order is its clock. Record timestamps are the clock of a partition pair's
state machine; without the merge the clock (the newest time offered) ran ahead on whichever
topic librdkafka handed over first and expired hundreds of generations whose feedback was
merely unread (seen in the kill test). Its topics are ``CreateTime``, so a single topic's
timestamps may go backwards; such a record waits behind the records read before it.

When a record is settled. A record is handed over only once nothing can still arrive before
it. For every *other* source, either a record of that source is already buffered (its head
sorts after the candidate, by construction), or that source is empty and the caller says it
can hold nothing earlier than the candidate (``pop``'s ``settled``). The two rules:

- The trainer's (``LogMerge.drained``), deterministic: the partition has been read to its
  end (an end-of-partition event, with nothing since: ``at_end``) and everything librdkafka
  fetched up to ``grace_ms`` after the candidate's timestamp has been handed to us (the
  caller passes ``drained_at_ms``: a time before which every fetched record has been
  consumed from the client). A record appended to that partition at or before the
  candidate's timestamp would have been fetched within the grace and so be buffered. The
  assumptions, stated: a broker clock and this host's clock differ by less than ``grace_ms``
  minus the fetch latency (``fetch.wait.max.ms`` plus a round trip), and the consumer keeps
  fetching every partition. At the end of a finite log the last records wait ``grace_ms``
  for this; while data flows on every partition they go at once.
- The processor's (``consumers.pairs``: a ``PartitionPair`` hands its two topics' queues to
  ``in_log_order``), as Kafka Streams synchronises the partitions of a task: the other
  topic has nothing unread (its position is at the high watermark of the last fetch; asking costs a client call, so the caller asks lazily, at most once a batch).
  A record waits so, in memory (unoffered, its offset uncommitted), but at most
  ``max_wait_s`` from when it was read (``pop``'s escape, on the merge's monotonic clock):
  the other topic may lag rather than stop, e.g. its records sit behind a producer's open
  transaction (Kafka Streams' ``max.task.idle.ms``). Each record waits at most that long,
  not one ``max_wait_s`` after the other. The escape makes the order depend on timing, so the
  trainer never uses it.

The order is written once, in ``in_log_order``: over queues of ``(timestamp, when read,
item)`` in read order, one per source, it pops heads in order while they are settled.
``LogMerge.pop`` takes its next record from it; the processor's pairs call it on their own
deques, without a ``LogMerge``'s per-record objects (its hot path: two sources, whose heads
are compared directly while both hold records).

Pure: no Kafka in here (the consumers feed it), so it is tested without a broker.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

#: How long past a record's timestamp the other, idle, partitions are given to show
#: an earlier record. Must exceed the fetch latency plus any broker/host clock skew.
GRACE_MS = 1_000

SourceT = TypeVar("SourceT", bound=Hashable)

#: ``settled(source, timestamp_ms)``: True when ``source``, empty, can no longer yield a
#: record that sorts before a candidate at ``timestamp_ms``.
Settled = Callable[[SourceT, int], bool]

#: A record waiting in its source's queue: its timestamp, when it was read (the merge's
#: monotonic clock, for ``max_wait_s``) and what the caller attached.
Entry = tuple[int, float, Any]


def in_log_order(queues: Sequence[tuple[SourceT, deque[Entry]]], settled: Settled[SourceT], *,
                 max_wait_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[SourceT, Any, int]]:
    """Pop the queues' entries in log order, as ``(source, item, timestamp)``, while the next
    one is settled (see the module docstring); lazy: stop iterating and the rest stays queued.

    ``queues``: each source with its entries in the order read, the sources in tie-break
    order. The next entry is the head that sorts first by ``(timestamp, index of its source)``.
    It goes when every *empty* source other than its own is settled for its timestamp
    (``settled(source, timestamp)``, asked only of those, and only until one says False); a
    source holding records is settled by construction (its head sorts after). Else it goes
    only once it was read at least ``max_wait_s`` ago (``clock``); None never lets it go
    early. Entries are added between iterations, never during one.
    """
    if len(queues) == 2:  # the processor's pairs: the heads compared directly
        (first, ones), (second, twos) = queues
        while True:
            while ones and twos:
                if twos[0][0] < ones[0][0]:
                    at, _, item = twos.popleft()
                    yield second, item, at
                else:
                    at, _, item = ones.popleft()
                    yield first, item, at
            if ones:
                source, queue, other = first, ones, second
            elif twos:
                source, queue, other = second, twos, first
            else:
                return
            at, read_at, item = queue[0]
            if not settled(other, at) and (max_wait_s is None or clock() - read_at < max_wait_s):
                return
            queue.popleft()
            yield source, item, at
    while True:
        heads = [(queue[0][0], index) for index, (_, queue) in enumerate(queues) if queue]
        if not heads:
            return
        source, queue = queues[min(heads)[1]]
        at, read_at, item = queue[0]
        if not all(settled(other, at) for other, waiting in queues if not waiting) and (
                max_wait_s is None or clock() - read_at < max_wait_s):
            return
        queue.popleft()
        yield source, item, at


@dataclass(frozen=True, slots=True)
class Ordered(Generic[SourceT]):
    """A record handed over in order: where it came from, its timestamp, and what the caller
    attached."""

    source: SourceT
    offset: int
    timestamp_ms: int
    item: Any


class LogMerge(Generic[SourceT]):
    """Buffers records per source and hands them over in ``(timestamp, source index)`` order of
    the sources' heads once that order is settled (see the module docstring). Not
    thread-safe.

    ``log_append_time``: the sources' timestamps never go backwards (the broker stamps them);
    a record that breaks this is refused. ``clock``: monotonic seconds, for ``pop``'s
    ``max_wait_s``.
    """

    def __init__(self, sources: Sequence[SourceT], *, log_append_time: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: By source: records read and not handed over yet, as ``(timestamp, when read on the
        #: clock, Ordered)``; and the same queues in the order of ``sources``, for
        #: ``in_log_order``.
        self._queues: dict[SourceT, deque[Entry]] = {source: deque() for source in sources}
        self._order = list(self._queues.items())
        self._at_end: dict[SourceT, bool] = dict.fromkeys(sources, False)
        self._log_append_time = log_append_time
        self._clock = clock

    def add(self, source: SourceT, offset: int, timestamp_ms: int, item: Any) -> None:
        """Buffer a record read from ``source``; a source's records must come in offset order.
        Never blocks. Raises ValueError for an offset not above the last one buffered of that
        source, or (``log_append_time``) a timestamp below it."""
        queue = self._queues[source]
        if queue:
            last = queue[-1][2]
            if offset <= last.offset or (self._log_append_time
                                         and timestamp_ms < last.timestamp_ms):
                raise ValueError(
                    f"source {source}: offset {offset} at {timestamp_ms} ms after offset "
                    f"{last.offset} at {last.timestamp_ms} ms (offsets must increase"
                    + (" and timestamps must not decrease: is the topic LogAppendTime?)"
                       if self._log_append_time else ")"))
        queue.append((timestamp_ms, self._clock(), Ordered(source, offset, timestamp_ms, item)))
        self._at_end[source] = False

    def at_end(self, source: SourceT) -> None:
        """The consumer reached the end of ``source`` (nothing after what was added); until the
        next ``add`` of it. Idempotent."""
        self._at_end[source] = True

    def drained(self, drained_at_ms: int, *, grace_ms: int = GRACE_MS) -> Settled[SourceT]:
        """The trainer's rule for ``pop``, a function of the log alone: an empty source is
        settled for a candidate at ``t`` once it was read to its end (``at_end``) and
        ``drained_at_ms >= t + grace_ms``. ``drained_at_ms``: wall-clock milliseconds such that
        every record the client fetched before then has been passed to ``add`` / ``at_end``."""
        def settled(source: SourceT, timestamp_ms: int) -> bool:
            return self._at_end[source] and drained_at_ms >= timestamp_ms + grace_ms

        return settled

    def pop(self, settled: Settled[SourceT], *,
            max_wait_s: float | None = None) -> Ordered[SourceT] | None:
        """The next record in order if it is settled, else None (it stays buffered). Never
        blocks.

        ``settled(source, timestamp_ms)`` is asked only of the empty sources other than the
        candidate's, and only until one says False. ``max_wait_s``: a candidate read at least
        that long ago (``clock``) goes even if an empty source is not settled; None (the
        trainer's) never lets one go early.
        """
        for _, record, _ in in_log_order(self._order, settled, max_wait_s=max_wait_s,
                                         clock=self._clock):
            return record
        return None

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def waiting_on(self) -> list[SourceT]:
        """The empty sources not read to their end, in the order of ``sources`` (what the next
        record waits for under ``drained``)."""
        return [source for source, queue in self._queues.items()
                if not queue and not self._at_end[source]]
