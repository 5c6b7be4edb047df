"""SAO's objective: advantages against running per-prompt reward statistics.

SAO (Streaming Advantage Optimization) needs no groups: every sample is
scored against what the stream has shown so far for its prompt. The
algorithm state holds, per prompt key (``Sample.prompt_id``), an
exponentially decayed reward mean and variance, plus the same over all
prompts (the *global* statistics, the fallback for a prompt not seen yet).

For a step's samples, in advantage-row order (``rollout_samples``):

1. Advantages, all from the state *before* the step:
   ``advantage = (reward - mean[key]) / max(sqrt(var[key]), std_floor)``,
   where an unseen key uses the global mean and variance.
2. The proposed state: the samples update the statistics one at a time, in
   row order. With ``a = 1 - decay`` and ``d = reward - mean``::

       mean <- mean + a * d
       var  <- (1 - a) * (var + a * d * d)

   (the exponentially weighted mean and variance). A key seen for the
   first time starts from the global statistics as they were before the
   step, then takes its update. The global statistics take every sample's
   update, with ``global_decay``.
3. At most ``max_keys`` keys are kept: the keys updated longest ago (by
   step; among equals, the later in key order) are dropped, and fall back
   to the global statistics when they come again. So a step updating more
   than ``max_keys`` keys keeps the first ``max_keys`` of them in key order.

The runtime makes the proposed state current only when the step is
acknowledged, so a replayed step sees the same state and gets the same
result. Pure: no I/O, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reef_stream.api.losses import LossFamily
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages, rollout_samples
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import RolloutUnit

from .loss import SAO_TRUNCATED_PG

#: Metric names (the trainer reports them as ``objective.<name>``).
METRIC_BASELINE = "baseline"                # mean of the baselines the step's samples used
METRIC_ADVANTAGE_MEAN = "advantage_mean"
METRIC_ADVANTAGE_STD = "advantage_std"
METRIC_REWARD_MEAN = "reward_mean"
METRIC_KNOWN_FRACTION = "known_key_fraction"  # share of samples whose key had statistics
METRIC_KEYS = "keys"                          # keys held after the step


@dataclass(frozen=True, slots=True)
class RewardStats:
    """SAO's algorithm state: global and per-key exponentially decayed reward statistics.

    Per-key statistics are parallel tuples, one entry per key, ``keys``
    sorted: ``means[i]``, ``variances[i]`` and ``last_step[i]`` (the step
    that last updated ``keys[i]``) belong to ``keys[i]``. ``step`` counts
    the steps applied. Only ints, floats, strings and tuples of them, so a
    checkpoint stores it (``reef_stream.api.objective.state_record``).
    """

    step: int = 0
    global_mean: float = 0.0
    global_variance: float = 1.0
    keys: tuple[str, ...] = ()
    means: tuple[float, ...] = ()
    variances: tuple[float, ...] = ()
    last_step: tuple[int, ...] = ()

    def lookup(self) -> dict[str, tuple[float, float, int]]:
        """``{key: (mean, variance, last_step)}``. Pure."""
        return {k: (m, v, s) for k, m, v, s in zip(self.keys, self.means, self.variances,
                                                    self.last_step, strict=True)}


def decayed(mean: float, variance: float, reward: float, decay: float) -> tuple[float, float]:
    """The exponentially weighted ``(mean, variance)`` after one more ``reward``. Pure."""
    alpha = 1.0 - decay
    delta = reward - mean
    return mean + alpha * delta, (1.0 - alpha) * (variance + alpha * delta * delta)


@dataclass(frozen=True, slots=True)
class StreamingAdvantage:
    """The SAO objective over ``RolloutUnit``\\ s (of any size; SAO's are one sample each).

    ``decay``: per-key decay (weight of the past per update, in [0, 1));
    ``global_decay``: the same for the global statistics, which see every
    sample and so may keep a longer memory. ``initial_mean`` /
    ``initial_variance``: the global statistics before any reward.
    ``std_floor``: the smallest standard deviation divided by (a prompt
    that always scores the same has variance 0). ``max_keys``: the cap on
    keys kept (see the module docstring). A bad setting raises one
    ``ConfigurationError`` listing every problem.
    """

    name: str = "sao"
    unit_type: type = RolloutUnit
    loss_family: LossFamily[Any] = SAO_TRUNCATED_PG
    decay: float = 0.9
    global_decay: float = 0.99
    initial_mean: float = 0.0
    initial_variance: float = 1.0
    std_floor: float = 0.1
    max_keys: int = 4096

    def __post_init__(self) -> None:
        problems = []
        for name in ("decay", "global_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                problems.append(f"StreamingAdvantage.{name} must be in [0, 1), got {value!r}")
        for name in ("initial_mean", "initial_variance", "std_floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"StreamingAdvantage.{name} must be a finite number, got {value!r}")
        if isinstance(self.initial_variance, (int, float)) and self.initial_variance < 0:
            problems.append(f"StreamingAdvantage.initial_variance must be at least 0, got "
                            f"{self.initial_variance!r}")
        if isinstance(self.std_floor, (int, float)) and self.std_floor <= 0:
            problems.append(f"StreamingAdvantage.std_floor must be positive, got "
                            f"{self.std_floor!r}")
        if not isinstance(self.max_keys, int) or isinstance(self.max_keys, bool) \
                or self.max_keys < 1:
            problems.append(f"StreamingAdvantage.max_keys must be a positive integer, got "
                            f"{self.max_keys!r}")
        if problems:
            raise ConfigurationError(problems)

    def initial_state(self) -> RewardStats:
        """No keys; the global statistics at ``initial_mean`` / ``initial_variance``. Pure,
        idempotent; called once, when a trainer starts without a checkpoint."""
        return RewardStats(global_mean=float(self.initial_mean),
                           global_variance=float(self.initial_variance))

    def compute(self, units: Sequence[RolloutUnit], state: RewardStats
                ) -> ObjectiveResult[RewardStats]:
        """Per-sample advantages ``float32[num_samples]`` from ``state``, metrics, and the
        statistics updated by this step's rewards as the proposed state.

        Pure and deterministic; blocks for the arithmetic only. Called once
        per training step, in step order, before the forward pass.
        """
        samples = rollout_samples(units)
        rewards = [float(sample.reward) for sample in samples]
        known = state.lookup()

        # 1. Advantages from the state before the step.
        baselines, stds = [], []
        for sample in samples:
            mean, variance, _ = known.get(sample.prompt_id,
                                          (state.global_mean, state.global_variance, 0))
            baselines.append(mean)
            stds.append(max(math.sqrt(variance), self.std_floor))
        advantages = (np.array(rewards) - np.array(baselines)) / np.array(stds)

        # 2. The proposed state: every sample updates its key's statistics and the global ones.
        step = state.step + 1
        stats = dict(known)
        global_mean, global_variance = state.global_mean, state.global_variance
        for sample, reward in zip(samples, rewards, strict=True):
            mean, variance, _ = stats.get(sample.prompt_id,
                                          (state.global_mean, state.global_variance, 0))
            stats[sample.prompt_id] = (*decayed(mean, variance, reward, self.decay), step)
            global_mean, global_variance = decayed(global_mean, global_variance, reward,
                                                   self.global_decay)

        # 3. The cap: keep the most recently updated keys.
        kept = sorted(sorted(stats), key=lambda k: -stats[k][2])[:self.max_keys]
        keys = tuple(sorted(kept))
        proposed = RewardStats(
            step=step, global_mean=global_mean, global_variance=global_variance, keys=keys,
            means=tuple(stats[k][0] for k in keys), variances=tuple(stats[k][1] for k in keys),
            last_step=tuple(stats[k][2] for k in keys))

        return ObjectiveResult(
            advantages=PerSampleAdvantages(advantages.astype(np.float32)),
            metrics={
                METRIC_BASELINE: float(np.mean(baselines)),
                METRIC_ADVANTAGE_MEAN: float(np.mean(advantages)),
                METRIC_ADVANTAGE_STD: float(np.std(advantages)),
                METRIC_REWARD_MEAN: float(np.mean(rewards)),
                METRIC_KNOWN_FRACTION: float(np.mean([s.prompt_id in known for s in samples])),
                METRIC_KEYS: float(len(keys)),
            },
            proposed_state=proposed,
            loss_family=self.loss_family,
        )
