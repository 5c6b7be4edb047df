"""The reward worker's call slots: where a recipe's reward function is called.

``RewardWorker`` (``reef_stream.consumers.reward.worker``) queues each taken generation as a ``Work``;
``concurrency`` call slots take them one at a time until each is settled (its Feedback or its
dead letter) or dropped:

- a sync reward function: call threads (``CallSlots._runner``), and a watchdog thread
  (``_watch``) that abandons a try running past ``timeout`` (its thread finishes alone, its
  result ignored) and starts a new call thread that goes on with the generation;
- a coroutine function (``is_coroutine_function``): tasks on the worker's asyncio loop
  (``_arunner``), each try under ``asyncio.timeout``.

Lanes (sync and sandboxed calls): ``concurrency`` fast slots take the queued generations;
``slow_lanes()`` slow slots take only generations whose try timed out (a timed-out try is
never tried again in the fast lane; with the slow lane's queue full it is dead-lettered at
once). Once ``ADAPT_MIN_SAMPLES`` tries returned, a fast try is watched against their p99:

1. past the p99 it is *overtime*: while fewer than ``slow_lanes()`` tries are, a new thread
   takes its place in the fast lane at once, and the overtime try goes on (a healthy call
   that is merely slow still returns; its thread ends after it);
2. past ``ADAPT_FACTOR`` times the p99 (at least ``fast_lane_floor``) it is demoted: it goes
   on, counted in the slow lane, and (unless an overtime thread already did) a new thread
   takes its place in the fast lane. With the slow lane full, the demoted try that has run
   the longest, past ``EVICT_FACTOR`` times the p99, times out to make room (it is far
   likelier to hang); with none that old, the new one times out there and then.

So a hanging call holds a fast slot for about the p99 of a healthy one, not for
``timeout`` x tries. A sandboxed try is killed (``Ticket.kill``), which frees its sandbox
worker at once. ``_write_call_metrics``: saturation (slots busy past the p99), call
latency, the slow lane and the sandbox pool.

``CallSlots`` is a mixin of ``RewardWorker``: it uses the worker's queue, lock and conditions
(``_queue``, ``_lock``, ``_ready``, ``_work_ready``, ``_idle``, ``_slots``, ``_closing``,
``_stop``, ``_watch_stop``, ``_loop``), its ``options``, ``summary`` and ``reward``, and
settles work through its ``_succeeded``, ``_failed``, ``_dropped`` and ``_broken``.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from reef_stream.api.rewards import is_transient
from reef_stream.consumers.reward.circuit import CLOSED, OPEN, Circuit
from reef_stream.consumers.reward.sandbox.categories import (
    CATEGORIES, TIMEOUT, Limits, SandboxFailure,
)
from reef_stream.consumers.reward.sandbox.latency import LatencyWindow
from reef_stream.consumers.reward.sandbox.pool import Ticket
from reef_stream.core.events import Generation
from reef_stream.core.metric_names import (
    REWARD_ABANDONED, REWARD_CALL_P50, REWARD_CALL_P99, REWARD_CIRCUIT_OPEN,
    REWARD_CIRCUIT_OPENINGS, REWARD_HELD, REWARD_SATURATED_SLOTS, REWARD_SATURATION,
    REWARD_SLOW_LANE,
    SANDBOX_CALL_P50, SANDBOX_CALL_P99, SANDBOX_COLD_STARTS, SANDBOX_FAILURES, SANDBOX_LIVE,
    SANDBOX_NETWORK_ISOLATED, SANDBOX_POOL_SIZE, SANDBOX_RESTARTS, SANDBOX_START_P50,
    SANDBOX_START_P99, SANDBOX_WARM_STARTS,
)
from reef_stream.topics.kafka import Message

__all__ = ["FAST", "MAX_BACKOFF_S", "SLOW", "CallSlots", "RewardOptions", "Slot", "Work", "backoff_seconds", "cancel_all",
           "is_coroutine_function"]

log = logging.getLogger(__name__)

#: The longest wait between two tries of one generation.
MAX_BACKOFF_S = 30.0
FAST, SLOW = "fast", "slow"
#: A fast-lane try leaves the fast lane after this many times the observed p99 ...
ADAPT_FACTOR = 1.5
#: ... but never before this many seconds (``RewardOptions.fast_lane_floor``), and only once
#: this many calls succeeded.
ADAPT_FLOOR_S = 0.1
ADAPT_MIN_SAMPLES = 32
#: With the slow lane full, a fast try at its adaptive deadline takes the place of the demoted
#: try that has run the longest, when that one ran past this many times the observed p99.
EVICT_FACTOR = 10
#: How often the p99 of the adaptive deadline is computed again.
P99_EVERY_S = 0.5
#: Generations waiting for the slow lane at most, per slow-lane slot; beyond, a timed-out
#: generation is dead-lettered at once.
SLOW_QUEUE_PER_SLOT = 8
#: The watchdog looks at the slots at least this often.
WATCH_EVERY_S = 0.05
#: The timer thread (delayed retries, the circuit's probes) looks at least this often.
TIMER_IDLE_S = 0.5
#: In-thread tries that timed out and whose threads still run, at most (``abandoned_limit``).
#: A sleeping thread costs about 16 KiB of memory (measured: 4,000 threads, 62 MiB).
ABANDONED_LIMIT = 4096
#: The sandbox pool's ``stats()`` keys, as metrics.
SANDBOX_STATS = {"size": SANDBOX_POOL_SIZE, "live": SANDBOX_LIVE, "warm_starts": SANDBOX_WARM_STARTS,
                 "cold_starts": SANDBOX_COLD_STARTS, "restarts": SANDBOX_RESTARTS,
                 "start_p50": SANDBOX_START_P50, "start_p99": SANDBOX_START_P99,
                 "call_p50": SANDBOX_CALL_P50, "call_p99": SANDBOX_CALL_P99,
                 "network_isolated": SANDBOX_NETWORK_ISOLATED}


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
    #: Per partition of the generations topic, the offset to stop before (``reef rescore``):
    #: a record at or past it is never taken, so never scored and never committed past.
    until: Mapping[int, int] | None = None
    #: "thread" (calls in the worker) or "process" (``reef_stream.consumers.reward.sandbox``: ``sandbox_target``,
    #: a ``module:attribute`` a fresh Python imports, with ``sandbox_overrides``, is called in a
    #: ``SandboxPool`` of ``sandbox_size`` workers [default: every lane's slots + 2] under
    #: ``sandbox_limits``).
    sandbox: str = "thread"
    sandbox_target: str | None = None
    sandbox_overrides: tuple[str, ...] = ()
    sandbox_limits: Limits = Limits()
    sandbox_size: int | None = None
    #: Slots of the slow lane (tries again after a timeout, calls past the fast lane's
    #: deadline) [default: a quarter of ``concurrency``, at least 1]; 0: none. ``adaptive``:
    #: the fast lane's deadline follows the observed latency (see the module docstring), never
    #: shorter than ``fast_lane_floor`` seconds.
    slow_concurrency: int | None = None
    adaptive: bool = True
    fast_lane_floor: float = ADAPT_FLOOR_S
    #: In-thread tries that timed out and still run (a sync call cannot be interrupted), at
    #: most; at the bound, no new in-thread try starts until one of them returns (the lag
    #: grows; ``--sandbox process`` kills a hung call instead).
    abandoned_limit: int = ABANDONED_LIMIT
    #: Whether the circuit (``reef_stream.consumers.reward.circuit``) holds the generations
    #: while most calls fail, instead of dead-lettering them.
    circuit: bool = True

    def slow_lanes(self) -> int:
        return max(1, self.concurrency // 4) if self.slow_concurrency is None \
            else self.slow_concurrency

    def pool_size(self) -> int:
        """Every call thread may hold a sandbox worker: the fast lane's, the slow lane's, the
        overtime and the demoted calls' (as many as the slow lane's slots each), and 2 more
        that absorb the restarts after kills."""
        return self.sandbox_size or self.concurrency + 3 * self.slow_lanes() + 2

    def problems(self) -> list[str]:
        found = list(self.sandbox_limits.problems())
        if self.sandbox not in ("thread", "process"):
            found.append(f"sandbox must be 'thread' or 'process', not {self.sandbox!r}")
        if self.sandbox == "process" and not self.sandbox_target:
            found.append("a process sandbox needs sandbox_target (module:attribute)")
        if self.slow_concurrency is not None and self.slow_concurrency < 0:
            found.append(f"slow concurrency must be 0 or more, not {self.slow_concurrency}")
        if self.concurrency < 1:
            found.append(f"concurrency must be at least 1, not {self.concurrency}")
        if self.backlog is not None and self.backlog < self.concurrency:
            found.append(f"backlog must be at least the concurrency ({self.concurrency}), "
                         f"not {self.backlog}")
        if self.abandoned_limit < 1:
            found.append(f"abandoned limit must be at least 1, not {self.abandoned_limit}")
        if not self.fast_lane_floor > 0:
            found.append(f"fast lane floor must be more than 0 seconds, not {self.fast_lane_floor}")
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


class Work:
    """One taken generation on its way to an outcome: its record (kept for a dead letter),
    where it came from, the decoded Generation, its entry among its partition's outcomes,
    and its tries so far (``error``: the last try's, None before a try or after a success;
    ``failure``: the last failure's signature, to see it repeat; ``repeated``: it did;
    ``retry_ready``: its backoff was served; ``probe``: the open circuit's probe)."""

    __slots__ = ("entry", "error", "failure", "generation", "message", "probe", "repeated",
                 "retry_ready", "timeouts", "tries", "where")

    def __init__(self, message: Message, where: tuple[str, int], generation: Generation,
                 entry: list) -> None:
        self.message, self.where, self.generation, self.entry = message, where, generation, entry
        self.tries = self.timeouts = 0
        self.error: BaseException | None = None
        self.failure: tuple | None = None
        self.probe = self.repeated = self.retry_ready = False


class Slot:
    """A call thread's running try, as the watchdog sees it (under the worker's lock):
    ``work`` (None between tries), when it ``started``, its ``deadline`` (the full timeout),
    ``overtime_at`` (the observed p99) and ``fast_deadline`` (the adaptive one of the fast
    lane; both None once passed or in the slow lane), its ``lane``, whether another thread
    ``replaced`` it in the fast lane (it ran into overtime or was demoted: its thread ends
    after this call), was ``demoted`` to the slow lane (and ``evicted`` from it), or
    ``abandoned`` (in-thread: its thread finishes alone), and the sandbox's ``ticket`` (None
    in-thread)."""

    __slots__ = ("abandoned", "deadline", "demoted", "evicted", "fast_deadline", "fast_done",
                 "lane", "overtime_at", "replaced", "started", "ticket", "work")

    def __init__(self, lane: str = FAST, ticket: Any = None) -> None:
        self.work: Work | None = None
        self.started = 0.0
        self.deadline: float | None = None
        self.overtime_at: float | None = None
        self.fast_deadline: float | None = None
        self.lane, self.ticket = lane, ticket
        self.abandoned = self.demoted = self.evicted = self.fast_done = self.replaced = False


class CallSlots:
    """The call slots of a ``RewardWorker`` (see the module docstring)."""

    def _init_calls(self, pool: Any) -> None:
        """The lanes' state; ``pool``: the sandbox's ``SandboxPool`` (None: in-thread)."""
        options = self.options
        self._pool = pool
        self._slow_lanes = options.slow_lanes()
        self._slow_queue: deque[Work] = deque()
        self._slow_ready = threading.Condition(self._lock)
        self._demoted = 0  # running calls moved to the slow lane
        self._overtime = 0  # running fast-lane calls past the p99, replaced but not demoted
        self.call_latency = LatencyWindow()  # of the tries that returned
        self._p99: float | None = None
        self._p99_at = 0.0
        #: Retries waiting out their backoff: a heap of (due, sequence, work), for the timer
        #: thread (``_timers``), which also probes the open circuit.
        self._delayed: list[tuple[float, int, Work]] = []
        self._delay_order = itertools.count()
        self._timer_ready = threading.Condition()
        self.circuit = Circuit() if options.circuit else None
        self._held_works: deque[Work] = deque()  # while the circuit is open
        self._probe_new = False
        #: Open: whether the next generation the consumer offers is taken, as a probe.
        self.admit_probe = False
        self._abandoned = 0  # in-thread tries that timed out and still run
        self._abandoned_room = threading.Condition(self._lock)
        self._abandoned_warned = False

    # ----------------------------------------------------------------- sync calls (threads)

    def _runner(self, work: Work | None = None, lane: str = FAST) -> None:
        """A call thread of a sync reward function (or of the sandbox): settles queued
        generations of its ``lane`` one at a time until the worker closes. ``work``: one to go
        on with first. Ends when its own call is abandoned, or after the call in which
        another thread took its place in the fast lane (overtime or demoted)."""
        slot = Slot(lane, None if self._pool is None else Ticket())
        with self._lock:
            self._slots.add(slot)
        while work is not None or (work := self._next_sync(lane)) is not None:
            try:
                if not self._run_sync(slot, work):
                    return
            except Exception as error:  # noqa: BLE001 - a bug here must not end the slot silently
                self._broken(error)
            work = None
        with self._lock:
            self._slots.discard(slot)

    def _next_sync(self, lane: str = FAST) -> Work | None:
        """The next queued generation of ``lane``; blocks while there is none. None once
        closing."""
        if lane == SLOW:
            with self._slow_ready:
                while not self._slow_queue and not self._closing:
                    self._slow_ready.wait()
                return None if self._closing else self._slow_queue.popleft()
        queue = self._queue
        while True:
            try:
                return queue.popleft()
            except IndexError:
                pass
            with self._ready:
                self._idle += 1  # before the last look at the queue: see _wake
                try:
                    while not queue and not self._closing:
                        self._ready.wait()
                finally:
                    self._idle -= 1
                if self._closing:
                    return None

    def _run_sync(self, slot: Slot, work: Work) -> bool:
        """Try the reward function on this thread until ``work`` is settled (feedback or dead
        letter), moved to the slow lane or dropped: True if this thread goes on with the next
        generation. False when the watchdog abandoned the try this thread was in (in-thread:
        another thread goes on with ``work``) or another thread took its place."""
        options = self.options
        while True:
            if work.error is not None and not self._again(work, slot.lane):
                return self._goes_on(slot)
            if self._dropped(work) or self._held(work, failed=False):
                return self._goes_on(slot)
            work.tries += 1
            with self._lock:
                if slot.ticket is None:
                    self._wait_for_abandoned_room()
                started = time.monotonic()
                slot.work, slot.started = work, started
                slot.deadline = started + options.timeout
                slot.fast_done = slot.lane != FAST or slot.replaced
                slot.overtime_at, slot.fast_deadline = (None, None) if slot.fast_done \
                    else self._adaptive_marks(started)
            try:
                if slot.ticket is not None:
                    result, error = self._pool.call(work.generation, options.timeout,
                                                    slot.ticket), None
                else:
                    result, error = self.reward(work.generation), None
                    if inspect.isawaitable(result):  # awaited on the loop; abandoned like a call
                        result = asyncio.run_coroutine_threadsafe(_awaited(result),
                                                                  self._loop).result()
            except BaseException as raised:  # noqa: BLE001 - the function's failure is the outcome
                result, error = None, raised
            with self._lock:
                if slot.abandoned:  # timed out: counted and taken over by the watchdog
                    self._abandoned -= 1
                    self._abandoned_room.notify()
                    return False
                slot.work = None
            if error is None:
                self.call_latency.add(time.monotonic() - started)
                self._record_try(work, None)
                self._succeeded(work, result)
                return self._goes_on(slot)
            if isinstance(error, SandboxFailure) and error.category == TIMEOUT:
                work.timeouts += 1
                self.summary.add(timed_out=1)
            work.error = error
            self._record_try(work, error)

    def _wait_for_abandoned_room(self) -> None:
        """Under the lock, before an in-thread try: wait while ``abandoned_limit`` timed-out
        tries still run (their threads cannot be stopped; memory stays bounded, the lag grows)."""
        limit = self.options.abandoned_limit
        while self._abandoned >= limit and not self._closing:
            if not self._abandoned_warned:
                self._abandoned_warned = True
                log.warning("%d reward calls timed out and still run (a sync call cannot be "
                            "stopped): no new call starts until one returns; --sandbox process "
                            "kills a hung call instead", self._abandoned)
            self._abandoned_room.wait(1.0)

    def _again(self, work: Work, lane: str | None) -> bool:
        """After a failed try: True to try again now (its backoff was served); otherwise
        ``work`` was held for the open circuit, settled (dead-lettered), moved to the slow lane,
        or waits out its backoff on the timer thread, holding no slot. ``lane``: the failed
        try's (None: an async call; there are no lanes).

        Dead-lettered: a sandbox failure that the same generation would meet again; a try past
        ``retries``; a failure that repeats the try before's (same type and message, or a
        second timeout) unless it is transient (``reef_stream.api.rewards.Transient``). A try
        that timed out in the fast lane is tried again only in the slow lane (when there is
        one, with room)."""
        if work.retry_ready:
            work.retry_ready = False
            return True
        if self._held(work, failed=True):
            return False
        error, options = work.error, self.options
        timed_out = _timed_out(error)
        if isinstance(error, SandboxFailure) and not error.retryable \
                or work.tries > options.retries:
            self._failed(work)
            return False
        failure = ("timeout",) if timed_out else None \
            if is_transient(error) or getattr(error, "transient", False) is True \
            else (getattr(error, "error_type", type(error).__name__), str(error)[:500])
        if failure is not None and failure == work.failure:
            work.repeated = True
            self._failed(work)
            return False
        work.failure = failure
        if timed_out and lane == FAST and self._slow_lanes:
            with self._slow_ready:
                room = len(self._slow_queue) < SLOW_QUEUE_PER_SLOT * self._slow_lanes
                if room:  # tried again at once when a slow-lane slot takes it
                    work.retry_ready = True
                    self._slow_queue.append(work)
                    self._slow_ready.notify()
            if room:
                self.summary.add(retried=1)
            else:
                full = "; the slow lane was full, so it was not tried again"
                work.error = SandboxFailure(TIMEOUT, error.detail + full, wall=True) \
                    if isinstance(error, SandboxFailure) else TimeoutError(f"{error}{full}")
                self._failed(work)
            return False
        self.summary.add(retried=1)
        self._delay(work, backoff_seconds(options, work.tries))
        return False

    # ----------------------------------------------------------------- retries and the circuit

    def _delay(self, work: Work, seconds: float) -> None:
        """``work`` is tried again in ``seconds``, queued first; no slot waits for it."""
        with self._timer_ready:
            heapq.heappush(self._delayed, (time.monotonic() + seconds, next(self._delay_order),
                                           work))
            self._timer_ready.notify()

    def _requeue(self, work: Work) -> None:
        """Any thread: ``work`` goes first in the fast lane's queue, and a runner is woken."""
        self._queue.appendleft(work)
        if self._is_async:
            self._loop.call_soon_threadsafe(self._work_ready.set)
        else:
            with self._ready:
                self._ready.notify()

    def _timers(self) -> None:
        """The timer thread: queues each delayed retry once its backoff has passed, and sends
        the open circuit's probes (``_probe``). Ends at close."""
        while not self._closing:
            with self._timer_ready:
                now = time.monotonic()
                due = []
                while self._delayed and self._delayed[0][0] <= now:
                    due.append(heapq.heappop(self._delayed)[2])
                if not due:
                    wait = self._delayed[0][0] - now if self._delayed else TIMER_IDLE_S
                    probe = None if self.circuit is None else self.circuit.seconds_to_probe()
                    self._timer_ready.wait(wait if probe is None else min(wait, probe))
            for work in due:
                work.retry_ready = True
                self._requeue(work)
            self._probe()

    def _held(self, work: Work, *, failed: bool) -> bool:
        """While the circuit is open: hold ``work`` (True) instead of trying it, or, after its
        try ``failed``, instead of retrying or dead-lettering it; that try does not count. The
        circuit's probe passes."""
        if self.circuit is None or not self.circuit.is_open:
            return False
        if work.probe and not failed:
            return False
        if failed:
            work.tries -= 1
            if _timed_out(work.error):
                work.timeouts -= 1
            work.error, work.probe = None, False
        elif work.error is not None:
            work.retry_ready = True  # held before its retry: tried at once when released
        self._held_works.append(work)
        return True

    def _record_try(self, work: Work, error: BaseException | None) -> None:
        """A try of ``work`` ended (``error`` None: it returned): tell the circuit if it was the
        generation's first try or a probe. Retries are left out: they say again what the first
        try said about one generation, not about the service. A sandbox failure the generation
        would meet again is the generation's, never an outage."""
        probe, work.probe = work.probe, False
        if self.circuit is None or isinstance(error, SandboxFailure) and not error.retryable \
                or work.tries > 1 and not probe:
            return
        change = self.circuit.record(error is None)
        if change == OPEN:
            log.warning("the reward circuit opened: most of the last %d generations' first "
                        "tries failed (the last: %s: %s); no new generation is taken, failing "
                        "ones are held, not dead-lettered, and one is tried again every %g s",
                        self.circuit.window, type(error).__name__, error,
                        self.circuit.probe_every)
        elif change == CLOSED:
            self._release_held("a try succeeded")

    def _probe(self) -> None:
        """Timer thread: when the open circuit's probe is due, try one held generation again
        (the longest held first; a failed probe is held again at the back), or, every other
        probe and when none is held, let one new generation in as the probe (``admit_probe``),
        so a circuit opened on a run of bad inputs does not probe only them."""
        if self.circuit is None or not self.circuit.probe_due():
            return
        self._probe_new = not self._probe_new
        if self._probe_new or not self._held_works:
            self.admit_probe = True
            return
        with suppress(IndexError):
            work = self._held_works.popleft()
            work.probe = True
            self._requeue(work)

    def _release_held(self, why: str) -> None:
        """The circuit closed: the held generations are queued first, in their order."""
        released = 0
        with suppress(IndexError):
            while True:
                self._queue.appendleft(self._held_works.pop())
                released += 1
        self.admit_probe = False
        log.info("the reward circuit closed (%s); %d held generations are tried again", why,
                 released)
        if self._is_async:
            self._loop.call_soon_threadsafe(self._work_ready.set)
        else:
            with self._ready:
                self._ready.notify(released)

    def _goes_on(self, slot: Slot) -> bool:
        """Whether the thread of ``slot`` takes another generation (not if another thread took
        its place)."""
        if not slot.replaced:
            return True
        with self._lock:
            self._left_fast_lane(slot)
            self._slots.discard(slot)
        return False

    def _left_fast_lane(self, slot: Slot) -> None:
        """Under the lock: a replaced slot's call ended, so it no longer counts as overtime or
        as demoted."""
        if slot.evicted:  # its place in the slow lane was given up when it was evicted
            return
        if slot.demoted:
            self._demoted -= 1
        elif slot.replaced:
            self._overtime -= 1

    def _adaptive_marks(self, started: float) -> tuple[float | None, float | None]:
        """When a fast-lane try that started at ``started`` runs into overtime (the observed
        p99) and when it leaves the fast lane (``ADAPT_FACTOR`` times the p99, at least
        ``fast_lane_floor``), once ``ADAPT_MIN_SAMPLES`` calls succeeded; (None, None) (only the
        full timeout) before, or without adaptive timeouts."""
        if not self.options.adaptive or len(self.call_latency) < ADAPT_MIN_SAMPLES:
            return None, None
        now = time.monotonic()
        if now - self._p99_at > P99_EVERY_S:
            self._p99 = self.call_latency.percentile(99)
            self._p99_at = now
        p99 = self._p99 or 0.0
        seconds = max(self.options.fast_lane_floor, ADAPT_FACTOR * p99)
        if seconds >= self.options.timeout:
            return None, None
        return started + p99, started + seconds

    def _watch(self) -> None:
        """The sync calls' watchdog thread: acts on the marks of each running try
        (``_passed_marks``: overtime, demotion). At the full timeout a try times out: in-thread
        it is abandoned (its thread finishes alone, its result ignored) and a new thread takes
        its place; in the sandbox it is killed (its process group; the slot is free at once).
        Sleeps until the earliest running mark, ``WATCH_EVERY_S`` at most."""
        timeout = self.options.timeout
        while not self._closing:
            now = time.monotonic()
            wake, stopped, replaced = now + timeout, [], 0
            with self._lock:
                for slot in self._slots:
                    if slot.work is None or slot.abandoned:
                        continue
                    replaced += self._passed_marks(slot, now, stopped)
                    if slot.deadline is not None and slot.deadline <= now:
                        self._stop_try(slot, f"no result within "
                                             f"{_within(now - slot.started, timeout)}", stopped)
                    for mark in (slot.overtime_at, slot.fast_deadline, slot.deadline):
                        if mark is not None and not slot.abandoned:
                            wake = min(wake, mark)
                for slot, work, _, _ in stopped:
                    if work is not None:
                        self._slots.discard(slot)
                        self._left_fast_lane(slot)
            for _ in range(replaced):
                self._start_runner(None, FAST)
            for slot, work, why, call in stopped:
                if work is None:  # that call only: the slot may be in the next
                    slot.ticket.kill(f"{why} (wall clock): the call's process group was killed",
                                     call)
                    continue
                work.timeouts += 1
                work.error = TimeoutError(why)
                self.summary.add(timed_out=1)
                self._record_try(work, work.error)
                if slot.replaced:  # its fast-lane place was taken: to the slow lane's queue
                    self._again(work, FAST)  # (no backoff: replaced only when slow lanes exist)
                else:  # a new thread in its place goes on with it (tried again, or moved)
                    self._start_runner(work, slot.lane)
            self._watch_stop.wait(max(0.0, min(wake - now, WATCH_EVERY_S)))

    def _passed_marks(self, slot: Slot, now: float, stopped: list) -> int:
        """Under the lock: act on the adaptive marks of ``slot``'s fast-lane try that ``now``
        passed (the module docstring); how many new fast-lane threads that takes (0 or 1)."""
        if slot.fast_deadline is None and not slot.fast_done:  # the p99 is known since
            slot.overtime_at, slot.fast_deadline = self._adaptive_marks(slot.started)
        new = 0
        if slot.overtime_at is not None and slot.overtime_at <= now:
            slot.overtime_at = None
            if self._overtime < self._slow_lanes:
                slot.replaced, self._overtime, new = True, self._overtime + 1, 1
        if slot.fast_deadline is not None and slot.fast_deadline <= now:
            slot.fast_deadline, slot.fast_done = None, True
            if self._demoted >= self._slow_lanes:
                self._evict_longest_demoted(now, stopped)
            if self._demoted < self._slow_lanes:
                if slot.replaced:  # its place in the fast lane is taken already
                    self._overtime -= 1
                else:
                    slot.replaced, new = True, 1
                slot.demoted, self._demoted = True, self._demoted + 1
            else:
                slot.deadline = now  # no room in the slow lane: it times out now
        return new

    def _evict_longest_demoted(self, now: float, stopped: list) -> None:
        """Under the lock, with the slow lane full of demoted tries: the one that has run the
        longest times out now if it ran past ``EVICT_FACTOR`` times the observed p99 (it is
        far likelier to hang than the try that needs its place), and its place is free."""
        running = [slot for slot in self._slots if slot.demoted and not slot.evicted
                   and slot.work is not None and not slot.abandoned and slot.deadline is not None]
        if not running:
            return
        victim = min(running, key=lambda slot: slot.started)
        seconds = now - victim.started
        if seconds < EVICT_FACTOR * (self._p99 or 0.0):
            return
        victim.evicted, self._demoted = True, self._demoted - 1
        self._stop_try(victim, f"no result within {seconds:.3g} s (the longest-running call in "
                               f"the full slow lane, past {EVICT_FACTOR:g} x the observed p99, "
                               "stopped to make room for a newer one)", stopped)

    def _stop_try(self, slot: Slot, why: str, stopped: list) -> None:
        """Under the lock: end ``slot``'s running try as timed out (``why``): in the sandbox it
        is killed once the lock is released; in-thread it is abandoned."""
        if slot.ticket is not None:
            stopped.append((slot, None, why, slot.ticket.calls))
            slot.deadline = None
        else:
            stopped.append((slot, slot.work, why, 0))
            slot.abandoned, slot.work = True, None
            self._abandoned += 1

    def _start_runner(self, work: Work | None, lane: str) -> None:
        threading.Thread(target=self._runner, args=(work, lane), name=f"reef-reward-{lane}",
                         daemon=True).start()

    def _saturated_slots(self) -> int:
        """Slots busy with a call running past the observed p99 (saturation)."""
        p99 = self.call_latency.percentile(99)
        if p99 is None:
            return 0
        now = time.monotonic()
        with self._lock:
            return sum(1 for slot in self._slots
                       if slot.work is not None and not slot.abandoned and now - slot.started > p99)

    def _write_call_metrics(self, writer: Any) -> None:
        """Saturation, call latency, the lanes and the sandbox pool, as Metric events."""
        saturated = self._saturated_slots()
        writer.write(REWARD_SATURATED_SLOTS, saturated)
        writer.write(REWARD_SATURATION, saturated / self.options.concurrency)
        for q, name in ((50, REWARD_CALL_P50), (99, REWARD_CALL_P99)):
            value = self.call_latency.percentile(q)
            if value is not None:
                writer.write(name, value)
        writer.write(REWARD_SLOW_LANE, len(self._slow_queue) + self._demoted)
        writer.write(REWARD_ABANDONED, self._abandoned)
        if self.circuit is not None:
            writer.write(REWARD_CIRCUIT_OPEN, int(self.circuit.is_open))
            writer.write(REWARD_CIRCUIT_OPENINGS, self.circuit.openings)
            writer.write(REWARD_HELD, len(self._held_works))
        if self._pool is None:
            return
        stats = self._pool.stats()
        for key, name in SANDBOX_STATS.items():
            if key in stats:
                writer.write(name, stats[key])
        for category in CATEGORIES:
            writer.write(SANDBOX_FAILURES, self._pool.failures[category], category=category)

    # ----------------------------------------------------------------- async calls (the loop)

    async def _arunner(self) -> None:
        """A call slot of a coroutine reward function (a task on the asyncio loop): settles
        queued generations one at a time until cancelled at close."""
        queue = self._queue
        while True:
            try:
                work = queue.popleft()
            except IndexError:
                self._idle += 1  # before the last look at the queue: see _wake
                try:
                    if not queue:
                        self._work_ready.clear()
                        await self._work_ready.wait()
                finally:
                    self._idle -= 1
                continue
            try:
                await self._run_async(work)
            except Exception as error:  # noqa: BLE001 - a bug here must not end the slot silently
                self._broken(error)

    async def _run_async(self, work: Work) -> None:
        """Try the reward function until ``work`` is settled, held, delayed (``_again``) or
        dropped; each try has ``timeout`` seconds (``asyncio.timeout``: no task of its own per
        try)."""
        options = self.options
        while True:
            if work.error is not None and not self._again(work, None):
                return
            if self._dropped(work) or self._held(work, failed=False):
                return
            work.tries += 1
            try:
                async with asyncio.timeout(options.timeout):
                    result = await self.reward(work.generation)
            except TimeoutError as error:
                work.timeouts += 1
                self.summary.add(timed_out=1)
                work.error = error if str(error) else TimeoutError(
                    f"no result within {options.timeout:g} s")
                self._record_try(work, work.error)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the function's failure is the outcome
                work.error = error
                self._record_try(work, error)
                continue
            self._record_try(work, None)
            self._succeeded(work, result)
            return


def _timed_out(error: BaseException | None) -> bool:
    return isinstance(error, TimeoutError) \
        or isinstance(error, SandboxFailure) and error.category == TIMEOUT


def _within(seconds: float, timeout: float) -> str:
    """How long a timed-out try had: ``timeout`` (``"30 s"``), or, cut short at the fast
    lane's adaptive deadline, the seconds it ran."""
    if seconds >= timeout:
        return f"{timeout:g} s"
    return (f"{seconds:.3g} s (the fast lane's deadline, {ADAPT_FACTOR:g} x the observed p99, "
            "with no room in the slow lane)")


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def backoff_seconds(options: RewardOptions, tries: int) -> float:
    """Seconds before the next try after ``tries`` failed ones."""
    return min(options.backoff * 2 ** (tries - 1), MAX_BACKOFF_S)


def cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)


def is_coroutine_function(function: Any) -> bool:
    """An ``async def`` function, an object whose ``__call__`` is one, or a ``NamedReward`` of
    either: its calls run as tasks on the asyncio loop."""
    inner = getattr(function, "function", None)  # NamedReward
    if inner is not None:
        return is_coroutine_function(inner)
    return inspect.iscoroutinefunction(function) \
        or inspect.iscoroutinefunction(getattr(type(function), "__call__", None))
