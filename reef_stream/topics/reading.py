"""Reading a topic to its current end, for the tools that look at the log after the fact.

    for message in read_to_end(bootstrap, "reef.generations"):
        ...

    reader = TopicReader(bootstrap, "reef.generations")   # keeps its place between calls
    first = list(reader.to_end())
    more = list(reader.to_end())          # only what arrived since
    reader.close()

The demo's checks (``reef_stream.demo.verify``, ``run.unit_ledger``) and ``reef trace`` use it.
A consumer assigned by hand, no group membership, nothing committed; ``read_committed``, so a
transactional topic yields only committed records. "The end" is each partition's end when
``to_end`` is called, as a read_committed consumer is told it (its last stable offset), or an
offset the caller gives (``until``): records produced after that are left for the next call,
and so are those of a transaction whose commit marker the coordinator has not yet written to
that partition (it writes the markers just after the commit is decided). The end of a
transactional partition may be a commit marker that is never delivered, so a partition is
done when the consumer's *position* reaches its end, not when a record at ``end - 1``
arrives.

``NewestFirst`` reads the other way, for a reader that wants only the newest record of some
kind (the trainer's ``committed_checkpoint``): windows of offsets back from each partition's
end, the newest window first, so what it costs depends on how far back the record is, not on
how long the topic is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from confluent_kafka import KafkaError, Message, TopicPartition

from reef_stream.topics.connect import new_consumer

#: Seconds a whole read may take before ``TimeoutError``.
READ_TIMEOUT_S = 120.0
#: Seconds one ``consume`` call waits before the positions are looked at again. A batch call
#: returns early only once it has its 5,000 records, so with a longer wait every read of a
#: smaller topic lasted at least that long after its last record had arrived.
POLL_S = 0.05
#: Offsets per partition ``NewestFirst`` reads first; each window further back is twice the
#: one after it. A trainer's acknowledgement takes two (its event and the commit marker).
NEWEST_FIRST_WINDOW = 64


class TopicReader:
    """Every record of ``topic`` in partition order, from the beginning, in calls to ``to_end``
    that each stop at the end the topic has then; see the module docstring. Not thread-safe."""

    def __init__(self, bootstrap: str, topic: str, *, timeout: float = READ_TIMEOUT_S) -> None:
        self.topic, self.timeout = topic, timeout
        self._consumer = new_consumer(bootstrap, "reef-reader", {
            "enable.auto.offset.store": False, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest"})
        #: Next offset to read, per partition (absent: from the beginning).
        self.positions: dict[int, int] = {}

    def to_end(self, until: Mapping[int, int] | None = None) -> Iterator[Message]:
        """The records after the last call's, up to the current end of each partition (or
        ``until[p]``, exclusive, and only the partitions in ``until``). A topic that does not
        exist has no records. Raises ``TimeoutError`` after ``timeout`` seconds."""
        ends = self._ends(until)
        yield from self.between({p: (self.positions.get(p, low), end)
                                 for p, (low, end) in ends.items()})

    def between(self, ranges: Mapping[int, tuple[int, int]]) -> Iterator[Message]:
        """The committed records of each partition ``p`` with ``start <= offset < end``, where
        ``ranges[p] == (start, end)``, in partition order; ``end`` at most the partition's end
        (``bounds``). Each partition's position is left at its ``end``. Raises
        ``TimeoutError`` after ``timeout`` seconds."""
        if not ranges:
            return
        self._consumer.assign([TopicPartition(self.topic, p, start)
                               for p, (start, _) in ranges.items()])
        pending = {p: end for p, (_, end) in ranges.items()}
        deadline = time.monotonic() + self.timeout
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.topic}: partitions {sorted(pending)} not read to "
                                       f"their end within {self.timeout:.0f} s")
                for message in self._consumer.consume(5000, timeout=POLL_S):
                    error, p = message.error(), message.partition()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF and error.fatal():
                            raise RuntimeError(f"reading {self.topic}: {error.str()}")
                        continue
                    if p in pending and message.offset() < pending[p]:
                        self.positions[p] = message.offset() + 1
                        yield message
                for tp in self._consumer.position([TopicPartition(self.topic, p)
                                                   for p in list(pending)]):
                    if tp.offset >= pending[tp.partition]:
                        self.positions[tp.partition] = pending.pop(tp.partition)
        finally:
            self._consumer.unassign()

    def bounds(self) -> dict[int, tuple[int, int]]:
        """``{partition: (low, end)}`` now: the first offset kept and the end a
        read_committed reader is given (the last stable offset). A topic that does not exist
        has none. Blocks for up to 30 s per partition."""
        metadata = self._consumer.list_topics(self.topic, timeout=30).topics.get(self.topic)
        if metadata is None or metadata.error is not None:
            return {}
        bounds = {}
        for p in metadata.partitions:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                             timeout=30)
            bounds[p] = (max(low, 0), high)
        return bounds

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ends(self, until: Mapping[int, int] | None) -> dict[int, tuple[int, int]]:
        """``{partition: (low, end)}`` for the partitions with something left to read."""
        ends = {}
        for p, (low, high) in self.bounds().items():
            if until is not None and p not in until:
                continue
            end = high if until is None else min(high, until[p])
            if end > self.positions.get(p, low):
                ends[p] = (low, end)
        return ends


class NewestFirst:
    """The committed records of ``topic`` newest first, in windows: iterating yields lists of
    records, each list the window of offsets just before the one yielded before it (per
    partition, back from the end each partition had when iteration began), in partition and
    offset order. The first window is ``window`` offsets long, each one after it twice the
    last, so a reader that stops at the first window holding what it wants reads about twice
    the offsets between that record and the end, however long the topic. ``records_read``
    and ``windows_read`` count what was read. Blocks while it reads; raises ``TimeoutError``
    past ``timeout`` per window. Not thread-safe."""

    def __init__(self, bootstrap: str, topic: str, *, window: int = NEWEST_FIRST_WINDOW,
                 timeout: float = READ_TIMEOUT_S) -> None:
        if window < 1:
            raise ValueError(f"a window holds at least one offset, not {window}")
        self.window = window
        self.records_read = 0
        self.windows_read = 0
        self._reader = TopicReader(bootstrap, topic, timeout=timeout)

    def __iter__(self) -> Iterator[list[Message]]:
        left = {p: (low, end) for p, (low, end) in self._reader.bounds().items() if end > low}
        size = self.window
        while left:
            ranges = {p: (max(low, end - size), end) for p, (low, end) in left.items()}
            records = list(self._reader.between(ranges))
            self.records_read += len(records)
            self.windows_read += 1
            left = {p: (left[p][0], start) for p, (start, _) in ranges.items()
                    if start > left[p][0]}
            size *= 2
            yield records

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> NewestFirst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_to_end(bootstrap: str, topic: str, *, until: Mapping[int, int] | None = None,
                timeout: float = READ_TIMEOUT_S) -> Iterator[Message]:
    """Every committed record of ``topic`` up to its current end (or ``until``); see
    ``TopicReader.to_end``."""
    with TopicReader(bootstrap, topic, timeout=timeout) as reader:
        yield from reader.to_end(until)
