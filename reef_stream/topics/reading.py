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
        if not ends:
            return
        self._consumer.assign([TopicPartition(self.topic, p, self.positions.get(p, low))
                               for p, (low, _) in ends.items()])
        pending = {p: end for p, (_, end) in ends.items()}
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

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ends(self, until: Mapping[int, int] | None) -> dict[int, tuple[int, int]]:
        """``{partition: (low, end)}`` for the partitions with something left to read."""
        metadata = self._consumer.list_topics(self.topic, timeout=30).topics.get(self.topic)
        if metadata is None or metadata.error is not None:
            return {}
        ends = {}
        for p in metadata.partitions:
            if until is not None and p not in until:
                continue
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                             timeout=30)
            end = high if until is None else min(high, until[p])
            if end > self.positions.get(p, max(low, 0)):
                ends[p] = (max(low, 0), end)
        return ends


def read_to_end(bootstrap: str, topic: str, *, until: Mapping[int, int] | None = None,
                timeout: float = READ_TIMEOUT_S) -> Iterator[Message]:
    """Every committed record of ``topic`` up to its current end (or ``until``); see
    ``TopicReader.to_end``."""
    with TopicReader(bootstrap, topic, timeout=timeout) as reader:
        yield from reader.to_end(until)
