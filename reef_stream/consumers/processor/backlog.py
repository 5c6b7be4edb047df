"""The trainer's backlog in units: what ``schedule.max_backlog_steps`` bounds.

    backlog = UnitBacklog()
    backlog.delivered(partition, offset)    # a unit's delivery report, its transaction open
    backlog.committed()                     # ... the transaction committed: the units count
    backlog.passed({0: 120, 1: 98})         # the newest checkpoint's next offsets
    backlog.units                           # units written that no checkpoint has passed

The backlog is the units waiting for the trainer: written to the units topic, and not yet
behind the offsets of its newest checkpoint (the units its next step will take, those it
already holds for that step included). It counts units, not offsets (every transaction
leaves a commit marker at an offset), so a backlog of a full step means the trainer has a
full step to take: the bound cannot hold the loop below one step (why it matters:
``docs/history.md``, "The backlog counted in units").

An instance knows the units it wrote itself (the offsets its producer's delivery reports
give), not another instance's: ``estimate(mine, of)`` scales its count by the share of the
input partitions it holds, so that the instances shed when together they hold about the
bound, each at least its share (rounded up: never below a step in all). Its partitions'
states count its own units against that share (``share``: the same rule), each unit one as
it is emitted: between two estimates (within a batch) a unit stands for the units the other
instances emit meanwhile too. Counted one against the whole bound instead, each of N
instances could emit the whole bound in one batch, N bounds together. A restarted
instance does not know the units it wrote before: it errs low until the trainer's next
checkpoint passes them.

``BacklogWait`` says when a full backlog holds the processor's input instead of shedding it
(``schedule.backlog_wait_s``). The processor learns that the trainer took a step only once
its checkpoint is committed and read (tens of milliseconds to a fetch later), and until then
it counts that step's units as waiting: a bound that sheds at once sheds, every step, what
arrives in that gap, and at an exact balance of generation and training the trainer then
waits for as long for its next step's units. Pure; no clock, no client.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping


class UnitBacklog:
    """Units written by this instance that the newest checkpoint has not passed."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, int]] = []  # (partition, offset), transaction open
        self._written: dict[int, deque[int]] = {}  # committed, ascending per partition
        self._passed: dict[int, int] = {}          # the newest checkpoint's next offsets

    def delivered(self, partition: int, offset: int) -> None:
        """The broker took a unit at ``partition``/``offset`` in the open transaction."""
        self._pending.append((partition, offset))

    def committed(self) -> None:
        """The open transaction committed: the units it wrote wait for the trainer."""
        for partition, offset in sorted(self._pending):
            if offset >= self._passed.get(partition, 0):
                self._written.setdefault(partition, deque()).append(offset)
        self._pending.clear()

    def aborted(self) -> None:
        """The open transaction was aborted: its units never existed for a reader."""
        self._pending.clear()

    def passed(self, offsets: Mapping[int, int]) -> None:
        """The newest checkpoint's next offset per partition of the units topic: the units
        before them are the trainer's (trained or skipped) and leave the backlog."""
        self._passed = dict(offsets)
        for partition, written in self._written.items():
            at = self._passed.get(partition, 0)
            while written and written[0] < at:
                written.popleft()

    @property
    def units(self) -> int:
        """Units this instance wrote that the newest checkpoint has not passed."""
        return sum(len(written) for written in self._written.values())

    def estimate(self, mine: int, of: int, emitted: int = 0) -> int:
        """The backlog of all instances as this one sees it, holding ``mine`` of ``of`` input
        partitions: its own units (``emitted``: those of the open batch too) scaled by
        ``of / mine``; 0 while it holds none."""
        if mine <= 0:
            return 0
        units = self.units + emitted
        return math.floor(units * of / mine) if mine < of else units


def share(bound: int, mine: int, of: int) -> int:
    """The part of ``bound`` an instance holding ``mine`` of ``of`` input partitions may hold
    itself: ``bound * mine / of``, rounded up (all of it while it holds them all). Its own
    units reach it exactly when ``estimate(mine, of)`` reaches ``bound``."""
    return bound if mine >= of else -(-bound * mine // of)


class BacklogWait:
    """Whether a full backlog holds the processor's input (``schedule.backlog_wait_s``): from
    the first fetch that finds it full, for ``wait_s`` seconds; after that what completes is
    shed, as without a wait, until the backlog has room again (a checkpoint passed units),
    and the next full backlog waits afresh. The caller gives the time.

        wait = BacklogWait(0.5)
        wait.holding(full=True, now=10.0)    # True: the first fetch that finds it full
        wait.holding(full=True, now=10.6)    # False: waited 0.5 s; shed
        wait.holding(full=False, now=10.7)   # False: room; the next full backlog waits again
    """

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._since: float | None = None   # when the backlog was first found full

    def holding(self, *, full: bool, now: float) -> bool:
        """Whether to hold this fetch's records: the backlog is ``full`` and has been for less
        than ``wait_s`` (never with a wait of 0)."""
        if not full or self.wait_s <= 0:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since < self.wait_s
