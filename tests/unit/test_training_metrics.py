"""The trainer's policy-health metrics without a broker: the logprob gap by behaviour version,
KL to the behaviour policy, the update's relative size, and that measuring changes nothing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from reef_stream.core.metric_names import (
    TRAINER_KL_BEHAVIOUR, TRAINER_LOGPROB_GAP_OLDER, TRAINER_LOGPROB_GAP_OLDER_TOKENS,
    TRAINER_LOGPROB_GAP_SAME_VERSION, TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS, TRAINER_UPDATE_RATIO,
)
from reef_stream.engine.training import TorchBackend, collate, completion_logprobs
from tests.recipes.trainable import recipe
from tests.unit_log import rollout_unit

STEP = 3                 # the step trains version 2 into version 3
TOKENS_PER_UNIT = 4 * 10  # rollout_unit: 4 samples of 10 completion tokens, all after a prompt


def _recorded(backend, unit, offset):
    """``unit`` with each sample's recorded logprobs set to the backend's own, plus ``offset``."""
    model = backend.accelerator.unwrap_model(backend.model)
    batch = collate(unit.members)
    with torch.no_grad():
        true = completion_logprobs(model(batch.input_ids, batch.attention_mask), batch).numpy()
    members = tuple(dataclasses.replace(m, completion_logprobs=(true[row] + offset).astype(
        np.float32)) for row, m in enumerate(unit.members))
    return dataclasses.replace(unit, members=members)


def _units(backend, versions_and_offsets):
    return [_recorded(backend, rollout_unit(i, policy_version=version), offset)
            for i, (version, offset) in enumerate(versions_and_offsets)]


#: One update a step, so every sample's forward pass precedes it and is measured.
ONE_UPDATE = dataclasses.replace(recipe, schedule=dataclasses.replace(
    recipe.schedule, optimizer_batch_size=4, micro_batch_size=2, epochs=1))


def _train(backend, units, step=STEP):
    result = recipe.objective.compute(units, recipe.objective.initial_state())
    return backend.train_step(units, result, step)


def test_the_gap_is_attributed_to_the_behaviour_version_of_each_sample():
    backend = TorchBackend(ONE_UPDATE)
    # Version 2 (the trainer's) recorded exactly; versions 0 and 1 recorded 0.5 too low.
    units = _units(backend, [(2, 0.0), (0, -0.5), (2, 0.0), (1, -0.5)])
    metrics = _train(backend, units)
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION] == pytest.approx(0.0, abs=1e-6)
    assert metrics[TRAINER_LOGPROB_GAP_OLDER] == pytest.approx(0.5, abs=1e-5)
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS] == 2 * TOKENS_PER_UNIT
    assert metrics[TRAINER_LOGPROB_GAP_OLDER_TOKENS] == 2 * TOKENS_PER_UNIT
    # k3 with r = current - behaviour = 0.5 on half the tokens, 0 on the others.
    assert metrics[TRAINER_KL_BEHAVIOUR] == pytest.approx((math.exp(0.5) - 1.5) / 2, rel=1e-4)


def test_kl_is_zero_on_policy_and_a_bucket_without_samples_is_absent():
    backend = TorchBackend(ONE_UPDATE)
    metrics = _train(backend, _units(backend, [(2, 0.0)] * 4))
    assert metrics[TRAINER_KL_BEHAVIOUR] == pytest.approx(0.0, abs=1e-9)
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS] == 4 * TOKENS_PER_UNIT
    assert TRAINER_LOGPROB_GAP_OLDER not in metrics
    assert TRAINER_LOGPROB_GAP_OLDER_TOKENS not in metrics

    backend = TorchBackend(ONE_UPDATE)
    metrics = _train(backend, _units(backend, [(0, 0.25)] * 4))   # all stale, recorded too high
    assert TRAINER_LOGPROB_GAP_SAME_VERSION not in metrics
    assert TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS not in metrics
    assert metrics[TRAINER_LOGPROB_GAP_OLDER] == pytest.approx(0.25, abs=1e-5)
    assert metrics[TRAINER_KL_BEHAVIOUR] == pytest.approx(math.exp(-0.25) - 0.75, rel=1e-4)


def _with_sgd(lr):
    return dataclasses.replace(recipe, backend=dataclasses.replace(
        recipe.backend, optimizer=lambda params: torch.optim.SGD(params, lr=lr)))


def test_update_ratio_is_the_weights_change_relative_to_the_weights_before():
    units = [rollout_unit(i) for i in range(4)]
    for lr in (0.1, 0.0):
        backend = TorchBackend(_with_sgd(lr))
        before = {k: v.clone() for k, v in backend.state()[0].items()}
        metrics = _train(backend, units)
        after = backend.state()[0]
        delta = math.sqrt(sum(float((after[k] - before[k]).double().square().sum())
                              for k in before))
        norm = math.sqrt(sum(float(v.double().square().sum()) for v in before.values()))
        if lr:
            assert delta > 0 and metrics[TRAINER_UPDATE_RATIO] == pytest.approx(delta / norm,
                                                                                rel=1e-6)
        else:
            assert metrics[TRAINER_UPDATE_RATIO] == 0.0


def test_with_several_updates_only_the_first_batch_is_measured_before_any_update():
    # recipe: optimizer batches of 2 units, two epochs: four updates a step. Every sample is
    # recorded exactly under the weights before the step, so a sample measured after an
    # update would show a gap.
    backend = TorchBackend(_with_sgd(0.5))
    metrics = _train(backend, _units(backend, [(2, 0.0)] * 4))
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS] == 2 * TOKENS_PER_UNIT
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION] == pytest.approx(0.0, abs=1e-6)
    assert metrics[TRAINER_UPDATE_RATIO] > 0


def test_a_family_without_behaviour_logprobs_reports_no_gap():
    from reef_stream.api.losses import VALUE_REGRESSION
    from reef_stream.api.recipe import Backend, Recipe
    from reef_stream.api.schedule import Schedule
    from tests.unit.test_training import RewardTargets

    regression = Recipe(
        name="values", processor=recipe.processor, objective=RewardTargets(),
        schedule=Schedule(units_per_step=4, optimizer_batch_size=4, micro_batch_size=4,
                          max_staleness=0),
        backend=Backend(name="torch", loss_families=(VALUE_REGRESSION,),
                        model=recipe.backend.model))
    units = [rollout_unit(i) for i in range(4)]
    result = regression.objective.compute(units, regression.objective.initial_state())
    metrics = TorchBackend(regression).train_step(units, result, STEP)
    assert TRAINER_KL_BEHAVIOUR not in metrics and TRAINER_LOGPROB_GAP_OLDER not in metrics
    assert metrics[TRAINER_UPDATE_RATIO] > 0


def test_a_sample_of_unknown_version_is_in_no_gap_bucket_only_in_kl():
    backend = TorchBackend(ONE_UPDATE)
    units = _units(backend, [(2, 0.0), (0, -0.5), (2, 0.0), (2, 0.0)])
    units[1] = dataclasses.replace(units[1], members=tuple(
        dataclasses.replace(m, policy_version_known=False) for m in units[1].members))
    metrics = _train(backend, units)
    assert metrics[TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS] == 3 * TOKENS_PER_UNIT
    assert TRAINER_LOGPROB_GAP_OLDER not in metrics  # version 0 here means "unknown"
    assert metrics[TRAINER_KL_BEHAVIOUR] == pytest.approx((math.exp(0.5) - 1.5) / 4, rel=1e-4)
