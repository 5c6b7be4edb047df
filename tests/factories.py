"""Events for the tests: one factory per event type, each returning a valid event whose every
field a keyword overrides.

    generation("g-7", policy_version=3, completion_token_ids=ids([4, 5, 6]),
               completion_logprobs=logprobs([-0.5, -1.0, -0.25]))
    feedback("g-7", source="exact", reward=0.0)
    sample("g-7", reward=1.0)
    rollout_unit(sample("g-7"), sample("g-8"), recipe="sao")
    ledger_of(publication(1), publication(2, Decision.CANARY, share=0.0, awaiting="approval"))

Every override reaches the event exactly as given (never converted), so a test that needs a wrong
dtype, a list where an array belongs or a missing value gets exactly what it built; ``ids`` and
``logprobs`` pack plain sequences as events hold them (int32 ids, float32 logprobs).

A test file whose events differ from these defaults in the same way everywhere keeps a small
local function that passes its differences here (``def generation(gid, group): return
factories.generation(gid, group_id=group, ...)``), so the differences are written once and are
all a reader has to look at.

Realistic ~1 KB generations for the fault and throughput tests are ``tests.faults.records``;
deterministic rollout units for the trainer's tests are ``tests.unit_log``; random events of every
type for the Avro writer and reader comparisons are ``tests.unit.random_events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from reef_stream.api.processor import unit_id as derived_unit_id
from reef_stream.core.events import (
    Decision, Feedback, FinishReason, Generation, Publication, RolloutUnit, Sample, SamplingParams,
)
from reef_stream.publishing.publications import PublicationLedger

#: the default ``created_at`` of every factory (epoch milliseconds: 2026-11-18)
T0 = 1_795_000_000_000


def generation(generation_id: str = "g-1", **overrides: Any) -> Generation:
    """A valid ``Generation`` called ``generation_id``: prompt ``[1, 2, 3]``, completion
    ``[4, 5]`` with logprobs ``[-0.5, -1.25]``, finished (STOP) by model ``tiny`` at policy version
    0 on ``replica-a``, ungrouped, sampled with ``max_tokens=16``, created at ``T0``. Any field is
    a keyword."""
    fields: dict[str, Any] = dict(
        generation_id=generation_id, request_id="r-1", prompt_id="p-1", model="tiny",
        policy_version=0, replica_id="replica-a",
        prompt_token_ids=ids([1, 2, 3]), completion_token_ids=ids([4, 5]),
        completion_logprobs=logprobs([-0.5, -1.25]),
        finish_reason=FinishReason.STOP, sampling=SamplingParams(max_tokens=16), created_at=T0)
    fields.update(overrides)
    return Generation(**fields)


def feedback(generation_id: str = "g-1", **overrides: Any) -> Feedback:
    """A valid ``Feedback`` on ``generation_id``: reward 1.0 from source ``judge``, no
    components, created at ``T0``; its id is ``"<generation_id>:<source>"`` unless
    ``feedback_id`` is given. Any field is a keyword."""
    fields: dict[str, Any] = dict(generation_id=generation_id, source="judge", reward=1.0,
                                  created_at=T0)
    fields.update(overrides)
    fields.setdefault("feedback_id", f"{generation_id}:{fields['source']}")
    return Feedback(**fields)


def sample(generation_id: str = "g-1", **overrides: Any) -> Sample:
    """A valid ``Sample`` of ``generation_id`` (what a unit holds of one generation): prompt
    ``p-1`` ``[1, 2, 3]``, completion ``[4, 5]`` with logprobs ``[-0.5, -1.25]``, policy version
    0, reward 1.0; the rest are ``Sample``'s own defaults. Any field is a keyword."""
    fields: dict[str, Any] = dict(
        generation_id=generation_id, prompt_id="p-1", policy_version=0,
        prompt_token_ids=ids([1, 2, 3]), completion_token_ids=ids([4, 5]),
        completion_logprobs=logprobs([-0.5, -1.25]), reward=1.0)
    fields.update(overrides)
    return Sample(**fields)


def rollout_unit(*members: Sample, recipe: str = "tiny", **overrides: Any) -> RolloutUnit:
    """A ``RolloutUnit`` of ``members`` (as given: none makes an empty unit) for ``recipe``: its
    id derived from the recipe and the members' generation ids as the processor derives it,
    grouped by the first member's prompt (``p-1`` if none), created at ``T0``. Any field is a
    keyword."""
    fields: dict[str, Any] = dict(
        unit_id=derived_unit_id(recipe, [m.generation_id for m in members]), recipe=recipe,
        group_key=members[0].prompt_id if members else "p-1", members=tuple(members),
        created_at=T0)
    fields.update(overrides)
    return RolloutUnit(**fields)


def publication(version: int, decision: Decision = Decision.PROMOTED,
                **overrides: Any) -> Publication:
    """A ``Publication`` of model ``m`` at ``version`` (checkpoint ``c<version>``, published at
    ``/pub/v<version>`` with sha256 ``sha<version>``), decided ``decision`` by evaluator ``e``
    after evaluating it, for reason ``because``; the checkpoint and the decision both created
    at ``1000 * version``. Any field is a keyword."""
    fields: dict[str, Any] = dict(
        model="m", policy_version=version, checkpoint_id=f"c{version}", uri=f"/pub/v{version}",
        sha256=f"sha{version}", decision=decision, reason="because", evaluator="e",
        evaluated=True, created_at=1000 * version, checkpoint_created_at=1000 * version)
    fields.update(overrides)
    return Publication(**fields)


def ledger_of(*publications: Publication) -> PublicationLedger:
    """A ``PublicationLedger`` (of no broker: it is never caught up) that recorded
    ``publications`` in order."""
    ledger = PublicationLedger("unused:9092", "ns")
    for one in publications:
        ledger.record(one)
    return ledger


def ids(values: Sequence[int]) -> np.ndarray:
    """``values`` as packed token ids (int32)."""
    return np.array(values, dtype=np.int32)


def logprobs(values: Sequence[float]) -> np.ndarray:
    """``values`` as packed logprobs (float32)."""
    return np.array(values, dtype=np.float32)
