"""Superseding: of a model's candidates waiting at once, the evaluator measures only the newest.

A trainer that checkpoints faster than the candidate evaluator's ``measure`` runs leaves
candidates waiting; measuring each in turn puts what replicas serve ever further behind the
trainer. The evaluator (``reef_stream.consumers.evaluator.evaluator``, option ``supersede``, with an
evaluator that measures) therefore takes the checkpoint events waiting at once (handed over
by its stage loop, not decided yet) and asks ``superseding`` which of them a newer waiting
one supersedes: per recipe and model, every candidate older than the newest waiting one. It
decides those REJECTED, with ``superseded_reason``, without verifying or measuring them (a
superseded candidate is never promoted, so nothing unverified is served), and measures the
newest as always. Each waiting checkpoint still gets exactly one decision, in log order. (The
evaluator measures a candidate of a model with no incumbent yet however many wait: see its
module docstring.)

A rollback checkpoint (``rolled_back_to`` set, see ``reef_stream.publishing.rollback``) is
neither superseded nor supersedes: the trainer does not retry a rejected rollback, so it is
decided as always. Pure: no Kafka, no files.
"""

from __future__ import annotations

from collections.abc import Sequence

from reef_stream.core.events import Checkpoint

__all__ = ["SUPERSEDED", "superseded_reason", "superseding"]

#: How the reason of a superseded candidate's rejection begins.
SUPERSEDED = "superseded: "


def superseding(waiting: Sequence[Checkpoint]) -> list[int | None]:
    """For each of ``waiting`` (in log order), the policy version that supersedes it, or None
    when it is decided as always.

    The newest of a recipe's model is its highest policy version among the waiting
    checkpoints that are not rollbacks; every other such checkpoint with a lower version is
    superseded by it. A checkpoint of the newest version is not superseded, however often it
    waits (a re-emitted event is found decided by the evaluator's ledger instead), and neither
    is a rollback, nor does a rollback supersede anything."""
    newest: dict[tuple[str, str], int] = {}
    for checkpoint in waiting:
        if checkpoint.rolled_back_to is None:
            key = (checkpoint.recipe, checkpoint.model)
            newest[key] = max(newest.get(key, checkpoint.policy_version),
                              checkpoint.policy_version)
    return [None if checkpoint.rolled_back_to is not None
            or checkpoint.policy_version >= newest[(checkpoint.recipe, checkpoint.model)]
            else newest[(checkpoint.recipe, checkpoint.model)]
            for checkpoint in waiting]


def superseded_reason(version: int) -> str:
    """The reason of a candidate's rejection when version ``version`` superseded it."""
    return (f"{SUPERSEDED}version {version} was waiting when this one's turn came; only the "
            "newest waiting candidate is measured")
