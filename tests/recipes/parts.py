"""Parts shared by the test recipes: a group-baseline objective and its state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reef_stream.api.losses import POLICY_GRADIENT, LossFamily
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages
from reef_stream.core.events import RolloutUnit


@dataclass(frozen=True, slots=True)
class RewardStats:
    """Running count and mean of every reward seen."""

    count: int = 0
    mean: float = 0.0


@dataclass(frozen=True, slots=True)
class GroupBaseline:
    """Advantage = reward - the mean reward of its unit; state: running reward mean."""

    name: str = "group-baseline"
    unit_type: type = RolloutUnit
    loss_family: LossFamily = POLICY_GRADIENT

    def initial_state(self) -> RewardStats:
        return RewardStats()

    def compute(self, units: Sequence[RolloutUnit], state: RewardStats) -> ObjectiveResult:
        advantages, rewards = [], []
        for unit in units:
            unit_rewards = np.array([m.reward for m in unit.members], dtype=np.float32)
            advantages.append(unit_rewards - unit_rewards.mean())
            rewards.extend(unit_rewards.tolist())
        count = state.count + len(rewards)
        mean = state.mean + (sum(rewards) - len(rewards) * state.mean) / count
        return ObjectiveResult(
            advantages=PerSampleAdvantages(np.concatenate(advantages)),
            metrics={"reward_mean": float(np.mean(rewards))},
            proposed_state=RewardStats(count=count, mean=mean),
            loss_family=self.loss_family,
        )
