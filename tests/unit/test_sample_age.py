"""Where a trained sample's age comes from (no broker).

- the age buckets: a value counts in the first bucket whose bound it does not exceed, per bucket
  (not cumulative), ``le`` written as Prometheus writes it;
- ``Sample.created_at`` is its generation's, through the processor and through Avro;
- ``StepAges``: the trainer's split of each sample's age (generation -> unit -> step), samples
  with an unknown ``created_at`` (0) left out.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from reef_stream.api.recipe import feedback_for
from reef_stream.consumers.trainer.trainer import StepAges
from reef_stream.core.events import RolloutUnit, Sample, events_equal
from reef_stream.core.histograms import (
    AGE_BOUNDS_S, AGE_LABELS, age_buckets, bound_label, bucket_label,
)
from reef_stream.core.metric_names import TRAINER_SAMPLE_AGE_SAMPLES
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.testing import run_processor
from tests import factories
from tests.recipes import second_task
from tests.recipes.second_task import Successor, generation

# --------------------------------------------------------------------------- buckets


def test_the_labels_are_the_bounds_as_prometheus_writes_le_then_inf():
    assert AGE_LABELS == ("0.25", "0.5", "0.75", "1", "1.5", "2", "3", "4", "6", "8", "12",
                          "16", "24", "32", "48", "64", "128", "256", "+Inf")
    assert (bound_label(1), bound_label(1.0), bound_label(0.75)) == ("1", "1", "0.75")
    assert TRAINER_SAMPLE_AGE_SAMPLES == "sample_age_samples"


def test_a_value_equal_to_a_bound_counts_in_that_bound_s_bucket():
    for bound in AGE_BOUNDS_S:
        assert bucket_label(bound) == bound_label(bound)
    assert bucket_label(256) == "256"
    assert bucket_label(256.001) == "+Inf"


def test_a_value_counts_in_the_first_bucket_whose_bound_it_does_not_exceed():
    assert bucket_label(0.0) == "0.25"
    assert bucket_label(0.2501) == "0.5"
    assert bucket_label(1.2) == "1.5"
    assert bucket_label(2.5) == "3"
    assert bucket_label(13) == "16"
    assert bucket_label(100) == "128"
    assert bucket_label(1e9) == "+Inf"
    assert bucket_label(-3) == "0.25"          # clocks apart: the first bucket
    assert bucket_label(math.nan) == "+Inf"


def test_counts_are_per_bucket_not_cumulative():
    # by hand: 0.1 and 0.25 -> 0.25; 0.3 -> 0.5; 1.0 -> 1; 1.01 and 1.5 -> 1.5; 300 -> +Inf
    assert age_buckets([0.1, 0.25, 0.3, 1.0, 1.01, 1.5, 300]) == {
        "0.25": 2, "0.5": 1, "1": 1, "1.5": 2, "+Inf": 1}
    assert age_buckets([]) == {}


def test_other_bounds_can_be_given():
    assert age_buckets([1, 2, 3], bounds=(2,)) == {"2": 2, "+Inf": 1}


# --------------------------------------------------------------------------- Sample.created_at


def test_a_sample_carries_its_generations_created_at_through_the_processor_and_avro():
    group = [dataclasses.replace(generation(f"g{i}", 1, token, -1.0, group="grp", size=4),
                                 created_at=10_000 + 250 * i)
             for i, token in enumerate((2, 2, 3, 4))]
    records = group + [feedback_for(g, Successor()(g), source="successor", created_at=12_000)
                       for g in group]
    (emitted,) = run_processor(second_task.grpo, records, start=11_000).units
    unit = emitted.unit
    assert [(s.generation_id, s.created_at) for s in unit.members] == [
        ("g0", 10_000), ("g1", 10_250), ("g2", 10_500), ("g3", 10_750)]

    registry = SchemaRegistry.default()
    decoded = registry.decode(*registry.encode(unit), RolloutUnit)
    assert events_equal(decoded, unit)
    assert [s.created_at for s in decoded.members] == [10_000, 10_250, 10_500, 10_750]


def test_a_sample_built_without_created_at_has_0_unknown():
    sample = Sample(generation_id="g", prompt_id="p", policy_version=0,
                    prompt_token_ids=np.array([1], np.int32),
                    completion_token_ids=np.array([2], np.int32),
                    completion_logprobs=np.array([-1.0], np.float32), reward=1.0)
    assert sample.created_at == 0


# --------------------------------------------------------------------------- the trainer's split


def unit(unit_id: str, created_at: int, *member_created_at: int) -> RolloutUnit:
    members = tuple(
        factories.sample(f"{unit_id}-{i}", prompt_id="p", prompt_token_ids=factories.ids([1]),
                         completion_token_ids=factories.ids([2]),
                         completion_logprobs=factories.logprobs([-1.0]), created_at=at)
        for i, at in enumerate(member_created_at))
    return factories.rollout_unit(*members, unit_id=unit_id, recipe="r", group_key="p",
                                  created_at=created_at)


def test_step_ages_split_each_known_sample_s_age_at_its_unit():
    units = [unit("a", 5_000, 1_000, 0, 4_500), unit("b", 9_000, 0), unit("c", 9_500, 9_000)]

    ages = StepAges.of(units, trained_at=10_000)

    # by hand, in seconds: a's members 1_000 and 4_500 (the 0 is unknown), c's member 9_000
    assert ages.sample_age == [9.0, 5.5, 1.0]
    assert ages.sample_to_unit == [4.0, 0.5, 0.5]
    assert ages.unit_to_train == [5.0, 5.0, 0.5]
    assert age_buckets(ages.sample_age) == {"12": 1, "6": 1, "1": 1}


def test_step_ages_of_units_written_before_the_field_are_empty():
    ages = StepAges.of([unit("old", 5_000, 0, 0)], trained_at=10_000)
    assert ages == StepAges([], [], [])
