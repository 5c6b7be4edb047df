"""The one stage loop: a consumer driving a stage's strategy, which every stage runs on.

    loop = StageLoop(strategy, StageOptions(stage="evaluator", topics=(topic,), namespace=ns,
                                            reads="checkpoint event", membership=Group(group)),
                     consumers=kafka_consumers(bootstrap), producer=producer)
    loop.run()          # blocks until loop.stop() (from any thread or a signal handler)

The contract. A strategy implements ``Strategy`` (``submit``, ``poll``, ``join``, ``close``)
and declares in ``capabilities`` the small protocols it implements besides; the loop calls a
capability's methods only when it is declared, and refuses a strategy whose declaration and
methods disagree (``ConfigurationError`` when the loop is built):

- ``Rebalancing``: ``on_assign`` / ``on_revoke`` with each assignment and revocation;
- ``Committing``: the loop commits what ``committable`` says (commit last: nothing else,
  synchronously or asynchronously every ``commit_every_s``, synchronously again at a
  revocation and at the end), then calls ``committed``;
- ``CommitsItself``: the strategy commits inside its own durability step, with the consumer
  it got in ``on_start``; the loop never commits. A ``Group`` member declares exactly one of
  the two; a ``Reader`` (every partition from the beginning, no group) neither;
- ``UsesConsumer``: ``on_start(consumer)`` before any assignment (again after a rejoin), to
  ask positions, watermarks and committed offsets, or ``seek`` / ``assign`` its own
  partitions; never to poll, subscribe or close (the loop does);
- ``ManualAssignment``: assigned what ``assignment`` returns instead of subscribing;
- ``DeadLetters``: a ``submit`` that raised ``InvalidRecord`` is dead-lettered by the loop
  (the record kept whole, reason ``undecodable <reads>: <error>``), acknowledged by the
  broker, then ``dead_lettered``; without it ``InvalidRecord`` is a ``FatalError``;
- ``FetchEnd``: ``fetched`` after every record of one fetch was handed over;
- ``PartitionEnd``: ``at_end`` when a partition was read to its end (``enable.partition.eof``);
- ``Fenced``: ``on_fenced`` when a static member was fenced; returning rejoins with a new
  consumer, raising stops. Without it ``ConsumerFenced`` is raised from ``run``.

The loop guarantees: records are submitted in offset order per partition, each once per
assignment; ``MessageRejected`` pauses the assignment and offers the same record again after
the next ``poll`` (polling goes on, so the membership stays alive), resuming once it is taken;
a missing topic is a ``ConfigurationError``, a fatal consumer error a ``FatalError``; an
exception in a rebalance step is raised from ``run``; ``stop`` is graceful (``join``, the final
commit, then the consumer, strategy and producer are closed, each even if another fails). It
writes consumer lag and the process's CPU time to ``metrics``. The consumer comes from a
``ConsumerFactory``: Kafka's (``kafka_consumers``) or the in-memory broker of the contract
tests (``reef_stream.topics.memory``).

Threads: ``run`` and every strategy method run on the caller of ``run``; ``stop`` may be called
from any thread or a signal handler.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import now_ms
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer
from reef_stream.topics.dead_letters import dead_letter
from reef_stream.topics.delivery import deliver
from reef_stream.topics.kafka import (
    OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition,
)

log = logging.getLogger(__name__)

#: Seconds between two writes of the consumer lag while nothing is committed.
LAG_EVERY_S = 1.0
#: How long ``stop`` lets the strategy finish what it holds (``join``), by default.
JOIN_TIMEOUT_S = 30.0

#: A fetch waits for this many bytes, or ``FETCH_WAIT_MAX_MS``, whichever comes first: under
#: load each request carries a batch instead of the few records that arrived since the last
#: one (the broker's CPU is per request), at the cost of at most that wait per hop.
FETCH_MIN_BYTES = 64 * 1024
FETCH_WAIT_MAX_MS = 50
#: A consumer of a sparse topic (a record every second or so: checkpoints, publications)
#: overrides both: the broker answers its fetch as soon as one record arrives, and an idle one
#: asks twice a second instead of every ``FETCH_WAIT_MAX_MS`` (the broker's requests/s).
SPARSE_FETCH: Mapping[str, int] = MappingProxyType({"fetch.min.bytes": 1,
                                                    "fetch.wait.max.ms": 500})

#: A position: (topic, partition) -> the next offset to read.
Positions = Mapping[tuple[str, int], int]
#: Builds the loop's consumer (again at a rejoin): (group id, settings) -> a consumer with
#: no auto-commit and no auto offset store that starts a group without offsets at the beginning.
ConsumerFactory = Callable[[str, Mapping[str, Any]], Consumer]


class MessageRejected(Exception):
    """Raised by ``Strategy.submit``: not now (the strategy is full). The loop pauses the
    assignment and offers the same message again after the strategy's next ``poll``."""


class ConsumerFenced(FatalError):
    """The loop's consumer was fenced as a static group member: another consumer joined
    with its ``group.instance.id`` (a consumer's only fatal error; librdkafka may also do it
    to itself after a coordinator moved, rejoining under a new member id)."""


# --------------------------------------------------------------------- the protocol

class Strategy(Protocol):
    """What every stage gives the loop. All methods run on the loop's thread. Order: (the
    capabilities' start and assignment hooks), then repeatedly ``poll`` and ``submit`` for each
    record of a fetch, and at the end ``join`` (a graceful stop only) and ``close``."""

    #: The capability protocols (below) this strategy implements; the loop calls nothing else.
    capabilities: ClassVar[frozenset[type]]

    def submit(self, message: Message) -> None:
        """Take one record (never an error event), in offset order per partition. May block for
        work done synchronously. Raises ``MessageRejected`` (nothing taken: offered again after
        the next ``poll``) or ``InvalidRecord`` (see ``DeadLetters``). Not idempotent."""

    def poll(self) -> None:
        """Every loop iteration, before each fetch (about every ``poll_timeout`` when idle): do
        periodic work, collect finished work. Should not block long; may stop the loop.
        Idempotent in effect: called whether or not anything happened."""

    def join(self, timeout: float | None) -> None:
        """At a graceful stop, before the final commit: finish the work held, blocking for up to
        ``timeout`` seconds. Called at most once; not after a failure."""

    def close(self) -> None:
        """Release what the strategy holds, after the consumer was closed. Called exactly once,
        also after a failure; must not raise for a strategy that never started."""


@runtime_checkable
class Rebalancing(Protocol):
    """Told of each assignment and revocation (eager: the whole assignment each time)."""

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        """Partitions assigned, before any of their records is submitted. Blocks the
        rebalance while it runs: restore what the partitions need here."""

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Partitions revoked or lost, after the loop committed what was committable for them
        (inside ``consume`` or at the consumer's close): forget them; drop what is held for them
        (their next owner reads it again). Blocks the rebalance while it runs. Once per
        revocation, not idempotent."""


@runtime_checkable
class Committing(Protocol):
    """The loop commits for the strategy: only what ``committable`` says, never more."""

    def committable(self) -> Positions:
        """The positions whose records' outcomes are durable by the stage's own rule (all
        records before each position). Non-blocking, idempotent; the loop commits each new one."""

    def committed(self, positions: Positions) -> None:
        """After the loop committed ``positions`` (a synchronous commit that succeeded, or an
        asynchronous one sent): post-commit side effects; the same positions may come again
        (at a revocation, at the end). A failed commit is logged, not reported; its positions
        are committed again at the next commit. May block (the side effects)."""


@runtime_checkable
class UsesConsumer(Protocol):
    """Holds the loop's consumer, to ask it and to reposition its own partitions."""

    def on_start(self, consumer: Consumer) -> None:
        """The loop's consumer, first of all calls; again with a new one after a rejoin.
        The strategy never polls, subscribes or closes it. Should not block."""


@runtime_checkable
class CommitsItself(UsesConsumer, Protocol):
    """Commits its input offsets itself, inside its own durability step (a Kafka transaction,
    a checkpoint), with the consumer of ``on_start``; the loop never commits."""


@runtime_checkable
class ManualAssignment(Protocol):
    """Assigned, not subscribed: the loop assigns what ``assignment`` returns."""

    def assignment(self, partitions: Mapping[str, list[int]]) -> list[TopicPartition]:
        """Given every partition of the loop's topics, the ones to read and where each starts.
        After ``on_start``, once per consumer; may block (restoring from a checkpoint)."""


@runtime_checkable
class DeadLetters(Protocol):
    """Its ``submit`` may raise ``InvalidRecord``: the loop dead-letters the record."""

    def dead_lettered(self, message: Message) -> None:
        """``message``'s dead letter is acknowledged, in its turn among the submitted records
        (instead of a ``submit`` that took it): its outcome is durable, so its position may
        become committable. Once per letter; should not block."""


@runtime_checkable
class FetchEnd(Protocol):
    """Works in batches: told when one fetch was handed over."""

    def fetched(self, drained_at_ms: int | None) -> None:
        """Every record of one fetch was submitted (also after a fetch of nothing).
        ``drained_at_ms``: wall-clock ms from before that fetch when it emptied the client's
        queue (fewer than ``batch`` messages); None when more may be queued. May block (one
        transaction, one training step)."""


@runtime_checkable
class PartitionEnd(Protocol):
    """Told when a partition was read to its end (with ``enable.partition.eof``)."""

    def at_end(self, topic: str, partition: int, offset: int) -> None:
        """``offset`` is the end, in order with the partition's records (between two
        ``submit``); again each time the partition is read to a new end. Should not block."""


@runtime_checkable
class Fenced(Protocol):
    """Survives being fenced as a static group member."""

    def on_fenced(self, fenced: ConsumerFenced) -> None:
        """The consumer was fenced (between two iterations; no revocation comes for it).
        Return to rejoin with a new consumer (``on_start`` again, then a new assignment); raise
        to stop. Once per fencing."""


#: Every capability a strategy may declare.
CAPABILITIES = (Rebalancing, Committing, UsesConsumer, CommitsItself, ManualAssignment,
                DeadLetters, FetchEnd, PartitionEnd, Fenced)
#: Capabilities with no method of their own (declared, not recognisable by their methods).
_MARKERS = (CommitsItself,)


# --------------------------------------------------------------------- the options

@dataclass(frozen=True)
class Group:
    """A member of consumer group ``name``: subscribes (unless ``ManualAssignment``) and
    commits (``Committing`` or ``CommitsItself``)."""

    name: str


@dataclass(frozen=True)
class Reader:
    """No group: every partition of the topics from the beginning (unless
    ``ManualAssignment``); nothing is committed."""


@dataclass(frozen=True)
class StageOptions:
    """The loop's settings, validated when built (one ``ConfigurationError`` listing every
    problem).

    ``stage``: the name its dead letters carry. ``topics``: what it reads. ``namespace``: whose
    dead-letters topic. ``reads``: what a record is, in a dead letter's reason. ``membership``:
    ``Group(name)`` or ``Reader()``. ``batch``: most messages taken from the client at a time.
    ``poll_timeout``: seconds a fetch waits for its first message. ``fill_batch``: a fetch
    waits the whole ``poll_timeout`` unless ``batch`` messages arrive sooner (librdkafka's
    ``consume``), a batching interval for a stage that does one transaction per fetch (the
    processor); without it (the default) a fetch returns as soon as a message is there, with
    whatever else the client holds then. ``join_timeout``: how long a stop waits for
    ``join``. ``commit_every_s``: the loop commits at most this often while running (0:
    whenever something became committable), asynchronously with ``asynchronous_commits``.
    ``consumer_config``: overrides of the consumer's settings."""

    stage: str
    topics: tuple[str, ...]
    namespace: str
    reads: str
    membership: Group | Reader
    batch: int = 1
    poll_timeout: float = 0.2
    fill_batch: bool = False
    join_timeout: float = JOIN_TIMEOUT_S
    commit_every_s: float = 0.0
    asynchronous_commits: bool = False
    consumer_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "topics", tuple(self.topics))
        object.__setattr__(self, "consumer_config", MappingProxyType(dict(self.consumer_config)))
        problems = []
        if not self.stage:
            problems.append("stage: a name is needed")
        if not self.topics or not all(self.topics):
            problems.append(f"topics: at least one, none empty (got {self.topics})")
        if not isinstance(self.membership, Group | Reader):
            problems.append(f"membership: Group(name) or Reader(), not {self.membership!r}")
        elif isinstance(self.membership, Group) and not self.membership.name:
            problems.append("membership: a group needs a name")
        if self.batch < 1:
            problems.append(f"batch: at least 1 (got {self.batch})")
        if self.poll_timeout <= 0:
            problems.append(f"poll_timeout: positive (got {self.poll_timeout})")
        if self.join_timeout < 0:
            problems.append(f"join_timeout: not negative (got {self.join_timeout})")
        if self.commit_every_s < 0:
            problems.append(f"commit_every_s: not negative (got {self.commit_every_s})")
        if problems:
            raise ConfigurationError(problems)


def group_consumer(bootstrap: str, group: str,
                   config: Mapping[str, Any] | None = None) -> Consumer:
    """The consumer of a stage's group: offsets are never committed or stored behind the
    stage's back (no auto-commit, no auto offset store: only the stage's commit-last step
    commits), a group without committed offsets starts at the beginning; ``config``
    overrides or adds settings."""
    return new_consumer(bootstrap, group, {
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        **(config or {}),
    })


def kafka_consumers(bootstrap: str) -> ConsumerFactory:
    """The loop's consumers from the Kafka cluster at ``bootstrap`` (``group_consumer``)."""
    return lambda group, config: group_consumer(bootstrap, group, config)


def _check_declaration(strategy: Any, options: StageOptions, producer: Producer | None) -> None:
    """``ConfigurationError`` unless the strategy's declared capabilities are exactly the ones
    it implements, and fit the membership."""
    name = type(strategy).__name__
    declared = getattr(strategy, "capabilities", None)
    if not isinstance(declared, frozenset):
        raise ConfigurationError(f"{name} declares no capabilities: give it "
                                 "`capabilities = frozenset({...})` (empty for none)")
    problems = [f"{name} declares {cap!r}, which is no capability of the stage loop"
                for cap in declared if cap not in CAPABILITIES]
    for cap in CAPABILITIES:
        implements = isinstance(strategy, cap)
        if cap in declared and not implements:
            problems.append(f"{name} declares {cap.__name__} but lacks its methods")
        elif cap not in declared and implements and cap not in _MARKERS \
                and not (cap is UsesConsumer and CommitsItself in declared):
            problems.append(f"{name} has the methods of {cap.__name__} without declaring it "
                            "(they would never be called)")
    commits = {Committing, CommitsItself} & declared
    if isinstance(options.membership, Group) and len(commits) != 1:
        problems.append(f"{name}: a group member declares Committing or CommitsItself "
                        "(exactly one)")
    if isinstance(options.membership, Reader) and commits:
        named = ", ".join(sorted(c.__name__ for c in commits))
        problems.append(f"{name}: a reader commits nothing (declares {named})")
    if DeadLetters in declared and producer is None:
        problems.append(f"{name} declares DeadLetters: the loop needs a producer for them")
    if problems:
        raise ConfigurationError(problems)


# --------------------------------------------------------------------- the loop

class StageLoop:
    """One consumer running ``strategy`` until ``stop``; see the module docstring.

    ``consumers`` builds the consumer. ``producer``: the stage's own; the loop sends dead
    letters with it (``DeadLetters``), polls it every iteration and flushes it at the end.
    ``metrics``: where the lag and CPU time go (None: nowhere). ``stop_event``: the event that
    stops the loop [default: its own], so a stage's own ``stop`` works before ``run`` too.
    ``logger``: the stage's own (assignments and dead letters are logged there). Not reusable
    after ``run`` returns.
    """

    def __init__(self, strategy: Strategy, options: StageOptions, *, consumers: ConsumerFactory,
                 producer: Producer | None = None, registry: SchemaRegistry | None = None,
                 metrics: Any = None, stop_event: threading.Event | None = None,
                 logger: logging.Logger | None = None) -> None:
        _check_declaration(strategy, options, producer)
        self.strategy, self.options, self.consumers = strategy, options, consumers
        self.capabilities: frozenset[type] = frozenset(strategy.capabilities)
        self.stage, self.topics = options.stage, list(options.topics)
        self.producer, self.metrics = producer, metrics
        self.dead_letters = declarations.dead_letters(options.namespace)
        self.registry = registry or SchemaRegistry.default()
        self.log = logger or log
        self.consumer: Consumer | None = None
        #: The loop commits: a group member whose strategy is ``Committing``.
        self._commits = Committing in self.capabilities
        self._stop = stop_event or threading.Event()
        self._commit_at = 0.0
        self._callback_error: BaseException | None = None
        #: Messages of the last fetch not taken yet (the first one rejected by submit), and
        #: that fetch's ``drained_at_ms``.
        self._pending: deque[Message] = deque()
        self._drained_at: int | None = None
        self._paused: list[TopicPartition] = []
        self._committed: dict[tuple[str, int], int] = {}
        self._lag_at = 0.0
        self._cpu_at = 0.0

    # ----------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask ``run`` to finish gracefully. Idempotent, non-blocking; safe from any thread
        and from a signal handler."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Create the consumer, check the topics exist (``ConfigurationError``), join (or
        assign), and drive the strategy until ``stop``; then join, commit, close. Blocks.
        Errors of the strategy propagate (after ``close``), with nothing more committed."""
        try:
            self._join()
            while not self._stop.is_set():
                try:
                    self._run_once()
                except ConsumerFenced as fenced:
                    if Fenced not in self.capabilities:
                        raise
                    self.strategy.on_fenced(fenced)
                    self.log.warning("%s: %s; rejoining with a new consumer", self.stage, fenced)
                    self._close_consumer()
                    self._join()
            self._raise_callback_error()
            self.strategy.join(self.options.join_timeout)
            self._commit(final=True)
            self._write_process(final=True)
        finally:
            # The consumer first: leaving the group revokes, and on_revoke still needs the
            # strategy (it commits what is committable); each step even if another fails.
            for what, close in (("consumer", self._close_consumer),
                                ("strategy", self.strategy.close), ("producer", self._flush)):
                try:
                    close()
                except Exception as error:  # noqa: BLE001 - shutting down anyway
                    self.log.warning("%s: closing the %s: %s", self.stage, what, error)

    def _join(self) -> None:
        """A new consumer, handed to the strategy; then subscribe, or assign."""
        membership = self.options.membership
        group = (membership.name if isinstance(membership, Group)
                 else f"reef-reader-{uuid.uuid4().hex}")
        self.consumer = consumer = self.consumers(group, self.options.consumer_config)
        self._pending, self._paused, self._committed = deque(), [], {}
        if UsesConsumer in self.capabilities or CommitsItself in self.capabilities:
            self.strategy.on_start(consumer)
        partitions = self._check_topics()
        if ManualAssignment in self.capabilities:
            assigned = self.strategy.assignment(partitions)
        elif isinstance(membership, Reader):
            assigned = [TopicPartition(t, p, OFFSET_BEGINNING)
                        for t in self.topics for p in partitions[t]]
        else:
            consumer.subscribe(self.topics, on_assign=self._on_assign,
                               on_revoke=self._on_revoke, on_lost=self._on_revoke)
            return
        self._on_assign(consumer, assigned)
        consumer.assign(assigned)

    def _close_consumer(self) -> None:
        """Leave the group (the revocation still commits with this consumer), then forget it."""
        if self.consumer is not None:
            try:
                self.consumer.close()
            finally:
                self.consumer = None

    def _flush(self) -> None:
        if self.producer is not None:
            self.producer.flush(10)

    # ----------------------------------------------------------------- one iteration

    def _fetch(self, timeout: float) -> list[Message]:
        """Up to ``batch`` messages: with ``fill_batch``, librdkafka's ``consume``, which waits
        ``timeout`` unless the batch fills sooner; otherwise what the client holds, or, when it
        holds nothing, the first message to arrive within ``timeout`` and what came with it.
        (A stage that needs a step of messages must not wait out ``timeout`` at every fetch
        for a batch that will not fill: the trainer's device idled 0.2 s a fetch.)"""
        batch = self.options.batch
        if self.options.fill_batch or batch == 1:
            return self.consumer.consume(batch, timeout)
        fetched = self.consumer.consume(batch, 0)
        if not fetched:
            fetched = self.consumer.consume(1, timeout)
            if fetched:
                fetched += self.consumer.consume(batch - 1, 0)
        return fetched

    def _run_once(self) -> None:
        self._raise_callback_error()
        self.strategy.poll()
        if self.producer is not None:
            self.producer.poll(0)
        if not self._pending or self._paused:
            # paused: poll on (heartbeats, rebalances), offering the held messages again soon
            before = now_ms()
            timeout = self.options.poll_timeout
            fetched = self._fetch(timeout / 2 if self._paused else timeout)
            self._raise_callback_error()
            if not self._pending:
                self._pending = deque(fetched)
                self._drained_at = before if len(fetched) < self.options.batch else None
            else:  # fetched before the pause took effect: read them again after resume
                self._seek_back(fetched)
        self._take()
        self._commit()

    def _take(self) -> None:
        """Hand the pending messages over in order, until one is rejected; after the last
        one of a fetch, ``fetched``."""
        while self._pending and not self._stop.is_set():
            message = self._pending[0]
            if self._record(message):
                try:
                    self.strategy.submit(message)
                except MessageRejected:
                    if not self._paused:
                        self._paused = list(self.consumer.assignment())
                        self.consumer.pause(self._paused)
                    return
                except InvalidRecord as error:
                    self._dead_letter(message, error)
                    self.strategy.dead_lettered(message)
            self._pending.popleft()
        if self._paused:
            self.consumer.resume(self._paused)
            self._paused = []
        if not self._pending and not self._stop.is_set() and FetchEnd in self.capabilities:
            self.strategy.fetched(self._drained_at)

    def _seek_back(self, fetched: list[Message]) -> None:
        first: dict[tuple[str, int], int] = {}
        for message in fetched:
            if message.error() is None:
                first.setdefault((message.topic(), message.partition()), message.offset())
        for (topic, partition), offset in first.items():
            self.consumer.seek(TopicPartition(topic, partition, offset))

    def _record(self, message: Message) -> bool:
        """True for a record; an error event is handled here (raised, or logged)."""
        error = message.error()
        if error is None:
            return True
        if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            raise ConfigurationError(f"topic {message.topic() or self.topics} does not exist: "
                                     "run `reef topics create`")
        if error.fatal() or error.code() == KafkaError._FATAL:
            # (a consumer's only fatal error, a static member fenced by another with its
            # group.instance.id, arrives as a _FATAL event whose fatal() is False)
            raise ConsumerFenced(f"the Kafka consumer failed: {error.str()}")
        if error.code() != KafkaError._PARTITION_EOF:
            self.log.warning("%s: Kafka consumer: %s", self.stage, error.str())
        elif PartitionEnd in self.capabilities:
            self.strategy.at_end(message.topic(), message.partition(), message.offset())
        return False

    def _dead_letter(self, message: Message, error: InvalidRecord) -> None:
        if DeadLetters not in self.capabilities:
            raise FatalError(f"{self.stage} cannot dead-letter {message.topic()}"
                             f"[{message.partition()}]@{message.offset()} ({error}): its "
                             "strategy does not declare DeadLetters") from error
        letter = dead_letter(f"undecodable {self.options.reads}: {error}", type(error).__name__,
                             stage=self.stage, message=message)
        value, headers = self.registry.encode(letter)
        deliver(self.producer, self.dead_letters, message.key(), value, headers,
                f"the dead letter for {message.topic()}[{message.partition()}]@"
                f"{message.offset()}")
        self.log.warning("dead-lettered %s[%d]@%d: %s", message.topic(), message.partition(),
                         message.offset(), letter.reason)

    # ----------------------------------------------------------------- commit last

    def _commit(self, only: set[tuple[str, int]] | None = None, *, final: bool = False) -> None:
        """Commit what a ``Committing`` strategy says is committable (``only``: of those
        partitions); then tell the strategy, write the lag. While running: positions not sent
        yet, at most every ``commit_every_s``, asynchronously with ``asynchronous_commits``;
        ``final`` (a revocation, the end): every committable position, synchronously. A reader
        and a strategy that commits itself commit nothing here."""
        self._write_process()
        if isinstance(self.options.membership, Reader):
            return
        fresh: dict[tuple[str, int], int] = {}
        now = time.monotonic()
        if self._commits and (final or now - self._commit_at >= self.options.commit_every_s):
            fresh = {where: offset for where, offset in self.strategy.committable().items()
                     if (final or self._committed.get(where) != offset)
                     and (only is None or where in only)}
        if fresh:
            self._commit_at = now
            asynchronous = self.options.asynchronous_commits and not final
            try:
                self.consumer.commit(offsets=[TopicPartition(t, p, o)
                                              for (t, p), o in sorted(fresh.items())],
                                     asynchronous=asynchronous)
            except KafkaException as error:
                self.log.warning("%s: committing %s failed (committed again later, or read "
                                 "again after a restart): %s", self.stage, fresh, error)
                for where in fresh:
                    self._committed.pop(where, None)
            else:
                self._committed.update(fresh)
                self.strategy.committed(fresh)
        if self.metrics is not None and self.consumer is not None \
                and (fresh or time.monotonic() - self._lag_at >= LAG_EVERY_S):
            self._lag_at = time.monotonic()
            self.metrics.write_lag(self.consumer)

    def _write_process(self, *, final: bool = False) -> None:
        """The process's CPU time so far (``MetricsWriter.write_process``, which never raises),
        every ``LAG_EVERY_S`` (``final``: now, at the end of ``run``)."""
        if self.metrics is None or not (final or time.monotonic() - self._cpu_at >= LAG_EVERY_S):
            return
        self._cpu_at = time.monotonic()
        self.metrics.write_process()

    # ----------------------------------------------------------------- the group

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("%s: assigned %s of %s", self.stage, _numbers(partitions),
                      _names(partitions))
        self._paused = []  # a new assignment starts unpaused; a full strategy pauses it again
        if Rebalancing in self.capabilities:
            self._in_callback(lambda: self.strategy.on_assign(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("%s: revoked %s of %s", self.stage, _numbers(partitions),
                      _names(partitions))
        gone = {(tp.topic, tp.partition) for tp in partitions}

        def revoke() -> None:
            self._commit(only=gone, final=True)
            if Rebalancing in self.capabilities:
                self.strategy.on_revoke(partitions)

        self._in_callback(revoke)
        for where in gone:
            self._committed.pop(where, None)
        # what is held for them: their next owner reads it
        self._pending = deque(m for m in self._pending if (m.topic(), m.partition()) not in gone)
        self._paused = [tp for tp in self._paused if (tp.topic, tp.partition) not in gone]

    def _in_callback(self, call: Any) -> None:
        """Run a rebalance step; keep its exception for ``run`` (see the module docstring)."""
        if self._callback_error is not None:
            return
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - re-raised by run()
            self._callback_error = error
            self._stop.set()

    def _raise_callback_error(self) -> None:
        if self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            raise error

    def _check_topics(self) -> dict[str, list[int]]:
        """The partitions of each topic; ``ConfigurationError`` for a topic that is missing."""
        partitions = {}
        for topic in self.topics:
            found = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
            if found is None or found.error is not None or not found.partitions:
                raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
            partitions[topic] = sorted(found.partitions)
        return partitions


def _numbers(partitions: list[TopicPartition]) -> list[int]:
    """The partition numbers, sorted (a log line reads ``assigned [0, 1, 2] of <topic>``)."""
    return sorted({tp.partition for tp in partitions})


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(sorted({tp.topic for tp in partitions})) or "nothing"
