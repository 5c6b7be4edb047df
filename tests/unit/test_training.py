"""The torch backend without a broker: collation, completion logprobs, deterministic steps."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from reef_stream.api.losses import VALUE_REGRESSION
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError
from reef_stream.engine.training import TorchBackend, collate, completion_logprobs
from tests import factories
from tests.recipes.trainable import recipe
from tests.unit_log import rollout_unit


def _sample(prompt, completion):
    return factories.sample("g", prompt_id="p", prompt_token_ids=factories.ids(prompt),
                            completion_token_ids=factories.ids(completion),
                            completion_logprobs=np.full(len(completion), -1.0, dtype=np.float32))


def test_collate_pads_and_completion_logprobs_read_the_predicting_position():
    batch = collate([_sample([1, 2], [3, 4, 5]), _sample([6], [7])])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.behaviour_logprobs.tolist() == [[-1, -1, -1], [-1, 0, 0]]
    # Logits that put all mass on "the position's own index": token 3 is predicted at position 1.
    logits = torch.full((2, 5, 10), -1e9)
    for position in range(5):
        logits[:, position, position + 2] = 0.0   # position i predicts token i + 2
    logprobs = completion_logprobs(logits, batch)
    assert logprobs[0].tolist() == [0.0, 0.0, 0.0]      # 3 at 1, 4 at 2, 5 at 3: all predicted
    assert logprobs[1, 0] < -1e8 and logprobs[1, 1:].tolist() == [0.0, 0.0]  # 7 at 0: not


def _step(backend, units, step, state):
    result = recipe.objective.compute(units, state)
    return backend.train_step(units, result, step), result.proposed_state


def test_the_same_units_from_the_same_state_give_bitwise_the_same_weights():
    units = [rollout_unit(i) for i in range(8)]
    runs = []
    for _ in range(2):
        backend, state = TorchBackend(recipe), recipe.objective.initial_state()
        before = {k: v.clone() for k, v in backend.state()[0].items()}
        for step in range(2):
            metrics, state = _step(backend, units[step * 4:(step + 1) * 4], step + 1, state)
            assert np.isfinite(metrics["loss"]) and "objective.reward_mean" in metrics
        runs.append(backend.state()[0])
    assert any(not torch.equal(before[k], runs[0][k]) for k in before), "training changed nothing"
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_restoring_a_state_continues_exactly():
    units = [rollout_unit(i) for i in range(8)]
    straight, state = TorchBackend(recipe), recipe.objective.initial_state()
    _, mid_state = _step(straight, units[:4], 1, state)
    saved = straight.state()
    saved = ({k: v.clone() for k, v in saved[0].items()}, copy.deepcopy(saved[1]),
             {k: v.clone() for k, v in saved[2].items()})
    _step(straight, units[4:], 2, mid_state)

    resumed = TorchBackend(recipe)
    resumed.restore(*saved)
    _step(resumed, units[4:], 2, mid_state)
    for name, tensor in straight.state()[0].items():
        assert torch.equal(tensor, resumed.state()[0][name]), name


def test_max_grad_norm_clips_each_update_and_the_step_reports_the_norm_before_clipping():
    import dataclasses

    units = [rollout_unit(i) for i in range(4)]
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731 - the update is lr x grad
    one_update = dataclasses.replace(recipe.schedule, optimizer_batch_size=4, micro_batch_size=2,
                                     epochs=1)
    free = dataclasses.replace(recipe, schedule=one_update,
                               backend=dataclasses.replace(recipe.backend, optimizer=sgd))
    clipped = dataclasses.replace(free, backend=dataclasses.replace(free.backend,
                                                                    max_grad_norm=0.005))
    runs = {}
    for name, chosen in (("free", free), ("clipped", clipped)):
        backend = TorchBackend(chosen)
        before = {k: v.clone() for k, v in backend.state()[0].items()}
        result = chosen.objective.compute(units, chosen.objective.initial_state())
        metrics = backend.train_step(units, result, 1)
        runs[name] = (metrics, {k: before[k] - v for k, v in backend.state()[0].items()})
    free_metrics, free_delta = runs["free"]
    clipped_metrics, clipped_delta = runs["clipped"]
    norm = free_metrics["grad_norm"]
    assert norm > 0.01 and clipped_metrics["grad_norm"] == pytest.approx(norm)
    # One SGD update each: the clipped one is the free one scaled to a gradient norm of 0.005.
    update_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d)
                                                        for d in clipped_delta.values()]))
    assert float(update_norm) == pytest.approx(0.1 * 0.005, rel=1e-3)
    for name, delta in free_delta.items():
        torch.testing.assert_close(clipped_delta[name], delta * (0.005 / norm), rtol=1e-2,
                                   atol=5e-7)  # float32 weights: ~1e-7 of rounding


def test_a_bad_max_grad_norm_is_a_recipe_problem():
    import dataclasses

    from reef_stream.api.recipe import recipe_problems

    for bad in (0, -1.0, float("nan"), True):
        broken = dataclasses.replace(recipe, backend=dataclasses.replace(recipe.backend,
                                                                         max_grad_norm=bad))
        assert any("max_grad_norm must be a positive finite number" in p
                   for p in recipe_problems(broken)), bad


def test_a_recipe_without_a_model_cannot_train():
    bare = Recipe(name="bare", processor=recipe.processor, objective=recipe.objective,
                  schedule=recipe.schedule,
                  backend=Backend(name="torch", loss_families=recipe.backend.loss_families))
    with pytest.raises(ConfigurationError, match="has no model"):
        TorchBackend(bare)


class RewardTargets:
    """value_regression: the targets are the samples' rewards; no state."""

    name = "reward-targets"
    unit_type = recipe.objective.unit_type
    loss_family = VALUE_REGRESSION

    def initial_state(self):
        return recipe.objective.initial_state()

    def compute(self, units, state):
        rewards = np.array([m.reward for u in units for m in u.members], dtype=np.float32)
        return ObjectiveResult(advantages=PerSampleAdvantages(rewards), metrics={},
                               proposed_state=state, loss_family=VALUE_REGRESSION)


def test_value_regression_fits_the_value_head_to_its_targets():
    regression = Recipe(
        name="values", processor=recipe.processor, objective=RewardTargets(),
        schedule=Schedule(units_per_step=4, optimizer_batch_size=4, micro_batch_size=4,
                          shuffle=False, max_staleness=0),
        backend=Backend(name="torch", loss_families=(VALUE_REGRESSION,),
                        model=recipe.backend.model,
                        optimizer=lambda params: torch.optim.Adam(params, lr=0.02)))
    backend, state = TorchBackend(regression), regression.objective.initial_state()
    units = [rollout_unit(i) for i in range(4)]
    losses = [backend.train_step(units, regression.objective.compute(units, state), step)["mse"]
              for step in range(1, 61)]
    assert losses[-1] < 0.2 * losses[0], losses[::10]
