"""``Schedule``: how a recipe's trainer turns rollout units into optimizer steps. Data only.

Every size counts rollout units (one unit is one emitted group, whatever its
number of samples). A training step takes ``units_per_step`` units, splits
them into optimizer batches of ``optimizer_batch_size`` units (one optimizer
update each), and each optimizer batch into micro batches of
``micro_batch_size`` units (one forward/backward each, gradients
accumulated). The step's units are visited ``epochs`` times, reshuffled each
epoch with ``seed`` when ``shuffle`` is set.

``max_staleness`` bounds how far behind the newest checkpoint a sample's
behaviour policy may be: a generation whose ``policy_version`` is more than
``max_staleness`` versions behind is dropped as too stale (by the processor,
with a dead letter), never trained on.

``max_backlog_steps`` bounds the queue in front of the trainer: the units
emitted that no checkpoint has taken yet. Beyond ``max_backlog_steps *
units_per_step`` of them, the processor sheds the units it completes (their
generations end SHED, with a dead letter) instead of queueing them. The units
topic is otherwise an unbounded buffer: when generations come faster than the
trainer trains, every unit waits its turn, the trainer only ever reaches units
that are nearly ``max_staleness`` stale, and a fault's backlog never drains.
A short queue keeps what is trained fresh, at the price of the samples shed.
None (the default): no bound.

``checkpoint_every`` is the acknowledgement cadence: the trainer writes a
checkpoint (and commits its offsets, and emits the ``Checkpoint`` event the
evaluator decides on) every that many steps, not after each one. The steps in
between are not lost in a crash: a restarted trainer restores the newest
checkpoint and trains them again from the log, to the same weights. What a
larger cadence saves is the checkpoint's write (a full model and optimizer
state); what it costs is replay after a crash, and versions that reach serving
only every ``checkpoint_every`` steps, so samples are up to that many steps
older: it must be at most ``max_staleness + 1``. A backlog bound counts what
the trainer's newest checkpoint has not taken, so it allows
``checkpoint_every - 1`` steps more.

A schedule checks its own invariants when it is built and raises one
``ConfigurationError`` listing every problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from reef_stream.core.errors import ConfigurationError


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
    #: Steps per checkpoint: the trainer acknowledges every this many (module docstring).
    checkpoint_every: int = 1

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
            + ("" if self.checkpoint_every == 1 else
               f", a checkpoint every {self.checkpoint_every} steps")
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
    if {"checkpoint_every", "max_staleness"} <= valid \
            and schedule.checkpoint_every > schedule.max_staleness + 1:
        problems.append(
            f"schedule.checkpoint_every ({schedule.checkpoint_every}) must be at most "
            f"max_staleness + 1 ({schedule.max_staleness + 1}): versions reach serving only at "
            "checkpoints, so every sample would be too stale before the next one")
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
