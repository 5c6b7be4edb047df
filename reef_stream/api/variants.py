"""The variants of the built-in objectives and losses, as typed options (never strings).

Each option is an enum or a frozen dataclass, validated when it is built
(``ConfigurationError`` naming the bad value), and says what it does in
``describe()`` (what ``reef check`` prints). The losses and objectives that take them:
``reef_stream.api.losses.ClippedPolicyGradient`` / ``ClippedWeightPolicyGradient`` and
``methods.grpo.objective.GroupNormalisedAdvantage``.

Options, and where they come from:

- ``AdvantageNormalisation``: how a group's centred rewards are scaled: the group's
  population std (GRPO, Shao et al. 2024, "DeepSeekMath"), its sample std, nothing (Dr. GRPO,
  Liu et al. 2025, "Understanding R1-Zero-Like Training"), whitened over the batch's tokens
  (REINFORCE++-baseline, Hu et al. 2025) or the batch's reward std (TRL); or the
  leave-one-out baseline (RLOO, Ahmadian et al. 2024).
- ``Aggregation``: how per-token terms become the loss: ``TokenMean`` (DAPO's token-level
  loss, Yu et al. 2025), ``SequenceMeanTokenMean`` (the original GRPO), ``SequenceMeanTokenSum``,
  ``ConstantNormaliser`` (Dr. GRPO: a fixed token budget per sequence).
- ``RatioLevel``: the importance ratio per token (PPO) or per sequence, the geometric mean of
  its tokens' ratios (GSPO, Zheng et al. 2025).
- ``KLPenalty``: a penalty to a frozen reference policy, by Schulman's k1/k2/k3 estimators
  ("Approximating KL divergence", 2020), as in GRPO.
- ``EntropyBonus``: minus a coefficient times the policy's entropy (Mnih et al. 2016, A3C).
- ``DecoupledProximal``: clip against a proximal policy recomputed at the start of the step,
  with the behaviour gap corrected by an importance weight (decoupled PPO, Hilton et al. 2022,
  "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025), per token or per
  sequence (``BehaviourWeightLevel``), truncated or masked beyond its bounds
  (``BehaviourWeightMode``): verl's rollout correction and AReaL's rejection sampling.
- ``LOG_RATIO_BOUND``: every log-ratio is clamped to ``[-bound, bound]`` before ``exp``.

Normalisation is exact over the optimizer batch: the backend counts the batch's loss tokens
and sequences (``BatchTotals``, summed over its micro batches and data-parallel ranks) before
the backward pass, and every loss divides by those totals, so the micro-batch size and the
number of ranks do not change the loss or its gradient.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from reef_stream.core.errors import ConfigurationError

#: The default bound on a log-ratio before ``exp``: ratios stay in ``[e^-20, e^20]`` (about
#: ``[2e-9, 4.9e8]``), finite in float32 (whose ``exp`` overflows past 88.7). A token whose
#: log-ratio lies outside has a constant ratio (no gradient through it); a behaviour logprob of
#: -100 thus gives a finite loss and gradient instead of an infinite ratio and a NaN step.
LOG_RATIO_BOUND = 20.0


def _positive(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    """``ConfigurationError`` unless ``value`` is a finite number > 0 (>= 0 with allow_zero)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ConfigurationError(f"{owner}.{name} must be a finite number "
                                 f"{'>= 0' if allow_zero else '> 0'}, got {value!r}")


# --------------------------------------------------------------------------- totals


@dataclass(frozen=True, slots=True)
class BatchTotals:
    """What a loss divides by: the optimizer batch's loss tokens and sequences (a sequence
    counts when it has at least one loss token), summed over its micro batches and every
    data-parallel rank. A loss given ``None`` takes its own micro batch's counts (a micro batch
    that is the whole batch)."""

    tokens: float
    sequences: float

    def __post_init__(self) -> None:
        _positive("BatchTotals", "tokens", self.tokens, allow_zero=True)
        _positive("BatchTotals", "sequences", self.sequences, allow_zero=True)

    @classmethod
    def of(cls, mask: torch.Tensor) -> BatchTotals:
        """The counts of one ``bool[B, T]`` mask (or ``bool[B]``: one entry a sequence)."""
        rows = mask if mask.ndim == 2 else mask[:, None]
        return cls(tokens=float(rows.sum()), sequences=float(rows.any(dim=1).sum()))


# --------------------------------------------------------------------------- aggregation


@dataclass(frozen=True, slots=True)
class TokenMean:
    """``sum(terms * mask) / tokens``: every token of the batch weighs the same, however long
    its sequence (DAPO's token-level policy-gradient loss, Yu et al. 2025). The default."""

    def reduce(self, terms: torch.Tensor, mask: torch.Tensor, totals: BatchTotals
               ) -> torch.Tensor:
        return (terms * mask).sum() / max(totals.tokens, 1.0)

    def describe(self) -> str:
        return "token-mean: the batch's token sum / its token count (DAPO)"


@dataclass(frozen=True, slots=True)
class SequenceMeanTokenMean:
    """``sum_i(mean_t(terms_i)) / sequences``: each sequence's token mean, averaged over the
    batch's sequences; a long sequence's tokens weigh less (the original GRPO, Shao et al.
    2024)."""

    def reduce(self, terms: torch.Tensor, mask: torch.Tensor, totals: BatchTotals
               ) -> torch.Tensor:
        lengths = mask.sum(dim=1).clamp(min=1.0)
        return ((terms * mask).sum(dim=1) / lengths).sum() / max(totals.sequences, 1.0)

    def describe(self) -> str:
        return "seq-mean-token-mean: each sequence's token mean, averaged over sequences (GRPO)"


@dataclass(frozen=True, slots=True)
class SequenceMeanTokenSum:
    """``sum(terms * mask) / sequences``: each sequence's token sum, averaged over the batch's
    sequences (no length normalisation; verl's ``seq-mean-token-sum``)."""

    def reduce(self, terms: torch.Tensor, mask: torch.Tensor, totals: BatchTotals
               ) -> torch.Tensor:
        return (terms * mask).sum() / max(totals.sequences, 1.0)

    def describe(self) -> str:
        return "seq-mean-token-sum: each sequence's token sum, averaged over sequences"


@dataclass(frozen=True, slots=True)
class ConstantNormaliser:
    """``sum(terms * mask) / (sequences * tokens_per_sequence)``: a fixed budget per sequence
    instead of its length, so no length bias (Dr. GRPO, Liu et al. 2025: the generation
    budget). ``tokens_per_sequence`` > 0."""

    tokens_per_sequence: float

    def __post_init__(self) -> None:
        _positive("ConstantNormaliser", "tokens_per_sequence", self.tokens_per_sequence)

    def reduce(self, terms: torch.Tensor, mask: torch.Tensor, totals: BatchTotals
               ) -> torch.Tensor:
        return (terms * mask).sum() / (max(totals.sequences, 1.0) * self.tokens_per_sequence)

    def describe(self) -> str:
        return (f"constant normaliser: token sum / (sequences x {self.tokens_per_sequence:g}) "
                "(Dr. GRPO)")


Aggregation = Union[TokenMean, SequenceMeanTokenMean, SequenceMeanTokenSum, ConstantNormaliser]
AGGREGATIONS = (TokenMean, SequenceMeanTokenMean, SequenceMeanTokenSum, ConstantNormaliser)


def check_aggregation(owner: str, value: object) -> None:
    if not isinstance(value, AGGREGATIONS):
        raise ConfigurationError(
            f"{owner}.aggregation must be one of {', '.join(a.__name__ for a in AGGREGATIONS)}, "
            f"got {value!r}")


# --------------------------------------------------------------------------- ratios


class RatioLevel(enum.Enum):
    """Where the importance ratio is taken."""

    #: One ratio per token, ``exp(logprob - behaviour)`` (PPO).
    TOKEN = "token"
    #: One ratio per sequence, ``exp(mean over its tokens of (logprob - behaviour))``, the
    #: geometric mean of its tokens' ratios, clipped as a whole (GSPO, Zheng et al. 2025).
    SEQUENCE = "sequence"


def log_ratio(current: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor,
              level: RatioLevel, bound: float) -> torch.Tensor:
    """``float[B, T]``: ``current - anchor`` per token (``anchor`` without gradient), or each
    sequence's masked token mean broadcast over its tokens (``RatioLevel.SEQUENCE``), clamped
    to ``[-bound, bound]``; 0 on padding."""
    raw = torch.where(mask, current - anchor.detach(), 0.0)
    if level is RatioLevel.SEQUENCE:
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        raw = (raw.sum(dim=1, keepdim=True) / lengths).expand_as(raw)
    return torch.where(mask, raw.clamp(-bound, bound), 0.0)


# --------------------------------------------------------------------------- penalties


class KLEstimator(enum.Enum):
    """Schulman's estimators of KL(current || reference) from a sample of the current policy,
    with ``d = reference - current`` per token (logprobs)."""

    #: ``-d``: unbiased, can be negative, high variance.
    K1 = "k1"
    #: ``d^2 / 2``: biased, low variance, never negative.
    K2 = "k2"
    #: ``exp(d) - 1 - d``: unbiased, never negative, low variance (GRPO's choice).
    K3 = "k3"

    def estimate(self, current: torch.Tensor, reference: torch.Tensor, bound: float
                 ) -> torch.Tensor:
        d = (reference.detach() - current).clamp(-bound, bound)
        if self is KLEstimator.K1:
            return -d
        if self is KLEstimator.K2:
            return 0.5 * d.square()
        return torch.expm1(d) - d


@dataclass(frozen=True, slots=True)
class KLPenalty:
    """Add ``coefficient * aggregate(k(current, reference))`` to the loss: a penalty to a
    reference policy (GRPO, Shao et al. 2024, with ``K3``). The reference logprobs come from the
    backend's frozen reference model (``reef_stream.engine.training``): a copy of the initial
    policy, or with ``reference`` the weights of that checkpoint (the URI of a checkpoint a
    trainer stored, e.g. ``/ckpt/step-000120-...``; verified against its manifest; its tensors
    must be the model's, a LoRA checkpoint's adapter alone included).

    ``estimate_bound`` > 0: each token's estimate is clamped to ``[-bound, bound]`` (a token
    beyond it adds a constant, no gradient). None, the default: unbounded, as GRPO and TRL
    (``GRPOTrainer``'s ``per_token_kl``, ``trl/trainer/grpo_trainer.py`` l. 3071-3073 at
    f2cd577). verl's ``low_var_kl`` / ``k3`` is ``estimate_bound=10``
    (``kl_penalty_forward``, ``verl/trainer/ppo/core_algos.py`` l. 1890-1896 at b178a3c); verl
    bounds no other estimator. Either way the log-ratio ``d`` is first clamped to the loss's
    ``log_ratio_bound`` (20 by default, verl's own clamp of ``d``)."""

    coefficient: float
    estimator: KLEstimator = KLEstimator.K3
    reference: str | None = None
    estimate_bound: float | None = None

    def __post_init__(self) -> None:
        _positive("KLPenalty", "coefficient", self.coefficient, allow_zero=True)
        if self.estimate_bound is not None:
            _positive("KLPenalty", "estimate_bound", self.estimate_bound)
        if not isinstance(self.estimator, KLEstimator):
            raise ConfigurationError(f"KLPenalty.estimator must be a KLEstimator (K1, K2, K3), "
                                     f"got {self.estimator!r}")
        if self.reference is not None and (not isinstance(self.reference, str)
                                           or not self.reference.strip()):
            raise ConfigurationError(f"KLPenalty.reference must be a checkpoint URI or None, "
                                     f"got {self.reference!r}")

    def estimate(self, current: torch.Tensor, reference: torch.Tensor, bound: float
                 ) -> torch.Tensor:
        """``float[B, T]``: the estimator's value per token, ``d`` clamped to ``[-bound,
        bound]`` first, the estimate to ``[-estimate_bound, estimate_bound]`` after. Pure."""
        estimate = self.estimator.estimate(current, reference, bound)
        if self.estimate_bound is None:
            return estimate
        return estimate.clamp(-self.estimate_bound, self.estimate_bound)

    def describe(self) -> str:
        to = "the initial policy" if self.reference is None else f"checkpoint {self.reference}"
        bounded = ("" if self.estimate_bound is None
                   else f", each token's estimate clamped to +-{self.estimate_bound:g}")
        return (f"KL to {to}, {self.estimator.value} estimator, coefficient "
                f"{self.coefficient:g}{bounded}")


@dataclass(frozen=True, slots=True)
class EntropyBonus:
    """Subtract ``coefficient * aggregate(entropy)`` from the loss, the entropy of the current
    policy's next-token distribution at each completion token (A3C, Mnih et al. 2016)."""

    coefficient: float

    def __post_init__(self) -> None:
        _positive("EntropyBonus", "coefficient", self.coefficient, allow_zero=True)

    def describe(self) -> str:
        return f"entropy bonus, coefficient {self.coefficient:g}"


class BehaviourWeightLevel(enum.Enum):
    """Where ``DecoupledProximal``'s behaviour weight ``w`` is taken, from ``l = proximal -
    behaviour`` per loss token (clamped to ``[-bound, bound]`` before ``exp``)."""

    #: ``w = exp(l)`` per token (verl's ``rollout_is="token"``; AReaL's ``level="token"``).
    TOKEN = "token"
    #: ``w = exp(sum of l over the sequence's loss tokens)``, the product of its tokens'
    #: weights, on every token of the sequence (verl's ``rollout_is="sequence"``).
    SEQUENCE = "sequence"
    #: ``w = exp(mean of l over the sequence's loss tokens)``, the geometric mean of its
    #: tokens' weights, on every token (AReaL's ``level="sequence"``, ``agg="mean"``).
    SEQUENCE_GEOMETRIC = "sequence_geometric"


class BehaviourWeightMode(enum.Enum):
    """What ``DecoupledProximal`` does with a behaviour weight outside ``[weight_floor,
    weight_cap]``."""

    #: Clamp it into the bounds; the token still trains (truncated IS: verl's
    #: ``rollout_is_threshold``; AReaL's ``action="clamp"``). The default.
    TRUNCATE = "truncate"
    #: Drop the token (its whole sequence, at a sequence level) from the loss; one inside keeps
    #: its weight unclamped (AReaL's ``action="mask"``; verl's rejection, ``rollout_rs``).
    MASK = "mask"


@dataclass(frozen=True, slots=True)
class DecoupledProximal:
    """Clip against the proximal policy (the weights at the start of the step, whose logprobs
    the backend recomputes then) instead of the behaviour policy, and weight each token by the
    behaviour importance weight ``w = proximal / behaviour`` (no gradient): decoupled PPO
    (Hilton et al. 2022; AReaL, Fu et al. 2025), also called the rollout correction (verl,
    "decoupled mode"). A sample many versions old is then corrected for its staleness, and the
    clip bounds the step's own update only.

    ``weight_level``: per token, or one weight per sequence (``BehaviourWeightLevel``).
    ``weight_mode``: beyond ``[weight_floor, weight_cap]`` (bounds included in it), truncate
    the weight or drop the token from the loss (``BehaviourWeightMode``). A dropped token
    still counts in the normaliser, as AReaL's ``ppo_actor_loss_fn`` keeps its original
    ``loss_mask`` count (``areal/utils/functional/functional.py``); verl drops it from there
    too, by rewriting ``response_mask`` before the update. ``weight_cap`` > 0 (None:
    untruncated; ``MASK`` needs it); ``weight_floor`` > 0 and <= ``weight_cap``, or None (no
    lower bound, as both).

    Defaults: token level, truncated at 2 (TRUNCATE, not MASK), as verl's truncated IS
    (``RolloutCorrectionConfig``: ``rollout_is_threshold = 2.0``, ``rollout_rs = None``,
    ``verl/trainer/config/algorithm.py`` l. 173-176 at b178a3c). AReaL masks by default once
    its filter is on (``RejectionSamplingConfig.action = "mask"``, ``upper = 5.0``,
    ``areal/api/cli_args.py`` l. 1263-1300 at 4aef98d): ``weight_mode=MASK, weight_cap=5``
    gives that. TRUNCATE stays the default because it was this option's only behaviour before
    (a run resumed or replayed with the default trains bitwise as before) and because a
    truncated token still trains with a bounded weight, where a masked one is lost; neither
    reference shows the other better in general (docs/design-notes.md, "Off-policy
    corrections").
    """

    weight_cap: float | None = 2.0
    weight_level: BehaviourWeightLevel = BehaviourWeightLevel.TOKEN
    weight_mode: BehaviourWeightMode = BehaviourWeightMode.TRUNCATE
    weight_floor: float | None = None

    def __post_init__(self) -> None:
        owner = "DecoupledProximal"
        if self.weight_cap is not None:
            _positive(owner, "weight_cap", self.weight_cap)
        if self.weight_floor is not None:
            _positive(owner, "weight_floor", self.weight_floor)
        if not isinstance(self.weight_level, BehaviourWeightLevel):
            raise ConfigurationError(
                f"{owner}.weight_level must be a BehaviourWeightLevel "
                f"({', '.join(m.name for m in BehaviourWeightLevel)}), got {self.weight_level!r}")
        if not isinstance(self.weight_mode, BehaviourWeightMode):
            raise ConfigurationError(
                f"{owner}.weight_mode must be a BehaviourWeightMode "
                f"({', '.join(m.name for m in BehaviourWeightMode)}), got {self.weight_mode!r}")
        if self.weight_mode is BehaviourWeightMode.MASK and self.weight_cap is None:
            raise ConfigurationError(f"{owner}.weight_cap must be set under "
                                     "BehaviourWeightMode.MASK: tokens whose weight is above it "
                                     "are dropped")
        if None not in (self.weight_cap, self.weight_floor) \
                and self.weight_floor > self.weight_cap:
            raise ConfigurationError(f"{owner}.weight_floor ({self.weight_floor:g}) is above "
                                     f"weight_cap ({self.weight_cap:g}); lower it or raise the cap")

    def weights(self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w, kept, truncated)``, each ``[B, T]``: the behaviour weight of each token (0
        where dropped or padding), without gradient; ``bool``, the loss tokens kept (``mask``
        but for those ``MASK`` drops); ``bool``, the loss tokens whose weight ``TRUNCATE``
        changed. ``bound``: the log-weight's clamp before ``exp``. Pure."""
        with torch.no_grad():
            raw = torch.where(mask, proximal.detach() - behaviour.detach(), 0.0)
            if self.weight_level is BehaviourWeightLevel.TOKEN:
                logs = raw
            else:
                logs = raw.sum(dim=1, keepdim=True)
                if self.weight_level is BehaviourWeightLevel.SEQUENCE_GEOMETRIC:
                    logs = logs / mask.sum(dim=1, keepdim=True).clamp(min=1)
                logs = logs.expand_as(raw)
            weight = torch.exp(logs.clamp(-bound, bound))
            kept, truncated = mask, torch.zeros_like(mask)
            if self.weight_mode is BehaviourWeightMode.MASK:
                inside = weight <= self.weight_cap
                if self.weight_floor is not None:
                    inside = inside & (weight >= self.weight_floor)
                kept = mask & inside
            elif self.weight_cap is not None or self.weight_floor is not None:
                clamped = weight.clamp(min=self.weight_floor, max=self.weight_cap)
                truncated, weight = mask & (clamped != weight), clamped
            return torch.where(kept, weight, 0.0), kept, truncated

    def describe(self) -> str:
        level = {BehaviourWeightLevel.TOKEN: "per token",
                 BehaviourWeightLevel.SEQUENCE: "per sequence (product)",
                 BehaviourWeightLevel.SEQUENCE_GEOMETRIC: "per sequence (geometric mean)",
                 }[self.weight_level]
        cap, floor = self.weight_cap, self.weight_floor
        if self.weight_mode is BehaviourWeightMode.MASK:
            which = "tokens" if self.weight_level is BehaviourWeightLevel.TOKEN else "sequences"
            bounds = f"above {cap:g}" if floor is None else f"outside [{floor:g}, {cap:g}]"
            what = f"{which} {bounds} dropped (still counted by the normaliser)"
        elif cap is None:
            what = "untruncated" if floor is None else f"raised to at least {floor:g}"
        else:
            what = f"truncated at {cap:g}" if floor is None else f"truncated to [{floor:g}, {cap:g}]"
        return ("decoupled proximal policy (recomputed at step start), behaviour weight "
                f"{level}, {what}")


class ExtraInput(enum.Enum):
    """Optional tensors of ``PolicyGradientInputs`` a loss asks the backend for (its
    ``extra_inputs``); the backend computes only those asked."""

    #: Logprobs of the frozen reference policy (``KLPenalty``).
    REFERENCE_LOGPROBS = "reference_logprobs"
    #: Logprobs of the weights at the start of the step (``DecoupledProximal``).
    PROXIMAL_LOGPROBS = "proximal_logprobs"
    #: The current policy's entropy per completion token (``EntropyBonus``).
    ENTROPY = "entropy"


# --------------------------------------------------------------------------- advantages


class AdvantageNormalisation(enum.Enum):
    """How a group's centred rewards ``r - mean(group)`` are scaled (``epsilon`` added to
    any std).

    A group of one (a generation ungrouped, or its group's others lost) has no other reward
    to compare with: every member but ``BATCH_STD`` gives it advantage 0 (its centred reward
    is 0; ``RLOO``: no other reward, 0), as TRL (``GRPOTrainer``: ``r - mean`` of the group;
    ``RLOOTrainer``). ``BATCH_STD`` gives it ``-m / std`` like every sample whose centred reward
    is 0 (OpenRLHF whitens every token). verl gives it ``r / (1 + eps)`` in GRPO (mean 0, std 1:
    ``compute_grpo_outcome_advantage``, ``verl/trainer/ppo/core_algos.py`` l. 314-316 at
    b178a3c), ``r`` in RLOO and REINFORCE++-baseline before whitening: the raw reward taken as
    an advantage, on another scale than its batch's normalised ones and of one sign whenever
    rewards are. 0 is chosen: a lone sample then adds nothing to the policy gradient (its KL and
    entropy terms still count), docs/design-notes.md, "Off-policy corrections"."""

    #: ``/ (std(group, ddof=0) + eps)`` (GRPO, Shao et al. 2024). The default.
    GROUP_POPULATION_STD = "group_population_std"
    #: ``/ (std(group, ddof=1) + eps)``: the sample std (as several open-source GRPO trainers
    #: compute it); a group of one has std 0.
    GROUP_SAMPLE_STD = "group_sample_std"
    #: Not scaled: ``r - mean(group)`` (Dr. GRPO, Liu et al. 2025: the std's difficulty bias
    #: removed).
    NONE = "none"
    #: REINFORCE++-baseline (Hu et al. 2025) as its authors' OpenRLHF computes it
    #: (``openrlhf/trainer/ppo_utils/experience_maker.py`` l. 267-268 and 315-327 at 3c3be62):
    #: ``c = r - mean(group)`` on each of the sample's loss tokens, then whitened over all the
    #: batch's loss tokens: ``(c - m) / sqrt(max(v, eps^2))`` with ``m`` and ``v`` the
    #: token-weighted mean and biased variance of ``c`` (a sample of ``L`` tokens counts ``L``
    #: times; OpenRLHF's ``var.clamp(min=1e-8).rsqrt()`` is ``eps = 1e-4``, this objective's
    #: default). verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``
    #: (``verl/trainer/ppo/core_algos.py`` l. 425) differs: Bessel-corrected variance,
    #: ``rsqrt(v + 1e-8)``. Groups dropped by dynamic sampling are left out of ``m`` and ``v``.
    BATCH_STD = "batch_std"
    #: ``/ (std(every reward of the batch, ddof=1) + eps)``: the std of the raw rewards, not
    #: the centred ones, per sample (TRL's ``GRPOConfig(scale_rewards="batch")``,
    #: ``trl/trainer/grpo_trainer.py`` l. 2694-2707 at f2cd577, ``nanstd`` Bessel-corrected,
    #: 0 for a single reward). Groups dropped by dynamic sampling are left out of that std.
    BATCH_REWARD_STD = "batch_reward_std"
    #: ``r_i - (sum(group) - r_i) / (n - 1)``: the mean of the group's other rewards as the
    #: baseline (RLOO, Ahmadian et al. 2024), equal to ``(r - mean(group)) * n / (n - 1)``; no
    #: std, ``epsilon`` unused. As TRL's ``RLOOTrainer`` (``trl/trainer/rloo_trainer.py``,
    #: ``normalize_advantages`` off) and verl's ``compute_rloo_outcome_advantage``
    #: (``verl/trainer/ppo/core_algos.py``, which scales ``r - mean`` by ``n / (n - 1)``). A group
    #: of one has no other reward: advantage 0, as TRL; verl gives it ``r`` (a baseline of 0).
    RLOO = "rloo"

    def apply(self, groups: list[np.ndarray], epsilon: float,
              kept: list[bool] | None = None,
              tokens: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The advantages of each group of rewards (float64 arrays), in order. ``kept``: per
        group, whether dynamic sampling keeps it (None: all). ``tokens``: per group, each
        sample's loss-token count, which ``BATCH_STD`` weighs it by (None: 1 each). Pure."""
        centred = [g - g.mean() for g in groups]
        counted = kept or [True] * len(groups)
        if self is AdvantageNormalisation.NONE:
            return centred
        if self is AdvantageNormalisation.RLOO:
            return [g - (g.sum() - g) / (g.size - 1) if g.size > 1 else np.zeros_like(g)
                    for g in groups]
        if self is AdvantageNormalisation.BATCH_STD:
            weights = tokens or [np.ones_like(g) for g in groups]
            flat = np.concatenate([c for c, keep in zip(centred, counted) if keep] or [[]])
            w = np.concatenate([np.asarray(t, dtype=np.float64)
                                for t, keep in zip(weights, counted) if keep] or [[]])
            total = float(w.sum())
            mean = float((flat * w).sum()) / total if total > 0 else 0.0
            var = float((np.square(flat - mean) * w).sum()) / total if total > 0 else 0.0
            return [(c - mean) / math.sqrt(max(var, epsilon ** 2)) for c in centred]
        if self is AdvantageNormalisation.BATCH_REWARD_STD:
            rewards = np.concatenate([g for g, keep in zip(groups, counted) if keep] or [[]])
            std = float(rewards.std(ddof=1)) if rewards.size > 1 else 0.0
            return [c / (std + epsilon) for c in centred]
        ddof = 0 if self is AdvantageNormalisation.GROUP_POPULATION_STD else 1
        return [c / ((float(g.std(ddof=ddof)) if g.size > ddof else 0.0) + epsilon)
                for c, g in zip(centred, groups)]

    def describe(self) -> str:
        return {
            AdvantageNormalisation.GROUP_POPULATION_STD:
                "(r - group mean) / (group population std + eps) (GRPO)",
            AdvantageNormalisation.GROUP_SAMPLE_STD:
                "(r - group mean) / (group sample std + eps)",
            AdvantageNormalisation.NONE: "r - group mean, unscaled (Dr. GRPO)",
            AdvantageNormalisation.BATCH_STD:
                "r - group mean, whitened over the batch's loss tokens (REINFORCE++-baseline, "
                "as OpenRLHF)",
            AdvantageNormalisation.BATCH_REWARD_STD:
                "(r - group mean) / (batch sample std of rewards + eps) (TRL "
                "scale_rewards=batch)",
            AdvantageNormalisation.RLOO:
                "r - mean of the group's other rewards, 0 for a group of one (RLOO)",
        }[self]


def equal_reward_groups(groups: list[np.ndarray]) -> list[bool]:
    """Per group, whether all its rewards are equal (no signal: dynamic sampling drops it,
    DAPO, Yu et al. 2025)."""
    return [bool(g.size == 0 or g.max() == g.min()) for g in groups]
