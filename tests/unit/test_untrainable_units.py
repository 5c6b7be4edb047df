"""What the torch backend can train, without a broker: ``untrainable`` names each kind of unit
that decodes but cannot be trained, precisely; each of those kinds really breaks a step (or
would train on something nobody generated); and a step whose advantages, loss or gradient norm
are still not finite raises ``NonFiniteStep`` before its update reaches the weights."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from reef_stream.api.losses import POLICY_GRADIENT, LossOutput
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages, PerTokenAdvantages
from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError, ReefError
from reef_stream.core.events import RolloutUnit
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.task import VOCAB_SIZE, TinyTransformer
from reef_stream.engine.models import TinyCausalLM
from reef_stream.engine.training import (
    NonFiniteStep, TorchBackend, UnitLimits, model_limits, untrainable,
)
from tests.recipes.parts import RewardStats
from tests.recipes.trainable import recipe
from tests.unit_log import rollout_unit

LIMITS = UnitLimits(vocab_size=64)  # the trainable recipe's TinyCausalLM(vocab_size=64)


def decoded(unit: RolloutUnit) -> RolloutUnit:
    """``unit`` as the trainer reads it: encoded and decoded (read-only little-endian views)."""
    registry = SchemaRegistry.default()
    return registry.decode(*registry.encode(unit), RolloutUnit)


def spoiled(i: int, member: int = 1, **changes) -> RolloutUnit:
    """Unit ``i`` (4 samples of 6 prompt and 10 completion tokens) with ``changes`` made to
    sample ``member``, through the wire."""
    unit = rollout_unit(i)
    members = list(unit.members)
    members[member] = dataclasses.replace(members[member], **changes)
    return decoded(dataclasses.replace(unit, members=tuple(members)))


def with_token(i: int, field: str, position: int, token: int) -> RolloutUnit:
    ids = getattr(rollout_unit(i).members[1], field).copy()
    ids[position] = token
    return spoiled(i, **{field: ids})


def with_logprob(i: int, position: int, value: float) -> RolloutUnit:
    logprobs = rollout_unit(i).members[1].completion_logprobs.copy()
    logprobs[position] = value
    return spoiled(i, completion_logprobs=logprobs)


def name(i: int) -> str:
    return f"unit {rollout_unit(i).unit_id} cannot be trained"


# --------------------------------------------------------------------------- the check


def test_a_good_unit_passes():
    assert untrainable(decoded(rollout_unit(0)), LIMITS) is None
    assert untrainable(rollout_unit(0), LIMITS) is None  # as built in-process, too
    assert untrainable(decoded(rollout_unit(1, vocab=64, prompt_len=0)), LIMITS) is None
    # The edges of the vocabulary, and no completion at all: trainable (nothing predicts it).
    assert untrainable(with_token(2, "completion_token_ids", 0, 63), LIMITS) is None
    assert untrainable(with_token(2, "prompt_token_ids", 0, 0), LIMITS) is None
    empty = np.array([], np.int32)
    assert untrainable(spoiled(3, completion_token_ids=empty,
                               completion_logprobs=np.array([], np.float32)), LIMITS) is None
    assert untrainable(decoded(rollout_unit(4, prompt_len=6, completion_len=10)),
                       UnitLimits(vocab_size=64, max_length=16)) is None


BAD = {
    "no samples": (
        lambda: decoded(dataclasses.replace(rollout_unit(0), members=())),
        f"{name(0)}: it has no samples"),
    "completion token id at the vocabulary size": (
        lambda: with_token(1, "completion_token_ids", 3, 64),
        f"{name(1)}: completion token id 64 at position 3 of generation g1-1 is outside the "
        "model's vocabulary (0..63)"),
    "negative prompt token id": (
        lambda: with_token(2, "prompt_token_ids", 5, -1),
        f"{name(2)}: prompt token id -1 at position 5 of generation g2-1 is outside the model's "
        "vocabulary (0..63)"),
    "huge completion token id": (
        lambda: with_token(3, "completion_token_ids", 9, 50321),
        f"{name(3)}: completion token id 50321 at position 9 of generation g3-1 is outside the "
        "model's vocabulary (0..63)"),
    "fewer logprobs than completion tokens": (
        lambda: spoiled(4, completion_logprobs=np.full(9, -1.0, np.float32)),
        f"{name(4)}: generation g4-1 has 10 completion tokens but 9 completion logprobs (the "
        "loss needs one per token)"),
    "one logprob for ten tokens (would broadcast)": (
        lambda: spoiled(5, completion_logprobs=np.array([-1.0], np.float32)),
        f"{name(5)}: generation g5-1 has 10 completion tokens but 1 completion logprobs (the "
        "loss needs one per token)"),
    "no tokens at all": (
        lambda: spoiled(6, prompt_token_ids=np.array([], np.int32),
                        completion_token_ids=np.array([], np.int32),
                        completion_logprobs=np.array([], np.float32)),
        f"{name(6)}: generation g6-1 has no tokens (its prompt and completion are empty)"),
    "NaN logprob": (
        lambda: with_logprob(7, 2, float("nan")),
        f"{name(7)}: completion logprob at position 2 of generation g7-1 is NaN"),
    "-inf logprob": (
        lambda: with_logprob(8, 0, float("-inf")),
        f"{name(8)}: completion logprob at position 0 of generation g8-1 is -inf"),
    "NaN reward": (
        lambda: spoiled(9, reward=float("nan")),
        f"{name(9)}: reward of generation g9-1 is NaN"),
    "infinite reward": (
        lambda: spoiled(10, reward=float("inf")),
        f"{name(10)}: reward of generation g10-1 is inf"),
    "infinite reward component": (
        lambda: spoiled(11, reward_components={"format": 1.0, "length": float("-inf")}),
        f"{name(11)}: reward component 'length' of generation g11-1 is -inf"),
    "a policy_mask shorter than the completion": (
        lambda: spoiled(21, policy_mask=np.ones(9, np.uint8)),
        f"{name(21)}: generation g21-1: its policy_mask has 9 values for 10 completion tokens "
        "(one per token, or none)"),
    "a policy_mask that is not 0/1": (
        lambda: spoiled(22, policy_mask=np.full(10, 2, np.uint8)),
        f"{name(22)}: generation g22-1: its policy_mask holds values other than 0 and 1"),
    "a policy_mask with no policy token": (
        lambda: spoiled(23, policy_mask=np.zeros(10, np.uint8)),
        f"{name(23)}: generation g23-1: its policy_mask marks no completion token as the "
        "policy's: nothing to train"),
}


def test_a_multi_turn_mask_that_fits_its_tokens_is_trainable():
    mask = np.array([1, 0, 0, 1, 1, 1, 1, 1, 1, 1], np.uint8)
    assert untrainable(spoiled(24, policy_mask=mask), LIMITS) is None


@pytest.mark.parametrize("kind", BAD)
def test_each_kind_of_untrainable_unit_gets_its_precise_reason(kind):
    make, reason = BAD[kind]
    assert untrainable(make(), LIMITS) == reason


def test_too_many_tokens_for_the_model():
    unit = decoded(rollout_unit(12, prompt_len=6, completion_len=10))
    assert untrainable(unit, UnitLimits(vocab_size=64, max_length=15)) == (
        f"{name(12)}: generation g12-0 has 16 tokens (6 prompt + 10 completion); the model takes "
        "at most 15; 3 more of its 4 samples cannot be trained either")


def test_the_first_problem_is_named_and_the_others_counted():
    unit = rollout_unit(13)
    members = [dataclasses.replace(m, reward=float("nan")) if k != 0 else m
               for k, m in enumerate(unit.members)]
    assert untrainable(decoded(dataclasses.replace(unit, members=tuple(members))), LIMITS) == (
        f"{name(13)}: reward of generation g13-1 is NaN; 2 more of its 4 samples cannot be "
        "trained either")


def test_the_limits_come_from_the_model():
    assert model_limits(TinyCausalLM(vocab_size=64, dim=8)) == UnitLimits(64)
    assert model_limits(TinyTransformer(dim=8, heads=2, max_len=16)) == UnitLimits(VOCAB_SIZE, 16)
    hugging_face_like = SimpleNamespace(config=SimpleNamespace(vocab_size=32000))
    assert model_limits(hugging_face_like) == UnitLimits(32000)
    with pytest.raises(ConfigurationError, match="says no vocabulary size.*vocab_size"):
        model_limits(torch.nn.Linear(2, 2))


def test_a_backend_without_a_vocabulary_size_is_a_configuration_error():
    bare = dataclasses.replace(recipe, backend=dataclasses.replace(
        recipe.backend, model=lambda: torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigurationError, match="Linear says no vocabulary size"):
        TorchBackend(bare)
    assert TorchBackend(recipe).limits == LIMITS


# --------------------------------------------------------------------------- why each matters


def _weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.state()[0].items()}


def _unchanged(before: dict[str, torch.Tensor], backend: TorchBackend) -> bool:
    after = backend.state()[0]
    return all(torch.equal(before[k], after[k]) for k in before)


#: One optimizer update a step, so a step that fails fails before any update.
ONE_UPDATE = dataclasses.replace(recipe, schedule=Schedule(
    units_per_step=4, optimizer_batch_size=4, micro_batch_size=1, epochs=1, seed=7,
    max_staleness=3))

#: What a step (objective, then backend) with the bad unit does without the check: the
#: exception it raises (NonFiniteStep: the guard caught what would have become NaN weights).
UNGUARDED = {
    "no samples": ReefError,                                    # collate: no sample
    "completion token id at the vocabulary size": (IndexError, RuntimeError),  # gather
    "huge completion token id": (IndexError, RuntimeError),
    "fewer logprobs than completion tokens": ValueError,        # collate: shapes
    "no tokens at all": RuntimeError,                           # a sequence of length 0
    "NaN logprob": NonFiniteStep,
    # (An -inf logprob no longer breaks the step: the losses clamp the log-ratio, so its ratio
    # is e^20; the check still refuses it, as a logprob nobody generated.)
    "NaN reward": ReefError,        # the objective's reward_mean metric is NaN: FatalError
    "infinite reward": ReefError,
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN it is given
@pytest.mark.parametrize("kind", UNGUARDED)
def test_without_the_check_the_step_fails_and_the_weights_are_untouched(kind):
    make, _ = BAD[kind]
    bad = make()
    if kind == "no tokens at all":  # alone in its unit, so alone in its micro batch
        bad = dataclasses.replace(bad, members=bad.members[1:2])
    units = [bad, *(decoded(rollout_unit(20 + k)) for k in range(3))]
    backend = TorchBackend(ONE_UPDATE)
    before = _weights(backend)
    with pytest.raises(UNGUARDED[kind]):
        backend.train_step(units, ONE_UPDATE.objective.compute(units, RewardStats()), 1)
    assert _unchanged(before, backend)


def test_a_too_long_sample_breaks_a_model_with_a_length_limit():
    transformer = dataclasses.replace(ONE_UPDATE, backend=dataclasses.replace(
        recipe.backend, model=lambda: TinyTransformer(dim=8, heads=2, max_len=12)))
    backend = TorchBackend(transformer)
    units = [decoded(rollout_unit(30 + k, vocab=VOCAB_SIZE, prompt_len=4, completion_len=9))
             for k in range(4)]
    assert untrainable(units[0], backend.limits).endswith(
        "has 13 tokens (4 prompt + 9 completion); the model takes at most 12; 3 more of its 4 "
        "samples cannot be trained either")
    with pytest.raises(ReefError, match="at most 12 tokens"):
        backend.train_step(units, ONE_UPDATE.objective.compute(units, RewardStats()), 1)


def test_a_prompt_token_outside_the_vocabulary_is_silently_clamped_by_the_tiny_models():
    """No error to show for this one: TinyCausalLM clamps input ids, so without the check the
    step trains on token 63 where the generation had 500 (another model would raise)."""
    bad = with_token(40, "prompt_token_ids", 0, 500)
    clamped = with_token(40, "prompt_token_ids", 0, 63)
    runs = []
    for first in (bad, clamped):
        units = [first, *(decoded(rollout_unit(41 + k)) for k in range(3))]
        backend = TorchBackend(ONE_UPDATE)
        backend.train_step(units, ONE_UPDATE.objective.compute(units, RewardStats()), 1)
        runs.append(backend.state()[0])
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert untrainable(bad, LIMITS) is not None


# --------------------------------------------------------------------------- the guard


def _result(units, advantages) -> ObjectiveResult:
    return ObjectiveResult(advantages=advantages, metrics={}, proposed_state=RewardStats(),
                           loss_family=POLICY_GRADIENT)


def test_non_finite_advantages_stop_the_step_before_any_update():
    units = [decoded(rollout_unit(50 + k)) for k in range(4)]
    values = np.zeros(16, np.float32)
    values[9] = np.nan   # unit 2's second sample
    backend = TorchBackend(ONE_UPDATE)
    before = _weights(backend)
    with pytest.raises(NonFiniteStep) as caught:
        backend.train_step(units, _result(units, PerSampleAdvantages(values)), 7)
    assert str(caught.value).startswith(
        f"step 7, units {units[2].unit_id}: the objective returned NaN or infinite advantages "
        "for 1 of 16 samples (first: row 9). ")
    assert "lower the learning rate" in str(caught.value)
    assert _unchanged(before, backend)


def test_a_non_finite_loss_names_the_step_and_the_micro_batch_units():
    units = [with_logprob(60, 0, float("nan")), *(decoded(rollout_unit(61 + k)) for k in range(3))]
    backend = TorchBackend(ONE_UPDATE)
    before = _weights(backend)
    with pytest.raises(NonFiniteStep, match=(
            rf"^step 3, units {units[0].unit_id}: the loss of a micro batch \(epoch 1\) is "
            r"NaN\. ")):
        backend.train_step(units, ONE_UPDATE.objective.compute(units, RewardStats()), 3)
    assert _unchanged(before, backend)


def test_a_non_finite_gradient_norm_stops_the_update():
    """A finite loss whose gradient is NaN (the square root's at 0): the optimizer never
    steps on it."""
    def finite_loss_nan_gradient(inputs):
        return LossOutput(loss=torch.sqrt(inputs.logprobs * 0).sum())

    sqrt_at_zero = dataclasses.replace(ONE_UPDATE, backend=dataclasses.replace(
        recipe.backend, losses={POLICY_GRADIENT: finite_loss_nan_gradient}))
    units = [decoded(rollout_unit(70 + k)) for k in range(4)]
    backend = TorchBackend(sqrt_at_zero)
    before = _weights(backend)
    with pytest.raises(NonFiniteStep, match=(
            r"^step 1, units .*: the gradient norm of an optimizer batch \(epoch 1\) is "
            r"NaN\. ")) as caught:
        backend.train_step(units, sqrt_at_zero.objective.compute(units, RewardStats()), 1)
    assert all(u.unit_id in str(caught.value) for u in units)   # the optimizer batch: all four
    assert _unchanged(before, backend)


def test_per_token_advantages_on_padding_are_ignored_even_when_not_finite():
    units = [decoded(rollout_unit(80 + k)) for k in range(4)]
    values = np.full((16, 12), np.nan, np.float32)   # completions are 10 tokens: 2 of padding
    mask = np.zeros((16, 12), bool)
    values[:, :10], mask[:, :10] = 0.5, True
    values[3, 4], mask[3, 4] = np.nan, False          # a real token, masked out
    backend = TorchBackend(ONE_UPDATE)
    metrics = backend.train_step(units, _result(units, PerTokenAdvantages(values, mask)), 1)
    assert np.isfinite(metrics["loss"])
    assert all(torch.isfinite(w).all() for w in backend.state()[0].values())
