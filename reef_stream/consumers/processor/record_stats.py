"""Running distributions of what the processor joins, written as Metric events.

The processor is the one stage that sees every generation next to the feedback
that scored it, reward workers' and external sources' alike, so it is where the
reward per feedback source and per policy version, the completion lengths and
the truncation rate are measured (``reef_stream.core.metric_names``: ``PROCESSOR_REWARD``,
``PROCESSOR_RESPONSE_TOKENS``, ``PROCESSOR_TRUNCATION_RATE``).

``RecordStats.observe`` takes the outcomes of a committed transaction (so an
aborted one is never counted); ``write`` sends the series that changed since
the last write, each as count, mean, standard deviation and cumulative buckets
(``le``, Prometheus' histogram convention). Per-version series are kept for the
newest ``max_versions`` versions only: an older version's series were written
when they last changed, and samples of it rarely still arrive.

Pure: no Kafka here (the writer is handed in).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reef_stream.core.events import FinishReason
from reef_stream.core.metric_names import (
    PROCESSOR_RESPONSE_TOKENS, PROCESSOR_REWARD, PROCESSOR_TRUNCATION_RATE,
)
from reef_stream.engine.join import FeedbackFate, Outcome, Step
from reef_stream.topics.metrics import MetricsWriter

#: Upper bounds of the reward histogram's buckets (a last one, +Inf, is implied).
REWARD_BOUNDS: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0)
#: Upper bounds of the completion-length histogram's buckets, in tokens (+Inf implied).
LENGTH_BOUNDS: tuple[float, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MAX_VERSIONS = 64
#: The version key of generations whose version is unknown (``Generation.policy_version_known``):
#: below every version, written with the label ``policy_version=unknown``.
UNKNOWN = -1


@dataclass(slots=True)
class Distribution:
    """Count, mean and variance (Welford's running update) and a histogram of the values added.

    ``buckets[i]`` counts the values ``<= bounds[i]`` and above the bound before it; the last
    entry counts the values above every bound (NaN included, as Prometheus' +Inf bucket would).
    """

    bounds: Sequence[float]
    count: int = 0
    mean: float = 0.0
    _m2: float = 0.0
    buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = [0] * (len(self.bounds) + 1)

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (value - self.mean)
        self.buckets[next((i for i, b in enumerate(self.bounds) if value <= b),
                          len(self.bounds))] += 1

    @property
    def std(self) -> float:
        """The population standard deviation (0 for fewer than two values)."""
        return math.sqrt(self._m2 / self.count) if self.count > 1 else 0.0

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, values <= le)`` per bound, then ``("+Inf", count)``."""
        out, total = [], 0
        for bound, n in zip([*map(_bound_label, self.bounds), "+Inf"], self.buckets):
            total += n
            out.append((bound, total))
        return out


class RecordStats:
    """The processor's distributions; see the module docstring."""

    def __init__(self, *, reward_bounds: Sequence[float] = REWARD_BOUNDS,
                 length_bounds: Sequence[float] = LENGTH_BOUNDS,
                 max_versions: int = MAX_VERSIONS) -> None:
        self.reward_bounds, self.length_bounds = tuple(reward_bounds), tuple(length_bounds)
        self.max_versions = max_versions
        self.rewards: dict[tuple[str, int], Distribution] = {}    # (source, version)
        self.lengths: dict[int, Distribution] = {}                 # version
        self.truncated: dict[int, int] = {}                        # version -> LENGTH count
        self._changed: set[tuple[str, Any]] = set()

    def observe(self, steps: Iterable[Step]) -> None:
        """Count the outcomes of ``steps``: every used feedback's reward, and every generation
        that ended in a unit's completion length and finish reason."""
        for step in steps:
            for fb in step.feedback:
                if fb.fate is FeedbackFate.USED and fb.policy_version is not None:
                    key = (fb.feedback.source, fb.policy_version if fb.version_known else UNKNOWN)
                    self._series(self.rewards, key, self.reward_bounds).add(fb.feedback.reward)
                    self._changed.add(("reward", key))
            for outcome in step.generations:
                if outcome.outcome is not Outcome.UNIT:
                    continue
                generation = outcome.generation
                version = generation.policy_version if generation.policy_version_known \
                    else UNKNOWN
                self._series(self.lengths, version, self.length_bounds).add(
                    len(generation.completion_token_ids))
                if generation.finish_reason is FinishReason.LENGTH:
                    self.truncated[version] = self.truncated.get(version, 0) + 1
                self._changed.add(("length", version))
        self._forget_old_versions()

    def write(self, writer: MetricsWriter) -> None:
        """Write each series that changed since the last call."""
        for kind, key in sorted(self._changed, key=repr):
            if kind == "reward":
                source, version = key
                if key in self.rewards:
                    _write(writer, PROCESSOR_REWARD, self.rewards[key],
                           source=source, policy_version=_label(version))
            elif key in self.lengths:
                lengths = self.lengths[key]
                _write(writer, PROCESSOR_RESPONSE_TOKENS, lengths, policy_version=_label(key))
                writer.write(PROCESSOR_TRUNCATION_RATE, self.truncated.get(key, 0) / lengths.count,
                             policy_version=_label(key))
                writer.write(f"{PROCESSOR_TRUNCATION_RATE}.count", lengths.count,
                             policy_version=_label(key))
        self._changed.clear()

    def _series(self, series: dict[Any, Distribution], key: Any,
                bounds: tuple[float, ...]) -> Distribution:
        found = series.get(key)
        if found is None:
            found = series[key] = Distribution(bounds)
        return found

    def _forget_old_versions(self) -> None:
        versions = sorted({v for _, v in self.rewards} | set(self.lengths))
        if len(versions) <= self.max_versions:
            return
        oldest_kept = versions[-self.max_versions]
        for key in [k for k in self.rewards if k[1] < oldest_kept]:
            del self.rewards[key]
        for version in [v for v in self.lengths if v < oldest_kept]:
            del self.lengths[version]
            self.truncated.pop(version, None)


def _write(writer: MetricsWriter, name: str, dist: Distribution, **labels: str) -> None:
    writer.write(f"{name}.count", dist.count, **labels)
    writer.write(f"{name}.mean", dist.mean, **labels)
    writer.write(f"{name}.std", dist.std, **labels)
    for le, count in dist.cumulative():
        writer.write(f"{name}.bucket", count, le=le, **labels)


def _label(version: int) -> str:
    return "unknown" if version == UNKNOWN else str(version)


def _bound_label(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))
