"""SAO's backend loss: a truncated importance-weighted policy gradient, as its own loss family.

Samples reach the trainer some policy versions after they were generated, so
the behaviour policy that sampled a token is not the current one. Instead of
dropping stale samples, SAO corrects them with a per-token importance weight
(the ratio of current to behaviour probability), truncated at ``truncation``
so that one unlikely token cannot dominate a step (V-trace's truncated
``rho``; "truncated importance sampling"):

    ratio  = exp(logprobs - behaviour_logprobs)            (per token, no gradient)
    weight = min(ratio, truncation)                        (no gradient)
    loss   = -sum(mask * weight * advantage * logprobs) / max(tokens, 1)

(``tokens``: the optimizer batch's loss tokens over every micro batch and data-parallel rank,
``PolicyGradientInputs.totals``; the micro batch's own when not given.)

The gradient is ``-weight * advantage * grad(logprobs)`` per unmasked token,
averaged over the optimizer batch's tokens: the policy gradient, reweighted. On
policy (``ratio == 1``) it is the plain policy gradient, the same as the
clipped ``policy_gradient`` family's there. The loss *value* is a surrogate
whose gradient is what matters; do not read it as an objective.

The family takes ``PolicyGradientInputs`` (the same tensors as the built-in
``policy_gradient`` family), so the torch backend builds its inputs the same
way: ``reef_stream.engine.training.INPUT_BUILDERS`` is keyed by a family's
``inputs`` type. Importing this module registers the family (idempotent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reef_stream.api.losses import (
    LossFamily, LossOutput, PolicyGradientInputs, PolicyGradientLoss, register_loss_family,
)
from reef_stream.api.variants import LOG_RATIO_BOUND, BatchTotals, RatioLevel, log_ratio
from reef_stream.core.errors import ConfigurationError

#: Metric names of the loss (the trainer prefixes nothing; they sit next to ``loss``).
METRIC_RATIO_MEAN = "ratio_mean"
METRIC_TRUNCATED_FRACTION = "truncated_fraction"
METRIC_WEIGHT_MEAN = "weight_mean"


@dataclass(frozen=True, slots=True)
class TruncatedPolicyGradient:
    """``loss(PolicyGradientInputs) -> LossOutput``: see the module docstring.

    ``truncation``: the bound ``c`` on the importance weight (``c >= 1`` keeps
    on-policy tokens unweighted; 1.0 is V-trace's usual choice). Shapes:
    every input is ``[B, T]`` (``PolicyGradientInputs``); the loss is 0-d.
    Gradients flow through ``logprobs`` only. A micro batch without unmasked
    tokens has loss 0. Metrics over unmasked tokens: ``ratio_mean``,
    ``truncated_fraction`` (share whose ratio exceeded ``truncation``) and
    ``weight_mean``. Pure, idempotent; called once per micro batch after
    the forward pass, before ``backward``.
    """

    truncation: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.truncation, bool) or not isinstance(self.truncation, (int, float)) \
                or not math.isfinite(self.truncation) or self.truncation <= 0:
            raise ConfigurationError(f"TruncatedPolicyGradient.truncation must be a positive "
                                     f"finite number, got {self.truncation!r}")

    def __call__(self, inputs: PolicyGradientInputs, /) -> LossOutput:
        mask = inputs.mask.to(inputs.logprobs.dtype)
        count = mask.sum().clamp(min=1.0)
        totals = inputs.totals or BatchTotals.of(inputs.mask)
        with torch.no_grad():
            # Clamped before exp (LOG_RATIO_BOUND): a behaviour logprob of -100 gives a large,
            # finite ratio, truncated like any other, not an infinite one.
            ratio = torch.exp(log_ratio(inputs.logprobs, inputs.behaviour_logprobs, inputs.mask,
                                        RatioLevel.TOKEN, LOG_RATIO_BOUND))
            weight = ratio.clamp(max=self.truncation)
            scale = weight * inputs.advantages * mask
        # Divided by the optimizer batch's tokens (every micro batch and rank), so the micro
        # batch size does not change the loss (a micro batch of one sample is no sequence mean).
        loss = -(scale * inputs.logprobs).sum() / max(totals.tokens, 1.0)
        with torch.no_grad():
            metrics = {
                METRIC_RATIO_MEAN: float((ratio * mask).sum() / count),
                METRIC_TRUNCATED_FRACTION: float(((ratio > self.truncation) * mask).sum() / count),
                METRIC_WEIGHT_MEAN: float((weight * mask).sum() / count),
            }
        return LossOutput(loss=loss, metrics=metrics)


#: SAO's loss family. The recipe's backend lists it and binds a configured loss to it.
SAO_TRUNCATED_PG: LossFamily[PolicyGradientInputs] = register_loss_family(LossFamily(
    name="sao_truncated_pg",
    inputs=PolicyGradientInputs,
    protocol=PolicyGradientLoss,
    reference=TruncatedPolicyGradient(),
    description="current and behaviour logprobs per token, advantages, mask -> truncated "
                "importance-weighted policy gradient (weight = min(ratio, c), no gradient "
                "through the weight)",
))
