"""The loss and advantage variants (``reef_stream.api.variants``) against values computed by
hand, each test naming the method or paper that introduced the variant."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from methods.grpo.objective import GroupNormalisedAdvantage
from methods.sao.loss import TruncatedPolicyGradient
from reef_stream.api.losses import (
    POLICY_GRADIENT, ClippedPolicyGradient, ClippedWeightPolicyGradient, PolicyGradientInputs,
)
from reef_stream.api.recipe import Backend
from reef_stream.api.schedule import Schedule
from reef_stream.api.variants import (
    AdvantageNormalisation, BatchTotals, BehaviourWeightLevel, BehaviourWeightMode,
    ConstantNormaliser, DecoupledProximal, EntropyBonus, KLEstimator, KLPenalty, RatioLevel,
    SequenceMeanTokenMean, SequenceMeanTokenSum, TokenMean,
)
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.metric_names import (
    LOSS_BEHAVIOUR_MASKED_FRACTION, LOSS_BEHAVIOUR_TRUNCATED_FRACTION, LOSS_BEHAVIOUR_WEIGHT_MEAN,
    LOSS_CLIP_FRACTION_HIGH, LOSS_CLIP_FRACTION_LOW,
    LOSS_DUAL_CLIP_FRACTION, LOSS_ENTROPY, LOSS_KL_REFERENCE, LOSS_RATIO_MEAN,
    OBJECTIVE_DYNAMIC_SAMPLING_DROPPED, TRAINER_SKIPPED_UPDATES,
)
from reef_stream.engine.training import TorchBackend
from tests.recipes.trainable import recipe
from tests.unit_log import rollout_unit


def _inputs(logprobs, behaviour, advantages, mask=None, **extra):
    """Float64 inputs; ``logprobs`` a leaf with a gradient."""
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    logprobs = as_tensor(logprobs).requires_grad_(True)
    mask = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else torch.tensor(mask)
    extra = {k: (as_tensor(v).requires_grad_(k == "entropy")) for k, v in extra.items()}
    return PolicyGradientInputs(logprobs=logprobs, behaviour_logprobs=as_tensor(behaviour),
                                advantages=as_tensor(advantages), mask=mask, **extra)


def _group(rewards):
    return [np.array(g, dtype=np.float64) for g in rewards]


# --------------------------------------------------------------------------- log-ratio clamp


@pytest.mark.parametrize("loss", [ClippedPolicyGradient(), ClippedPolicyGradient(dual_clip=3.0),
                                  ClippedWeightPolicyGradient(), TruncatedPolicyGradient()],
                         ids=["ppo", "dual-clip", "cispo", "sao"])
def test_a_behaviour_logprob_of_minus_100_gives_a_finite_loss_and_gradient(loss):
    """Issue 18: exp(-1 + 100) overflows float32 (past 88.7); the log-ratio is clamped to
    +-LOG_RATIO_BOUND (20) first, so the ratio is e^20, finite, in float32 as in float64."""
    for dtype in (torch.float32, torch.float64):
        inputs = PolicyGradientInputs(
            logprobs=torch.tensor([[-1.0, -0.5]], dtype=dtype, requires_grad=True),
            behaviour_logprobs=torch.tensor([[-100.0, -0.5]], dtype=dtype),
            advantages=torch.tensor([[-1.0, 1.0]], dtype=dtype),
            mask=torch.ones(1, 2, dtype=torch.bool))
        out = loss(inputs)
        out.loss.backward()
        assert math.isfinite(out.loss.item()), dtype
        assert torch.isfinite(inputs.logprobs.grad).all(), inputs.logprobs.grad
        assert out.metrics[LOSS_RATIO_MEAN] == pytest.approx((math.exp(20.0) + 1) / 2, rel=1e-5)


def test_the_ppo_loss_of_a_clamped_token_by_hand():
    """PPO (Schulman et al. 2017) with the clamp: A = -1, log-ratio 99 -> 20, the unclipped
    term e^20 * -1 is the min: loss e^20 / 1 token; the clamp holds the ratio, so no gradient."""
    inputs = _inputs([[-1.0]], [[-100.0]], [[-1.0]])
    out = ClippedPolicyGradient()(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.exp(20.0))
    assert inputs.logprobs.grad.tolist() == [[0.0]]
    inside = _inputs([[-1.0]], [[-11.0]], [[-1.0]])         # 10 < 20: untouched
    assert ClippedPolicyGradient()(inside).loss.item() == pytest.approx(math.exp(10.0))


# --------------------------------------------------------------------------- clip


def test_clip_higher_by_hand():
    """DAPO's clip-higher (Yu et al. 2025): epsilon 0.2 below, 0.28 above. r = 1.5, A = +1 ->
    1.28; r = 0.5, A = -1 -> min(-0.5, -0.8) = -0.8; loss -(1.28 - 0.8) / 2 = -0.24."""
    inputs = _inputs([[math.log(1.5), math.log(0.5)]], [[0.0, 0.0]], [[1.0, -1.0]])
    out = ClippedPolicyGradient(epsilon=0.2, epsilon_high=0.28)(inputs)
    assert out.loss.item() == pytest.approx(-0.24)
    assert out.metrics[LOSS_CLIP_FRACTION_HIGH] == 0.5
    assert out.metrics[LOSS_CLIP_FRACTION_LOW] == 0.5
    symmetric = ClippedPolicyGradient(epsilon=0.2)(inputs)
    assert symmetric.loss.item() == pytest.approx(-(1.2 - 0.8) / 2)


def test_dual_clip_by_hand():
    """Dual-clip PPO (Ye et al. 2020): A = -1, r = 5: PPO's min(-5, -1.2) = -5, bounded below
    by c * A = -3: loss 3 and no gradient; without the dual clip loss 5, gradient -r * A = 5."""
    inputs = _inputs([[math.log(5.0)]], [[0.0]], [[-1.0]])
    out = ClippedPolicyGradient(dual_clip=3.0)(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(3.0)
    assert inputs.logprobs.grad.tolist() == [[0.0]]
    assert out.metrics[LOSS_DUAL_CLIP_FRACTION] == 1.0
    plain = _inputs([[math.log(5.0)]], [[0.0]], [[-1.0]])
    out = ClippedPolicyGradient()(plain)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(5.0)
    assert plain.logprobs.grad.item() == pytest.approx(5.0)


# --------------------------------------------------------------------------- ratio level


def test_sequence_level_ratio_by_hand():
    """GSPO (Zheng et al. 2025): one ratio a sequence, exp(mean log-ratio). Tokens 0.1 and 0.3
    -> s = e^0.2 = 1.2214, A = +1: clipped at 1.2 (loss -1.2, no gradient); with epsilon 0.3
    unclipped: loss -e^0.2, d/dlogp_t = -s / 2 for each of its 2 tokens; the padding token of
    the row takes no part."""
    log = [[0.1, 0.3, 0.0]]
    mask = [[True, True, False]]
    for epsilon, value, gradient in ((0.2, -1.2, 0.0),
                                     (0.3, -math.exp(0.2), -math.exp(0.2) / 2)):
        inputs = _inputs(log, [[0.0, 0.0, -7.0]], [[1.0, 1.0, 1.0]], mask)
        out = ClippedPolicyGradient(epsilon=epsilon, ratio_level=RatioLevel.SEQUENCE,
                                    aggregation=SequenceMeanTokenMean())(inputs)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(value)
        assert inputs.logprobs.grad[0].tolist() == pytest.approx([gradient, gradient, 0.0])


# --------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("aggregation, expected", [
    (TokenMean(), (-2 + 3) / 4),              # DAPO's token-level loss
    (SequenceMeanTokenMean(), (-2 + 1) / 2),  # the original GRPO
    (SequenceMeanTokenSum(), (-2 + 3) / 2),
    (ConstantNormaliser(4), (-2 + 3) / (2 * 4)),  # Dr. GRPO
])
def test_aggregations_by_hand(aggregation, expected):
    """On policy (r = 1) the terms are -A: a 1-token sequence with A = 2 (term -2) and a
    3-token one with A = -1 (terms 1, 1, 1): token-mean (DAPO) 0.25, seq-mean-token-mean
    (GRPO) -0.5, seq-mean-token-sum 0.5, constant normaliser 4 (Dr. GRPO) 0.125."""
    inputs = _inputs([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], [[-1.0, 0.0, 0.0], [-1.0] * 3],
                     [[2.0, 0.0, 0.0], [-1.0] * 3], [[True, False, False], [True] * 3])
    assert ClippedPolicyGradient(aggregation=aggregation)(inputs).loss.item() == pytest.approx(
        expected)


# --------------------------------------------------------------------------- CISPO


def test_cispo_clipped_weights_by_hand():
    """CISPO (MiniMax-M1, 2025): weights clip(r, 1 - 0.5, 1 + 0.2) without gradient, times
    A * logprob. r = e^0.5 -> 1.2, r = e^-1 -> 0.5; A = 1: loss -(1.2 * -0.5 + 0.5 * -2) / 2 =
    0.8, gradient -(1.2, 0.5) / 2: every token keeps a gradient, clipped or not."""
    inputs = _inputs([[-0.5, -2.0]], [[-1.0, -1.0]], [[1.0, 1.0]])
    out = ClippedWeightPolicyGradient(epsilon_high=0.2, epsilon_low=0.5)(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.8)
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-0.6, -0.25])
    assert out.metrics[LOSS_CLIP_FRACTION_HIGH] == 0.5 and out.metrics[LOSS_CLIP_FRACTION_LOW] == 0.5
    unbounded = _inputs([[-0.5, -2.0]], [[-1.0, -1.0]], [[1.0, 1.0]])
    out = ClippedWeightPolicyGradient(epsilon_high=0.2)(unbounded)   # no lower bound
    assert out.loss.item() == pytest.approx(-(1.2 * -0.5 + math.exp(-1) * -2.0) / 2)


# --------------------------------------------------------------------------- penalties


@pytest.mark.parametrize("estimator, per_token", [
    (KLEstimator.K1, [0.5, -1.0]),
    (KLEstimator.K2, [0.125, 0.5]),
    (KLEstimator.K3, [math.exp(-0.5) - 0.5, math.e - 2.0]),
])
def test_kl_penalty_estimators_by_hand(estimator, per_token):
    """Schulman's k1/k2/k3 ("Approximating KL divergence", 2020; k3 as in GRPO), with
    d = reference - current = (-0.5, 1): k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d. A = 0, so
    the loss is 0.1 * their token mean, as is the metric without the coefficient."""
    inputs = _inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [[0.0, 0.0]],
                     reference_logprobs=[[-1.5, -1.0]])
    loss = ClippedPolicyGradient(kl=KLPenalty(0.1, estimator))
    out = loss(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1 * sum(per_token) / 2)
    assert out.metrics[LOSS_KL_REFERENCE] == pytest.approx(sum(per_token) / 2)
    d = np.array([-0.5, 1.0])
    derivative = {KLEstimator.K1: np.ones(2), KLEstimator.K2: -d,
                  KLEstimator.K3: 1 - np.exp(d)}[estimator]          # d k / d current
    assert inputs.logprobs.grad[0].tolist() == pytest.approx((0.1 * derivative / 2).tolist())


def test_kl_estimate_bound_clamps_each_tokens_estimate_as_verls_low_var_kl():
    """d = reference - current = (1, 3, -12): k3 = e - 2 = .718, e^3 - 4 = 16.09 and e^-12 + 11
    = 11.000006. With estimate_bound 10 (verl's low_var_kl) the last two are 10, constant (no
    gradient): loss 0.1 * (e - 2 + 20) / 3, gradient 0.1 * (1 - e) / 3 on the first token
    only. verl's ``kl_penalty_forward`` lines (core_algos.py l. 1890-1896 at b178a3c) give the
    same per-token values (to an ulp: k3 here is ``expm1(d) - d``); unbounded (the default)
    the estimate is k3's own."""
    def inputs():
        return _inputs([[-1.0, -3.0, -0.5]], [[-1.0, -3.0, -0.5]], [[0.0, 0.0, 0.0]],
                       reference_logprobs=[[0.0, 0.0, -12.5]])
    bounded, free = inputs(), inputs()
    out = ClippedPolicyGradient(kl=KLPenalty(0.1, estimate_bound=10.0))(bounded)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1 * (math.e - 2 + 20) / 3)
    assert out.metrics[LOSS_KL_REFERENCE] == pytest.approx((math.e - 2 + 20) / 3)
    assert bounded.logprobs.grad[0].tolist() == pytest.approx([0.1 * (1 - math.e) / 3, 0, 0])
    k3 = [math.e - 2, math.exp(3) - 4, math.exp(-12) + 11]
    unbounded = ClippedPolicyGradient(kl=KLPenalty(0.1))(free)
    assert unbounded.metrics[LOSS_KL_REFERENCE] == pytest.approx(sum(k3) / 3)
    # verl b178a3c, verl/trainer/ppo/core_algos.py, kl_penalty_forward, "low_var_kl"
    logprob, ref_logprob = bounded.logprobs.detach(), bounded.reference_logprobs
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    theirs = torch.clamp((torch.exp(kl) - kl - 1).contiguous(), min=-10, max=10)
    ours = KLPenalty(0.1, estimate_bound=10.0).estimate(logprob, ref_logprob, 20.0)
    assert ours[0].tolist() == pytest.approx(theirs[0].tolist(), rel=1e-15)  # expm1: an ulp
    assert "clamped to +-10" in KLPenalty(0.1, estimate_bound=10.0).describe()


def test_entropy_bonus_by_hand():
    """The entropy bonus (A3C, Mnih et al. 2016): A = 0, entropies (1.0, 0.5), coefficient
    0.1: loss -0.1 * 0.75, metric 0.75, gradient -0.1 / 2 on each token's entropy."""
    inputs = _inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], entropy=[[1.0, 0.5]])
    out = ClippedPolicyGradient(entropy=EntropyBonus(0.1))(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.075)
    assert out.metrics[LOSS_ENTROPY] == pytest.approx(0.75)
    assert inputs.entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05])


def test_a_loss_asks_the_backend_for_what_its_options_need():
    """The extra inputs follow the options; a loss given inputs without them says which."""
    assert ClippedPolicyGradient().extra_inputs == frozenset()
    options = ClippedPolicyGradient(kl=KLPenalty(0.1), entropy=EntropyBonus(0.01),
                                    proximal=DecoupledProximal())
    assert {e.value for e in options.extra_inputs} == {
        "reference_logprobs", "entropy", "proximal_logprobs"}
    with pytest.raises(Exception, match="needs reference_logprobs"):
        ClippedPolicyGradient(kl=KLPenalty(0.1))(_inputs([[-1.0]], [[-1.0]], [[1.0]]))


# --------------------------------------------------------------------------- decoupled PPO


def test_decoupled_proximal_policy_by_hand():
    """Decoupled PPO (Hilton et al. 2022; AReaL): behaviour -3, proximal -2, current -1.9,
    A = +1. Against the proximal policy r = e^0.1 = 1.105 (inside the clip), times the behaviour
    weight min(e^(-2 + 3), 2) = 2: loss -2 e^0.1, gradient -2 e^0.1. Untruncated the weight is e.
    Clipped against the behaviour policy instead, r = e^1.1 > 1.2: loss -1.2, no gradient."""
    def run(loss):
        inputs = _inputs([[-1.9]], [[-3.0]], [[1.0]], proximal_logprobs=[[-2.0]])
        out = loss(inputs)
        out.loss.backward()
        return out.loss.item(), inputs.logprobs.grad.item(), out.metrics

    value, gradient, metrics = run(ClippedPolicyGradient(proximal=DecoupledProximal(2.0)))
    assert value == pytest.approx(-2 * math.exp(0.1))
    assert gradient == pytest.approx(-2 * math.exp(0.1))
    assert metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] == pytest.approx(2.0)
    value, _, _ = run(ClippedPolicyGradient(proximal=DecoupledProximal(None)))
    assert value == pytest.approx(-math.e * math.exp(0.1))
    value, gradient, _ = run(ClippedPolicyGradient())
    assert (value, gradient) == (pytest.approx(-1.2), 0.0)


# --------------------------------------------------------------------------- rollout correction

TOKEN, SEQUENCE, GEOMETRIC = (BehaviourWeightLevel.TOKEN, BehaviourWeightLevel.SEQUENCE,
                              BehaviourWeightLevel.SEQUENCE_GEOMETRIC)
TRUNCATE, MASK = BehaviourWeightMode.TRUNCATE, BehaviourWeightMode.MASK
#: Behaviour weights proximal / behaviour of two sequences: (3, 1/2, 1) and (3/2, 4, padding).
WEIGHTS = [[3.0, 0.5, 1.0], [1.5, 4.0, 1.0]]
PADDING = [[True, True, True], [True, True, False]]


def _corrected(proximal: DecoupledProximal, aggregation=TokenMean(), totals=None):
    """The loss, gradient (flat) and metrics of ``WEIGHTS`` with current = proximal (every ratio 1,
    inside the clip) and A = +1: per kept token the term is -w, its gradient -w / normaliser."""
    proximal_logprobs = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]]
    behaviour = [[p - math.log(w) for p, w in zip(row, weights)]
                 for row, weights in zip(proximal_logprobs, WEIGHTS)]
    inputs = _inputs(proximal_logprobs, behaviour, [[1.0] * 3] * 2, PADDING,
                     proximal_logprobs=proximal_logprobs)
    if totals is not None:
        inputs = dataclasses.replace(inputs, totals=totals)
    out = ClippedPolicyGradient(proximal=proximal, aggregation=aggregation)(inputs)
    out.loss.backward()
    return out.loss.item(), inputs.logprobs.grad.flatten().tolist(), out.metrics


@pytest.mark.parametrize("option, kept_weights, truncated", [
    # Token level: (3, 1/2, 1 | 3/2, 4) truncated at 2: (2, 1/2, 1 | 3/2, 2).
    (DecoupledProximal(2.0), [[2, .5, 1], [1.5, 2, 0]], 2),
    (DecoupledProximal(2.0, weight_floor=0.8), [[2, .8, 1], [1.5, 2, 0]], 3),
    # The product per sequence: 3 * 1/2 * 1 = 1.5 and 3/2 * 4 = 6, truncated at 2.
    (DecoupledProximal(2.0, SEQUENCE), [[1.5] * 3, [2, 2, 0]], 2),
    # The geometric mean per sequence: 1.5^(1/3) and 6^(1/2) = 2.449, truncated at 2.
    (DecoupledProximal(2.0, GEOMETRIC), [[1.5 ** (1 / 3)] * 3, [2, 2, 0]], 2),
    (DecoupledProximal(None, SEQUENCE), [[1.5] * 3, [6, 6, 0]], None),
], ids=["token", "token-floor", "sequence", "geometric", "sequence-untruncated"])
def test_rollout_correction_truncated_by_hand(option, kept_weights, truncated):
    """Truncated importance sampling between the behaviour and the proximal policy (verl's
    rollout correction, rollout_is token or sequence with rollout_is_threshold; AReaL's
    action="clamp"): the weight multiplies the clipped surrogate, 5 loss tokens normalise."""
    value, gradient, metrics = _corrected(option)
    total = sum(map(sum, kept_weights))
    assert value == pytest.approx(-total / 5)
    assert gradient == pytest.approx([-w / 5 for row in kept_weights for w in row])
    assert metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] == pytest.approx(total / 5)
    if truncated is None:
        assert LOSS_BEHAVIOUR_TRUNCATED_FRACTION not in metrics
    else:
        assert metrics[LOSS_BEHAVIOUR_TRUNCATED_FRACTION] == pytest.approx(truncated / 5)
    assert LOSS_BEHAVIOUR_MASKED_FRACTION not in metrics


@pytest.mark.parametrize("option, kept_weights", [
    # Token level, above 2 dropped: 3 and 4 go; (1/2, 1 | 3/2) keep their weights.
    (DecoupledProximal(2.0, TOKEN, MASK), [[0, .5, 1], [1.5, 0, 0]]),
    # And below 0.8: 1/2 goes too.
    (DecoupledProximal(2.0, TOKEN, MASK, 0.8), [[0, 0, 1], [1.5, 0, 0]]),
    # Per sequence: the product 6 > 2 drops the second sequence, 1.5 keeps the first.
    (DecoupledProximal(2.0, SEQUENCE, MASK), [[1.5] * 3, [0, 0, 0]]),
    # The geometric mean 2.449 > 2 drops the second; 1.145 keeps the first.
    (DecoupledProximal(2.0, GEOMETRIC, MASK), [[1.5 ** (1 / 3)] * 3, [0, 0, 0]]),
    # A floor of 1.2 above 1.145 drops the first too: nothing trains, loss 0.
    (DecoupledProximal(2.0, GEOMETRIC, MASK, 1.2), [[0, 0, 0], [0, 0, 0]]),
], ids=["token", "token-floor", "sequence", "geometric", "geometric-floor"])
def test_rollout_correction_masked_by_hand(option, kept_weights):
    """Masked importance sampling (AReaL's action="mask"; verl's rejection, rollout_rs): a
    token (a sequence, at a sequence level) whose weight is outside [floor, cap] is dropped
    from the loss, no gradient; one inside keeps its weight unclamped. The dropped tokens still
    count in the normaliser (AReaL's ppo_actor_loss_fn keeps the loss_mask count): 5 tokens."""
    value, gradient, metrics = _corrected(option)
    total = sum(map(sum, kept_weights))
    kept = sum(w > 0 for row in kept_weights for w in row)
    assert value == pytest.approx(-total / 5)
    assert gradient == pytest.approx([-w / 5 for row in kept_weights for w in row])
    assert metrics[LOSS_BEHAVIOUR_MASKED_FRACTION] == pytest.approx((5 - kept) / 5)
    assert metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] == pytest.approx(total / kept if kept else 0.0)
    assert LOSS_BEHAVIOUR_TRUNCATED_FRACTION not in metrics


def test_a_masked_token_stays_in_every_normaliser():
    """Token mask at 2 keeps (1/2, 1 | 3/2). Each sequence's token mean divides by its full
    length (3, 2): (1.5 / 3 + 1.5 / 2) / 2 sequences = 0.625. With the optimizer batch's
    totals (10 tokens, as the backend gives them) the token mean is 3 / 10."""
    option = DecoupledProximal(2.0, TOKEN, MASK)
    assert _corrected(option, SequenceMeanTokenMean())[0] == pytest.approx(-0.625)
    assert _corrected(option, totals=BatchTotals(tokens=10, sequences=4))[0] == pytest.approx(
        -0.3)


def test_a_masked_token_leaves_the_sequence_ratio():
    """GSPO's sequence ratio under a token mask takes the kept tokens only (as AReaL computes
    it over the rejection's loss_mask): current - proximal (0.1, 5); behaviour weights (1, 10),
    the second dropped at 2: ratio e^0.1 = 1.105, inside the clip: loss -1.105 / 2 tokens (the
    untouched mean log-ratio 2.55 would clip it at 1.2)."""
    inputs = _inputs([[-0.9, 4.0]], [[-1.0, -1.0 - math.log(10)]], [[1.0, 1.0]],
                     proximal_logprobs=[[-1.0, -1.0]])
    loss = ClippedPolicyGradient(ratio_level=RatioLevel.SEQUENCE,
                                 proximal=DecoupledProximal(2.0, TOKEN, MASK))
    assert loss(inputs).loss.item() == pytest.approx(-math.exp(0.1) / 2)


@pytest.mark.parametrize("level", list(BehaviourWeightLevel))
@pytest.mark.parametrize("mode", list(BehaviourWeightMode))
@pytest.mark.parametrize("base", [
    ClippedPolicyGradient(),
    ClippedPolicyGradient(epsilon_high=0.28, dual_clip=3.0, ratio_level=RatioLevel.SEQUENCE,
                          aggregation=SequenceMeanTokenMean(), kl=KLPenalty(0.1),
                          entropy=EntropyBonus(0.01)),
], ids=["ppo", "many-options"])
def test_with_behaviour_equal_to_proximal_the_correction_changes_nothing(level, mode, base):
    """Every weight exactly 1 (e^0): the loss and its gradient are bitwise those of the same
    loss without the correction (clipped against the behaviour policy, which is then the
    proximal one), and nothing is truncated or dropped."""
    rng = np.random.default_rng(5)
    mask = [[True] * 4, [True, True, False, False], [True] * 3 + [False]]
    behaviour = (-rng.random((3, 4)) * 3).tolist()
    fields = dict(logprobs=(-rng.random((3, 4)) * 3).tolist(), behaviour=behaviour,
                  advantages=np.repeat(rng.normal(size=(3, 1)), 4, axis=1).tolist(),
                  mask=mask, reference_logprobs=(-rng.random((3, 4)) * 3).tolist(),
                  entropy=(rng.random((3, 4)) * 2).tolist())
    plain, corrected = _inputs(**fields), _inputs(**fields, proximal_logprobs=behaviour)
    with_correction = dataclasses.replace(
        base, proximal=DecoupledProximal(1.5, level, mode, weight_floor=0.5))
    outputs = [base(plain), with_correction(corrected)]
    for out in outputs:
        out.loss.backward()
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    assert torch.equal(plain.logprobs.grad, corrected.logprobs.grad)
    assert outputs[1].metrics.get(LOSS_BEHAVIOUR_TRUNCATED_FRACTION, 0.0) == 0.0
    assert outputs[1].metrics.get(LOSS_BEHAVIOUR_MASKED_FRACTION, 0.0) == 0.0
    assert outputs[1].metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] == 1.0


def test_reef_check_names_the_behaviour_weight():
    assert DecoupledProximal().describe().endswith("behaviour weight per token, truncated at 2")
    assert DecoupledProximal(2.0, SEQUENCE, MASK, 0.5).describe().endswith(
        "per sequence (product), sequences outside [0.5, 2] dropped (still counted by the "
        "normaliser)")


def test_the_behaviour_weights_carry_no_gradient():
    """The weights change the measure, not the objective (verl detaches them; AReaL computes
    them from detached logprobs): a proximal logprob with a gradient gives weights without."""
    proximal = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    for level in BehaviourWeightLevel:
        weight, kept, _ = DecoupledProximal(2.0, level).weights(
            proximal, torch.tensor([[-2.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool), 20.0)
        assert not weight.requires_grad and kept.all()


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("normalisation, expected", [
    (AdvantageNormalisation.GROUP_POPULATION_STD, [[1, -1, -1, 1], [1 / 3 ** .5] * 3 + [-3 ** .5]]),
    (AdvantageNormalisation.GROUP_SAMPLE_STD, [[.5 / (1 / 3) ** .5 * s for s in (1, -1, -1, 1)],
                                               [.25 / .5] * 3 + [-.75 / .5]]),
    (AdvantageNormalisation.NONE, [[.5, -.5, -.5, .5], [.25, .25, .25, -.75]]),
    (AdvantageNormalisation.BATCH_STD, [[c / 1.75 ** .5 * 8 ** .5 for c in (.5, -.5, -.5, .5)],
                                        [c / 1.75 ** .5 * 8 ** .5 for c in (.25,) * 3 + (-.75,)]]),
    (AdvantageNormalisation.BATCH_REWARD_STD,
     [[c / (15 / 56) ** .5 for c in (.5, -.5, -.5, .5)],
      [c / (15 / 56) ** .5 for c in (.25,) * 3 + (-.75,)]]),
    (AdvantageNormalisation.RLOO, [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3] * 3 + [-1]]),
])
def test_advantage_normalisations_by_hand(normalisation, expected):
    """Groups (1, 0, 0, 1) and (1, 1, 1, 0), centred (.5, -.5, -.5, .5) and (.25, .25, .25,
    -.75): GRPO's population std (.5; .433), the sample std (.577; .5), none (Dr. GRPO, Liu et
    al. 2025), the batch std sqrt(1.75 / 8) (REINFORCE++-baseline, Hu et al. 2025: all
    completions 10 tokens, so the token weighting changes nothing), the sample std of the eight
    raw rewards, five 1s and three 0s about 5/8: sqrt((5 * 9 + 3 * 25) / 64 / 7) = sqrt(15 /
    56) (TRL's scale_rewards="batch"), the mean of the other three as baseline (RLOO, Ahmadian
    et al. 2024: 1 - 1/3, 0 - 2/3; 1 - 2/3, 0 - 1)."""
    objective = GroupNormalisedAdvantage(epsilon=1e-12, normalisation=normalisation)
    units = [rollout_unit(i) for i in range(2)]
    units = [dataclasses.replace(u, members=tuple(dataclasses.replace(m, reward=float(r))
                                                  for m, r in zip(u.members, rewards)))
             for u, rewards in zip(units, ([1, 0, 0, 1], [1, 1, 1, 0]))]
    result = objective.compute(units, objective.initial_state())
    assert np.asarray(result.advantages.values).tolist() == pytest.approx(
        [v for group in expected for v in group], rel=1e-5)
    assert result.advantages.keep is None


def _with_lengths(unit, rewards, lengths):
    """``unit`` with its members' rewards and completion lengths (tokens and logprobs cut)."""
    return dataclasses.replace(unit, members=tuple(
        dataclasses.replace(m, reward=float(r), completion_token_ids=m.completion_token_ids[:n],
                            completion_logprobs=m.completion_logprobs[:n])
        for m, r, n in zip(unit.members, rewards, lengths)))


def test_batch_std_whitens_over_loss_tokens_as_openrlhf():
    """REINFORCE++-baseline as OpenRLHF: groups (1, 0) of 1 and 3 tokens and (2, 0) of 2 and 2,
    centred (.5, -.5) and (1, -1). Over the 8 tokens: mean (.5 - 1.5 + 2 - 2) / 8 = -1/8, biased
    variance (.625^2 + 3 * .375^2 + 2 * 1.125^2 + 2 * .875^2) / 8 = 39/64, so the advantages are
    (5, -3, 9, -7) / sqrt(39). OpenRLHF's own lines (``experience_maker.py``, the reward on
    every action token, then the masked whitening) give the same on the padded tokens."""
    units = [_with_lengths(rollout_unit(0, group_size=2), (1, 0), (1, 3)),
             _with_lengths(rollout_unit(1, group_size=2), (2, 0), (2, 2))]
    objective = GroupNormalisedAdvantage(normalisation=AdvantageNormalisation.BATCH_STD)
    values = np.asarray(objective.compute(units, objective.initial_state()).advantages.values)
    assert values.tolist() == pytest.approx([v / 39 ** .5 for v in (5, -3, 9, -7)], rel=1e-6)
    # OpenRLHF 3c3be62, openrlhf/trainer/ppo_utils/experience_maker.py l. 267-268, 315-327
    rewards = torch.tensor([[1., 0.], [2., 0.]])
    rewards = (rewards - rewards.mean(-1, keepdim=True)).reshape(-1)
    action_mask = torch.arange(3)[None, :] < torch.tensor([1, 3, 2, 2])[:, None]
    all_advantages = (rewards[:, None] * action_mask).flatten()
    all_action_masks = action_mask.flatten()
    num_actions = all_action_masks.sum()
    mean = (all_advantages * all_action_masks).sum() / num_actions
    var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
    theirs = ((all_advantages - mean) * var.clamp(min=1e-8).rsqrt()).reshape(4, 3)[:, 0]
    assert values.tolist() == pytest.approx(theirs.tolist(), rel=1e-6)


def test_batch_std_floors_the_std_at_epsilon_as_openrlhf_clamps_the_variance():
    """Rewards (1, 0) and (1, 0), one token each: centred +-.5, std .5. With epsilon 2 the std
    is floored at 2 (OpenRLHF: ``var.clamp(min=1e-8)``, epsilon 1e-4), not added to it: +-.25."""
    units = [_with_lengths(rollout_unit(i, group_size=2), (1, 0), (1, 1)) for i in range(2)]
    for epsilon, scale in ((2.0, 2.0), (1e-4, .5)):
        objective = GroupNormalisedAdvantage(epsilon=epsilon,
                                             normalisation=AdvantageNormalisation.BATCH_STD)
        values = objective.compute(units, objective.initial_state()).advantages.values
        assert np.asarray(values).tolist() == pytest.approx([.5 / scale, -.5 / scale] * 2)


def test_rloo_takes_each_groups_own_size_and_gives_a_group_of_one_zero():
    """RLOO (TRL's RLOOTrainer): groups (3), (2, 0) and (4, 1, 1) of sizes 1, 2, 3. A group of
    one has no other reward: 0 (TRL; verl's compute_rloo_outcome_advantage gives r = 3). Of two:
    2 - 0, 0 - 2. Of three: 4 - 1, 1 - 2.5, 1 - 2.5. The epsilon plays no part."""
    units = [rollout_unit(i) for i in range(3)]
    units = [dataclasses.replace(u, members=tuple(dataclasses.replace(m, reward=float(r))
                                                  for m, r in zip(u.members, rewards)))
             for u, rewards in zip(units, ([3], [2, 0], [4, 1, 1]))]
    for epsilon in (1e-4, 0.5):
        objective = GroupNormalisedAdvantage(epsilon=epsilon,
                                             normalisation=AdvantageNormalisation.RLOO)
        result = objective.compute(units, objective.initial_state())
        assert np.asarray(result.advantages.values).tolist() == [0, 2, -2, 3, -1.5, -1.5]


@pytest.mark.parametrize("normalisation, rest", [
    (AdvantageNormalisation.GROUP_POPULATION_STD, [1, -1]),
    (AdvantageNormalisation.GROUP_SAMPLE_STD, [.5 / .5 ** .5, -.5 / .5 ** .5]),
    (AdvantageNormalisation.NONE, [.5, -.5]),
    (AdvantageNormalisation.BATCH_STD, [.5 * 6 ** .5, -.5 * 6 ** .5]),
    (AdvantageNormalisation.BATCH_REWARD_STD, [.5 / (7 / 3) ** .5, -.5 / (7 / 3) ** .5]),
    (AdvantageNormalisation.RLOO, [1, -1]),
])
def test_a_group_of_one_gets_advantage_zero(normalisation, rest):
    """Groups (3) and (1, 0): the lone 3 gets 0 under every normalisation (TRL's choice; verl's
    GRPO gives r / (1 + eps) = 3). The pair: centred +-.5; population std .5, sample std
    sqrt(.5); batch tokens (0, .5, -.5) of 10 each, mean 0, variance 1/6; raw rewards (3, 1, 0),
    sample variance (25 + 1 + 16) / 9 / 2 = 7/3; RLOO 1 - 0, 0 - 1."""
    units = [_with_lengths(rollout_unit(0, group_size=1), (3,), (10,)),
             _with_lengths(rollout_unit(1, group_size=2), (1, 0), (10, 10))]
    objective = GroupNormalisedAdvantage(epsilon=1e-12, normalisation=normalisation)
    values = objective.compute(units, objective.initial_state()).advantages.values
    assert np.asarray(values).tolist() == pytest.approx([0, *rest], rel=1e-5)


def test_dynamic_sampling_drops_groups_with_all_equal_rewards():
    """DAPO's dynamic sampling (Yu et al. 2025): of groups (1,1,1,1), (1,0,0,1), (0,0,0,0) the
    first and last carry no signal: dropped (keep False on their samples), 2/3 counted; the
    batch std leaves them out (the kept group's centred rewards alone: std .5)."""
    units = [rollout_unit(i) for i in range(3)]
    units = [dataclasses.replace(u, members=tuple(dataclasses.replace(m, reward=float(r))
                                                  for m, r in zip(u.members, rewards)))
             for u, rewards in zip(units, ([1] * 4, [1, 0, 0, 1], [0] * 4))]
    objective = GroupNormalisedAdvantage(epsilon=1e-12, dynamic_sampling=True,
                                         normalisation=AdvantageNormalisation.BATCH_STD)
    result = objective.compute(units, objective.initial_state())
    assert np.asarray(result.advantages.keep).tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert result.metrics[OBJECTIVE_DYNAMIC_SAMPLING_DROPPED] == pytest.approx(2 / 3)
    assert np.asarray(result.advantages.values)[4:8].tolist() == pytest.approx([1, -1, -1, 1])
    off = GroupNormalisedAdvantage().compute(units, GroupNormalisedAdvantage().initial_state())
    assert off.advantages.keep is None and OBJECTIVE_DYNAMIC_SAMPLING_DROPPED not in off.metrics


# --------------------------------------------------------------------------- typed options


@pytest.mark.parametrize("build, words", [
    (lambda: ClippedPolicyGradient(dual_clip=0.5), "dual_clip must be a finite number > 1"),
    (lambda: ClippedPolicyGradient(epsilon_high=-0.1), "epsilon_high must be"),
    (lambda: ClippedPolicyGradient(aggregation="token-mean"), "aggregation must be one of"),
    (lambda: ClippedPolicyGradient(ratio_level="sequence"), "ratio_level must be a RatioLevel"),
    (lambda: ClippedPolicyGradient(log_ratio_bound=100.0), "log_ratio_bound must be in"),
    (lambda: ClippedWeightPolicyGradient(epsilon_low=1.5), "epsilon_low must be"),
    (lambda: KLPenalty(-1.0), "KLPenalty.coefficient must be"),
    (lambda: KLPenalty(0.1, "k3"), "estimator must be a KLEstimator"),
    (lambda: KLPenalty(0.1, reference=""), "reference must be a checkpoint URI"),
    (lambda: KLPenalty(0.1, estimate_bound=0.0), "KLPenalty.estimate_bound must be"),
    (lambda: ConstantNormaliser(0), "tokens_per_sequence must be"),
    (lambda: DecoupledProximal(weight_cap=0.0), "weight_cap must be"),
    (lambda: DecoupledProximal(weight_cap=-2.0), "weight_cap must be a finite number > 0"),
    (lambda: DecoupledProximal(weight_floor=0.0), "weight_floor must be a finite number > 0"),
    (lambda: DecoupledProximal(2.0, weight_floor=3.0),
     r"weight_floor \(3\) is above weight_cap \(2\)"),
    (lambda: DecoupledProximal(weight_mode="drop"),
     "weight_mode must be a BehaviourWeightMode \\(TRUNCATE, MASK\\), got 'drop'"),
    (lambda: DecoupledProximal(weight_level="seq"), "weight_level must be a BehaviourWeightLevel"),
    (lambda: DecoupledProximal(None, weight_mode=BehaviourWeightMode.MASK),
     "weight_cap must be set under BehaviourWeightMode.MASK"),
    (lambda: GroupNormalisedAdvantage(normalisation="none"), "must be an AdvantageNormalisation"),
])
def test_options_are_checked_when_built(build, words):
    with pytest.raises(ConfigurationError, match=words):
        build()


# --------------------------------------------------------------------------- in the backend


def _backend(loss, schedule=None):
    schedule = schedule or Schedule(units_per_step=2, optimizer_batch_size=2, micro_batch_size=1,
                                    epochs=1, seed=3, max_staleness=3)
    configured = dataclasses.replace(recipe, schedule=schedule, backend=Backend(
        name="torch", loss_families=(POLICY_GRADIENT,), model=recipe.backend.model,
        losses={POLICY_GRADIENT: loss}))
    return TorchBackend(configured), configured


def _step(backend, configured, units, step):
    result = configured.objective.compute(units, configured.objective.initial_state())
    return backend.train_step(units, result, step)


def test_the_kl_reference_is_a_frozen_copy_of_the_initial_policy():
    """GRPO's KL penalty: the backend keeps the seeded initial weights, never trained; the KL
    to them is 0 before the first update and grows as the policy moves; the step reports it,
    the entropy and the clip fraction per side."""
    loss = ClippedPolicyGradient(kl=KLPenalty(0.05), entropy=EntropyBonus(0.01),
                                 epsilon_high=0.28)
    schedule = Schedule(units_per_step=2, optimizer_batch_size=2, micro_batch_size=2, epochs=1,
                        seed=3, max_staleness=3)
    backend, configured = _backend(loss, schedule)
    frozen = {k: v.clone() for k, v in backend.reference.state_dict().items()}
    assert all(torch.equal(frozen[k], v) for k, v in backend.state()[0].items())
    first = _step(backend, configured, [rollout_unit(0), rollout_unit(1)], 1)
    assert first[LOSS_KL_REFERENCE] == pytest.approx(0.0, abs=1e-7)
    for step in range(2, 6):
        metrics = _step(backend, configured, [rollout_unit(2 * step), rollout_unit(2 * step + 1)],
                        step)
    assert metrics[LOSS_KL_REFERENCE] > 1e-6
    assert all(torch.equal(frozen[k], v) for k, v in backend.reference.state_dict().items())
    assert metrics[LOSS_ENTROPY] > 0
    assert {LOSS_CLIP_FRACTION_LOW, LOSS_CLIP_FRACTION_HIGH} <= set(metrics)


def _stored(tmp_path, weights):
    """A checkpoint holding ``weights``, as a trainer stores one; its URI."""
    from reef_stream.core.events import TopicOffset
    from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore

    return CheckpointStore(str(tmp_path / "ckpt")).write(CheckpointContents(
        step=1, policy_version=1, model="policy", recipe="trainable", trainer_group="g",
        weights=weights, optimizer={"state": {}, "param_groups": []}, rng={},
        algorithm_state={}, offsets=(TopicOffset(topic="t", partition=0, offset=1),),
        trained_units=np.zeros(0, dtype=np.uint64))).uri


def test_the_kl_reference_can_be_a_checkpoint_the_recipe_chooses(tmp_path):
    """GRPO's KL penalty to a chosen checkpoint instead of the initial policy: the backend's
    reference holds that checkpoint's weights, so the KL is already above 0 before the first
    update; a checkpoint of another model is refused, naming its tensors."""
    schedule = Schedule(units_per_step=2, optimizer_batch_size=2, micro_batch_size=2, epochs=1,
                        seed=3, max_staleness=3)
    trained, configured = _backend(ClippedPolicyGradient(), schedule)
    for step in range(1, 4):
        _step(trained, configured, [rollout_unit(2 * step), rollout_unit(2 * step + 1)], step)
    chosen = {k: v.clone() for k, v in trained.state()[0].items()}
    uri = _stored(tmp_path, chosen)
    backend, configured = _backend(ClippedPolicyGradient(kl=KLPenalty(0.05, reference=uri)),
                                   schedule)
    assert all(torch.equal(chosen[k], v) for k, v in backend.reference.state_dict().items())
    assert any(not torch.equal(chosen[k], v) for k, v in backend.state()[0].items())
    metrics = _step(backend, configured, [rollout_unit(0), rollout_unit(1)], 1)
    assert metrics[LOSS_KL_REFERENCE] > 1e-6
    assert "KL to checkpoint" in KLPenalty(0.05, reference=uri).describe()

    other = _stored(tmp_path / "other", {"head.weight": torch.zeros(3, 3)})
    with pytest.raises(ConfigurationError, match="does not fit the recipe's model.*head.weight"):
        _backend(ClippedPolicyGradient(kl=KLPenalty(0.05, reference=other)), schedule)


def test_the_proximal_policy_is_the_weights_at_the_start_of_the_step():
    """Decoupled PPO in the backend: two updates a step; the proximal logprobs are recomputed
    once, before the first, so the behaviour weight of the step's tokens is the same as the
    loss computes it by hand from the start-of-step weights and the recorded logprobs."""
    loss = ClippedPolicyGradient(proximal=DecoupledProximal(weight_cap=None))
    schedule = Schedule(units_per_step=2, optimizer_batch_size=1, micro_batch_size=1, epochs=1,
                        shuffle=False, seed=3, max_staleness=3)
    backend, configured = _backend(loss, schedule)
    units = [rollout_unit(0), rollout_unit(1)]
    from reef_stream.engine.training import collate, completion_logprobs
    with torch.no_grad():
        weights = []
        for unit in units:
            batch = collate(unit.members)
            start = completion_logprobs(backend.model(batch.input_ids, batch.attention_mask),
                                        batch)
            weights.append(torch.exp(start - batch.behaviour_logprobs).mean().item())
    metrics = _step(backend, configured, units, 1)
    assert metrics[LOSS_BEHAVIOUR_WEIGHT_MEAN] == pytest.approx(np.mean(weights), rel=1e-5)


def test_the_backend_masks_by_the_sequence_weight_of_the_start_of_step_weights():
    """Masked rollout correction in the backend: each sample's geometric-mean weight,
    exp(mean over its completion of start-of-step logprob - recorded logprob), dropped above a
    cap set between two of them; the step reports the share of its loss tokens dropped, per
    micro batch (one unit each here), as computed by hand from those weights."""
    from reef_stream.engine.training import collate, completion_logprobs

    units = [rollout_unit(0), rollout_unit(1)]
    schedule = Schedule(units_per_step=2, optimizer_batch_size=2, micro_batch_size=1, epochs=1,
                        shuffle=False, seed=3, max_staleness=3)
    backend, configured = _backend(ClippedPolicyGradient(), schedule)
    means, lengths = [], []
    with torch.no_grad():
        for unit in units:
            batch = collate(unit.members)
            start = completion_logprobs(backend.model(batch.input_ids, batch.attention_mask),
                                        batch)
            length = batch.completion_mask.sum(1)
            means.append(((start - batch.behaviour_logprobs) * batch.completion_mask).sum(1)
                         / length)
            lengths.append(length)
    ordered = torch.exp(torch.cat(means)).sort().values
    cap = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2  # none on it
    shares = [float((length * (torch.exp(mean) > cap)).sum() / length.sum())
              for mean, length in zip(means, lengths)]
    assert 0 < np.mean(shares) < 1
    backend, configured = _backend(ClippedPolicyGradient(proximal=DecoupledProximal(
        cap, BehaviourWeightLevel.SEQUENCE_GEOMETRIC, BehaviourWeightMode.MASK)), schedule)
    metrics = _step(backend, configured, units, 1)
    assert metrics[LOSS_BEHAVIOUR_MASKED_FRACTION] == pytest.approx(np.mean(shares), rel=1e-6)
    assert math.isfinite(metrics["loss"])


def test_a_step_with_a_behaviour_logprob_of_minus_100_trains():
    """Issue 18: such a sample stopped the trainer with NonFiniteStep, replayed identically
    forever; clamped, the step trains and the weights stay finite."""
    unit = rollout_unit(0)
    first = unit.members[0]
    logprobs = first.completion_logprobs.copy()
    logprobs[0] = -100.0
    unit = dataclasses.replace(unit, members=(dataclasses.replace(
        first, completion_logprobs=logprobs), *unit.members[1:]))
    backend, configured = _backend(ClippedPolicyGradient())
    metrics = _step(backend, configured, [unit, rollout_unit(1)], 1)
    assert math.isfinite(metrics["loss"])
    assert all(torch.isfinite(v).all() for v in backend.state()[0].values())


def test_an_optimizer_batch_with_every_sample_dropped_makes_no_update():
    """DAPO's dynamic sampling can drop every group of an optimizer batch: then there is nothing
    to learn from, and an AdamW step on zero gradients would still move the weights (momentum,
    weight decay). The batch is skipped, counted; the weights and the optimizer stay as they were."""
    units = [dataclasses.replace(u, members=tuple(dataclasses.replace(m, reward=1.0)
                                                  for m in u.members))
             for u in (rollout_unit(0), rollout_unit(1))]
    backend, configured = _backend(ClippedPolicyGradient())
    objective = GroupNormalisedAdvantage(dynamic_sampling=True)
    before = {k: v.clone() for k, v in backend.state()[0].items()}
    metrics = backend.train_step(units, objective.compute(units, objective.initial_state()), 1)
    assert metrics[TRAINER_SKIPPED_UPDATES] == 1.0
    assert all(torch.equal(before[k], v) for k, v in backend.state()[0].items())
    assert not backend.optimizer.state          # AdamW never stepped
    kept = [dataclasses.replace(units[0], members=tuple(
        dataclasses.replace(m, reward=float(i % 2)) for i, m in enumerate(units[0].members))),
        units[1]]
    metrics = backend.train_step(kept, objective.compute(kept, objective.initial_state()), 1)
    assert TRAINER_SKIPPED_UPDATES not in metrics
    assert any(not torch.equal(before[k], v) for k, v in backend.state()[0].items())


# --------------------------------------------------------------------------- the recipe


def test_grpo_exposes_the_variants_and_reef_check_prints_the_chosen_ones():
    """methods.grpo's factory takes the loss, the advantages' normalisation and dynamic
    sampling; ``reef check`` prints each part's choice (here DAPO's clip-higher, dual-clip PPO,
    a k2 KL penalty, Dr. GRPO's advantages, DAPO's dynamic sampling)."""
    import functools

    from methods.grpo import recipe as grpo
    from reef_stream.api.recipe import check_recipe
    from reef_stream.cli.check import contract_lines
    from reef_stream.core.serde import SchemaRegistry
    from reef_stream.demo.recipes import bind

    loss = ClippedPolicyGradient(epsilon_high=0.28, dual_clip=3.0,
                                 kl=KLPenalty(0.01, KLEstimator.K2))
    bound = bind(functools.partial(grpo, loss=loss, normalisation=AdvantageNormalisation.NONE,
                                   dynamic_sampling=True))
    check_recipe(bound, complete=True)
    assert bound.backend.losses[POLICY_GRADIENT] is loss
    lines = contract_lines(bound, "variants", SchemaRegistry.default())
    for expected in [
        "            advantages: r - group mean, unscaled (Dr. GRPO), eps 0.0001",
        "            dynamic sampling: groups whose rewards are all equal dropped (DAPO)",
        "loss:      ClippedPolicyGradient",
        "            clip: ratio in [1 - 0.2, 1 + 0.28] (clip-higher, DAPO), dual clip 3 "
        "(dual-clip PPO)",
        "            ratio: token-level (PPO)",
        "            aggregation: token-mean: the batch's token sum / its token count (DAPO)",
        "            kl: KL to the initial policy, k2 estimator, coefficient 0.01",
        "            entropy: none",
        "            log-ratio: clamped to +-20 before exp",
    ]:
        assert expected in lines, (expected, lines)


def test_reef_check_prints_the_default_grpo_variants_and_set_changes_the_objectives():
    from click.testing import CliRunner

    from reef_stream.cli.main import main

    result = CliRunner().invoke(main, ["check", "--recipe", "reef_stream.demo.recipes:grpo"])
    assert result.exit_code == 0, result.output
    assert ("            advantages: (r - group mean) / (group population std + eps) (GRPO), "
            "eps 0.0001\n            dynamic sampling: off\nloss:      ClippedPolicyGradient\n"
            "            clip: ratio in [1 - 0.2, 1 + 0.2] (PPO), no dual clip\n") in result.stdout
    result = CliRunner().invoke(main, [
        "check", "--recipe", "reef_stream.demo.recipes:grpo", "--set",
        "objective.normalisation=batch_std", "--set", "objective.dynamic_sampling=true"])
    assert result.exit_code == 0, result.output
    assert "r - group mean, whitened over the batch's loss tokens (REINFORCE++-baseline" \
        in result.stdout
    assert "dynamic sampling: groups whose rewards are all equal dropped" in result.stdout


def test_set_reaches_the_rloo_advantages():
    """``--set objective.normalisation=rloo`` (the enum's value; its name RLOO too) switches the
    built-in GRPO objective to RLOO advantages; the loss's options are the recipe factory's
    ``loss`` argument (``backend.losses`` is a mapping, which ``--set`` does not reach)."""
    from reef_stream.api.recipe import apply_overrides
    from reef_stream.demo.recipes import grpo

    for value in ("rloo", "RLOO"):
        changed = apply_overrides(grpo, [f"objective.normalisation={value}"])
        assert changed.objective.normalisation is AdvantageNormalisation.RLOO
    assert changed.objective.describe()[0] == (
        "advantages: r - mean of the group's other rewards, 0 for a group of one (RLOO), "
        "eps 0.0001")
