"""An in-memory broker for the stage loop's contract tests: the consumer and producer surface the
loop and its strategies use, with the semantics they rely on, and nothing more.

Never used by a production code path: it runs ``tests/contract/`` beside the same suite on a
real Kafka broker, which keeps every guarantee's test (STYLE.md 13).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reef_stream.topics.kafka import (
    OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition,
)

#: librdkafka's logical offsets that ``confluent_kafka`` names and ``topics.kafka`` does not.
_OFFSET_END, _OFFSET_STORED, _OFFSET_INVALID = -1, -1000, -1001
#: ``Message.timestamp()``'s type of a producer's timestamp (``TIMESTAMP_CREATE_TIME``).
_CREATE_TIME = 1

Rebalance = Callable[[Any, list[TopicPartition]], None]


@dataclass(frozen=True)
class _TopicMetadata:
    partitions: dict[int, None]
    error: KafkaError | None = None


@dataclass(frozen=True)
class _ClusterMetadata:
    topics: dict[str, _TopicMetadata]


@dataclass
class _Group:
    """A consumer group: its members in join order, and the committed offsets."""

    members: list[MemoryConsumer] = field(default_factory=list)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)


class MemoryBroker:
    """Topics of partitions held in lists, consumer groups with an eager range assignment, and
    static members fenced by a newer one with the same ``group.instance.id``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._logs: dict[str, list[list[Message]]] = {}
        self._groups: dict[str, _Group] = {}

    # ------------------------------------------------------------------ for tests

    def create_topic(self, name: str, partitions: int = 1) -> None:
        """A topic of ``partitions`` empty partitions; an existing one is kept."""
        with self._lock:
            self._logs.setdefault(name, [[] for _ in range(partitions)])

    def messages(self, topic: str, partition: int | None = None) -> list[Message]:
        """Every record of ``topic`` (of one partition), in offset order per partition."""
        with self._lock:
            logs = self._logs[topic]
            chosen = logs if partition is None else [logs[partition]]
            return [message for log in chosen for message in log]

    def committed(self, group: str, topic: str, partition: int) -> int:
        """The group's committed offset, or ``-1001`` (none)."""
        with self._lock:
            return self._group(group).committed.get((topic, partition), _OFFSET_INVALID)

    def consumer(self, group: str, config: Mapping[str, Any] | None = None) -> MemoryConsumer:
        """A consumer of ``group`` (a ``stage.ConsumerFactory``). Honours
        ``enable.partition.eof``, ``group.instance.id`` and ``auto.offset.reset`` (earliest by
        default, as the loop's Kafka consumers); other settings are ignored."""
        return MemoryConsumer(self, group, dict(config or {}))

    def producer(self, config: Mapping[str, Any] | None = None) -> MemoryProducer:
        """A producer; every record is acknowledged at once (settings are ignored)."""
        return MemoryProducer(self)

    # ------------------------------------------------------------------ inside

    def _group(self, name: str) -> _Group:
        return self._groups.setdefault(name, _Group())

    def _append(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]] | None) -> Message:
        with self._lock:
            log = self._logs[topic][partition]
            message = Message(topic=topic, partition=partition, offset=len(log), key=key,
                              value=value, headers=headers or None,
                              timestamp=(_CREATE_TIME, int(time.time() * 1000)))
            log.append(message)
            self._lock.notify_all()
            return message

    def _rebalance(self, group: _Group) -> None:
        """Range assignment over the members in join order; each takes it at its next
        ``consume``, once no other member holds any of it (the eager join's barrier)."""
        for member in group.members:
            member._target = []
        topics = sorted({t for member in group.members for t in member._topics})
        for topic in topics:
            members = [m for m in group.members if topic in m._topics]
            count = len(self._logs.get(topic, []))
            share, extra = divmod(count, len(members))
            start = 0
            for n, member in enumerate(members):
                size = share + (1 if n < extra else 0)
                member._target += [(topic, p) for p in range(start, start + size)]
                start += size
        for member in group.members:
            member._rebalancing = True
        self._lock.notify_all()


class MemoryConsumer:
    """The ``confluent_kafka.Consumer`` surface of the stage loop and its strategies; rebalance
    callbacks run inside ``consume`` and ``close`` on the caller's thread, as librdkafka's do."""

    def __init__(self, broker: MemoryBroker, group: str, config: dict[str, Any]) -> None:
        self._broker, self._group_name, self._config = broker, group, config
        self._eof = bool(config.get("enable.partition.eof", False))
        self._instance = config.get("group.instance.id")
        self._topics: list[str] = []
        self._callbacks: tuple[Rebalance | None, Rebalance | None] = (None, None)
        self._positions: dict[tuple[str, int], int] = {}  # the assignment and where it reads
        self._paused: set[tuple[str, int]] = set()
        self._eof_at: dict[tuple[str, int], int] = {}
        self._target: list[tuple[str, int]] = []
        self._rebalancing = False
        self._subscribed = self._fenced = self._closed = False
        self._next = 0  # the partition to read first, in turn

    # ------------------------------------------------------------------ metadata

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMetadata:
        with self._broker._lock:
            names = list(self._broker._logs) if topic is None else [topic]
            return _ClusterMetadata({
                name: _TopicMetadata(dict.fromkeys(range(len(self._broker._logs[name]))))
                for name in names if name in self._broker._logs})

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        with self._broker._lock:
            return 0, len(self._log(partition.topic, partition.partition))

    # ------------------------------------------------------------------ assignment

    def subscribe(self, topics: list[str], on_assign: Rebalance | None = None,
                  on_revoke: Rebalance | None = None, on_lost: Rebalance | None = None) -> None:
        self._check_open()
        with self._broker._lock:
            group = self._broker._group(self._group_name)
            if self._instance is not None:
                for member in list(group.members):
                    if member._instance == self._instance and member is not self:
                        member._fenced = True
                        member._positions = {}
                        group.members.remove(member)
            self._topics, self._callbacks = list(topics), (on_assign, on_revoke)
            self._subscribed = True
            if self not in group.members:
                group.members.append(self)
            self._broker._rebalance(group)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._check_open()
        with self._broker._lock:
            self._positions = {(tp.topic, tp.partition): self._start(tp) for tp in partitions}
            self._paused &= set(self._positions)
            self._eof_at = {}

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in sorted(self._positions)]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused -= {(tp.topic, tp.partition) for tp in partitions}

    def seek(self, partition: TopicPartition) -> None:
        where = (partition.topic, partition.partition)
        if where not in self._positions:
            raise KafkaException(KafkaError(KafkaError._STATE, f"{where} is not assigned"))
        with self._broker._lock:
            self._positions[where] = self._start(partition)
            self._eof_at.pop(where, None)

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition,
                               self._positions.get((tp.topic, tp.partition), _OFFSET_INVALID))
                for tp in partitions]

    # ------------------------------------------------------------------ offsets

    def commit(self, message: Message | None = None, offsets: list[TopicPartition] | None = None,
               asynchronous: bool = True) -> list[TopicPartition] | None:
        """Stores ``offsets`` (only these: the loop always names them); at once, either way."""
        self._check_open()
        if offsets is None or message is not None:
            raise NotImplementedError("the memory broker commits named offsets only")
        if self._fenced:
            raise KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer member"))
        with self._broker._lock:
            group = self._broker._group(self._group_name)
            for tp in offsets:
                group.committed[(tp.topic, tp.partition)] = tp.offset
        return None if asynchronous else list(offsets)

    def committed(self, partitions: list[TopicPartition],
                  timeout: float | None = None) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition,
                               self._broker.committed(self._group_name, tp.topic, tp.partition))
                for tp in partitions]

    # ------------------------------------------------------------------ reading

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        """Up to ``num_messages`` records (and partition ends), in offset order per partition;
        waits up to ``timeout`` seconds for the first. A fenced consumer gets one fatal event."""
        self._check_open()
        deadline = time.monotonic() + max(timeout, 0)
        while True:
            if self._fenced:
                return [Message(error=KafkaError(
                    KafkaError._FATAL, "fenced: another consumer joined with group.instance.id "
                    f"{self._instance}", fatal=True))]
            if self._rebalancing:
                self._serve_rebalance()
            with self._broker._lock:
                taken = self._take(num_messages)
                left = deadline - time.monotonic()
                if taken or left <= 0:
                    return taken
                self._broker._lock.wait(min(left, 0.05))

    def close(self) -> None:
        """Leave the group: the assignment is revoked first (the callback runs here)."""
        if self._closed:
            return
        if self._subscribed and not self._fenced:
            revoked = self.assignment()
            if revoked and self._callbacks[1] is not None:
                self._callbacks[1](self, revoked)
            with self._broker._lock:
                group = self._broker._group(self._group_name)
                if self in group.members:
                    group.members.remove(self)
                    self._broker._rebalance(group)
        self._positions, self._closed = {}, True

    # ------------------------------------------------------------------ inside

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Consumer closed")

    def _log(self, topic: str, partition: int) -> list[Message]:
        try:
            return self._broker._logs[topic][partition]
        except (KeyError, IndexError):
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART,
                                            f"{topic}[{partition}]")) from None

    def _start(self, tp: TopicPartition) -> int:
        """Where an assigned partition starts reading (its committed offset when none given)."""
        end = len(self._log(tp.topic, tp.partition))
        if tp.offset >= 0:
            return tp.offset
        if tp.offset == OFFSET_BEGINNING:
            return 0
        if tp.offset == _OFFSET_END:
            return end
        committed = self._broker._group(self._group_name).committed.get(
            (tp.topic, tp.partition), _OFFSET_INVALID)
        if committed >= 0:
            return committed
        return end if self._config.get("auto.offset.reset", "earliest") in (
            "latest", "largest", "end") else 0

    def _serve_rebalance(self) -> None:
        """Revoke the whole assignment, then take the new one once nobody else holds it."""
        on_assign, on_revoke = self._callbacks
        if self._positions:
            revoked = self.assignment()
            if on_revoke is not None:
                on_revoke(self, revoked)
            with self._broker._lock:
                self._positions, self._paused, self._eof_at = {}, set(), {}
        with self._broker._lock:
            group = self._broker._group(self._group_name)
            target = set(self._target)
            if any(target & set(m._positions) for m in group.members if m is not self):
                return  # an old owner has not revoked yet: asked again at the next consume
            self._rebalancing = False
            assigned = [TopicPartition(t, p, _OFFSET_INVALID) for t, p in sorted(target)]
        if on_assign is not None:
            on_assign(self, assigned)
        if not self._rebalancing and not self._fenced:
            self.assign(assigned)

    def _take(self, limit: int) -> list[Message]:
        """Under the broker's lock: records of the unpaused partitions, each partition in turn."""
        taken: list[Message] = []
        readable = [where for where in sorted(self._positions) if where not in self._paused]
        if not readable:
            return taken
        self._next = (self._next + 1) % len(readable)
        for where in readable[self._next:] + readable[:self._next]:
            log = self._log(*where)
            position = self._positions[where]
            while position < len(log) and len(taken) < limit:
                taken.append(log[position])
                position += 1
            self._positions[where] = position
            if self._eof and position >= len(log) and self._eof_at.get(where) != position \
                    and len(taken) < limit:
                self._eof_at[where] = position
                taken.append(Message(topic=where[0], partition=where[1], offset=position,
                                     error=KafkaError(KafkaError._PARTITION_EOF)))
            if len(taken) >= limit:
                break
        return taken


class MemoryProducer:
    """The ``confluent_kafka.Producer`` surface of the stage loop: ``produce`` appends at once,
    delivery callbacks run at the next ``poll`` or ``flush``, as librdkafka's do."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._reports: list[tuple[Callable[..., Any], KafkaError | None, Message | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, on_delivery: Callable[..., Any] | None = None,
                headers: Iterable[tuple[str, bytes]] | None = None, **_: Any) -> None:
        error: KafkaError | None = None
        message: Message | None = None
        with self._broker._lock:
            logs = self._broker._logs.get(topic)
            if logs is None:
                error = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"no topic {topic}")
            else:
                if partition < 0:
                    partition = zlib.crc32(key) % len(logs) if key is not None else 0
                message = self._broker._append(topic, partition, key, value,
                                               list(headers) if headers else None)
        if on_delivery is not None:
            self._reports.append((on_delivery, error, message))

    def poll(self, timeout: float | None = None) -> int:
        reports, self._reports = self._reports, []
        for callback, error, message in reports:
            callback(error, message)
        return len(reports)

    def flush(self, timeout: float | None = None) -> int:
        self.poll(0)
        return 0

    def __len__(self) -> int:
        return len(self._reports)
