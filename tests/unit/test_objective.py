"""Objective results: frozen, shape-checked, with a checkpointable algorithm state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.objective import (
    Objective, ObjectiveResult, PerSampleAdvantages, PerTokenAdvantages, rollout_samples,
    state_from_record, state_record,
)
from reef_stream.core.errors import FatalError
from reef_stream.core.events import RolloutUnit
from reef_stream.engine.testing import run_processor
from tests.recipes.parts import GroupBaseline, RewardStats
from tests.unit.test_processor import GROUPED, feedback, generation


def units() -> list[RolloutUnit]:
    records = [generation("a", "g1", 2), generation("b", "g1", 2), generation("c"),
               feedback("a", reward=1.0), feedback("b", reward=0.0), feedback("c", reward=0.5)]
    return [u.unit for u in run_processor(GROUPED, records).units]


def test_an_objective_computes_advantages_in_sample_order_and_proposes_state():
    objective = GroupBaseline()
    assert isinstance(objective, Objective)
    batch = units()
    assert [s.generation_id for s in rollout_samples(batch)] == ["a", "b", "c"]
    result = objective.compute(batch, RewardStats(count=1, mean=0.0))
    assert result.advantages.values.tolist() == [0.5, -0.5, 0.0]
    assert result.advantages.num_samples == 3
    assert result.metrics == {"reward_mean": 0.5}
    assert result.proposed_state == RewardStats(count=4, mean=1.5 / 4)
    assert result.loss_family is POLICY_GRADIENT
    assert objective.compute(batch, RewardStats(count=1, mean=0.0)).proposed_state == \
        result.proposed_state  # deterministic: a replayed step proposes the same


def test_results_are_frozen_and_their_metrics_read_only():
    result = GroupBaseline().compute(units(), RewardStats())
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.metrics = {}
    with pytest.raises(TypeError):
        result.metrics["x"] = 1.0


def test_per_token_advantages_take_numpy_or_torch_with_a_matching_mask():
    PerTokenAdvantages(values=np.zeros((2, 5), np.float32), mask=np.ones((2, 5), bool))
    tokens = PerTokenAdvantages(values=torch.zeros(2, 5), mask=torch.ones(2, 5, dtype=torch.bool))
    assert tokens.num_samples == 2
    with pytest.raises(FatalError, match=r"values have shape \(2, 5\), mask \(2, 4\)"):
        PerTokenAdvantages(values=torch.zeros(2, 5), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(FatalError, match="must have 1 dims"):
        PerSampleAdvantages(values=np.zeros((2, 1)))
    with pytest.raises(FatalError, match="numpy array or a torch tensor"):
        PerSampleAdvantages(values=[0.5, -0.5])


@pytest.mark.parametrize("change, words", [
    ({"advantages": np.zeros(3)}, "PerSampleAdvantages or PerTokenAdvantages"),
    ({"metrics": {"kl": float("nan")}}, "finite floats"),
    ({"metrics": {"kl": "0.1"}}, "finite floats"),
    ({"loss_family": "policy_gradient"}, "must be a LossFamily"),
])
def test_a_malformed_result_is_refused(change, words):
    fields = dict(advantages=PerSampleAdvantages(np.zeros(3)), metrics={"kl": 0.1},
                  proposed_state=RewardStats(), loss_family=POLICY_GRADIENT)
    fields.update(change)
    with pytest.raises(FatalError, match=words):
        ObjectiveResult(**fields)


@dataclasses.dataclass(frozen=True)
class Coefficients:
    kl: float
    steps: int
    name: str
    history: tuple[float, ...]


def test_algorithm_state_round_trips_through_a_plain_record():
    state = Coefficients(kl=0.05, steps=3, name="adaptive", history=(0.1, 0.07))
    record = state_record(state)
    assert record == {"kl": 0.05, "steps": 3, "name": "adaptive", "history": [0.1, 0.07]}
    assert state_from_record(Coefficients, record) == state
    with pytest.raises(FatalError, match="holds ndarray"):
        state_record(Coefficients(kl=0.0, steps=0, name="", history=np.zeros(2)))
    with pytest.raises(FatalError, match="frozen dataclass"):
        state_record({"kl": 0.05})
