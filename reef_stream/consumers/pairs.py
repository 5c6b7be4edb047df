"""A co-partitioned pair (generations[p], feedback[p]) of the processor, and its clock.

Record timestamps are the clock, per partition pair, and a pair's records are offered in
timestamp order across its two topics (``PartitionPair.ready``), the generations topic first
at equal timestamps: a record waits in memory (unoffered, its offset uncommitted) until the
other topic has been read past its timestamp or has nothing unread, at most ``max_idle_s``
from when it was read. The merge and why it is so: ``reef_stream.engine.log_merge``.

The pair applies that rule itself, over plain deques, rather than through a ``LogMerge``: it
is the processor's rule of ``LogMerge.pop`` (heads in ``(timestamp, index of the topic)``
order, an empty topic settled when ``caught_up()`` names it, a record let go ``max_idle_s``
after it was read) without its per-record objects, head list and closure calls, which
were ~15% of the processor's CPU per record (issue 15). ``tests/unit/test_pairs.py`` checks
that both hand the records over in the same order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reef_stream.engine.join import ProcessorState
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
    #: By topic, the records read and not offered yet, in the order read: (timestamp, when
    #: read on the monotonic clock, message). CreateTime topics: timestamps may go backwards.
    _held: dict[str, deque[tuple[int, float, Any]]] = field(init=False)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._held = {topic: deque() for topic in self.topics}

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
        empty. Lazy: stop iterating and the rest stays held."""
        held = [(topic, self._held[topic]) for topic in self.topics]
        if len(held) == 2:  # the processor's case, without the general loop's head search
            (first, ones), (second, twos) = held
            while ones and twos:
                if twos[0][0] < ones[0][0]:
                    at, _, message = twos.popleft()
                    yield second, message, at
                else:
                    at, _, message = ones.popleft()
                    yield first, message, at
        while True:
            heads = [(queue[0][0], index) for index, (_, queue) in enumerate(held) if queue]
            if not heads:
                return
            index = min(heads)[1]
            topic, queue = held[index]
            empty = [other for other, waiting in held if not waiting]
            settled = not empty or caught_up().issuperset(empty)
            if not settled and self.clock() - queue[0][1] < max_idle_s:
                return
            if settled and len(heads) == 1:  # every other topic empty and settled: in order
                while queue:
                    at, _, message = queue.popleft()
                    yield topic, message, at
                return
            at, _, message = queue.popleft()
            yield topic, message, at

    def held(self) -> bool:
        """True while a record read is not offered yet."""
        return any(self._held.values())
