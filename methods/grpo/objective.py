"""GRPO's objective: group-normalised advantages, for the built-in clipped ``policy_gradient``.

Each unit is one group (the completions of one prompt). Within a unit with
rewards ``r``::

    advantage_i = (r_i - mean(r)) / (std(r) + epsilon)

with the population standard deviation (``ddof=0``) by default; the other
scalings (sample std, none as in Dr. GRPO, the batch's std) and RLOO's
leave-one-out baseline are ``AdvantageNormalisation`` values
(``reef_stream.api.variants``). A group whose rewards
are all equal has advantages 0: it carries no signal (``zero_std_fraction``
counts them); with ``dynamic_sampling`` (DAPO) such groups are dropped from the
loss and its normaliser (``PerSampleAdvantages.keep``), counted in
``dynamic_sampling_dropped_fraction``. The objective keeps no statistics across
steps: its state only counts steps. Pure: no I/O, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reef_stream.api.losses import POLICY_GRADIENT, LossFamily
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages
from reef_stream.api.variants import AdvantageNormalisation, equal_reward_groups
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import RolloutUnit
from reef_stream.core.metric_names import OBJECTIVE_DYNAMIC_SAMPLING_DROPPED

#: Metric names (the trainer reports them as ``objective.<name>``).
METRIC_REWARD_MEAN = "reward_mean"
METRIC_REWARD_STD = "reward_std"              # mean over groups of the within-group std
METRIC_ADVANTAGE_MEAN = "advantage_mean"
METRIC_ADVANTAGE_STD = "advantage_std"
METRIC_ZERO_STD_FRACTION = "zero_std_fraction"  # share of groups whose rewards are all equal
METRIC_GROUP_SIZE = "group_size"              # mean members per unit


@dataclass(frozen=True, slots=True)
class GroupState:
    """GRPO's algorithm state: the number of steps applied (nothing else carries over)."""

    step: int = 0


@dataclass(frozen=True, slots=True)
class GroupNormalisedAdvantage:
    """The GRPO objective over ``RolloutUnit``\\ s, one group each.

    ``epsilon``: added to the standard deviation (positive). ``normalisation``: how the
    centred rewards are scaled (``AdvantageNormalisation``; GRPO's group population std by
    default, ``NONE`` for Dr. GRPO). ``dynamic_sampling``: drop the groups whose rewards are
    all equal from the loss (DAPO, Yu et al. 2025; off by default). A group of one gets
    advantage 0 (verl: ``r / (1 + eps)``; ``AdvantageNormalisation`` says why). Raises
    ``ConfigurationError`` for a bad setting.
    """

    name: str = "grpo"
    unit_type: type = RolloutUnit
    loss_family: LossFamily[Any] = POLICY_GRADIENT
    epsilon: float = 1e-4
    normalisation: AdvantageNormalisation = AdvantageNormalisation.GROUP_POPULATION_STD
    dynamic_sampling: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) \
                or not math.isfinite(self.epsilon) or self.epsilon <= 0:
            raise ConfigurationError(f"GroupNormalisedAdvantage.epsilon must be a positive finite "
                                     f"number, got {self.epsilon!r}")
        if not isinstance(self.normalisation, AdvantageNormalisation):
            raise ConfigurationError(
                f"GroupNormalisedAdvantage.normalisation must be an AdvantageNormalisation "
                f"({', '.join(n.name for n in AdvantageNormalisation)}), got "
                f"{self.normalisation!r}")
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigurationError(f"GroupNormalisedAdvantage.dynamic_sampling must be a bool, "
                                     f"got {self.dynamic_sampling!r}")

    def describe(self) -> tuple[str, ...]:
        """The chosen variant of each part, one ``part: choice`` a line (``reef check``)."""
        return (f"advantages: {self.normalisation.describe()}, eps {self.epsilon:g}",
                "dynamic sampling: " + ("groups whose rewards are all equal dropped (DAPO)"
                                        if self.dynamic_sampling else "off"))

    def initial_state(self) -> GroupState:
        """Step 0. Pure, idempotent; called once, when a trainer starts without a checkpoint."""
        return GroupState()

    def compute(self, units: Sequence[RolloutUnit], state: GroupState
                ) -> ObjectiveResult[GroupState]:
        """Per-sample advantages ``float32[num_samples]`` (units in order, then members),
        metrics, and ``GroupState(step + 1)``.

        Pure and deterministic; blocks for the arithmetic only. Called once
        per training step, in step order, before the forward pass.
        """
        rewards = [np.array([member.reward for member in unit.members], dtype=np.float64)
                   for unit in units]
        stds = [float(group.std()) for group in rewards]
        equal = equal_reward_groups(rewards)
        kept = [not e for e in equal] if self.dynamic_sampling else None
        tokens = [np.array([len(member.completion_token_ids) for member in unit.members],
                           dtype=np.float64) for unit in units]
        values = np.concatenate(self.normalisation.apply(rewards, self.epsilon, kept, tokens))
        keep = None
        extra: dict[str, float] = {}
        if kept is not None:
            keep = np.concatenate([np.full(len(g), k) for g, k in zip(rewards, kept)])
            extra[OBJECTIVE_DYNAMIC_SAMPLING_DROPPED] = float(np.mean(equal))
        return ObjectiveResult(
            advantages=PerSampleAdvantages(values.astype(np.float32), keep),
            metrics={
                **extra,
                METRIC_REWARD_MEAN: float(np.concatenate(rewards).mean()),
                METRIC_REWARD_STD: float(np.mean(stds)),
                METRIC_ADVANTAGE_MEAN: float(values.mean()),
                METRIC_ADVANTAGE_STD: float(values.std()),
                METRIC_ZERO_STD_FRACTION: float(np.mean([s == 0.0 for s in stds])),
                METRIC_GROUP_SIZE: float(np.mean([len(u.members) for u in units])),
            },
            proposed_state=GroupState(step=state.step + 1),
            loss_family=self.loss_family,
        )
