"""The one stage loop: a consumer group member driving a stage's strategy.

    loop = StageLoop(strategy, stage="evaluator", bootstrap=..., group=..., topics=[topic],
                     namespace=ns, reads="checkpoint event", producer=producer)
    loop.run()          # blocks until loop.stop() (from any thread or a signal handler)

Every stage runs on it: reward workers, processor, trainer, evaluator, and the serving
side's follower. In the spirit of Sentry arroyo's ``StreamProcessor`` driving its
processing strategies, the loop owns everything a stage would otherwise write again:

- the ``Consumer`` (``group_consumer``: no auto-commit, no auto offset store, earliest);
- the assignment: ``subscribe`` with assignment and revocation (logged, handed to the
  strategy; an exception inside a rebalance callback is kept and raised from ``run``,
  since confluent-kafka turns one raised there into a ``SystemError``), or a manual
  assignment (below);
- ``consume`` (up to ``batch`` records at a time, handed over one by one with ``submit``,
  then ``fetched``), and consumer errors (a missing topic is a ``ConfigurationError``, a
  fatal error a ``FatalError``, anything else is logged; the end of a partition goes to
  the strategy's ``at_end``);
- a static member fenced by a newer consumer with its ``group.instance.id``
  (``ConsumerFenced``): raised, unless the strategy has ``on_fenced``, which decides
  (raise to stop); then the loop rejoins with a new consumer;
- backpressure: a strategy that cannot take a message now raises ``MessageRejected``;
  the loop pauses its assignment, keeps the message (and the rest of its batch), keeps
  polling (the group membership stays alive) and offers it again after the strategy's
  next ``poll``; it resumes once the messages are taken;
- the dead letter of a record the strategy cannot process (``submit`` raised
  ``InvalidRecord``): built by ``topics.dead_letters.dead_letter`` (the record kept whole,
  keyed by its own key, reason ``undecodable <reads>: <error>``) and acknowledged by the
  broker before the loop goes on (``FatalError`` otherwise: nothing past it is committed);
- consumer lag (``MetricsWriter.write_lag``) after each commit and every ``LAG_EVERY_S``;
  the process's CPU time (``MetricsWriter.write_process``) every ``LAG_EVERY_S`` and once
  more at the end, for a reader too;
- ``stop()``: graceful; the strategy finishes what it holds (``join``), what is
  committable is committed, then the strategy and the consumer are closed;
- commit last: the strategy says what is committable (``committable()``: positions
  past records whose outcome is durable, by the stage's own rule); the loop commits them
  (synchronously, or asynchronously at most every ``commit_every_s``; synchronously again
  at a revocation and at the end) and tells the strategy (``committed``). The loop never
  commits a position the strategy did not hand it.

Two choices a stage makes, for the two stages whose guarantee lives in their own
durability step:

- ``strategy_commits``: the strategy commits itself, inside that step, with the consumer
  the loop gave it in ``on_start``; the loop never commits. The processor commits its input
  offsets inside each batch's Kafka transaction (``send_offsets_to_transaction`` with the
  consumer's group metadata), atomically with the units, dead letters and changelog it
  wrote: a commit after the transaction would replay the batch against a state that already
  holds it after a crash in between. The trainer commits in ``Trainer._acknowledge``, after
  the checkpoint is durable and its event acknowledged, before the proposed state becomes
  the trainer's.
- a manual assignment: a strategy with ``assignment(partitions)`` is assigned what that
  returns (partitions and where each starts) instead of subscribing. The trainer's step
  must not depend on a rebalance: data-parallel ranks own ``p % ranks`` and start at their
  checkpoint's offsets. A reader (``group=None``: the follower, whose every replica reads
  every publication) is assigned every partition from the beginning and commits nothing.

The strategy may use the consumer it got in ``on_start`` to ask (positions, watermarks,
committed offsets, group metadata), to commit (with ``strategy_commits``) and to reposition
its own partitions (``seek``, or ``assign`` again for a manual assignment: the trainer
going back to its newest checkpoint after a failed step). It never polls, subscribes or
closes it: the loop does.

Threads: ``run`` and every strategy method run on one thread (the caller of ``run``);
``stop`` may be called from any thread or a signal handler.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

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
#: How long ``stop`` lets the strategy finish what it holds (``join``).
JOIN_TIMEOUT_S = 30.0

#: A fetch waits for this many bytes, or ``FETCH_WAIT_MAX_MS``, whichever comes first: under
#: load each request carries a batch instead of the few records that arrived since the last
#: one (the broker's CPU is per request), at the cost of at most that wait per hop.
FETCH_MIN_BYTES = 64 * 1024
FETCH_WAIT_MAX_MS = 50

#: A position: (topic, partition) -> the next offset to read.
Positions = Mapping[tuple[str, int], int]


class MessageRejected(Exception):
    """Raised by ``Strategy.submit``: not now (the strategy is full). The loop pauses the
    assignment and offers the same message again after the strategy's next ``poll``."""


class ConsumerFenced(FatalError):
    """The loop's consumer was fenced as a static group member: another consumer joined
    with its ``group.instance.id`` (a consumer's only fatal error; librdkafka may also do it
    to itself after a coordinator moved, rejoining under a new member id)."""


class Strategy(Protocol):
    """What a stage gives the loop. Every method runs on the loop's thread, in this order:
    ``on_start``; ``assignment`` (manual assignment only); ``on_assign``; then, repeatedly,
    ``poll``, ``submit`` (or ``dead_lettered``) for each record of a fetch, ``fetched``,
    ``committable`` / ``committed``; ``on_revoke`` at a rebalance; ``join`` and ``close`` at
    the end. Methods marked optional may be left out."""

    def on_start(self, consumer: Consumer) -> None:
        """Optional. The loop's consumer, before any assignment (again after a rejoin); see
        the module docstring for what the strategy may do with it."""

    def assignment(self, partitions: Mapping[str, list[int]]) -> list[TopicPartition]:
        """Optional: assign manually. Given every partition of the loop's topics, the ones
        to read and where each starts."""

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        """Partitions assigned (eager protocol: the whole new assignment). Blocks the
        rebalance while it runs: restore what the partitions need here."""

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Partitions revoked or lost, after the loop committed what was ``committable`` for
        them: forget them; drop what is held for them (a dropped record is read again by
        its next owner)."""

    def submit(self, message: Message) -> None:
        """Take one record (never an error event). May block for work done synchronously.
        Raises ``MessageRejected`` for backpressure (nothing taken), or ``InvalidRecord``
        when the record cannot be processed (the loop dead-letters it, then calls
        ``dead_lettered``)."""

    def fetched(self, drained_at_ms: int | None) -> None:
        """Optional. Every record of one fetch was taken (also after a fetch of nothing).
        ``drained_at_ms``: wall-clock milliseconds from before that fetch when it emptied
        the client's queue (fewer than ``batch`` messages), so every record fetched before
        then has been submitted; None when more may be queued. A stage that works in batches
        (one transaction, one training step) does it here."""

    def dead_lettered(self, message: Message) -> None:
        """``message``'s dead letter is acknowledged: its outcome is durable, so its
        position may become committable."""

    def poll(self) -> None:
        """Called every loop iteration (about every 0.2 s when idle): do periodic work,
        collect finished work. Should not block long; may call the stage's ``stop``."""

    def committable(self) -> Positions:
        """The positions whose records' outcomes are durable by the stage's own rule (all
        records before each position). Idempotent; the loop commits each new one. Not called
        with ``strategy_commits``."""

    def committed(self, positions: Positions) -> None:
        """After the loop committed ``positions`` (a synchronous commit that succeeded, or an
        asynchronous one sent). Post-commit side effects here. A failed commit is logged and
        not reported: the positions are committed again at the next commit. Not called with
        ``strategy_commits``."""

    def on_fenced(self, fenced: ConsumerFenced) -> None:
        """Optional: the consumer was fenced as a static member. Return to rejoin the group
        with a new consumer (``on_start`` again, then a new assignment); raise to stop."""

    def join(self, timeout: float | None) -> None:
        """At a graceful stop: finish the work held, for up to ``timeout`` seconds."""

    def close(self) -> None:
        """Release what the strategy holds. Called once, also after a failure."""

    # Optional: ``at_end(topic, partition, offset)``, called when a partition was read to its
    # end (with ``enable.partition.eof``), ``offset`` being the end, in order with the records.


def group_consumer(bootstrap: str, group: str,
                   config: Mapping[str, Any] | None = None) -> Consumer:
    """The consumer of a stage's group: offsets are never committed or stored behind the
    stage's back (no auto-commit, no auto offset store: only the stage's commit-last step
    commits), a group without committed offsets starts at the beginning; ``config``
    overrides or adds settings. The loop builds its consumer here (again at a rejoin)."""
    return new_consumer(bootstrap, group, {
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        **(config or {}),
    })


class StageLoop:
    """One consumer group member running ``strategy`` until ``stop``; see the module
    docstring.

    ``group``: the consumer group; None for a reader (see the module docstring).
    ``stage``: the stage name its dead letters carry. ``reads``: what a record is, in a
    dead letter's reason (``undecodable <reads>: ...``). ``producer``: sends those dead
    letters (the stage's own; the loop only polls and flushes it); None for a strategy
    that never raises ``InvalidRecord`` (one that sends its own dead letters as outcomes).
    ``consumer_config`` overrides the loop's consumer settings. ``batch``: most messages
    taken from the client at a time. ``metrics``: where the lag goes (None: nowhere).
    ``stop_event``: the event that stops the loop [default: its own], so a stage's own
    ``stop`` works before ``run`` too. ``join_timeout``: how long a stop waits for the
    strategy's ``join``. ``commit_every_s``: commits while running at most this often (0:
    whenever something became committable), asynchronously with ``asynchronous_commits``;
    at a revocation and at the end every committable position is committed again,
    synchronously (so a failed asynchronous commit is repaired). ``strategy_commits``: the
    strategy commits itself (see the module docstring). ``logger``: the stage's own
    (assignments and dead letters are logged there). Not reusable after ``run`` returns.
    """

    def __init__(self, strategy: Strategy, *, stage: str, bootstrap: str, group: str | None,
                 topics: Sequence[str], namespace: str, reads: str, producer: Producer | None,
                 registry: SchemaRegistry | None = None,
                 consumer_config: Mapping[str, Any] | None = None, batch: int = 1,
                 metrics: Any = None, poll_timeout: float = 0.2,
                 stop_event: threading.Event | None = None,
                 join_timeout: float = JOIN_TIMEOUT_S, commit_every_s: float = 0.0,
                 asynchronous_commits: bool = False, strategy_commits: bool = False,
                 logger: logging.Logger | None = None) -> None:
        self.strategy, self.stage, self.group, self.reads = strategy, stage, group, reads
        self.topics = list(topics)
        self.bootstrap, self.producer, self.metrics = bootstrap, producer, metrics
        self.dead_letters = declarations.dead_letters(namespace)
        self.registry = registry or SchemaRegistry.default()
        self.consumer_config = dict(consumer_config or {})
        self.batch, self.poll_timeout, self.join_timeout = batch, poll_timeout, join_timeout
        self.commit_every_s, self.asynchronous_commits = commit_every_s, asynchronous_commits
        self.strategy_commits = strategy_commits
        self.log = logger or log
        self.consumer: Consumer | None = None
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
                    if not hasattr(self.strategy, "on_fenced"):
                        raise
                    self.strategy.on_fenced(fenced)
                    self.log.warning("%s: %s; rejoining with a new consumer", self.stage, fenced)
                    self._close_consumer()
                    self._join()
            self._raise_callback_error()
            self.strategy.join(self.join_timeout)
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
        """A new consumer, handed to the strategy; then subscribe, or assign manually."""
        self.consumer = consumer = group_consumer(
            self.bootstrap, self.group or f"reef-reader-{uuid.uuid4().hex}", self.consumer_config)
        self._pending, self._paused, self._committed = deque(), [], {}
        if hasattr(self.strategy, "on_start"):
            self.strategy.on_start(consumer)
        partitions = self._check_topics()
        if self.group is None or hasattr(self.strategy, "assignment"):
            assigned = (self.strategy.assignment(partitions)
                        if hasattr(self.strategy, "assignment")
                        else [TopicPartition(t, p, OFFSET_BEGINNING)
                              for t in self.topics for p in partitions[t]])
            self._on_assign(consumer, assigned)
            consumer.assign(assigned)
        else:
            consumer.subscribe(self.topics, on_assign=self._on_assign,
                               on_revoke=self._on_revoke, on_lost=self._on_revoke)

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

    def _run_once(self) -> None:
        self._raise_callback_error()
        self.strategy.poll()
        if self.producer is not None:
            self.producer.poll(0)
        if not self._pending or self._paused:
            # paused: poll on (heartbeats, rebalances), offering the held messages again soon
            before = now_ms()
            fetched = self.consumer.consume(
                self.batch, self.poll_timeout / 2 if self._paused else self.poll_timeout)
            self._raise_callback_error()
            if not self._pending:
                self._pending = deque(fetched)
                self._drained_at = before if len(fetched) < self.batch else None
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
        if not self._pending and not self._stop.is_set() and hasattr(self.strategy, "fetched"):
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
        elif hasattr(self.strategy, "at_end"):
            self.strategy.at_end(message.topic(), message.partition(), message.offset())
        return False

    def _dead_letter(self, message: Message, error: InvalidRecord) -> None:
        if self.producer is None:
            raise FatalError(f"{self.stage} cannot dead-letter {message.topic()}"
                             f"[{message.partition()}]@{message.offset()} ({error}): its stage "
                             "loop has no producer") from error
        letter = dead_letter(f"undecodable {self.reads}: {error}", type(error).__name__,
                             stage=self.stage, message=message)
        value, headers = self.registry.encode(letter)
        deliver(self.producer, self.dead_letters, message.key(), value, headers,
                f"the dead letter for {message.topic()}[{message.partition()}]@"
                f"{message.offset()}")
        self.log.warning("dead-lettered %s[%d]@%d: %s", message.topic(), message.partition(),
                         message.offset(), letter.reason)

    # ----------------------------------------------------------------- commit last

    def _commit(self, only: set[tuple[str, int]] | None = None, *, final: bool = False) -> None:
        """Commit what the strategy says is committable (``only``: of those partitions); then
        tell the strategy, write the lag. While running: positions not sent yet, at most
        every ``commit_every_s``, asynchronously with ``asynchronous_commits``; ``final``
        (a revocation, the end): every committable position, synchronously. A reader, and
        a strategy that commits itself, commit nothing here."""
        self._write_process()
        if self.group is None:
            return
        fresh: dict[tuple[str, int], int] = {}
        now = time.monotonic()
        if not self.strategy_commits and (final or now - self._commit_at >= self.commit_every_s):
            fresh = {where: offset for where, offset in self.strategy.committable().items()
                     if (final or self._committed.get(where) != offset)
                     and (only is None or where in only)}
        if fresh:
            self._commit_at = now
            asynchronous = self.asynchronous_commits and not final
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
        self._in_callback(lambda: self.strategy.on_assign(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("%s: revoked %s of %s", self.stage, _numbers(partitions),
                      _names(partitions))
        gone = {(tp.topic, tp.partition) for tp in partitions}

        def revoke() -> None:
            self._commit(only=gone, final=True)
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
