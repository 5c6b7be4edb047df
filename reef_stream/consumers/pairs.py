"""A co-partitioned pair (generations[p], feedback[p]) of the processor, and its clock.

Record timestamps are the clock, per partition pair, and a pair's records are offered in
timestamp order across its two topics (``PartitionPair.ready``): a record waits in memory
(unoffered, its offset uncommitted) until the other topic has been read past its timestamp
or has nothing unread (position at the high watermark of the last fetch), as Kafka Streams
synchronises the partitions of a task, but at most ``max_idle_s`` from when it was read
(the other topic lags rather than stops, e.g. its records sit behind a producer's open
transaction; Kafka Streams' ``max.task.idle.ms``). Without this, the state machine's clock
(the newest time offered) ran ahead on whichever topic librdkafka handed over first and
expired hundreds of generations whose feedback was merely unread (seen in the kill test).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

from reef_stream.engine.join import ProcessorState
from reef_stream.topics.events import now_ms


@dataclass
class PartitionPair:
    """The state of one co-partitioned pair (generations[p], feedback[p]), and its records
    read but not offered yet. Used by the processor's loop thread only."""

    state: ProcessorState[Any]
    #: The topics of the pair, the first one offered first at equal timestamps.
    topics: tuple[str, ...]
    touched: set[str] = field(default_factory=set)
    #: By topic: records read, not offered yet, as (message, timestamp, when read (monotonic)).
    queues: dict[str, deque[tuple[Any, int, float]]] = field(default_factory=dict)
    next: dict[str, int] = field(default_factory=dict)  # next offset to read, by topic

    def __post_init__(self) -> None:
        for topic in self.topics:
            self.queues.setdefault(topic, deque())

    def queue(self, message: Any) -> None:
        """Hold a consumed record until ``ready`` offers it (its broker timestamp, or now
        when it has none, is its time on the clock)."""
        kind, at = message.timestamp()
        self.next[message.topic()] = message.offset() + 1
        self.queues[message.topic()].append(
            (message, now_ms() if kind == TIMESTAMP_NOT_AVAILABLE else at, time.monotonic()))

    def ready(self, caught_up: Callable[[], set[str]],
              max_idle_s: float) -> Iterator[tuple[str, Any, int]]:
        """Pop the held records in timestamp order across the topics, as (topic, message,
        timestamp), as far as the clock allows (see the module docstring). ``caught_up()``:
        the topics of the pair with nothing unread; called only when one topic's queue is
        empty. Lazy: stop iterating and the rest stays held."""
        while True:
            heads = {t: q[0][1] for t, q in self.queues.items() if q}
            if not heads:
                return
            if len(heads) == 1:
                # the other topic's queue is empty: go on only if it has nothing unread,
                # or the head record has waited max_idle_s since it was read (each record
                # waits at most that long, not one max_idle_s after the other)
                if not caught_up().issuperset(set(self.topics) - heads.keys()):
                    (head,) = heads
                    if time.monotonic() - self.queues[head][0][2] < max_idle_s:
                        return
            topic = min(heads, key=lambda t: (heads[t], t != self.topics[0]))
            message, at, _ = self.queues[topic].popleft()
            yield topic, message, at

    def held(self) -> bool:
        """True while a record read is not offered yet."""
        return any(self.queues.values())
