"""A co-partitioned pair (generations[p], feedback[p]) of the processor, and its clock.

Record timestamps are the clock, per partition pair, and a pair's records are offered in
timestamp order across its two topics (``PartitionPair.ready``), the generations topic first
at equal timestamps: a record waits in memory (unoffered, its offset uncommitted) until the
other topic has been read past its timestamp or has nothing unread, at most ``max_idle_s``
from when it was read. The merge and why it is so: ``reef_stream.engine.log_merge``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reef_stream.engine.join import ProcessorState
from reef_stream.engine.log_merge import LogMerge
from reef_stream.topics.events import now_ms
from reef_stream.topics.kafka import TIMESTAMP_NOT_AVAILABLE


@dataclass
class PartitionPair:
    """The state of one co-partitioned pair (generations[p], feedback[p]), and its records
    read but not offered yet. Used by the processor's loop thread only."""

    state: ProcessorState[Any]
    #: The topics of the pair, the first one offered first at equal timestamps.
    topics: tuple[str, ...]
    touched: set[str] = field(default_factory=set)
    next: dict[str, int] = field(default_factory=dict)  # next offset to read, by topic
    #: The records read, not offered yet (CreateTime topics: timestamps may go backwards).
    merge: LogMerge[str] = field(init=False)

    def __post_init__(self) -> None:
        self.merge = LogMerge(self.topics)

    def queue(self, message: Any) -> None:
        """Hold a consumed record until ``ready`` offers it (its broker timestamp, or now
        when it has none, is its time on the clock)."""
        kind, at = message.timestamp()
        self.next[message.topic()] = message.offset() + 1
        self.merge.add(message.topic(), message.offset(),
                       now_ms() if kind == TIMESTAMP_NOT_AVAILABLE else at, message)

    def ready(self, caught_up: Callable[[], set[str]],
              max_idle_s: float) -> Iterator[tuple[str, Any, int]]:
        """Pop the held records in timestamp order across the topics, as (topic, message,
        timestamp), as far as the clock allows (see the module docstring). ``caught_up()``:
        the topics of the pair with nothing unread; called only when a topic's queue is
        empty. Lazy: stop iterating and the rest stays held."""
        def settled(topic: str, _timestamp_ms: int) -> bool:
            return topic in caught_up()

        while (record := self.merge.pop(settled, max_wait_s=max_idle_s)) is not None:
            yield record.source, record.item, record.timestamp_ms

    def held(self) -> bool:
        """True while a record read is not offered yet."""
        return len(self.merge) > 0
