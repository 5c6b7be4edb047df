"""Reward workers: run a recipe's reward function over generations and emit Feedback.

    worker = RewardWorker(recipe, bootstrap=..., namespace="reef", options=RewardOptions(concurrency=8))
    summary = worker.run()        # blocks until stop(), --max-records, --idle-exit or a signal
    print(summary.line())

One worker is one member of a consumer group (default ``reward-<recipe name>``) on
``<ns>.generations``, running on the stage loop (``reef_stream.consumers.stage``; its strategy
is ``_Rewards``). Each generation is decoded, scored by the ``RewardFunction`` in one of
``concurrency`` call slots (``reef_stream.consumers.reward.calls``: each try has ``timeout``
seconds, ``retries`` retries after ``backoff * 2**k`` capped at ``MAX_BACKOFF_S``; a fast try
past ``ADAPT_FACTOR`` x the observed p99 moves to the slow lane; ``sandbox="process"`` runs
each try in a ``reef_stream.consumers.reward.sandbox`` process), and gets exactly one outcome:
``Feedback`` (id ``<generation id>:<source>``, keyed like its generation) for a finite
``Reward``, else a ``DeadLetter`` (stage ``reward``) naming the cause. A failed reward is
never recorded as 0.

Durability order (``_done_positions``): outcome sent -> acknowledged by the broker -> offset
committed, up to the contiguous acknowledged prefix. A restarted worker redoes at most the
uncommitted tail (duplicate feedback ids, which the processor drops); a send that FAILED for
good raises ``FatalError``. At most ``backlog`` generations are held (``DEFAULT_BACKLOG``);
a full backlog waits ``ROOM_WAIT_S`` before pausing partitions. ``run`` is called from one
thread; ``stop`` from any thread or a signal handler. The long form: ``docs/stages.md``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import numbers
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from reef_stream.api.recipe import Recipe, Reward, feedback_for
from reef_stream.consumers.reward.calls import (
    FAST, SLOW, CallSlots, RewardOptions, Work, cancel_all, is_coroutine_function,
)
from reef_stream.consumers.reward.sandbox.categories import SandboxFailure
from reef_stream.consumers.reward.sandbox.pool import SandboxPool
from reef_stream.consumers.stage import (
    Committing, FetchEnd, Group, MessageRejected, Rebalancing, StageLoop, StageOptions,
    kafka_consumers,
)
from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import DeadLetter, Generation, now_ms
from reef_stream.core.metric_names import (
    REWARD_DROPPED, REWARD_FAILED, REWARD_INVALID, REWARD_MEAN, REWARD_RECORDS, REWARD_RETRIED,
    REWARD_REWARDED, REWARD_TIMED_OUT, REWARD_UNDECODABLE, STAGE_REWARD,
)
from reef_stream.core.serde import decode
from reef_stream.core.settings import Settings, load_settings
from reef_stream.intake.producer import DeliveryState, RecordProducer, SendHandle
from reef_stream.topics import declarations
from reef_stream.topics.connect import bootstrap_servers
from reef_stream.topics.dead_letters import dead_letter
from reef_stream.topics.kafka import Message, TopicPartition
from reef_stream.topics.metrics import MetricsWriter, PeriodicMetrics

__all__ = ["RewardOptions", "RewardSummary", "RewardWorker", "default_group"]

log = logging.getLogger(__name__)

STAGE = STAGE_REWARD
#: Generations taken and not yet settled at most, unless ``RewardOptions.backlog`` says.
DEFAULT_BACKLOG = 1024
#: The least ``idle_exit`` of a worker that holds no partition (a rebalance may be under way).
UNASSIGNED_IDLE_S = 30.0
#: How often done offsets are committed while running.
COMMIT_INTERVAL_S = 1.0
#: Most records the stage loop takes from the client at a time.
CONSUME_BATCH = 256
#: Idle runners are woken after each fetch, and after this many records of a long one.
WAKE_EVERY = 64
#: How long a full backlog waits for room (half of it) before the partitions are paused.
ROOM_WAIT_S = 0.5
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


class RewardWorker(CallSlots):
    """One reward worker of a consumer group; see the module docstring.

    ``spool_dir``: the producer's spool [default: the first one no live worker of the group
    holds, under ``$REEF_HOME/spool/<ns>/<group>/``]. ``consumer_config``: extra
    confluent-kafka settings. ``on_outcome(kind, event)``: called after each outcome is
    handed to the producer (kind: rewarded, failed, invalid, undecodable), on the thread that
    sent it (a call thread, the asyncio loop's or the consumer's); it must be quick, and an
    exception it raises is logged and ignored. Raises ``ConfigurationError`` for bad options or a
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
        if getattr(recipe, "reward_sandbox", "thread") == "process" \
                and options.sandbox != "process":
            problems.append(f"recipe {recipe.name!r} requires its reward function to run in a "
                            "sandbox process (reward_sandbox='process'): use --sandbox process")
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
        pool = None if options.sandbox != "process" else SandboxPool(
            options.sandbox_target, overrides=options.sandbox_overrides,
            limits=options.sandbox_limits, size=options.pool_size())
        self._is_async = pool is None and is_coroutine_function(self.reward)
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
        self._loop_thread: threading.Thread | None = None
        self._producer: RecordProducer | None = None
        #: Taken generations whose call has not started, in order; the runners take from it.
        self._queue: deque[Work] = deque()
        self._unwoken = 0  # records queued since the last _wake (consumer thread)
        self._idle = 0  # runners waiting for work
        self._ready = threading.Condition()  # sync runners wait here
        self._work_ready: asyncio.Event | None = None  # async runners wait here
        self._tasks: list[asyncio.Task] = []  # the async runners (the loop keeps weak refs)
        self._slots: set = set()  # the sync runners' tries, for the watchdog
        self._watch_stop = threading.Event()
        self._metrics: PeriodicMetrics | None = None
        self._init_calls(pool)

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
        self._loop, self._loop_thread, self._producer = loop, loop_thread, producer
        if self._pool is not None:
            self._pool.start()
        self._start_runners()
        self._start_metrics()
        self._last_assigned = time.monotonic()  # the idle clock starts at the subscription
        try:
            StageLoop(_Rewards(self, producer), StageOptions(
                stage=STAGE, topics=(self.topic,), namespace=self.namespace, reads="generation",
                membership=Group(self.group), batch=CONSUME_BATCH, poll_timeout=0.1,
                fill_batch=True, join_timeout=self.options.grace, commit_every_s=COMMIT_INTERVAL_S,
                asynchronous_commits=True, consumer_config=self._consumer_config),
                consumers=kafka_consumers(self.bootstrap), producer=None,
                metrics=self._metrics.writer, stop_event=self._finish, logger=log).run()
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        if self._fatal is not None:
            raise FatalError(str(self._fatal)) from self._fatal
        return self.summary

    def _start_runners(self) -> None:
        """``concurrency`` call slots: tasks on the asyncio loop for a coroutine function;
        threads and their watchdog for a sync one. Each takes one queued generation at a time."""
        count = self.options.concurrency
        if self._is_async:
            async def start() -> None:
                self._work_ready = asyncio.Event()
                loop = asyncio.get_running_loop()
                self._tasks = [loop.create_task(self._arunner()) for _ in range(count)]

            asyncio.run_coroutine_threadsafe(start(), self._loop).result()
        else:
            for lane, slots in ((FAST, count), (SLOW, self._slow_lanes)):
                for _ in range(slots):
                    self._start_runner(None, lane)
            threading.Thread(target=self._watch, name="reef-reward-watchdog",
                             daemon=True).start()
        threading.Thread(target=self._timers, name="reef-reward-timers", daemon=True).start()

    # ----------------------------------------------------------------- taking records

    def _take(self, message: Message, *, probe: bool = False) -> None:
        """Consumer thread: decode one record and queue it for a call slot (``_wake`` tells
        the idle runners, once per fetch), or dead-letter it at once if it is undecodable."""
        where = (message.topic(), message.partition())
        offset = message.offset()
        until = self.options.until
        if until is not None and offset >= until.get(where[1], 0):
            return
        with self._lock:
            partition = self._partitions.get(where)
            if partition is None:  # revoked between the fetch and now: the new owner reads it
                return
            entry = partition.take(offset)
            self._in_flight += 1
        self.summary.add(records=1)
        try:
            generation = decode(message.value(), message.headers(), Generation,
                                topic=where[0], partition=where[1], offset=offset)
        except InvalidRecord as error:
            self.summary.add(undecodable=1)
            self._emit(self._dead_letter(message, f"undecodable generation: {error}",
                                         type(error).__name__), entry, "undecodable")
            return
        work = Work(message, where, generation, entry)
        work.probe = probe
        self._queue.append(work)
        self._unwoken += 1
        if self._unwoken >= WAKE_EVERY:
            self._wake()

    def _wake(self) -> None:
        """Consumer thread: wake idle runners for the records queued since the last wake, if any.

        ``_idle`` is read without a lock: a runner counts itself idle before it looks at the
        queue a last time and sleeps, so one that this read misses sees the new records."""
        if not self._unwoken:
            return
        self._unwoken = 0
        if not self._idle:
            return
        if self._is_async:
            self._loop.call_soon_threadsafe(self._work_ready.set)
        else:
            with self._ready:
                self._ready.notify(len(self._queue))

    def _wait_for_room(self, target: int, timeout: float) -> bool:
        """Consumer thread: wait up to ``timeout`` seconds (less at a stop) until no more than
        ``target`` records are in flight; True if so."""
        deadline = time.monotonic() + timeout
        while self._in_flight > target and time.monotonic() < deadline \
                and not self._stop.wait(0.005):
            pass
        return self._in_flight <= target

    def _drop_queued(self) -> None:
        """At a stop: drop the queued records at once, the retries waiting out their backoff and
        those the circuit holds (uncommitted: the group reads them again)."""
        with self._timer_ready:
            dropped = len(self._delayed)
            self._delayed.clear()
        for queue in (self._queue, self._slow_queue, self._held_works):
            with suppress(IndexError):
                while True:  # popleft: a call slot may take one meanwhile
                    queue.popleft()
                    dropped += 1
        if dropped:
            with self._lock:
                self._in_flight -= dropped
            self.summary.add(dropped=dropped)

    # ----------------------------------------------------------------- outcomes

    def _broken(self, error: Exception) -> None:
        """A call slot failed outside the reward function (the outcome could not be built or
        sent): that generation has no outcome, so nothing past it may be committed: stop."""
        log.error("a generation's outcome could not be emitted", exc_info=error)
        with self._lock:
            if self._fatal is None:
                self._fatal = FatalError(f"a generation's outcome could not be emitted "
                                         f"({type(error).__name__}: {error}); its offset stays "
                                         "uncommitted")
        self._stop.set()

    def _succeeded(self, work: Work, result: Any) -> None:
        """Emit the Feedback of a try that returned, or the dead letter of an invalid result."""
        problem = _invalid_result(result)
        if problem is None:
            try:
                feedback = feedback_for(work.generation, result, source=self.reward.source,
                                        created_at=now_ms())
                sent = self._emit(feedback, work.entry, "rewarded")
            except InvalidRecord as error:  # e.g. a non-finite component
                problem = str(error)
            except Exception as error:  # noqa: BLE001 - e.g. components that are not numbers
                problem = f"{type(error).__name__}: {error}"
            else:
                if sent:
                    self.summary.add(rewarded=1, reward_sum=float(result.reward))
                return
        self.summary.add(invalid=1)
        tries = work.tries
        reason = (f"reward function {self.reward.source!r} returned an invalid result for "
                  f"generation {work.generation.generation_id} after {tries} "
                  f"{'try' if tries == 1 else 'tries'}: {problem}")
        self._emit(self._dead_letter(work.message, reason, "InvalidRecord"), work.entry, "invalid")

    def _failed(self, work: Work) -> None:
        """Emit the dead letter of a generation whose every try raised or timed out, or that
        ended in a sandbox failure (``error_type`` ``sandbox.<category>``)."""
        self.summary.add(failed=1)
        tries, timeouts, last_error = work.tries, work.timeouts, work.error
        error_type = getattr(last_error, "error_type", type(last_error).__name__)
        if isinstance(last_error, SandboxFailure):
            reason = (f"reward function {self.reward.source!r} ended without a reward in the "
                      f"sandbox for generation {work.generation.generation_id} after {tries} "
                      f"{'try' if tries == 1 else 'tries'}: {last_error} (category "
                      f"{last_error.category})")
            self._emit(self._dead_letter(work.message, reason, error_type), work.entry, "failed")
            return
        raised = tries - timeouts
        counts = f"{timeouts} timed out, {raised} raised" if timeouts and raised else \
            ("all timed out" if timeouts else "all raised")
        repeated = ("; it failed the same way as the try before, so it was not tried again"
                    if work.repeated else "")
        reason = (f"reward function {self.reward.source!r} failed on every one of "
                  f"{tries} tries ({counts}) for generation {work.generation.generation_id}; "
                  f"last error: {error_type}: {last_error}{repeated}")
        self._emit(self._dead_letter(work.message, reason, error_type), work.entry, "failed")

    def _dropped(self, work: Work) -> bool:
        """True if ``work``'s partition was revoked since it was taken (even if assigned again:
        the new assignment reads it again from the committed offset) or the worker is stopping
        (a call not yet started, or a retry, does not start then): leave it."""
        with self._lock:
            if self._closing or self._stop.is_set() \
                    or self._partitions.get(work.where) is not work.entry[2]:
                self._in_flight -= 1
                self.summary.add(dropped=1)
                return True
        return False

    # ----------------------------------------------------------------- emitting

    def _dead_letter(self, message: Message, reason: str, error_type: str) -> DeadLetter:
        """The record kept whole (key, value, headers) with where it came from."""
        return dead_letter(reason, error_type, stage=STAGE, message=message)

    def _emit(self, event: Any, entry: list, outcome: str) -> bool:
        """Send the outcome of a record; it counts as done once the broker acknowledged it.

        False if it was not sent (the worker is closing, or the producer could not take it).
        Raises ``InvalidRecord`` (nothing sent, the entry still open) for an invalid Feedback.
        """
        if self._closing:
            self._leave(dropped=True)
            return False
        try:
            handle = self._producer.send(event)
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
        handle.add_done_callback(partial(self._settled, entry))
        if self._on_outcome is not None:
            try:
                self._on_outcome(outcome, event)
            except Exception as error:  # noqa: BLE001 - an observer; the outcome is sent
                log.warning("on_outcome(%r) raised %s: %s", outcome, type(error).__name__, error)
        return True

    def _settled(self, entry: list, handle: SendHandle) -> None:
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
        spool and fatal states are for records that must not be lost; a metric may be); see
        ``PeriodicMetrics``."""
        self._metrics = PeriodicMetrics(self.bootstrap, self.namespace, STAGE_REWARD, {
            "recipe": self.recipe.name, "group": self.group,
            "instance": f"{socket.gethostname()}.{os.getpid()}"}, every_s=METRICS_INTERVAL_S)

    @property
    def metrics_dropped(self) -> int:
        """Metric events the client refused or the broker did not take."""
        return self._metrics.dropped if self._metrics is not None else 0

    def _emit_metrics(self, *, final: bool = False) -> None:
        """Write the counters as Metric events if ``METRICS_INTERVAL_S`` passed and they changed
        since the last write (the stage loop writes the lag); ``final``: whether or not the
        interval passed, then flush for up to 5 s. Consumer thread only; never raises."""
        if self._metrics is None:
            return
        def write(writer: MetricsWriter, state: tuple) -> None:
            counters = state[0]
            self._write_call_metrics(writer)
            for attribute, name in _COUNTER_METRICS.items():
                writer.write(name, counters[attribute])
            if counters["rewarded"]:
                writer.write(REWARD_MEAN, counters["reward_sum"] / counters["rewarded"],
                             source=self.reward.source)

        circuit = self.circuit
        self._metrics.emit(lambda: (self.summary.counters(), self._saturated_slots(),
                                    len(self._slow_queue) + self._demoted, self._abandoned,
                                    len(self._held_works),
                                    circuit and (circuit.is_open, circuit.openings)),
                           write, final=final)

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
        """The first half of stopping, in the durability order: at a stop the queued records
        are dropped, running calls finish (up to ``grace``; without a stop, at --max-records or
        --idle-exit, the queued ones too) → their outcomes are flushed; the stage loop then
        commits the done offsets."""
        if self._stop.is_set():
            self._drop_queued()
        else:
            self._wake()
        deadline = time.monotonic() + self.options.grace
        while self._in_flight > 0 and time.monotonic() < deadline and self._fatal is None \
                and not self._hurry.is_set():
            time.sleep(0.01)
        with self._lock:
            self._closing = True
        producer.flush(max(5.0, deadline - time.monotonic()))

    def _close(self, producer: RecordProducer) -> None:
        """The second half, after the loop committed and closed the consumer: the clients."""
        with self._lock:
            self._closing = True
            abandoned = self._in_flight
        with self._ready:  # the call threads and the watchdog end
            self._ready.notify_all()
        with self._slow_ready:
            self._slow_ready.notify_all()
        with self._timer_ready:
            self._timer_ready.notify_all()
        with self._abandoned_room:
            self._abandoned_room.notify_all()
        self._watch_stop.set()
        if abandoned:
            log.warning("%d generations had no stored outcome at stop; their offsets stay "
                        "uncommitted and the group reads them again", abandoned)
        try:
            self._loop.call_soon_threadsafe(cancel_all, self._loop)
            self._loop_thread.join(5)
            producer.close(5)
        finally:
            if self._pool is not None:
                self._pool.close()
            self._emit_metrics(final=True)
            if self._spool_lock is not None:
                os.close(self._spool_lock)


class _Rewards:
    """The reward worker's strategy on the stage loop: ``submit`` takes a generation (queued
    for a call slot; an undecodable one dead-lettered as its outcome, through the worker's
    spooling producer), refusing while the backlog is full (``MessageRejected``: the loop
    pauses; see ``submit``) until it drained to half; ``fetched`` wakes the call slots;
    ``committable`` is the done prefix of every partition; ``join`` and ``close`` are the two
    halves of stopping. ``poll`` writes the metrics and ends the loop at ``--idle-exit``,
    ``--max-records`` (both: calls already taken still finish), a ``stop`` or a fatal
    outcome."""

    capabilities = frozenset({Rebalancing, Committing, FetchEnd})

    def __init__(self, worker: RewardWorker, producer: RecordProducer) -> None:
        self.worker, self.producer = worker, producer
        options = worker.options
        self.backlog = options.backlog or max(DEFAULT_BACKLOG, 2 * options.concurrency)
        self._full = False
        self._last_activity = time.monotonic()

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        self.worker._assigned(partitions)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self.worker._revoked(partitions)

    def submit(self, message: Message) -> None:
        # A full backlog waits up to ROOM_WAIT_S for room, then pauses the partitions (not the
        # polling: rebalances and heartbeats go on while slow calls run) until it is half full.
        worker = self.worker
        in_flight, half = worker._in_flight, self.backlog // 2
        if self._full:
            self._full = in_flight > half
        elif in_flight >= self.backlog:
            worker._wake()
            self._full = not worker._wait_for_room(half, ROOM_WAIT_S)
        probe = False
        if worker.circuit is not None and worker.circuit.is_open:
            if not worker.admit_probe:
                raise MessageRejected  # open: no new generation but a probe until one succeeds
            worker.admit_probe, probe = False, True
        elif self._full:
            raise MessageRejected
        self._last_activity = time.monotonic()
        worker._take(message, probe=probe)
        if worker.options.max_records is not None \
                and worker.summary.records >= worker.options.max_records:
            worker._finish.set()

    def fetched(self, drained_at_ms: int | None) -> None:
        """The runners are woken once per fetch, not once per record."""
        self.worker._wake()

    def poll(self) -> None:
        worker = self.worker
        worker._wake()
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
        self.worker._close(self.producer)


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
