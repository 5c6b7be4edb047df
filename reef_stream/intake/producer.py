"""The producer SDK: send Generation and Feedback records without ever losing one.

    producer = RecordProducer()                  # REEF_BOOTSTRAP_SERVERS or the local cluster
    handle = producer.send(generation)           # validates, encodes, hands over; never blocks long
    handles = producer.send_many(generations)    # the same for a batch, at a lower cost per record
    handle.wait(10)                              # True once the broker acknowledged it
    report = producer.flush(30)                  # waits for everything outstanding
    producer.close()

Guarantees: an idempotent producer with ``acks=all``; a handle is ACKNOWLEDGED once every
in-sync replica has the record, or FAILED with an error that will not go away. While the
broker is unreachable records go to a bounded on-disk ``Spool`` (SPOOLED), replayed in order
on reconnect and by the next producer on the same directory; a full spool makes ``send``
block up to ``block_timeout`` and raise ``SpoolFull``: nothing is dropped. Invalid records
raise ``InvalidRecord`` (``send_many``: ``InvalidRecordInBatch``, and nothing of the batch is
sent). A replayed record may arrive twice; readers deduplicate. A generation and its
feedback share one key (``record_key``), so a group lands in one partition. ``guard=`` (a
``Follower``) refuses generations of a version the replica never served. Counters go to
``<ns>.metrics`` every ``metrics_every_s`` (``INTAKE_*``), through a producer that may drop
them. ``send`` may be called from any thread; handle callbacks run on the background thread.
The long form: ``docs/intake.md`` ("The producer SDK").
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from reef_stream.core import metric_names
from reef_stream.core.errors import ConfigurationError, InvalidRecord, ReefError
from reef_stream.core.events import DeadLetter, Feedback, Generation
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings, load_settings
from reef_stream.intake.spool import FsyncPolicy, Spool, SpoolFull
from reef_stream.intake.validation import (
    InvalidRecordInBatch, RecordTooLarge, check_size, validate, validate_many,
)
from reef_stream.topics import declarations, metrics
from reef_stream.topics.connect import bootstrap_servers, new_producer
from reef_stream.topics.kafka import KafkaError

__all__ = ["DeliveryState", "FlushReport", "GenerationGuard", "InvalidRecordInBatch",
           "RecordProducer", "SendHandle", "SpoolFull", "record_key"]

#: librdkafka gives up on a record after this long and hands it back; it then goes to the spool.
MESSAGE_TIMEOUT_MS = 15_000
#: How often the background thread asks an unreachable broker whether it is back.
PROBE_INTERVAL_S = 1.0
#: Spooled records replayed per round of the background thread.
REPLAY_BATCH = 2_000

log = logging.getLogger(__name__)

#: Numbers the producers of one process apart in their metrics' ``instance`` label.
_INSTANCES = itertools.count(1)

_RETRIABLE = {
    KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN, KafkaError.REQUEST_TIMED_OUT, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT,
}


class DeliveryState(enum.Enum):
    PENDING = "pending"            # in this process's memory, on its way to the broker
    SPOOLED = "spooled"            # on disk in the spool, durable on this host
    ACKNOWLEDGED = "acknowledged"  # stored by the broker (acks=all)
    FAILED = "failed"              # will never be stored; ``error`` says why


class DeliveryError(ReefError):
    """The broker refused a record for good (missing topic, authorisation, size)."""


class SendHandle:
    """What ``send`` returns: the fate of one record.

    ``state`` changes PENDING → ACKNOWLEDGED, or PENDING/SPOOLED →
    ACKNOWLEDGED, or → FAILED. ``durable`` is True once the record survives
    this process (spooled or acknowledged).
    """

    __slots__ = ("topic", "key", "state", "error", "partition", "offset", "_owner", "_listeners",
                 "_headers")

    def __init__(self, owner: "RecordProducer", topic: str, key: bytes | None,
                 headers: list[tuple[str, bytes]] | None = None):
        self.topic = topic
        self.key = key
        self.state = DeliveryState.PENDING
        self.error: Exception | None = None
        self.partition: int | None = None
        self.offset: int | None = None
        self._owner = owner
        #: Called (on the thread that changed it) after every change of state until done.
        self._listeners: list[Callable[[SendHandle], None]] | None = None
        #: The record's headers, for the spool if its delivery fails (a report does not carry them).
        self._headers = headers

    @property
    def done(self) -> bool:
        """True once ACKNOWLEDGED or FAILED."""
        return self.state in (DeliveryState.ACKNOWLEDGED, DeliveryState.FAILED)

    @property
    def durable(self) -> bool:
        return self.state in (DeliveryState.SPOOLED, DeliveryState.ACKNOWLEDGED)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout``; True if ACKNOWLEDGED. Raises the error if FAILED."""
        self._owner._wait_for(lambda: self.done, timeout)
        if self.state is DeliveryState.FAILED:
            raise self.error
        return self.state is DeliveryState.ACKNOWLEDGED

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Block until the record survives this process (spooled or acknowledged) or ``timeout``.

        True if durable. Raises the error if the record FAILED.
        """
        self._owner._wait_for(lambda: self.durable or self.done, timeout)
        if self.state is DeliveryState.FAILED:
            raise self.error
        return self.durable

    def add_done_callback(self, callback: Callable[["SendHandle"], None]) -> None:
        """Call ``callback(handle)`` once, when done (at once if it already is)."""
        def once_done(handle: SendHandle) -> None:
            if handle.done:
                callback(handle)
        self._owner.add_state_listener(self, once_done)

    def __repr__(self) -> str:
        where = f" {self.partition}@{self.offset}" if self.offset is not None else ""
        return f"<SendHandle {self.topic} {self.state.value}{where}>"


@dataclass(frozen=True)
class FlushReport:
    """What ``flush`` left outstanding: ``pending`` in memory, ``spooled`` on disk."""

    pending: int
    spooled: int
    acknowledged: int
    failed: int

    @property
    def complete(self) -> bool:
        return self.pending == 0 and self.spooled == 0


class GenerationGuard(Protocol):
    """Checks every Generation a ``RecordProducer`` is given, before it is sent."""

    def check(self, generation: Generation) -> None:
        """Raise ``InvalidRecord`` if ``generation`` must not be sent. Does not block; called
        on the thread calling ``send``."""
        ...


def record_key(event: Generation | Feedback | DeadLetter) -> bytes | None:
    """The Kafka key of an event (see the module docstring)."""
    if isinstance(event, (Generation, Feedback)):
        return (event.group_id or event.generation_id).encode()
    return event.key


class RecordProducer:
    """Sends typed intake records to their topics; see the module docstring.

    ``spool_dir`` defaults to ``$REEF_HOME/spool/<namespace>``: one spool per
    producing process; two live producers must not share one. ``guard``: checks each
    Generation before it is sent (a serving replica's ``Follower``).
    """

    def __init__(self, bootstrap: str | None = None, *, settings: Settings | None = None,
                 namespace: str | None = None, spool_dir: Path | None = None,
                 spool_max_bytes: int = 1 << 30, fsync: FsyncPolicy = "batch",
                 block_timeout: float = 30.0, config: dict | None = None,
                 registry: SchemaRegistry | None = None, guard: GenerationGuard | None = None,
                 metrics_every_s: float | None = 10.0, client: str = "sdk"):
        settings = settings or load_settings()
        bootstrap = bootstrap or bootstrap_servers(settings)
        self._guard = guard
        namespace = namespace or settings.namespace
        self.block_timeout = block_timeout
        self._registry = registry or SchemaRegistry.default()
        self._topics = {
            Generation: declarations.generations(namespace),
            Feedback: declarations.feedback(namespace),
            DeadLetter: declarations.dead_letters(namespace),
        }
        limits = {t.name: t.max_message_bytes for t in declarations.declare_topics(namespace)}
        self._limits = {topic: limits[topic] for topic in self._topics.values()}
        self._producer = new_producer(bootstrap, {
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 20,
            "compression.type": "lz4",
            "message.timeout.ms": MESSAGE_TIMEOUT_MS,
            "message.max.bytes": max(self._limits.values()) + 1024,
            "queue.buffering.max.messages": 200_000,
            "queue.buffering.max.kbytes": 512 * 1024,
            "error_cb": self._on_client_error,
            **(config or {}),
        })
        self._spool = Spool(spool_dir or settings.home / "spool" / namespace,
                            max_bytes=spool_max_bytes, fsync=fsync)
        #: Guards the counters and handle states; a plain lock, taken on every record.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0  # threads in _wait_for: notify only when someone listens
        self._in_memory = 0
        self._acknowledged = 0
        self._failed = 0
        self._replaying: set[int] = set()
        self._replay_reports: list[tuple[int, KafkaError | None, object]] = []
        #: Replayed records acknowledged in the spool but not yet counted (``_settle_replays``):
        #: ``flush`` waits for them, or its report could count fewer than were acknowledged.
        self._settling = 0
        self._replay_after = 0
        self._reachable = True
        self._last_probe = 0.0
        self._closed = False
        self._sent: Counter[str] = Counter()       # by topic
        self._rejected: Counter[str] = Counter()   # by reason
        self._metrics = None if metrics_every_s is None else _IntakeMetrics(
            bootstrap, namespace, metrics_every_s,
            {"instance": f"{socket.gethostname()}.{os.getpid()}.{next(_INSTANCES)}",
             "client": client})
        self._pump = threading.Thread(target=self._run_pump, name="reef-producer", daemon=True)
        self._pump.start()

    # ----------------------------------------------------------------- sending

    def send(self, event: Generation | Feedback | DeadLetter) -> SendHandle:
        """Validate, encode and hand over one record; return its handle.

        Raises InvalidRecord (nothing sent; also when the ``guard`` refuses a Generation),
        SpoolFull (after ``block_timeout`` seconds of backpressure; nothing sent) or
        ConfigurationError (closed).
        """
        topic = self._topic_of(event)
        try:
            validate(event)
            return self.send_raw(topic, *self._prepare(topic, event))
        except InvalidRecord as error:
            self._count(self._rejected, _rejection(error))
            raise

    def send_many(self, events: Sequence[Generation | Feedback | DeadLetter]) -> list[SendHandle]:
        """Validate, encode and hand over a batch of records, in order; return their handles.

        The whole batch is validated and encoded first (Generations' arrays
        checked together, see ``validation.validate_many``): one invalid record
        raises ``InvalidRecordInBatch`` naming its index and field, and nothing
        of the batch is sent. Then each record is handed over as ``send``
        does (to the client, or to the spool while anything is spooled).
        Raises ``SpoolFull`` after ``block_timeout`` seconds of backpressure:
        the records before it were accepted (their handles are the error's
        ``handles``), it and the rest were not. ConfigurationError when closed.
        """
        if self._closed:
            raise ConfigurationError("this RecordProducer is closed")
        if not isinstance(events, (list, tuple)):
            events = list(events)
        prepared = []
        try:
            for index, event in enumerate(events):
                self._topic_of(event, index)
            validate_many(events)
            for index, event in enumerate(events):
                topic = self._topics[type(event)]
                try:
                    prepared.append((topic, *self._prepare(topic, event)))
                except InvalidRecord as error:
                    raise InvalidRecordInBatch(index, error) from None
        except InvalidRecord as error:
            self._count(self._rejected, _rejection(error))
            raise
        return self._hand_over(prepared)

    def _topic_of(self, event, index: int | None = None) -> str:
        """The topic of ``event``'s type; InvalidRecord (or, with the ``index`` of a batch,
        InvalidRecordInBatch) for a type the intake does not take."""
        topic = self._topics.get(type(event))
        if topic is None:
            error = InvalidRecord(f"intake takes Generation, Feedback or DeadLetter records, "
                                  f"not {type(event).__name__}")
            raise error if index is None else InvalidRecordInBatch(index, error)
        return topic

    def _prepare(self, topic: str, event) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
        """The key, value and headers of a validated ``event``: guard, encode, size check.

        Raises InvalidRecord (the guard refused it, it does not fit its schema or its topic).
        """
        if self._guard is not None and isinstance(event, Generation):
            self._guard.check(event)
        value, headers = self._registry.encode(event)
        key = record_key(event)
        check_size(topic, key, value, headers, self._limits[topic])
        return key, value, headers

    def send_raw(self, topic: str, key: bytes | None, value: bytes,
                 headers: list[tuple[str, bytes]]) -> SendHandle:
        """Send bytes already encoded and validated (the import paths use ``send``)."""
        if self._closed:
            raise ConfigurationError("this RecordProducer is closed")
        handle = SendHandle(self, topic, key, headers)
        if self._reachable and self._spool.empty:
            with self._lock:
                self._in_memory += 1
                self._sent[topic] += 1
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers,
                                       on_delivery=partial(self._delivered, handle))
                return handle
            except Exception as error:  # BufferError, or a refusal: not queued either way
                with self._lock:
                    self._in_memory -= 1
                    self._sent[topic] -= 1
                if not isinstance(error, BufferError):
                    raise
            # the client's queue is full: fall through to the spool
        self._spool_new(handle, topic, key, value, headers)
        return handle

    def _hand_over(self, prepared: list[tuple[str, bytes | None, bytes, list]]) -> list[SendHandle]:
        """``send_raw`` of each prepared record, in order, taking the lock twice per batch."""
        handles: list[SendHandle] = []
        produce, delivered = self._producer.produce, self._delivered
        with self._lock:
            self._in_memory += len(prepared)  # before any report can take one off
        try:
            for topic, key, value, headers in prepared:
                if not (self._reachable and self._spool.empty):
                    break  # spooled records are not overtaken
                handle = SendHandle(self, topic, key, headers)
                try:
                    produce(topic, value=value, key=key, headers=headers,
                            on_delivery=partial(delivered, handle))
                except BufferError:
                    break  # the client's queue is full: the rest go to the spool
                handles.append(handle)
        finally:
            with self._lock:
                self._in_memory -= len(prepared) - len(handles)
                for handle in handles:
                    self._sent[handle.topic] += 1
        for topic, key, value, headers in prepared[len(handles):]:
            handle = SendHandle(self, topic, key, headers)
            try:
                self._spool_new(handle, topic, key, value, headers)
            except SpoolFull as full:
                full.handles = tuple(handles)
                raise
            handles.append(handle)
        return handles

    def _spool_new(self, handle: SendHandle, topic: str, key: bytes | None, value: bytes,
                   headers: list[tuple[str, bytes]]) -> None:
        """Spool a record that was never handed to the client; count it as sent."""
        try:
            self._spool_record(handle, topic, key, value, headers)
        except SpoolFull:
            self._count(self._rejected, "spool_full")
            raise
        self._count(self._sent, topic)

    def _count(self, counter: Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    def _spool_record(self, handle: SendHandle, topic: str, key: bytes | None, value: bytes,
                      headers, bounded: bool = True) -> None:
        # The state is set first: once appended, the record may be replayed and
        # acknowledged by the pump thread before append even returns.
        previous, handle.state = handle.state, DeliveryState.SPOOLED
        try:
            self._spool.append(topic, key, value, headers, timeout=self.block_timeout,
                               attachment=handle, bounded=bounded)
        except SpoolFull:
            handle.state = previous
            raise
        self._notify(handle)

    def _spool_is_empty(self) -> bool:
        """True while records go straight to the client (nothing spooled, broker reachable)."""
        return self._reachable and self._spool.empty

    # ----------------------------------------------------------------- delivery reports

    def _delivered(self, handle: SendHandle, error: KafkaError | None, message) -> None:
        """Delivery report of a record sent straight from memory (runs on the pump thread)."""
        if error is None:  # the common case, in one critical section
            self._reachable = True
            with self._lock:
                self._in_memory -= 1
                handle.partition, handle.offset = message.partition(), message.offset()
                handle.state = DeliveryState.ACKNOWLEDGED
                self._acknowledged += 1
                listeners, handle._listeners = handle._listeners, None
                if self._waiters:
                    self._cond.notify_all()
            for listener in listeners or ():
                listener(handle)
            return
        if error.code() in _RETRIABLE:
            self._reachable = False
            try:
                self._spool_record(handle, message.topic(), message.key(), message.value(),
                                   handle._headers or [], bounded=False)
            except SpoolFull as full:
                self._resolve(handle, DeliveryState.FAILED, full)
            with self._lock:
                self._in_memory -= 1
            return
        with self._lock:
            self._in_memory -= 1
        self._finish(handle, error, message)

    def _replayed(self, seq: int, error: KafkaError | None, message) -> None:
        """Delivery report of a record replayed from the spool; settled in ``_settle_replays``."""
        self._replaying.discard(seq)
        if error is not None and error.code() in _RETRIABLE:
            self._reachable = False
            self._replay_after = min(self._replay_after, seq - 1)
            return
        self._replay_reports.append((seq, error, message))

    def _settle_replays(self) -> None:
        """Acknowledge the replayed records reported since the last call, in one spool write."""
        reports, self._replay_reports = self._replay_reports, []
        if not reports:
            return
        with self._cond:
            self._settling += len(reports)
        try:
            self._settle(reports)
        finally:
            with self._cond:
                self._settling -= len(reports)
                self._cond.notify_all()

    def _settle(self, reports: list[tuple[int, KafkaError | None, object]]) -> None:
        """Drop ``reports``' records from the spool, then count each and settle its handle."""
        handles = self._spool.ack([seq for seq, _, _ in reports])
        for seq, error, message in reports:
            handle = handles.get(seq)
            if handle is not None:
                self._finish(handle, error, message)
                continue
            # Spooled by an earlier producer on this directory: no caller is waiting for it.
            with self._cond:
                if error is None:
                    self._acknowledged += 1
                else:
                    self._failed += 1
            if error is not None:
                log.error("a record replayed from the spool was refused for good and is dropped "
                          "from the spool: %s (key %r)", _explain(error, message.topic()), message.key())

    def _finish(self, handle: SendHandle, error: KafkaError | None, message) -> None:
        if error is None:
            handle.partition, handle.offset = message.partition(), message.offset()
            self._reachable = True
            self._resolve(handle, DeliveryState.ACKNOWLEDGED, None)
        else:
            self._resolve(handle, DeliveryState.FAILED, DeliveryError(_explain(error, handle.topic)))

    def _resolve(self, handle: SendHandle, state: DeliveryState, error: Exception | None) -> None:
        with self._cond:
            handle.state, handle.error = state, error
            if state is DeliveryState.ACKNOWLEDGED:
                self._acknowledged += 1
            else:
                self._failed += 1
        self._notify(handle)

    def _notify(self, handle: SendHandle) -> None:
        """Wake the waiters and run the listeners of ``handle`` after a change of state."""
        with self._cond:
            listeners = handle._listeners
            if handle.done:
                handle._listeners = None
            if self._waiters:
                self._cond.notify_all()
        for listener in listeners or ():
            listener(handle)

    def add_state_listener(self, handle: SendHandle, listener: Callable[[SendHandle], None]) -> None:
        """Call ``listener(handle)`` after each change of its state until it is done.

        Called at once if the handle is already done. Listeners run on the
        thread that changed the state (often the producer's own) and must be quick.
        """
        with self._cond:
            if not handle.done:
                handle._listeners = (handle._listeners or []) + [listener]
                return
        listener(handle)

    def _on_client_error(self, error: KafkaError) -> None:
        if error.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            self._reachable = False

    # ----------------------------------------------------------------- the background thread

    def _run_pump(self) -> None:
        while not self._closed:
            self._producer.poll(0.05)
            if self._metrics is not None and self._metrics.due():
                self._metrics.write(self._metric_values())
            self._settle_replays()
            if len(self._spool) and not self._reachable:
                self._probe()
            if len(self._spool) and self._reachable:
                self._replay()

    def _probe(self) -> None:
        if time.monotonic() - self._last_probe < PROBE_INTERVAL_S:
            return
        self._last_probe = time.monotonic()
        try:
            self._producer.list_topics(timeout=1.0)
            self._reachable = True
        except Exception:  # noqa: BLE001 - still unreachable
            pass

    def _replay(self) -> None:
        """Produce the next spooled records, in order, keeping at most a batch in flight."""
        if len(self._replaying) >= REPLAY_BATCH:
            return
        room = REPLAY_BATCH - len(self._replaying)
        for entry in self._spool.unacked(after=self._replay_after, limit=room):
            if entry.seq in self._replaying:
                continue
            try:
                self._producer.produce(entry.topic, value=entry.value, key=entry.key,
                                       headers=list(entry.headers),
                                       on_delivery=lambda e, m, s=entry.seq: self._replayed(s, e, m))
            except BufferError:
                break
            self._replaying.add(entry.seq)
            self._replay_after = entry.seq
            room -= 1
            if room == 0:
                break

    # ----------------------------------------------------------------- waiting and closing

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiters += 1
            try:
                while not predicate():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
            finally:
                self._waiters -= 1
        return True

    def _metric_values(self) -> dict:
        with self._cond:
            return {"sent": dict(self._sent), "rejected": dict(self._rejected),
                    "acknowledged": self._acknowledged, "failed": self._failed,
                    "spooled": len(self._spool)}

    def report(self) -> FlushReport:
        with self._cond:
            return FlushReport(pending=self._in_memory, spooled=len(self._spool),
                               acknowledged=self._acknowledged, failed=self._failed)

    def flush(self, timeout: float = 30.0) -> FlushReport:
        """Wait up to ``timeout`` seconds for every record to be acknowledged or failed.

        Returns what is still outstanding; ``report.complete`` is True when
        nothing is. Spooled records stay durable on disk either way.
        """
        self._wait_for(lambda: self._in_memory == 0 and not len(self._spool)
                       and not self._settling, timeout)
        return self.report()

    def close(self, timeout: float = 30.0) -> FlushReport:
        """Flush, then stop. What is still spooled is replayed by the next producer."""
        report = self.flush(timeout)
        self._closed = True
        self._pump.join()
        self._producer.flush(0)
        if self._metrics is not None:
            self._metrics.close(self._metric_values(), reachable=self._reachable)
        self._spool.close()
        return report

    def __enter__(self) -> "RecordProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _IntakeMetrics:
    """A ``RecordProducer``'s metrics writer: its own producer, written on the pump thread."""

    def __init__(self, bootstrap: str, namespace: str, every_s: float,
                 labels: dict[str, str]) -> None:
        self.every_s, self.dropped = every_s, 0
        self._at, self._sent_values = time.monotonic(), None
        self._producer = metrics.metrics_producer(bootstrap, self._on_dropped)
        self._writer = metrics.MetricsWriter(self._producer, namespace, metric_names.STAGE_INTAKE,
                                             labels)

    def _on_dropped(self) -> None:
        self.dropped += 1

    def due(self) -> bool:
        return time.monotonic() - self._at >= self.every_s

    def write(self, values: dict) -> None:
        """Write ``values`` (``RecordProducer._metric_values``) if they changed; never raises."""
        self._at = time.monotonic()
        try:
            if values != self._sent_values:
                writer = self._writer
                writer.write_counts(metric_names.INTAKE_SENT, values["sent"], "topic")
                writer.write_counts(metric_names.INTAKE_REJECTED, values["rejected"], "reason")
                writer.write(metric_names.INTAKE_ACKNOWLEDGED, values["acknowledged"])
                writer.write(metric_names.INTAKE_FAILED, values["failed"])
                writer.write(metric_names.INTAKE_SPOOLED, values["spooled"])
                self._sent_values = values
            self._producer.poll(0)
        except Exception as error:  # noqa: BLE001 - metrics never fail the intake
            log.warning("intake metrics not written: %s", error)

    def close(self, values: dict, *, reachable: bool) -> None:
        """The last values, a short flush while the broker answers, then what is left dropped
        (a metric never holds a closing producer back)."""
        self.write(values)
        try:
            self._producer.flush(2 if reachable else 0)
            self._producer.purge()
            self._producer.flush(0)
        except Exception as error:  # noqa: BLE001
            log.warning("intake metrics not flushed: %s", error)


def _rejection(error: InvalidRecord) -> str:
    """The ``rejected`` counter of a refused record: too large for its topic, or invalid."""
    if isinstance(error, InvalidRecordInBatch):
        error = error.error
    return "too_large" if isinstance(error, RecordTooLarge) else "invalid"


def _explain(error: KafkaError, topic: str) -> str:
    code = error.code()
    if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        return f"topic {topic} does not exist: run `reef topics create`"
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return f"this client may not write to {topic}: check its ACLs"
    if code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
        return f"the record is larger than {topic} accepts"
    return f"the broker refused the record for {topic}: {error.str()}"
