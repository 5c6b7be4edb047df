"""``Schedule``: how a recipe's trainer turns rollout units into optimizer steps. Data only.

Every size counts rollout units (one emitted group each). A step takes ``units_per_step``
units, in optimizer batches of ``optimizer_batch_size`` (one update each) split into micro
batches of ``micro_batch_size`` (one forward/backward each), visited ``epochs`` times,
reshuffled with ``seed`` when ``shuffle`` is set.

- ``max_staleness``: a generation whose ``policy_version`` is more than this many versions
  behind the newest checkpoint is dropped as too stale (a dead letter), never trained.
- ``max_backlog_steps``: beyond ``max_backlog_steps * units_per_step`` units no checkpoint
  has taken, the processor sheds the units it completes (SHED, a dead letter); None: no bound.
- ``backlog_wait_s``: while that backlog is full, the processor holds what it reads (unoffered,
  its offsets uncommitted) for up to this many seconds before it sheds. The trainer's next
  checkpoint, if it comes meanwhile, makes room, and what would have been shed is trained: the
  processor learns of a step only once its checkpoint is committed and read, so a bound that
  sheds at once sheds every step what arrives in that gap, and the trainer then waits for it
  (``docs/history.md``, "Waiting for the checkpoint"). 0: shed at once.
- ``unknown_version``: what becomes of a generation whose producer could not tell its policy
  version (``Generation.policy_version_known`` False: ``reef intake proxy`` marks one recorded
  across a reload). ``reject`` (the default) dead-letters it (``processor.unknown_version``),
  never trained. ``stalest`` takes its version as 0, the oldest it can be: it is trained only
  while every version is within ``max_staleness`` of the newest checkpoint, so the bound holds
  whatever its true version was; afterwards it is too stale. Either way it is counted apart
  (``unknown_version_generations``, by outcome) and labelled ``unknown`` in the per-version
  metrics; a trained one is left out of the trainer's staleness (``Sample.policy_version_known``). Why ``reject`` by default: ``docs/proxy.md`` ("Versions").
- ``checkpoint_every``: the acknowledgement cadence, in steps (a checkpoint, its offsets and
  its ``Checkpoint`` event); the steps between are replayed from the log after a crash. It
  must be at most ``max_staleness + 1``.

A schedule checks its own invariants when built and raises one ``ConfigurationError``
listing every problem. Why a short backlog and what a cadence costs:
``docs/design-notes.md`` ("Schedules").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reef_stream.core.errors import ConfigurationError

#: ``Schedule.unknown_version``: dead-letter a generation of unknown version, or take its
#: version as the stalest (0). See the module docstring.
REJECT, STALEST = "reject", "stalest"
UNKNOWN_VERSION_RULES = (REJECT, STALEST)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """The batch geometry of a training step, in rollout units.

    ``units_per_step`` must be a multiple of ``optimizer_batch_size``, which
    must be a multiple of ``micro_batch_size``; every size and ``epochs`` are
    at least 1; ``max_staleness`` and ``seed`` are at least 0.
    """

    units_per_step: int
    optimizer_batch_size: int
    micro_batch_size: int
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    #: In policy versions: 0 trains only on samples of the newest checkpoint.
    max_staleness: int
    #: In steps of units waiting for the trainer; None: unbounded (see the module docstring).
    max_backlog_steps: int | None = None
    #: Seconds a full backlog holds the processor's input before it sheds; 0: at once.
    backlog_wait_s: float = 0.0
    #: Steps per checkpoint: the trainer acknowledges every this many (module docstring).
    checkpoint_every: int = 1
    #: A generation of unknown policy version: ``reject`` or ``stalest`` (module docstring).
    unknown_version: str = REJECT

    def __post_init__(self) -> None:
        problems = schedule_problems(self)
        if problems:
            raise ConfigurationError(problems)

    @property
    def optimizer_steps_per_epoch(self) -> int:
        """Optimizer updates per pass over a step's units."""
        return self.units_per_step // self.optimizer_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro batches whose gradients make one optimizer update."""
        return self.optimizer_batch_size // self.micro_batch_size

    def describe(self) -> str:
        """One line for people (``reef check``)."""
        return (
            f"{self.units_per_step} units per step, optimizer batch {self.optimizer_batch_size} "
            f"({self.optimizer_steps_per_epoch} updates per epoch), micro batch "
            f"{self.micro_batch_size} ({self.accumulation_steps} accumulated), "
            f"{self.epochs} epoch{'' if self.epochs == 1 else 's'}, "
            f"shuffle {'on' if self.shuffle else 'off'} (seed {self.seed}), "
            f"max staleness {self.max_staleness} policy version"
            f"{'' if self.max_staleness == 1 else 's'}"
            + ("" if self.max_backlog_steps is None else
               f", backlog at most {self.max_backlog_steps} step"
               f"{'' if self.max_backlog_steps == 1 else 's'} of units")
            + ("" if not self.backlog_wait_s else
               f" (held up to {self.backlog_wait_s:g} s for a checkpoint before shedding)")
            + ("" if self.checkpoint_every == 1 else
               f", a checkpoint every {self.checkpoint_every} steps")
            + ("" if self.unknown_version == REJECT else
               ", unknown policy versions taken as the stalest")
        )

    @property
    def max_backlog_units(self) -> int | None:
        """``max_backlog_steps`` in units (None: unbounded), plus the ``checkpoint_every - 1``
        steps the trainer may have taken since its newest checkpoint."""
        if self.max_backlog_steps is None:
            return None
        return (self.max_backlog_steps + self.checkpoint_every - 1) * self.units_per_step


def schedule_problems(schedule: Schedule) -> list[str]:
    """Every invariant ``schedule`` breaks, as sentences (empty when it is consistent)."""
    problems: list[str] = []
    least = {"units_per_step": 1, "optimizer_batch_size": 1, "micro_batch_size": 1, "epochs": 1,
             "seed": 0, "max_staleness": 0, "checkpoint_every": 1}
    valid = set()
    for name, minimum in least.items():
        value = getattr(schedule, name)
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"schedule.{name} must be an integer, got {value!r}")
        elif value < minimum:
            problems.append(f"schedule.{name} must be at least {minimum}, got {value}")
        else:
            valid.add(name)
    backlog = schedule.max_backlog_steps
    if backlog is not None and (not isinstance(backlog, int) or isinstance(backlog, bool)
                                or backlog < 1):
        problems.append(f"schedule.max_backlog_steps must be None or an integer of at least 1, "
                        f"got {backlog!r}")
    wait = schedule.backlog_wait_s
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait < math.inf:
        problems.append(f"schedule.backlog_wait_s must be a number of seconds of at least 0, "
                        f"got {wait!r}")
    elif wait and backlog is None:
        problems.append(f"schedule.backlog_wait_s ({wait:g} s) holds a full backlog, and "
                        "schedule.max_backlog_steps is None (no bound): set both or neither")
    if {"checkpoint_every", "max_staleness"} <= valid \
            and schedule.checkpoint_every > schedule.max_staleness + 1:
        problems.append(
            f"schedule.checkpoint_every ({schedule.checkpoint_every}) must be at most "
            f"max_staleness + 1 ({schedule.max_staleness + 1}): versions reach serving only at "
            "checkpoints, so every sample would be too stale before the next one")
    if schedule.unknown_version not in UNKNOWN_VERSION_RULES:
        problems.append(f"schedule.unknown_version must be one of "
                        f"{', '.join(map(repr, UNKNOWN_VERSION_RULES))}, got "
                        f"{schedule.unknown_version!r}")
    if not isinstance(schedule.shuffle, bool):
        problems.append(f"schedule.shuffle must be True or False, got {schedule.shuffle!r}")
    for larger, smaller in (("units_per_step", "optimizer_batch_size"),
                            ("optimizer_batch_size", "micro_batch_size")):
        if {larger, smaller} <= valid and getattr(schedule, larger) % getattr(schedule, smaller):
            problems.append(
                f"schedule.{larger} ({getattr(schedule, larger)}) must be a multiple of "
                f"schedule.{smaller} ({getattr(schedule, smaller)})"
            )
    return problems
