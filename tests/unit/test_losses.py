"""Loss families: typed inputs, a fixed typed return, reference losses checked by hand, the registry."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reef_stream.api.losses import (
    POLICY_GRADIENT, VALUE_REGRESSION, ClippedPolicyGradient, LossFamily, LossOutput,
    MaskedSquaredError, PolicyGradientInputs, ValueRegressionInputs, ValueRegressionLoss,
    is_registered, loss_families, loss_family, register_loss_family,
)
from reef_stream.core.errors import ConfigurationError, FatalError


def test_clipped_policy_gradient_by_hand():
    # ratios 1.5, 0.5, 1.1 (and a masked 1.0); advantages 1, -1, 2 (and 5, masked); epsilon 0.2
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]],
                            dtype=torch.float64, requires_grad=True)
    inputs = PolicyGradientInputs(
        logprobs=logprobs, behaviour_logprobs=torch.zeros(1, 4, dtype=torch.float64),
        advantages=torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=torch.float64),
        mask=torch.tensor([[True, True, True, False]]))
    out = POLICY_GRADIENT.reference(inputs)
    assert isinstance(out, LossOutput)
    # min(1.5*1, 1.2*1) = 1.2; min(0.5*-1, 0.8*-1) = -0.8; min(2.2, 2.2) = 2.2
    assert out.loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3)
    assert out.metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 3)
    out.loss.backward()
    # clipped tokens and the masked one get no gradient; d(-r*A/3)/dlogp = -r*A/3
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, -2.2 / 3, 0.0])


def test_a_wider_clip_changes_only_what_was_clipped():
    inputs = PolicyGradientInputs(
        logprobs=torch.tensor([[math.log(1.5)]], dtype=torch.float64),
        behaviour_logprobs=torch.zeros(1, 1, dtype=torch.float64),
        advantages=torch.ones(1, 1, dtype=torch.float64), mask=torch.ones(1, 1, dtype=torch.bool))
    assert ClippedPolicyGradient(epsilon=0.2)(inputs).loss.item() == pytest.approx(-1.2)
    assert ClippedPolicyGradient(epsilon=1.0)(inputs).loss.item() == pytest.approx(-1.5)


def test_squared_error_by_hand_in_one_and_two_dimensions():
    predictions = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    inputs = ValueRegressionInputs(predictions=predictions,
                                   targets=torch.tensor([0.0, 2.0, 5.0, 100.0], dtype=torch.float64),
                                   mask=torch.tensor([True, True, True, False]))
    out = VALUE_REGRESSION.reference(inputs)
    assert out.loss.item() == pytest.approx((1 + 0 + 4) / 3)
    assert out.metrics == pytest.approx({"mse": 5 / 3, "prediction_mean": 2.0})
    out.loss.backward()
    assert predictions.grad.tolist() == pytest.approx([2 / 3, 0.0, -4 / 3, 0.0])

    two_d = ValueRegressionInputs(predictions=torch.tensor([[1.0, 3.0]]),
                                  targets=torch.tensor([[0.0, 0.0]]),
                                  mask=torch.tensor([[True, True]]))
    assert MaskedSquaredError()(two_d).loss.item() == pytest.approx(5.0)


def test_nothing_unmasked_is_a_zero_loss_not_nan():
    inputs = PolicyGradientInputs(logprobs=torch.zeros(2, 3), behaviour_logprobs=torch.zeros(2, 3),
                                  advantages=torch.ones(2, 3), mask=torch.zeros(2, 3, dtype=torch.bool))
    out = POLICY_GRADIENT.reference(inputs)
    assert out.loss.item() == 0.0 and out.metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize("change, words", [
    ({"advantages": torch.zeros(2, 4)}, "advantages has shape (2, 4), logprobs (2, 3)"),
    ({"mask": torch.ones(2, 3)}, "mask must be a bool tensor"),
    ({"logprobs": torch.zeros(6), "behaviour_logprobs": torch.zeros(6),
      "advantages": torch.zeros(6), "mask": torch.ones(6, dtype=torch.bool)}, "must have 2 dims"),
    ({"behaviour_logprobs": [[0.0] * 3] * 2}, "behaviour_logprobs must be a torch.Tensor"),
])
def test_inputs_are_checked_once_when_built(change, words):
    fields = dict(logprobs=torch.zeros(2, 3), behaviour_logprobs=torch.zeros(2, 3),
                  advantages=torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool))
    fields.update(change)
    with pytest.raises(FatalError, match=words.replace("(", r"\(").replace(")", r"\)")):
        PolicyGradientInputs(**fields)


def test_a_loss_is_a_scalar():
    with pytest.raises(FatalError, match="0-d tensor"):
        LossOutput(loss=torch.zeros(2))


def _absolute_error(inputs: ValueRegressionInputs) -> LossOutput:
    return LossOutput(loss=(inputs.predictions - inputs.targets).abs().mean())


CUSTOM = LossFamily(name="test_absolute_error", inputs=ValueRegressionInputs,
                    protocol=ValueRegressionLoss, reference=_absolute_error,
                    description="predictions, targets -> mean absolute error")


def test_the_built_in_families_are_registered():
    assert loss_family("policy_gradient") is POLICY_GRADIENT
    assert loss_family("value_regression") is VALUE_REGRESSION
    assert {POLICY_GRADIENT, VALUE_REGRESSION} <= set(loss_families())
    assert POLICY_GRADIENT.inputs is PolicyGradientInputs


def test_a_method_registers_its_own_family_once():
    assert register_loss_family(CUSTOM) is CUSTOM
    assert register_loss_family(CUSTOM) is CUSTOM  # idempotent
    assert loss_family("test_absolute_error") is CUSTOM and is_registered(CUSTOM)
    impostor = LossFamily(name="test_absolute_error", inputs=ValueRegressionInputs,
                          protocol=object, reference=lambda inputs: inputs.predictions.sum(),
                          description="")
    with pytest.raises(ConfigurationError, match="already registered"):
        register_loss_family(impostor)
    assert not is_registered(impostor)


def test_a_method_imported_under_two_names_is_told_so():
    """The checkout's methods.sao and the wheel's reef_stream.methods.sao are the same files:
    importing both in one process registers SAO's family twice, and the error says why."""
    script = ("import methods.sao, reef_stream.methods.sao as again\n"
              "again.recipe")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode != 0
    assert "imported under two names" in result.stderr, result.stderr[-2000:]


def test_registry_errors_say_what_to_do():
    with pytest.raises(ConfigurationError, match="lower_snake_case"):
        register_loss_family(LossFamily(name="Policy Gradient", inputs=object, protocol=object,
                                        reference=_absolute_error, description=""))
    with pytest.raises(ConfigurationError, match="no loss family named 'ppo'; registered: "):
        loss_family("ppo")
    with pytest.raises(ConfigurationError, match="is not a LossFamily"):
        register_loss_family("policy_gradient")
