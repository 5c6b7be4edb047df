"""A co-partitioned pair (generations[p], feedback[p]) of the processor, and its clock.

Record timestamps are the clock, per partition pair, and a pair's records are offered in
timestamp order across its two topics (``PartitionPair.ready``), the generations topic first
at equal timestamps: a record waits in memory (unoffered, its offset uncommitted) until the
other topic has been read past its timestamp or has nothing unread, at most ``max_idle_s``
from when it was read. The merge and why it is so: ``reef_stream.engine.log_merge``.

The pair keeps its records in plain deques, one per topic, and ``ready`` hands them to
``log_merge.in_log_order``, the one place the order is written (the rule of ``LogMerge.pop``
with an empty topic settled when ``caught_up()`` names it), rather than going through a
``LogMerge`` and its per-record objects (why: ``docs/processor.md``, "Throughput and
latency"). ``tests/unit/test_pairs.py`` checks that a pair and a ``LogMerge`` hand the
records over in the same order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reef_stream.core.events import now_ms
from reef_stream.engine.join import ProcessorState
from reef_stream.engine.log_merge import Entry, in_log_order
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
    #: By topic, the records read and not offered yet, in the order read: (timestamp, when
    #: read on the monotonic clock, message). CreateTime topics: timestamps may go backwards.
    _held: dict[str, deque[Entry]] = field(init=False)
    _queues: list[tuple[str, deque[Entry]]] = field(init=False)  # _held in ``topics`` order
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._held = {topic: deque() for topic in self.topics}
        self._queues = [(topic, self._held[topic]) for topic in self.topics]

    def queue(self, message: Any) -> None:
        """Hold a consumed record until ``ready`` offers it (its broker timestamp, or now
        when it has none, is its time on the clock). Raises ValueError for an offset below
        the next one expected of its topic (records of a topic must come in offset order)."""
        kind, at = message.timestamp()
        topic, offset = message.topic(), message.offset()
        held = self._held[topic]
        if held and offset < self.next[topic]:  # next: the offset after the last one held
            raise ValueError(f"{topic}: offset {offset} read after offset "
                             f"{self.next[topic] - 1} (offsets must increase)")
        self.next[topic] = offset + 1
        held.append((now_ms() if kind == TIMESTAMP_NOT_AVAILABLE else at, self.clock(), message))

    def ready(self, caught_up: Callable[[], set[str]],
              max_idle_s: float) -> Iterator[tuple[str, Any, int]]:
        """Pop the held records in timestamp order across the topics, as (topic, message,
        timestamp), as far as the clock allows (see the module docstring). ``caught_up()``:
        the topics of the pair with nothing unread; called only when a topic's queue is
        empty (at most once a record). Lazy: stop iterating and the rest stays held."""
        return in_log_order(self._queues, lambda topic, _at: topic in caught_up(),
                            max_wait_s=max_idle_s, clock=self.clock)

    def held(self) -> bool:
        """True while a record read is not offered yet."""
        return any(self._held.values())
