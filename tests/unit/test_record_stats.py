"""The processor's distributions (``reef_stream.consumers.processor.record_stats``) from outcomes whose values are
known: reward per source and version, completion lengths, truncation; no broker."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from reef_stream.consumers.processor.record_stats import Distribution, RecordStats
from reef_stream.core import metric_names
from reef_stream.core.events import Feedback, FinishReason, Generation, SamplingParams
from reef_stream.engine.join import FeedbackFate, FeedbackOutcome, GenerationOutcome, Outcome, Step
from tests import factories


class RecordingWriter:
    """Collects what ``RecordStats.write`` writes (the real writer's two methods)."""

    def __init__(self) -> None:
        self.written: dict[tuple, float] = {}

    def write(self, name: str, value: float, **labels: str) -> None:
        self.written[(name, *sorted(labels.items()))] = value


def generation(gid: str, version: int, length: int, finish=FinishReason.STOP) -> Generation:
    """The factory's generation (tests/factories.py) with ``length`` completion tokens."""
    return factories.generation(
        gid, request_id=gid, prompt_id="p", policy_version=version, replica_id="r",
        prompt_token_ids=np.arange(4, dtype=np.int32),
        completion_token_ids=np.arange(length, dtype=np.int32),
        completion_logprobs=np.zeros(length, dtype=np.float32), finish_reason=finish, created_at=1,
        sampling=SamplingParams(max_tokens=64))


def used(gid: str, source: str, reward: float, version: int | None,
         fate=FeedbackFate.USED) -> FeedbackOutcome:
    fb = Feedback(feedback_id=f"{gid}-{source}", generation_id=gid, group_id=None, source=source,
                  reward=reward, created_at=1)
    return FeedbackOutcome(fb, fate, "", None, 1, version)


def ended(g: Generation, outcome=Outcome.UNIT) -> GenerationOutcome:
    return GenerationOutcome(g, outcome, "", g.generation_id, None, None, 1)


def test_distribution_moments_and_cumulative_buckets():
    values = [-2.0, -1.0, 0.0, 0.1, 0.5, 0.5, 1.0, 3.0]
    dist = Distribution((-1.0, 0.0, 0.5, 1.0))
    for v in values:
        dist.add(v)
    assert dist.count == 8
    assert dist.mean == pytest.approx(statistics.fmean(values))
    assert dist.std == pytest.approx(statistics.pstdev(values))
    # a value equal to a bound counts in that bound's bucket (le: less than or equal)
    assert dist.cumulative() == [("-1", 2), ("0", 3), ("0.5", 6), ("1", 7), ("+Inf", 8)]


def test_one_value_has_no_spread():
    dist = Distribution((0.0,))
    dist.add(5.0)
    assert (dist.count, dist.mean, dist.std) == (1, 5.0, 0.0)


def test_rewards_by_source_and_version_lengths_and_truncation():
    stats = RecordStats(reward_bounds=(0.0, 1.0), length_bounds=(8, 16))
    gens = [generation("a", 3, 4), generation("b", 3, 10, FinishReason.LENGTH),
            generation("c", 5, 20), generation("d", 5, 6)]
    stats.observe([
        Step(generations=(ended(gens[0]), ended(gens[1]), ended(gens[2]),
                          ended(gens[3], Outcome.EXPIRED)),      # an expired one: not counted
             feedback=(used("a", "judge", 1.0, 3), used("b", "judge", 0.0, 3),
                       used("a", "exact", 0.5, 3), used("c", "judge", 2.0, 5),
                       used("d", "judge", 9.0, 5, FeedbackFate.UNUSED),   # not used: not counted
                       used("x", "judge", 9.0, None, FeedbackFate.LATE))),
    ])
    writer = RecordingWriter()
    stats.write(writer)
    reward, tokens = metric_names.PROCESSOR_REWARD, metric_names.PROCESSOR_RESPONSE_TOKENS
    rate = metric_names.PROCESSOR_TRUNCATION_RATE
    judge3 = (("policy_version", "3"), ("source", "judge"))
    assert writer.written[(f"{reward}.count", *judge3)] == 2
    assert writer.written[(f"{reward}.mean", *judge3)] == 0.5
    assert writer.written[(f"{reward}.std", *judge3)] == 0.5
    assert [writer.written[(f"{reward}.bucket", ("le", le), *judge3)]
            for le in ("0", "1", "+Inf")] == [1, 2, 2]
    assert writer.written[(f"{reward}.count", ("policy_version", "3"), ("source", "exact"))] == 1
    judge5 = (("policy_version", "5"), ("source", "judge"))
    assert writer.written[(f"{reward}.count", *judge5)] == 1
    assert writer.written[(f"{reward}.bucket", ("le", "1"), *judge5)] == 0
    assert writer.written[(f"{tokens}.mean", ("policy_version", "3"))] == 7
    assert writer.written[(f"{tokens}.std", ("policy_version", "3"))] == 3
    assert [writer.written[(f"{tokens}.bucket", ("le", le), ("policy_version", "3"))]
            for le in ("8", "16", "+Inf")] == [1, 2, 2]
    assert writer.written[(rate, ("policy_version", "3"))] == 0.5
    assert writer.written[(f"{rate}.count", ("policy_version", "3"))] == 2
    assert writer.written[(f"{tokens}.count", ("policy_version", "5"))] == 1
    assert writer.written[(rate, ("policy_version", "5"))] == 0.0


def test_only_series_that_changed_are_written_again():
    stats = RecordStats()
    stats.observe([Step(feedback=(used("a", "judge", 1.0, 3),))])
    stats.write(RecordingWriter())
    stats.observe([Step(feedback=(used("b", "judge", 0.0, 4),))])
    writer = RecordingWriter()
    stats.write(writer)
    assert {dict(k[1:])["policy_version"] for k in writer.written} == {"4"}
    writer = RecordingWriter()
    stats.write(writer)
    assert writer.written == {}


def test_old_versions_are_forgotten_beyond_max_versions():
    stats = RecordStats(max_versions=3)
    for version in range(6):
        stats.observe([Step(generations=(ended(generation(f"g{version}", version, 4)),),
                            feedback=(used(f"g{version}", "judge", 1.0, version),))])
    assert sorted(stats.lengths) == [3, 4, 5]
    assert sorted(v for _, v in stats.rewards) == [3, 4, 5]
    assert not math.isnan(stats.lengths[5].mean)
