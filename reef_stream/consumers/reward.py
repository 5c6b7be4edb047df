"""Reward workers: run a recipe's reward function over generations and emit Feedback.

    worker = RewardWorker(recipe, bootstrap=..., namespace="reef", options=RewardOptions(concurrency=8))
    summary = worker.run()        # blocks until stop(), --max-records, --idle-exit or a signal
    print(summary.line())

One worker is one member of a Kafka consumer group (default ``reward-<recipe
name>``) on ``<ns>.generations``; more workers in the same group share its
partitions. For each generation the worker:

1. decodes it (``serde.decode``); an undecodable record, or one that is not a
   ``Generation``, becomes a ``DeadLetter`` with the reason at once;
2. calls the recipe's ``RewardFunction``, at most ``concurrency`` calls in
   flight. Sync functions run on worker threads, coroutine functions on the
   worker's asyncio loop. Each try has ``timeout`` seconds; a try that raises
   or times out is retried up to ``retries`` times, after ``backoff * 2**k``
   seconds (capped at ``MAX_BACKOFF_S``);
3. emits the outcome through a ``RecordProducer``: ``Feedback`` built with
   ``recipe.feedback_for`` (id ``<generation id>:<source>``, keyed like its
   generation, so co-partitioned with it) when a try returned a ``Reward``
   with a finite reward; otherwise a ``DeadLetter`` (stage ``reward``) naming
   the exception, its message and the number of tries, with the generation's
   topic, partition, offset, original bytes and headers. A failed reward is
   never recorded as a reward of 0: it gets no Feedback at all. A result that
   is not a ``Reward`` or has a non-finite reward is dead-lettered as invalid
   without a retry (calling again would give the same answer).

The worker runs on the stage loop (``reef_stream.consumers.stage``), which owns
the consumer, the group, pausing, commits and lag; the worker's strategy
(``_Rewards``) takes records and says what is committable.

Offsets, the durability order (``_done_positions``): an outcome is sent → its
``SendHandle`` is ACKNOWLEDGED by the broker → the generation's partition
offset is committed, only up to the contiguous prefix of generations whose
outcomes are acknowledged. A worker killed at any moment and restarted
re-processes at most the uncommitted tail, so a generation may get its
Feedback twice (same feedback id); the processor deduplicates feedback by
generation id and source, so that is harmless. Nothing is ever skipped. A
send that FAILED for good (e.g. the feedback topic is missing) stops the
worker with a ``FatalError``: committing past it would lose an outcome.

Rebalances: when partitions are revoked, the worker stops taking their
records, drops those not yet started (the new owner reads them again), commits
the done prefix and forgets the partitions; calls already running finish and
their outcomes are still sent (duplicates of the new owner's, harmless).

Stopping (``stop()``, SIGTERM/SIGINT in the command): no new records are
taken, running calls get up to ``grace`` seconds to finish, the producer is
flushed, done offsets are committed, then everything closes. A sync call
still running after a timeout or the grace period cannot be interrupted: its
thread is abandoned (a daemon thread) and its result ignored.

Backpressure: at most ``backlog`` generations are taken and not yet settled
(default 1024, or ``2 * concurrency`` if more): taken records wait for one
of the ``concurrency`` call slots, so a slot never waits for a fetch. When
the backlog is full the worker pauses its partitions and keeps polling, so
group heartbeats and rebalances are served while slow calls run; it resumes
them once the backlog drained to half. Pausing is kept rare on purpose: a
resumed partition's next fetch comes only after the broker's fetch wait
(~0.5 s), so pausing every few records capped a worker at ``backlog / 0.5 s``
(``bench/reward.py``). On a stop, taken records whose call has not started
are dropped at once (uncommitted: the group reads them again); only running
calls get the grace.

Metrics: the counters of ``RewardSummary`` (``REWARD_*`` in ``reef_stream.ops.metrics``,
stage ``reward``, labels ``recipe``, ``group``, ``instance`` = host.pid) and the
mean reward per feedback source go to ``<ns>.metrics`` through a plain producer
of the worker's own, from the consumer loop at most once a second when they
changed, and once at stop; they also set the process's Prometheus gauges
(``reef_stream.ops.prometheus``). Writing them never waits on the broker: a metric
that cannot be queued or delivered is dropped (``metrics_dropped``).

Threads: ``run`` owns the Kafka consumer and must be called from one thread;
an asyncio loop on a thread of its own schedules the calls; the producer's
delivery callbacks mark outcomes done. ``stop`` may be called from any thread
or a signal handler.
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import logging
import math
import numbers
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reef_stream.config import Settings, load_settings
from reef_stream.topics.connect import bootstrap_servers
from reef_stream.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.topics.dead_letters import dead_letter, headers_of
from reef_stream.topics.events import DeadLetter, Generation, MessageHeader, now_ms
from reef_stream.intake.producer import DeliveryState, RecordProducer, SendHandle
from reef_stream.ops.metrics import (
    REWARD_DROPPED, REWARD_FAILED, REWARD_INVALID, REWARD_MEAN, REWARD_RECORDS, REWARD_RETRIED,
    REWARD_REWARDED, REWARD_TIMED_OUT, REWARD_UNDECODABLE, STAGE_REWARD, MetricsWriter,
    metrics_producer,
)
from reef_stream.api.recipe import Recipe, Reward, feedback_for
from reef_stream.topics import declarations
from reef_stream.topics.kafka import Message, Producer, TopicPartition
from reef_stream.topics.serde import decode
from reef_stream.consumers.stage import MessageRejected, StageLoop

__all__ = ["RewardOptions", "RewardSummary", "RewardWorker", "default_group"]

log = logging.getLogger(__name__)

STAGE = STAGE_REWARD
#: The longest wait between two tries of one generation.
MAX_BACKOFF_S = 30.0
#: Generations taken and not yet settled at most, unless ``RewardOptions.backlog`` says.
DEFAULT_BACKLOG = 1024
#: The least ``idle_exit`` of a worker that holds no partition (a rebalance may be under way).
UNASSIGNED_IDLE_S = 30.0
#: How often done offsets are committed while running.
COMMIT_INTERVAL_S = 1.0
#: How often, at most, the counters are written as Metric events while running.
METRICS_INTERVAL_S = 1.0
#: The metric of each counter of ``RewardSummary``.
_COUNTER_METRICS = {
    "records": REWARD_RECORDS, "rewarded": REWARD_REWARDED, "failed": REWARD_FAILED,
    "invalid": REWARD_INVALID, "undecodable": REWARD_UNDECODABLE, "retried": REWARD_RETRIED,
    "timed_out": REWARD_TIMED_OUT, "dropped": REWARD_DROPPED,
}


def default_group(recipe: Recipe, namespace: str) -> str:
    """The consumer group of a recipe's reward workers unless one is given.

    Under the namespace, so two pipelines sharing a cluster never share workers.
    """
    return f"{namespace}.reward.{recipe.name}"


@dataclass(frozen=True)
class RewardOptions:
    """How a worker runs; validated by ``problems()``.

    ``retries``: extra tries after the first (0 = one try). ``backlog``: generations taken
    and not yet settled at most [default: ``DEFAULT_BACKLOG`` or ``2 * concurrency`` if more]
    (see the module docstring). ``max_records``:
    stop after taking this many records. ``idle_exit``: stop after this many
    seconds without a new record and nothing in flight.
    """

    concurrency: int = 8
    backlog: int | None = None
    timeout: float = 30.0
    retries: int = 2
    backoff: float = 0.5
    grace: float = 30.0
    group: str | None = None
    max_records: int | None = None
    idle_exit: float | None = None

    def problems(self) -> list[str]:
        found = []
        if self.concurrency < 1:
            found.append(f"concurrency must be at least 1, not {self.concurrency}")
        if self.backlog is not None and self.backlog < self.concurrency:
            found.append(f"backlog must be at least the concurrency ({self.concurrency}), "
                         f"not {self.backlog}")
        if not self.timeout > 0:
            found.append(f"timeout must be more than 0 seconds, not {self.timeout}")
        if self.retries < 0:
            found.append(f"retries must be 0 or more, not {self.retries}")
        if self.backoff < 0:
            found.append(f"backoff must be 0 or more seconds, not {self.backoff}")
        if self.grace < 0:
            found.append(f"grace must be 0 or more seconds, not {self.grace}")
        if self.max_records is not None and self.max_records < 1:
            found.append(f"max records must be at least 1, not {self.max_records}")
        if self.idle_exit is not None and not self.idle_exit > 0:
            found.append(f"idle exit must be more than 0 seconds, not {self.idle_exit}")
        return found


@dataclass
class RewardSummary:
    """The worker's counters. ``records``: generations taken; ``rewarded``: feedback sent;
    ``failed``: reward calls that failed on every try (dead-lettered); ``invalid``: results
    that were not a finite ``Reward`` (dead-lettered); ``undecodable``: records that did not
    decode as a Generation (dead-lettered); ``retried``: tries after a failed one;
    ``timed_out``: tries that timed out; ``dropped``: records dropped on a revoke or at
    stop before their outcome was sent (their offsets stay uncommitted); ``reward_sum``: the
    sum of the rewards sent as feedback (their mean is ``reward_sum / rewarded``)."""

    group: str = ""
    records: int = 0
    rewarded: int = 0
    failed: int = 0
    invalid: int = 0
    undecodable: int = 0
    retried: int = 0
    timed_out: int = 0
    dropped: int = 0
    committed: int = 0
    reward_sum: float = 0.0
    elapsed_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)

    def counters(self) -> dict[str, float]:
        """A consistent snapshot of the counters written as metrics, and ``reward_sum``."""
        with self._lock:
            return {name: getattr(self, name) for name in (*_COUNTER_METRICS, "reward_sum")}

    def line(self) -> str:
        """One line for the log: ``reward worker <group>: records=... rewarded=... ...``."""
        names = ("records", "rewarded", "failed", "invalid", "undecodable", "retried",
                 "timed_out", "dropped", "committed")
        counts = " ".join(f"{name}={getattr(self, name)}" for name in names)
        return f"reward worker {self.group}: {counts} elapsed_s={self.elapsed_s:.1f}"


@dataclass(frozen=True, slots=True)
class _Taken:
    """One consumed generation record, with the position it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[MessageHeader, ...]


class _Partition:
    """The outcomes of one assigned partition, in offset order: what may be committed."""

    def __init__(self) -> None:
        self.entries: deque[list] = deque()  # [offset, done, this partition]
        self.position: int | None = None  # the next offset to consume after the done prefix

    def take(self, offset: int) -> list:
        entry = [offset, False, self]
        self.entries.append(entry)
        return entry

    def done_prefix(self) -> int | None:
        """The next offset to consume after the contiguous done prefix (None: nothing done yet)."""
        while self.entries and self.entries[0][1]:
            self.position = self.entries.popleft()[0] + 1
        return self.position


class RewardWorker:
    """One reward worker of a consumer group; see the module docstring.

    ``spool_dir``: the producer's spool [default: the first one no live worker of the group
    holds, under ``$REEF_HOME/spool/<ns>/<group>/``]. ``consumer_config``: extra
    confluent-kafka settings. ``on_outcome(kind, event)``: called after each outcome is
    handed to the producer (kind: rewarded, failed, invalid, undecodable), on the loop's or the
    consumer's thread; it must be quick. Raises ``ConfigurationError`` for bad options or a
    recipe without a reward function.
    """

    def __init__(self, recipe: Recipe, *, bootstrap: str | None = None,
                 settings: Settings | None = None, namespace: str | None = None,
                 options: RewardOptions = RewardOptions(), spool_dir: Path | None = None,
                 consumer_config: dict | None = None,
                 on_outcome: Callable[[str, Any], None] | None = None):
        problems = options.problems()
        if recipe.reward is None:
            problems.append(f"recipe {recipe.name!r} has no reward function (Recipe(reward=...))")
        if problems:
            raise ConfigurationError(problems)
        self.recipe = recipe
        self.reward = recipe.reward
        self.options = options
        settings = settings or load_settings()
        self.namespace = namespace or settings.namespace
        self.bootstrap = bootstrap or bootstrap_servers(settings)
        self.group = options.group or default_group(recipe, self.namespace)
        self.topic = declarations.generations(self.namespace)
        self.summary = RewardSummary(group=self.group)
        self._settings = settings
        self._spool_dir = spool_dir
        self._spool_lock: int | None = None
        self._consumer_config = consumer_config or {}
        self._on_outcome = on_outcome
        self._is_async = _is_coroutine_function(self.reward)
        self._stop = threading.Event()
        #: Ends the stage loop: a stop, --idle-exit, --max-records, a fatal outcome (only a
        #: stop also drops the calls not started yet).
        self._finish = threading.Event()
        self._hurry = threading.Event()
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._in_flight = 0
        self._last_assigned = time.monotonic()
        self._fatal: Exception | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._metrics: MetricsWriter | None = None
        self._metrics_producer: Producer | None = None
        self._metrics_sent: dict[str, float] | None = None  # the counters last written
        self._metrics_at = 0.0
        #: Metric events that could not be queued or delivered (dropped).
        self.metrics_dropped = 0

    # ----------------------------------------------------------------- public

    def stop(self, *, now: bool = False) -> None:
        """Ask ``run`` to stop taking records and shut down cleanly; with ``now``, without
        waiting for running calls (their generations stay uncommitted). Safe from any thread
        and from a signal handler."""
        if now:
            self._hurry.set()
        self._stop.set()
        self._finish.set()

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called (or the worker stopped itself)."""
        return self._stop.is_set()

    def run(self) -> RewardSummary:
        """Consume, reward and emit until stopped; return the counters. Blocks.

        Raises ``FatalError`` when an outcome could not be stored for good (after
        committing what is safe) and ``ConfigurationError`` for a missing topic.
        """
        started = time.monotonic()
        producer = RecordProducer(self.bootstrap, settings=self._settings,
                                  namespace=self.namespace, spool_dir=self._claim_spool(),
                                  client="reward")
        loop = asyncio.new_event_loop()
        loop_thread = threading.Thread(target=loop.run_forever, name="reef-reward-loop",
                                       daemon=True)
        loop_thread.start()
        self._loop = loop
        self._semaphore = asyncio.run_coroutine_threadsafe(
            _make_semaphore(self.options.concurrency), loop).result()
        self._start_metrics()
        self._last_assigned = time.monotonic()  # the idle clock starts at the subscription
        try:
            StageLoop(_Rewards(self, producer, loop, loop_thread), stage=STAGE,
                      bootstrap=self.bootstrap, group=self.group, topics=[self.topic],
                      namespace=self.namespace, reads="generation", producer=None,
                      consumer_config=self._consumer_config, metrics=self._metrics,
                      poll_timeout=0.1, stop_event=self._finish, join_timeout=self.options.grace,
                      commit_every_s=COMMIT_INTERVAL_S, asynchronous_commits=True, logger=log).run()
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        if self._fatal is not None:
            raise FatalError(str(self._fatal)) from self._fatal
        return self.summary

    # ----------------------------------------------------------------- taking records

    def _take(self, message: Message, producer: RecordProducer) -> None:
        key = (message.topic(), message.partition())
        with self._lock:
            partition = self._partitions.get(key)
            if partition is None:  # revoked between the fetch and now: the new owner reads it
                return
            entry = partition.take(message.offset())
            self._in_flight += 1
        self.summary.add(records=1)
        taken = _Taken(message.topic(), message.partition(), message.offset(), message.key(),
                       message.value(), headers_of(message.headers()))
        try:
            generation = decode(taken.value, message.headers(), Generation, topic=taken.topic,
                                partition=taken.partition, offset=taken.offset)
        except InvalidRecord as error:
            self.summary.add(undecodable=1)
            self._emit(producer, self._dead_letter(taken, f"undecodable generation: {error}",
                                                   type(error).__name__), entry, "undecodable")
            return
        asyncio.run_coroutine_threadsafe(self._score(producer, taken, generation, entry),
                                         self._loop)

    # ----------------------------------------------------------------- scoring (on the loop)

    async def _score(self, producer: RecordProducer, taken: _Taken, generation: Generation,
                     entry: list) -> None:
        """Try the reward function, then emit Feedback or a DeadLetter for ``taken``."""
        async with self._semaphore:
            if self._dropped(taken, entry):
                return
            tries, timeouts, last_error = 0, 0, None
            for attempt in range(self.options.retries + 1):
                if attempt:
                    self.summary.add(retried=1)
                    await asyncio.sleep(min(self.options.backoff * 2 ** (attempt - 1),
                                            MAX_BACKOFF_S))
                    if self._dropped(taken, entry):
                        return
                tries += 1
                try:
                    result = await asyncio.wait_for(self._call(generation), self.options.timeout)
                except (asyncio.TimeoutError, TimeoutError) as error:
                    timeouts += 1
                    self.summary.add(timed_out=1)
                    last_error = error if str(error) else TimeoutError(
                        f"no result within {self.options.timeout:g} s")
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # noqa: BLE001 - the function's failure is the outcome
                    last_error = error
                    continue
                break
            else:
                self.summary.add(failed=1)
                raised = tries - timeouts
                counts = f"{timeouts} timed out, {raised} raised" if timeouts and raised else \
                    ("all timed out" if timeouts else "all raised")
                reason = (f"reward function {self.reward.source!r} failed on every one of "
                          f"{tries} tries ({counts}) for generation {generation.generation_id}; "
                          f"last error: {type(last_error).__name__}: {last_error}")
                self._emit(producer, self._dead_letter(taken, reason, type(last_error).__name__),
                           entry, "failed")
                return
        problem = _invalid_result(result)
        if problem is None:
            try:
                feedback = feedback_for(generation, result, source=self.reward.source,
                                        created_at=now_ms())
                sent = self._emit(producer, feedback, entry, "rewarded")
            except InvalidRecord as error:  # e.g. a non-finite component
                problem = str(error)
            except Exception as error:  # noqa: BLE001 - e.g. components that are not numbers
                problem = f"{type(error).__name__}: {error}"
            else:
                if sent:
                    self.summary.add(rewarded=1, reward_sum=float(result.reward))
                return
        self.summary.add(invalid=1)
        reason = (f"reward function {self.reward.source!r} returned an invalid result for "
                  f"generation {generation.generation_id} after {tries} "
                  f"{'try' if tries == 1 else 'tries'}: {problem}")
        self._emit(producer, self._dead_letter(taken, reason, "InvalidRecord"), entry, "invalid")

    async def _call(self, generation: Generation) -> Any:
        """One try: a coroutine function on this loop, a sync one on a daemon thread."""
        if self._is_async:
            return await self.reward(generation)
        future = self._loop.create_future()

        def call() -> None:
            try:
                result = self.reward(generation)
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting try
                self._loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

        threading.Thread(target=call, name="reef-reward-call", daemon=True).start()
        result = await future
        if inspect.isawaitable(result):  # a sync callable that returned an awaitable
            result = await result
        return result

    def _dropped(self, taken: _Taken, entry: list) -> bool:
        """True if ``taken``'s partition was revoked since it was taken (even if assigned again:
        the new assignment reads it again from the committed offset) or the worker is stopping
        (a call not yet started, or a retry, does not start then): leave it."""
        with self._lock:
            if self._closing or self._stop.is_set() \
                    or self._partitions.get((taken.topic, taken.partition)) is not entry[2]:
                self._in_flight -= 1
                self.summary.add(dropped=1)
                return True
        return False

    # ----------------------------------------------------------------- emitting

    def _dead_letter(self, taken: _Taken, reason: str, error_type: str) -> DeadLetter:
        return dead_letter(reason, error_type, stage=STAGE, topic=taken.topic,
                           partition=taken.partition, offset=taken.offset, key=taken.key,
                           value=taken.value, headers=taken.headers)

    def _emit(self, producer: RecordProducer, event: Any, entry: list, outcome: str) -> bool:
        """Send the outcome of a record; it counts as done once the broker acknowledged it.

        False if it was not sent (the worker is closing, or the producer could not take it).
        Raises ``InvalidRecord`` (nothing sent, the entry still open) for an invalid Feedback.
        """
        with self._lock:
            closing = self._closing
        if closing:
            self._leave(dropped=True)
            return False
        try:
            handle = producer.send(event)
        except InvalidRecord:
            raise
        except Exception as error:  # noqa: BLE001 - SpoolFull, closed: the outcome is not stored
            with self._lock:
                if self._fatal is None:
                    self._fatal = FatalError(f"an outcome could not be sent ({type(error).__name__}: "
                                             f"{error}); its offset stays uncommitted")
            self._leave(dropped=True)
            self._stop.set()
            return False
        handle.add_done_callback(lambda h: self._settled(h, entry))
        if self._on_outcome is not None:
            self._on_outcome(outcome, event)
        return True

    def _settled(self, handle: SendHandle, entry: list) -> None:
        """Delivery callback (producer thread): mark the record done, or stop the worker."""
        if handle.state is DeliveryState.ACKNOWLEDGED:
            with self._lock:
                entry[1] = True
                self._in_flight -= 1
            return
        with self._lock:
            self._in_flight -= 1
            if self._fatal is None:
                self._fatal = FatalError(f"an outcome could not be stored ({handle.error}); "
                                         "its offset stays uncommitted")
        self._stop.set()

    def _leave(self, dropped: bool) -> None:
        with self._lock:
            self._in_flight -= 1
        if dropped:
            self.summary.add(dropped=1)

    # ----------------------------------------------------------------- metrics

    def _start_metrics(self) -> None:
        """The metrics producer: a plain one of its own, apart from the outcomes' producer (whose
        spool and fatal states are for records that must not be lost; a metric may be). The
        processor's settings: ``acks=1``, one request in flight (one worker's events stay in
        order), a bounded queue; a metric that cannot be queued or delivered is dropped."""
        def dropped() -> None:
            self.metrics_dropped += 1

        self._metrics_producer = metrics_producer(self.bootstrap, dropped)
        self._metrics = MetricsWriter(self._metrics_producer, self.namespace, STAGE_REWARD, {
            "recipe": self.recipe.name, "group": self.group,
            "instance": f"{socket.gethostname()}.{os.getpid()}"})

    def _emit_metrics(self, *, final: bool = False) -> None:
        """Write the counters as Metric events if ``METRICS_INTERVAL_S`` passed and they changed
        since the last write (the first time: always; the stage loop writes the lag);
        ``final``: whether or not the interval passed, then flush for up to 5 s and close.
        Consumer thread only; never raises."""
        writer, producer = self._metrics, self._metrics_producer
        if writer is None or producer is None:
            return
        try:
            due = final or time.monotonic() - self._metrics_at >= METRICS_INTERVAL_S
            counters = self.summary.counters() if due else None
            if counters is not None and counters != self._metrics_sent:
                for attribute, name in _COUNTER_METRICS.items():
                    writer.write(name, counters[attribute])
                if counters["rewarded"]:
                    writer.write(REWARD_MEAN, counters["reward_sum"] / counters["rewarded"],
                                 source=self.reward.source)
                self._metrics_sent, self._metrics_at = counters, time.monotonic()
            producer.poll(0)
            if final:
                self.metrics_dropped += producer.flush(5)
        except Exception as error:  # noqa: BLE001 - metrics never fail the worker
            self.metrics_dropped += 1
            log.warning("metrics not written: %s", error)

    # ----------------------------------------------------------------- offsets and rebalances

    def _done_positions(self) -> dict[tuple[str, int], int]:
        """Per partition, the offset after the contiguous prefix of acknowledged outcomes: what
        the stage loop may commit (the last step of outcome sent → acknowledged → committed)."""
        with self._lock:
            positions = {key: part.done_prefix() for key, part in self._partitions.items()}
        return {key: position for key, position in positions.items() if position is not None}

    def _assigned(self, partitions: list[TopicPartition]) -> None:
        with self._lock:
            for tp in partitions:
                self._partitions.setdefault((tp.topic, tp.partition), _Partition())
            self._last_assigned = time.monotonic()

    def _revoked(self, partitions: list[TopicPartition]) -> None:
        """After the loop committed their done prefix: forget them (their calls still running
        find themselves dropped, or send duplicates of the new owner's outcomes)."""
        with self._lock:
            for tp in partitions:
                self._partitions.pop((tp.topic, tp.partition), None)

    # ----------------------------------------------------------------- start and stop

    def _claim_spool(self) -> Path:
        """A spool directory no live worker of this group uses (two producers must not share
        one); a restarted worker takes over the first free one and replays what it holds."""
        if self._spool_dir is not None:
            return self._spool_dir
        base = self._settings.home / "spool" / self.namespace / self.group
        base.mkdir(parents=True, exist_ok=True)
        for slot in range(1024):
            fd = os.open(base / f"{slot}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._spool_lock = fd
            return base / str(slot)
        raise ConfigurationError(f"1024 reward workers already use spools under {base}")

    def _drain(self, producer: RecordProducer) -> None:
        """The first half of stopping, in the durability order: running calls finish (up to
        ``grace``) → their outcomes are flushed; the stage loop then commits the done offsets."""
        deadline = time.monotonic() + self.options.grace
        while self._in_flight > 0 and time.monotonic() < deadline and self._fatal is None \
                and not self._hurry.is_set():
            time.sleep(0.01)
        with self._lock:
            self._closing = True
        producer.flush(max(5.0, deadline - time.monotonic()))

    def _close(self, producer: RecordProducer, loop: asyncio.AbstractEventLoop,
               loop_thread: threading.Thread) -> None:
        """The second half, after the loop committed and closed the consumer: the clients."""
        with self._lock:
            self._closing = True
            abandoned = self._in_flight
        if abandoned:
            log.warning("%d generations had no stored outcome at stop; their offsets stay "
                        "uncommitted and the group reads them again", abandoned)
        try:
            loop.call_soon_threadsafe(_cancel_all, loop)
            loop_thread.join(5)
            producer.close(5)
        finally:
            self._emit_metrics(final=True)
            if self._spool_lock is not None:
                os.close(self._spool_lock)


class _Rewards:
    """The reward worker's strategy on the stage loop: ``submit`` takes a generation (its
    call scheduled on the asyncio loop; an undecodable one dead-lettered as its outcome,
    through the worker's spooling producer), refusing while the backlog is full
    (``MessageRejected``: the loop pauses) until it drained to half; ``committable`` is the
    done prefix of every partition; ``join`` and ``close`` are the two halves of stopping.
    ``poll`` writes the metrics and ends the loop at ``--idle-exit``, ``--max-records``
    (both: calls already taken still finish), a ``stop`` or a fatal outcome."""

    def __init__(self, worker: RewardWorker, producer: RecordProducer,
                 loop: asyncio.AbstractEventLoop, loop_thread: threading.Thread) -> None:
        self.worker, self.producer = worker, producer
        self._loop, self._loop_thread = loop, loop_thread
        options = worker.options
        self.backlog = options.backlog or max(DEFAULT_BACKLOG, 2 * options.concurrency)
        self._full = False
        self._last_activity = time.monotonic()

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        self.worker._assigned(partitions)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self.worker._revoked(partitions)

    def submit(self, message: Message) -> None:
        # A full backlog pauses the partitions rather than the polling, so that rebalances and
        # group heartbeats go on while slow calls run; they resume at half (a resumed fetch
        # costs the broker's fetch wait, so not at every settled record).
        worker = self.worker
        in_flight = worker._in_flight
        if in_flight >= self.backlog:
            self._full = True
        elif in_flight <= self.backlog // 2:
            self._full = False
        if self._full:
            raise MessageRejected
        self._last_activity = time.monotonic()
        worker._take(message, self.producer)
        if worker.options.max_records is not None \
                and worker.summary.records >= worker.options.max_records:
            worker._finish.set()

    def dead_lettered(self, message: Message) -> None:
        """Never called: ``submit`` sends its own dead letters, as outcomes."""

    def poll(self) -> None:
        worker = self.worker
        worker._emit_metrics()
        if worker._stop.is_set() or worker._fatal is not None:
            worker._finish.set()
            return
        idle = worker.options.idle_exit
        if idle is None:
            return
        if not worker._partitions:
            # Holding no partition yet: the group may still be rebalancing to give this
            # worker its share (a member notices a rebalance at its next heartbeat).
            idle = max(idle, UNASSIGNED_IDLE_S)
        quiet_since = max(self._last_activity, worker._last_assigned)
        if worker._in_flight == 0 and time.monotonic() - quiet_since >= idle:
            log.info("no new generation for %.1f s: stopping", idle)
            worker._finish.set()

    def committable(self) -> dict[tuple[str, int], int]:
        return self.worker._done_positions()

    def committed(self, positions: Mapping[tuple[str, int], int]) -> None:
        self.worker.summary.add(committed=len(positions))

    def join(self, timeout: float | None) -> None:
        self.worker._drain(self.producer)

    def close(self) -> None:
        self.worker._close(self.producer, self._loop, self._loop_thread)


async def _make_semaphore(size: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(size)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the try timed out meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)


def _is_coroutine_function(function: Any) -> bool:
    if inspect.iscoroutinefunction(function):
        return True
    inner = getattr(function, "function", None)  # NamedReward
    return inner is not None and inspect.iscoroutinefunction(inner)


def _invalid_result(result: Any) -> str | None:
    """Why ``result`` is not a usable reward, or None."""
    if not isinstance(result, Reward):
        return f"expected a reef_stream.api.recipe.Reward, got {type(result).__name__}"
    value = result.reward
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return f"reward must be a number, not {type(value).__name__}"
    if not math.isfinite(value):
        return f"reward is {value}; rewards must be finite"
    return None


if __name__ == "__main__":
    from reef_stream.cli.reward import main

    main()
