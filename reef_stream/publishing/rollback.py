"""The trainer's way out of a stall after rejections: roll back to the incumbent, forwards.

When the evaluator rejects checkpoint after checkpoint, replicas keep serving the incumbent
I while the trainer's step S moves on; once S is more than ``schedule.max_staleness``
versions past I every sample is too stale and the loop stands still for good.
``stall_reason`` names that state from the publications alone (the trainer's newest
checkpoint is decided, and I is too far behind; a CANARY waiting for release is no stall);
``StallWatch``, rank 0's fold of ``<ns>.publications``, asks it every ``CHECK_EVERY_S``.
The trainer then acknowledges ``rollback_checkpoint``: version S + 1 (versions stay
monotonic), I's verified weights, optimizer, RNG and algorithm state, step S's offsets and
unit set, and ``rolled_back_to = I``. The evaluator promotes it unmeasured when
``check_rollback`` finds I still the incumbent; a rejected rollback is not retried.
Data-parallel ranks agree on the moment and the incumbent at a meeting (``Vote``,
``agree``) every rank reaches in the same order. The long form: ``docs/design-notes.md``
("Rollback after rejections").
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass

import numpy as np
import torch

from reef_stream.core.errors import ConfigurationError, FatalError, RetryableError
from reef_stream.core.events import Decision, Publication, TopicOffset, now_ms
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointError, load
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.topics.kafka import KafkaException

__all__ = ["CHECK_EVERY_S", "Agreed", "StallWatch", "Verdict", "Vote", "agree", "check_rollback",
           "rollback_checkpoint", "rollback_contents", "stall_reason"]

#: Seconds between two looks at the publications for a stall (and, under data parallelism,
#: between two meetings of ranks that hold no full share of a step).
CHECK_EVERY_S = 1.0


def stall_reason(step: int, max_staleness: int, incumbent: Publication | None,
                 decided_version: int | None) -> str | None:
    """Why a trainer at ``step`` can train nothing more, or None when it can (or may soon).

    ``incumbent``: the model's newest PROMOTED publication; ``decided_version``: the newest
    version with a decision. Stalled: the trainer's newest checkpoint is decided (no promotion
    can come from the evaluator without a new step) and the incumbent, what replicas serve, is
    more than ``max_staleness`` versions behind it (every sample it makes is too stale)."""
    if incumbent is None or decided_version is None or decided_version < step:
        return None
    behind = step - incumbent.policy_version
    if behind <= max_staleness:
        return None
    return (f"the evaluator decided up to version {decided_version} and replicas serve version "
            f"{incumbent.policy_version}, {behind} behind the trainer's {step} (max_staleness "
            f"{max_staleness}): every sample they make is too stale to train")


class Verdict(enum.Enum):
    """How rank 0's rollback went (``StallWatch.roll_back``), told to every rank."""

    DONE = "done"        # acknowledged: every rank resumes from it
    CANNOT = "cannot"    # this trainer cannot roll back (for good): every rank waits
    FAILED = "failed"    # not acknowledged: every rank resumes from the newest checkpoint


class StallWatch:
    """Rank 0's part in rolling back: its fold of ``<ns>.publications``, which says whether the
    trainer has stalled (``target``), and the rollback's acknowledgement (``roll_back``).
    ``open`` blocks until the topic is read to its end; ``close`` at the end. On the trainer's
    loop thread only. ``log``: the trainer's logger (what it says is the trainer's)."""

    def __init__(self, bootstrap: str, namespace: str, *, model: str, max_staleness: int,
                 log: logging.Logger) -> None:
        self.model, self.max_staleness, self.log = model, max_staleness, log
        self.ledger = PublicationLedger(bootstrap, namespace)
        #: Why this trainer cannot roll back (None: it can); set once, for good.
        self.cannot: str | None = None
        self._logged: str | None = None   # the stall last logged

    def open(self) -> StallWatch:
        self.ledger.open()
        self.ledger.catch_up()
        return self

    def target(self, step: int, rolled_back_to: int | None) -> tuple[Publication, str] | None:
        """Fold the publications that arrived (never waits); when a trainer at ``step`` has
        stalled (``stall_reason``) and may roll back, the incumbent to go back to and the
        stall's reason. Otherwise None; a stall it may not roll back from (``cannot``, or
        ``rolled_back_to``: its newest checkpoint is a rollback, rejected too) is logged once
        per reason, and the trainer waits for a promotion."""
        self.ledger.poll(0)
        incumbent = self.ledger.incumbent(self.model)
        reason = stall_reason(step, self.max_staleness, incumbent,
                              self.ledger.decided_version(self.model))
        if self.ledger.waiting(self.model) is not None:
            reason = None  # a staged version (canary, approval) may be promoted soon
        if reason is None or incumbent is None:
            self._logged = None
            return None
        cannot = self.cannot or (
            None if rolled_back_to is None else
            f"the rollback to version {rolled_back_to} (step {step}) was rejected too")
        if cannot is None:
            return incumbent, reason
        if self._logged != reason:
            self._logged = reason
            self.log.error("stalled: %s; %s; waiting for a promotion", reason, cannot)
        return None

    def roll_back(self, target: tuple[Publication, str],
                  acknowledge: Callable[[CheckpointContents], object], *, step: int,
                  recipe: str, group: str, offsets: tuple[TopicOffset, ...],
                  trained: Set[int]) -> Verdict:
        """Acknowledge the rollback checkpoint to ``target`` (the incumbent, the stall's reason:
        ``rollback_checkpoint``) as version ``step`` with ``acknowledge`` (the trainer's one
        durability step). Blocks. CANNOT when this trainer cannot roll back to it (``cannot``
        is set: it never tries again), FAILED when reading, writing or acknowledging failed."""
        incumbent, reason = target
        self.log.warning("stalled: %s; rolling back to the weights of version %d as version %d",
                         reason, incumbent.policy_version, step)
        try:
            acknowledge(rollback_checkpoint(
                incumbent, step=step, model=self.model, recipe=recipe, group=group,
                offsets=offsets, trained=trained, created_at=now_ms()))
        except ConfigurationError as error:
            self.cannot = f"it cannot roll back: {error}"
            self.log.error("cannot roll back: %s", error)
            return Verdict.CANNOT
        except (RetryableError, CheckpointError, KafkaException) as error:
            self.log.error("the rollback to version %d failed: %s; resuming from the newest "
                           "checkpoint", incumbent.policy_version, error)
            return Verdict.FAILED
        return Verdict.DONE

    def close(self) -> None:
        self.ledger.close()


def rollback_checkpoint(incumbent: Publication, *, step: int, model: str, recipe: str,
                        group: str, offsets: tuple[TopicOffset, ...], trained: Set[int],
                        created_at: int) -> CheckpointContents:
    """The rollback checkpoint to ``incumbent`` (``rollback_contents``), from its published
    copy (read and verified: blocks). Raises ``ConfigurationError`` when that copy is another
    recipe's (this trainer cannot roll back to it), ``CheckpointError`` when it cannot be read
    or does not verify (retry)."""
    target = load(incumbent.uri, incumbent.sha256)
    if target.recipe != recipe:
        raise ConfigurationError(
            f"version {incumbent.policy_version} of model {model} is a checkpoint of recipe "
            f"{target.recipe!r}, not {recipe!r}")
    return rollback_contents(target, step=step, model=model, recipe=recipe, group=group,
                             offsets=offsets, trained=trained,
                             rolled_back_to=incumbent.policy_version, created_at=created_at)


def rollback_contents(incumbent: CheckpointContents, *, step: int, model: str, recipe: str,
                      group: str, offsets: tuple[TopicOffset, ...], trained: Set[int],
                      rolled_back_to: int, created_at: int) -> CheckpointContents:
    """The rollback checkpoint of a trainer at ``step - 1``: the incumbent's weights, optimizer,
    RNG and algorithm state as version ``step``, at the trainer's acknowledged ``offsets`` with
    its ``trained`` unit hashes; no unit trained in it."""
    return CheckpointContents(
        step=step, policy_version=step, model=model, recipe=recipe, trainer_group=group,
        weights=incumbent.weights, optimizer=incumbent.optimizer, rng=incumbent.rng,
        algorithm_state=incumbent.algorithm_state, offsets=offsets,
        trained_units=np.fromiter(sorted(trained), dtype=np.uint64, count=len(trained)),
        step_units=(), metrics={}, created_at=created_at, rolled_back_to=rolled_back_to)


# --------------------------------------------------------------------------- data parallelism


@dataclass(frozen=True)
class Vote:
    """What one data-parallel rank brings to a meeting. ``step``: the rank's step (every rank
    is at the same one); ``ready``: it holds its share of the next step; ``stop``: it was asked
    to stop; ``roll_back_to`` (rank 0's only): the incumbent's version, the trainer having
    stalled. Exchanged as JSON, never pickled."""

    step: int
    ready: bool = False
    stop: bool = False
    roll_back_to: int | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes, rank: int) -> Vote:
        """Rank ``rank``'s vote. Raises ``FatalError`` when ``data`` is not a vote: that rank
        is at another collective (out of step), and nothing it does can be trusted."""
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as error:
            raise FatalError(f"data-parallel rank {rank} is out of step: it sent {data[:80]!r} "
                             "where a vote was expected") from error


class Agreed(enum.Enum):
    """What every rank does after a meeting (``agree``)."""

    STOP = "stop"            # every rank stops: one was asked to
    ROLL_BACK = "roll back"  # rank 0 found the trainer stalled
    STEP = "step"            # every rank holds its share: train the step
    WAIT = "wait"            # go on reading (a rank holding its share meets again)


def agree(votes: Sequence[Vote]) -> Agreed:
    """The outcome of a meeting, from every rank's vote in rank order (the same on every rank:
    a pure function of the votes). A stop wins over a rollback (the rollback is decided again
    after a restart), a rollback over a step (the units held are read again after it). Raises
    ``FatalError`` when the ranks are at different steps."""
    steps = {vote.step for vote in votes}
    if len(steps) > 1:
        raise FatalError(f"data-parallel ranks are at different steps {[v.step for v in votes]}")
    if any(vote.stop for vote in votes):
        return Agreed.STOP
    if votes[0].roll_back_to is not None:
        return Agreed.ROLL_BACK
    if all(vote.ready for vote in votes):
        return Agreed.STEP
    return Agreed.WAIT


def check_rollback(rolled_back_to: int, current: Publication | None,
                   candidate_weights: Mapping[str, torch.Tensor],
                   incumbent_weights: Mapping[str, torch.Tensor] | None) -> tuple[Decision, str]:
    """The evaluator's decision on a rollback checkpoint (``rolled_back_to`` set): PROMOTED when
    version ``rolled_back_to`` is still the incumbent (``current``) and the candidate's weights
    are exactly its weights (already measured and promoted), REJECTED with the reason
    otherwise: serving never goes back past a newer promotion."""
    if current is None or current.decision is not Decision.PROMOTED:
        return Decision.REJECTED, (f"a rollback to version {rolled_back_to}, but no version is "
                                   "promoted")
    if current.policy_version != rolled_back_to:
        return Decision.REJECTED, (
            f"a rollback to version {rolled_back_to}, but the incumbent is now version "
            f"{current.policy_version}: serving does not go back past a newer promotion")
    if incumbent_weights is None or set(candidate_weights) != set(incumbent_weights) or not all(
            torch.equal(candidate_weights[name], incumbent_weights[name])
            for name in candidate_weights):
        return Decision.REJECTED, (f"a rollback to version {rolled_back_to}, but its weights are "
                                   f"not those of version {rolled_back_to}")
    return Decision.PROMOTED, (
        f"rollback: the trainer stalled after rejections and went back to the weights of "
        f"version {rolled_back_to}, promoted before (checked equal, not measured again)")
