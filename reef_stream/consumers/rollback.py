"""The trainer's way out of a stall after rejections: roll back to the incumbent, forwards.

A candidate evaluator may reject checkpoint after checkpoint. Replicas go on
serving the incumbent (the newest PROMOTED version, I) while the trainer moves
on; once the trainer's step S is more than ``schedule.max_staleness`` versions
past I, every sample the fleet makes is too stale to train (the processor and
the trainer drop it), so no step comes, so no new candidate: the loop stands
still for good.

``stall_reason`` names that state from the publications alone: the evaluator
decided on the trainer's newest checkpoint (it decides in version order, so
nothing newer is in flight), and the incumbent is more than ``max_staleness``
behind it. The trainer then writes a rollback checkpoint
(``rollback_contents``; ``Trainer._roll_back`` acknowledges it like a step):

- version S + 1, so versions stay monotonic and every stage's staleness
  arithmetic holds unchanged;
- the incumbent's weights, optimizer, RNG and algorithm state (read from its
  published copy, verified);
- the offsets and trained-unit set of step S: what was read since step S is
  read again and judged against S + 1 (too stale: dead-lettered, counted);
- ``rolled_back_to = I`` in the checkpoint and its ``Checkpoint`` event, so
  ``reef trace`` and ``reef top`` show it, and the metric ``rollbacks``.

The evaluator promotes a rollback without measuring it once it has checked
that its weights are the incumbent's (they were measured when I was promoted)
and that I is still the incumbent (``check_rollback``). Replicas load S + 1;
fresh samples flow again. A rollback the evaluator rejects is not retried: the
trainer logs why it waits (once) until a version is promoted.

Data parallelism: the ranks would have to agree on the moment; that is not
built, so a data-parallel trainer logs the stall and waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import numpy as np
import torch

from reef_stream.engine.checkpoints import CheckpointContents
from reef_stream.topics.events import Decision, Publication, TopicOffset

__all__ = ["CHECK_EVERY_S", "check_rollback", "rollback_contents", "stall_reason"]

#: Seconds between two looks at the publications for a stall.
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
