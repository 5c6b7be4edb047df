"""One timestamp order over several sources of a Kafka log, handed over once it is settled.

``LogMerge`` buffers each source's records in read order and hands over the head that sorts
first by ``(timestamp, index of its source)``; within a source, records keep their offsets'
order. A record is handed over only once it is *settled*: every other source either holds a
record already (which sorts after it) or, by the caller's rule, can hold nothing earlier:

- the trainer's rule (``LogMerge.drained``), deterministic, for the partitions of the units
  topic (``LogAppendTime``): the partition was read to its end and everything fetched up to
  ``grace_ms`` past the candidate's timestamp was consumed. Its order, ``(timestamp,
  partition, offset)``, is a function of the log alone, so a restarted trainer rebuilds the
  same steps. Assumed: broker and host clocks differ by less than ``grace_ms`` minus the
  fetch latency;
- the processor's rule (``consumers.processor.pairs``), for a partition pair's two topics: the
  other topic has nothing unread, or the record has waited ``max_wait_s`` (Kafka Streams'
  ``max.task.idle.ms``; this escape depends on timing, so the trainer never uses it).

The order is written once, in ``in_log_order``. Pure: no Kafka here, tested without a broker.
Why the order and the rules are these: ``docs/design-notes.md`` ("The log merge").
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
