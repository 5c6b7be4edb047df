"""A multi-turn sample's environment tokens are masked out of training: collate ANDs the sample's
policy_mask into completion_mask, so the gradient of the policy-gradient loss is zero on the
logits that predict environment tokens (computed by backward, not assumed), and not zero on the
policy's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.objective import PerSampleAdvantages
from reef_stream.api.parts import ComposedProcessor, RequireSources, Ungrouped
from reef_stream.core.errors import FatalError
from reef_stream.core.events import (
    Feedback, Sample, SamplingParams, Segment, SegmentSource,
)
from reef_stream.engine.outcomes import Outcome
from reef_stream.engine.testing import Restart, run_processor
from reef_stream.engine.training import collate, completion_logprobs, policy_gradient_inputs
from tests import factories

VOCAB = 11


def sample(completion, mask=None, prompt=(1, 2, 3), generation_id="g") -> Sample:
    logprobs = np.full(len(completion), -1.5, dtype=np.float32)
    extra = {}
    if mask is not None:
        extra["policy_mask"] = np.array(mask, dtype=np.uint8)
        logprobs[np.array(mask) == 0] = 0.0  # environment tokens carry no logprob
    return factories.sample(generation_id, prompt_id="p", prompt_token_ids=factories.ids(prompt),
                            completion_token_ids=factories.ids(completion),
                            completion_logprobs=logprobs, **extra)


class Logits(torch.nn.Module):
    """A "model" whose logits are one leaf tensor, so its gradient is readable per position."""

    def __init__(self, batch: int, length: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(batch, length, VOCAB,
                                                    generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask):
        return self.table[:, :input_ids.shape[1]]


def gradient_by_completion_token(samples) -> torch.Tensor:
    """``float[B, T]``: the norm of the loss's gradient on the logits predicting each completion
    token."""
    batch = collate(samples)
    model = Logits(len(samples), batch.input_ids.shape[1])
    inputs = policy_gradient_inputs(model, batch, PerSampleAdvantages(
        values=np.array([1.0, 0.5][:len(samples)], dtype=np.float32)), np.arange(len(samples)))
    POLICY_GRADIENT.reference(inputs).loss.backward()
    t = batch.completion_ids.shape[1]
    positions = batch.completion_start[:, None] + torch.arange(t)[None, :] - 1
    grad = model.table.grad.norm(dim=-1)   # [B, L]
    return grad.gather(1, positions.clamp(min=0))


def test_collate_ands_the_policy_mask_into_completion_mask():
    batch = collate([sample([4, 5, 6, 7], mask=[1, 0, 0, 1]), sample([8, 9]),
                     sample([4, 5, 6], mask=[])])
    assert batch.completion_mask.tolist() == [
        [True, False, False, True], [True, True, False, False], [True, True, True, False]]
    # the environment tokens are still in the model's input: the policy is conditioned on them
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch.attention_mask[0].all()


def test_the_loss_gradient_is_zero_on_environment_tokens_and_not_on_the_policys():
    masked = gradient_by_completion_token([sample([4, 5, 6, 7], mask=[1, 0, 0, 1]),
                                           sample([8, 9, 10, 3], mask=[1, 1, 0, 1])])
    assert masked[0, 1] == 0 and masked[0, 2] == 0 and masked[1, 2] == 0
    assert (masked[0, [0, 3]] > 0).all() and (masked[1, [0, 1, 3]] > 0).all()
    # the same tokens without a mask: every token has a gradient (the mask is what zeroes it)
    unmasked = gradient_by_completion_token([sample([4, 5, 6, 7]), sample([8, 9, 10, 3])])
    assert (unmasked > 0).all()


def test_environment_tokens_add_nothing_to_the_current_logprobs_the_losses_read():
    batch = collate([sample([4, 5, 6, 7], mask=[1, 0, 0, 1])])
    logits = torch.randn(1, batch.input_ids.shape[1], VOCAB)
    logprobs = completion_logprobs(logits, batch)
    assert logprobs[0, 1] == 0 and logprobs[0, 2] == 0 and (logprobs[0, [0, 3]] < 0).all()


@pytest.mark.parametrize("mask", [[1, 0, 1], [1, 0, 2, 1], [0, 0, 0, 0]])
def test_collate_refuses_a_mask_that_does_not_fit(mask):
    with pytest.raises(FatalError, match="generation bad: its policy_mask"):
        collate([Sample(generation_id="bad", prompt_id="p", policy_version=0,
                        prompt_token_ids=np.array([1], dtype=np.int32),
                        completion_token_ids=np.array([4, 5, 6, 7], dtype=np.int32),
                        completion_logprobs=np.zeros(4, dtype=np.float32), reward=0.0,
                        policy_mask=np.array(mask, dtype=np.uint8))])



# --- the processor's join: the mask travels from the generation into the unit --------------


def generation(generation_id, segments=()):
    return factories.generation(
        generation_id, request_id="r", prompt_id="p", model="m", replica_id="x",
        prompt_token_ids=factories.ids([1, 2]), completion_token_ids=factories.ids([4, 5, 6, 7]),
        completion_logprobs=factories.logprobs([-1, 0, 0, -1]),
        sampling=SamplingParams(max_tokens=4), created_at=1,
        segments=tuple(Segment(source=SegmentSource[source], length=n) for source, n in segments))


def join(*generations):
    processor = ComposedProcessor(grouping=Ungrouped(),
                                  feedback=RequireSources(("exact",), timeout_ms=1_000))
    records = []
    for g in generations:   # a restart between each generation and its feedback: from snapshots
        records += [g, Restart(), Feedback(feedback_id=f"{g.generation_id}:f",
                                           generation_id=g.generation_id, source="exact",
                                           reward=1.0, created_at=1)]
    return run_processor(processor, records, finish=True)


def test_the_join_puts_each_multi_turn_generations_mask_in_its_sample():
    outcomes = join(generation("multi", [("POLICY", 1), ("ENVIRONMENT", 2), ("POLICY", 1)]),
                    generation("single"),
                    generation("turns", [("POLICY", 2), ("POLICY", 2)]),
                    generation("bad", [("POLICY", 1), ("ENVIRONMENT", 2)]))

    def sample_of(gid):
        (member,) = outcomes.unit_of(gid).unit.members
        return member

    assert sample_of("multi").policy_mask.tolist() == [1, 0, 0, 1]
    assert sample_of("single").policy_mask.size == 0
    assert sample_of("turns").policy_mask.size == 0   # no environment token: nothing masked
    bad = outcomes.outcome("bad")
    assert bad.outcome is Outcome.INVALID and "segments do not fit" in bad.reason
    # and collate masks the environment tokens of the unit's sample
    assert collate([sample_of("multi")]).completion_mask.tolist() == [[True, False, False, True]]
