"""When a trainer has stalled after rejections, what data-parallel ranks agree on at a meeting,
and when the evaluator lets its rollback through (reef_stream.publishing.rollback): pure
functions, no broker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reef_stream.core.errors import FatalError
from reef_stream.core.events import Decision, Publication, TopicOffset
from reef_stream.engine.checkpoints import CheckpointContents
from reef_stream.publishing.rollback import (
    Agreed, Vote, agree, check_rollback, rollback_contents, stall_reason,
)


def publication(version: int, decision: Decision = Decision.PROMOTED) -> Publication:
    return Publication(model="m", policy_version=version, checkpoint_id=f"c{version}",
                       uri=f"file:///v{version}", sha256="0" * 64, decision=decision,
                       reason="test", evaluator="test", evaluated=True,
                       measurement={"score": 0.5}, created_at=1)


def test_a_trainer_is_stalled_only_once_its_newest_version_is_decided_past_the_staleness():
    served = publication(1)
    # max_staleness 2: at step 3 a sample of version 1 is still trainable.
    assert stall_reason(3, 2, served, decided_version=3) is None
    # Step 4, its candidate not decided yet: a promotion may still come.
    assert stall_reason(4, 2, served, decided_version=3) is None
    reason = stall_reason(4, 2, served, decided_version=4)
    assert reason is not None and "serve version 1, 3 behind the trainer's 4" in reason
    # Nothing promoted: nothing to go back to.
    assert stall_reason(9, 2, None, decided_version=9) is None
    # The newest version was promoted: it is the incumbent, nothing is stale.
    assert stall_reason(9, 2, publication(9), decided_version=9) is None
    # max_staleness 0: one step past the served version with its candidate rejected.
    assert stall_reason(2, 0, publication(1), decided_version=2) is not None


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "b": torch.zeros(3)}


def test_the_evaluator_promotes_a_rollback_only_to_the_incumbent_s_exact_weights():
    incumbent = publication(3)
    decision, reason = check_rollback(3, incumbent, weights(0.5), weights(0.5))
    assert decision is Decision.PROMOTED and "weights of version 3" in reason
    # One element different.
    changed = weights(0.5)
    changed["w"][1, 2] = 0.5000001
    assert check_rollback(3, incumbent, changed, weights(0.5))[0] is Decision.REJECTED
    # A tensor missing or extra.
    assert check_rollback(3, incumbent, {"w": weights(0.5)["w"]}, weights(0.5))[0] \
        is Decision.REJECTED
    # The incumbent moved on (a newer promotion): never back past it.
    decision, reason = check_rollback(3, publication(6), weights(0.5), weights(0.5))
    assert decision is Decision.REJECTED and "incumbent is now version 6" in reason
    assert check_rollback(3, None, weights(0.5), None)[0] is Decision.REJECTED
    # The incumbent's weights could not be read.
    assert check_rollback(3, incumbent, weights(0.5), None)[0] is Decision.REJECTED


def test_a_rollback_checkpoint_holds_the_incumbent_s_state_at_the_trainer_s_offsets():
    incumbent = CheckpointContents(
        step=3, policy_version=3, model="m", recipe="r", trainer_group="g", weights=weights(0.5),
        optimizer={"state": {}, "param_groups": []}, rng={"torch": torch.arange(4)},
        algorithm_state={"baseline": 0.25}, offsets=(TopicOffset(topic="u", partition=0, offset=10),),
        trained_units=np.array([1, 2], dtype=np.uint64), step_units=("a",),
        metrics={"loss": 1.0}, created_at=5)
    offsets = (TopicOffset(topic="u", partition=0, offset=40), TopicOffset(topic="u", partition=1, offset=7))
    rolled = rollback_contents(incumbent, step=8, model="m", recipe="r", group="g",
                               offsets=offsets, trained={9, 1, 5}, rolled_back_to=3,
                               created_at=77)
    assert (rolled.step, rolled.policy_version, rolled.rolled_back_to) == (8, 8, 3)
    assert rolled.weights is incumbent.weights and rolled.optimizer is incumbent.optimizer
    assert rolled.rng is incumbent.rng and rolled.algorithm_state == {"baseline": 0.25}
    assert rolled.offsets == offsets            # the trainer's position, not the incumbent's
    assert rolled.trained_units.tolist() == [1, 5, 9] and rolled.trained_units.dtype == np.uint64
    assert rolled.step_units == () and dict(rolled.metrics) == {} and rolled.created_at == 77


def test_ranks_agree_on_a_stop_before_a_rollback_and_on_a_rollback_before_a_step():
    ready, reading = Vote(step=4, ready=True), Vote(step=4)
    assert agree([ready, ready]) is Agreed.STEP
    assert agree([ready, reading]) is agree([reading, ready]) is Agreed.WAIT
    assert agree([reading, reading]) is Agreed.WAIT
    # Rank 0 found the trainer stalled: a rollback, even with every share held.
    stalled = Vote(step=4, ready=True, roll_back_to=1)
    assert agree([stalled, ready]) is agree([Vote(step=4, roll_back_to=1), reading]) \
        is Agreed.ROLL_BACK
    # Only rank 0 follows the publications: another rank's vote to roll back is not counted.
    assert agree([ready, Vote(step=4, ready=True, roll_back_to=1)]) is Agreed.STEP
    # Any rank asked to stop stops them all, before anything else.
    assert agree([stalled, Vote(step=4, stop=True)]) is Agreed.STOP
    with pytest.raises(FatalError, match=r"different steps \[4, 5\]"):
        agree([ready, Vote(step=5, ready=True)])
    # One rank meets alone.
    assert agree([Vote(step=0, roll_back_to=3)]) is Agreed.ROLL_BACK


def test_a_vote_travels_as_json_and_anything_else_is_a_rank_out_of_step():
    vote = Vote(step=7, ready=True, stop=False, roll_back_to=2)
    assert Vote.decode(vote.encode(), 0) == vote
    assert Vote.decode(Vote(step=0).encode(), 1) == Vote(step=0, roll_back_to=None)
    # An empty message: the other rank is in _resume's barrier, not at a meeting.
    for garbage in (b"", b"{\"units\": []}", b"\x00\x01"):
        with pytest.raises(FatalError, match="rank 1 is out of step"):
            Vote.decode(garbage, 1)
