"""The reward worker's call slots: where a recipe's reward function is called.

``RewardWorker`` (``reef_stream.consumers.reward``) queues each taken generation as a ``Work``;
``concurrency`` call slots take them one at a time until each is settled (its Feedback or its
dead letter) or dropped:

- a sync reward function: call threads (``CallSlots._runner``), and a watchdog thread
  (``_watch``) that abandons a try running past ``timeout`` (its thread finishes alone, its
  result ignored) and starts a new call thread that goes on with the generation;
- a coroutine function (``is_coroutine_function``): tasks on the worker's asyncio loop
  (``_arunner``), each try under ``asyncio.timeout``.

``CallSlots`` is a mixin of ``RewardWorker``: it uses the worker's queue, lock and conditions
(``_queue``, ``_lock``, ``_ready``, ``_work_ready``, ``_idle``, ``_slots``, ``_closing``,
``_stop``, ``_watch_stop``, ``_loop``), its ``options``, ``summary`` and ``reward``, and
settles work through its ``_succeeded``, ``_failed``, ``_dropped`` and ``_broken``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import TYPE_CHECKING, Any

from reef_stream.topics.events import Generation
from reef_stream.topics.kafka import Message

if TYPE_CHECKING:
    from reef_stream.consumers.reward import RewardOptions

__all__ = ["MAX_BACKOFF_S", "CallSlots", "Slot", "Work", "backoff_seconds", "cancel_all",
           "is_coroutine_function"]

#: The longest wait between two tries of one generation.
MAX_BACKOFF_S = 30.0


class Work:
    """One taken generation on its way to an outcome: its record (kept for a dead letter),
    where it came from, the decoded Generation, its entry among its partition's outcomes,
    and its tries so far (``error``: the last try's, None before a try or after a success)."""

    __slots__ = ("entry", "error", "generation", "message", "timeouts", "tries", "where")

    def __init__(self, message: Message, where: tuple[str, int], generation: Generation,
                 entry: list) -> None:
        self.message, self.where, self.generation, self.entry = message, where, generation, entry
        self.tries = self.timeouts = 0
        self.error: BaseException | None = None


class Slot:
    """A call thread's running try, as the watchdog sees it (under the worker's lock):
    ``work`` (None between tries), when it ``started``, whether it was ``abandoned``."""

    __slots__ = ("abandoned", "started", "work")

    def __init__(self) -> None:
        self.work: Work | None = None
        self.started = 0.0
        self.abandoned = False


class CallSlots:
    """The call slots of a ``RewardWorker`` (see the module docstring)."""

    # ----------------------------------------------------------------- sync calls (threads)

    def _runner(self, work: Work | None = None) -> None:
        """A call thread of a sync reward function: settles queued generations one at a time
        until the worker closes. ``work``: the generation of a timed-out try, which this thread
        goes on with in place of the abandoned one. Ends when its own call is abandoned."""
        slot = Slot()
        with self._lock:
            self._slots.add(slot)
        while work is not None or (work := self._next_sync()) is not None:
            try:
                if not self._run_sync(slot, work):
                    return
            except Exception as error:  # noqa: BLE001 - a bug here must not end the slot silently
                self._broken(error)
            work = None

    def _next_sync(self) -> Work | None:
        """The next queued generation; blocks while there is none. None once closing."""
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
        letter) or dropped: True. False when the watchdog abandoned the try this thread was
        in: the thread ends (another goes on with ``work``)."""
        options = self.options
        while True:
            if work.error is not None:  # the last try failed
                if work.tries > options.retries:
                    self._failed(work)
                    return True
                self.summary.add(retried=1)
                self._stop.wait(backoff_seconds(options, work.tries))  # a stop cuts it short
            if self._dropped(work):
                return True
            work.tries += 1
            with self._lock:
                slot.work, slot.started = work, time.monotonic()
            try:
                result, error = self.reward(work.generation), None
                if inspect.isawaitable(result):  # awaited on the loop; abandoned like a call
                    result = asyncio.run_coroutine_threadsafe(_awaited(result),
                                                              self._loop).result()
            except BaseException as raised:  # noqa: BLE001 - the function's failure is the outcome
                result, error = None, raised
            with self._lock:
                if slot.abandoned:  # timed out: counted and taken over by the watchdog
                    return False
                slot.work = None
            if error is None:
                self._succeeded(work, result)
                return True
            work.error = error

    def _watch(self) -> None:
        """The sync calls' watchdog thread: a try running for ``timeout`` seconds is abandoned
        (its thread finishes alone, its result ignored) and counted as timed out, and a new
        call thread goes on with its generation. Sleeps until the earliest running deadline."""
        timeout = self.options.timeout
        while not self._closing:
            now = time.monotonic()
            wake, expired = now + timeout, []
            with self._lock:
                for slot in self._slots:
                    if slot.work is None:
                        continue
                    deadline = slot.started + timeout
                    if deadline <= now:
                        expired.append((slot, slot.work))
                        slot.abandoned, slot.work = True, None
                    else:
                        wake = min(wake, deadline)
                for slot, _ in expired:
                    self._slots.discard(slot)
            for slot, work in expired:
                work.timeouts += 1
                work.error = TimeoutError(f"no result within {timeout:g} s")
                self.summary.add(timed_out=1)
                threading.Thread(target=self._runner, args=(work,), name="reef-reward-call",
                                 daemon=True).start()
            self._watch_stop.wait(max(0.0, wake - now))

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
        """Try the reward function until ``work`` is settled or dropped; each try has
        ``timeout`` seconds (``asyncio.timeout``: no task of its own per try)."""
        options = self.options
        while True:
            if work.error is not None:  # the last try failed
                if work.tries > options.retries:
                    self._failed(work)
                    return
                self.summary.add(retried=1)
                await asyncio.sleep(backoff_seconds(options, work.tries))
            if self._dropped(work):
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
                continue
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the function's failure is the outcome
                work.error = error
                continue
            self._succeeded(work, result)
            return


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
