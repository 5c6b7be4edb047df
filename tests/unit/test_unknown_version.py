"""Generations of unknown policy version (``metadata["reef.policy_version"] = "unknown"``, as
``reef intake proxy`` records one across a reload) under the schedule's ``unknown_version``
rule: rejected (the default) or taken as the stalest; counted apart, named in the dead
letter, labelled ``unknown`` in the per-version metrics. Pure: no broker."""

from __future__ import annotations

from collections import Counter

import pytest

from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import apply_overrides
from reef_stream.api.schedule import REJECT, STALEST, Schedule
from reef_stream.consumers.processor.metrics import ProcessorMetrics
from reef_stream.consumers.processor.record_stats import RecordStats
from reef_stream.consumers.processor.step_records import StepRecords
from reef_stream.core import metric_names
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import (
    POLICY_VERSION_KEY, UNKNOWN_POLICY_VERSION, DeadLetter, Generation, SamplingParams,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.join import FeedbackFate, Outcome, ProcessorState, Step
from reef_stream.engine.testing import NewCheckpoint, Restart, run_processor
from tests import factories

PROCESSOR = ComposedProcessor(grouping=ByGroupId(),
                              feedback=RequireSources(("exact",), timeout_ms=1_000))


def generation(gid: str, *, version: int = 0, unknown: bool = False, group: str | None = None,
               size: int = 1) -> Generation:
    return factories.generation(
        gid, request_id=gid, prompt_id="p", group_id=group, group_size=size,
        policy_version=version, completion_token_ids=factories.ids([4, 5]),
        completion_logprobs=factories.logprobs([-0.5, -0.25]), sampling=SamplingParams(max_tokens=8),
        created_at=1_000, metadata={POLICY_VERSION_KEY: UNKNOWN_POLICY_VERSION} if unknown else {})


def feedback(gid: str, group: str | None = None):
    return factories.feedback(gid, group_id=group, source="exact", reward=1.0, created_at=2_000)


def test_the_marker_is_what_makes_a_version_unknown():
    assert not generation("g", unknown=True).policy_version_known
    assert generation("g").policy_version_known  # version 0 alone is a version (a base model's)


def test_reject_is_the_default_and_dead_letters_it_even_without_a_staleness_bound():
    assert Schedule(units_per_step=1, optimizer_batch_size=1, micro_batch_size=1,
                    max_staleness=0).unknown_version == REJECT
    out = run_processor(PROCESSOR, [generation("u", unknown=True), feedback("u"),
                                    generation("k"), feedback("k")])
    assert {g: o.outcome for g, o in out.generations.items()} == {
        "u": Outcome.UNKNOWN_VERSION, "k": Outcome.UNIT}
    assert Outcome.UNKNOWN_VERSION.dead_letter
    assert "policy version is unknown" in out.outcome("u").reason
    assert "'reject'" in out.outcome("u").reason
    assert out.fates_of("u:exact")[0].fate is FeedbackFate.LATE
    assert out.counts["generations.unknown_version"] == 1
    assert out.counts["unknown_version.unknown_version"] == 1
    assert "unknown_version.unit" not in out.counts


def test_a_rejected_member_ends_its_group_as_a_stale_one_would():
    records = [generation("a", unknown=True, group="grp", size=2),
               generation("b", version=3, group="grp", size=2), feedback("b", "grp")]
    out = run_processor(PROCESSOR, records, max_staleness=2, newest_checkpoint_version=3)
    assert out.outcome("a").outcome is Outcome.UNKNOWN_VERSION
    assert out.outcome("b").outcome is Outcome.EXPIRED and out.units == ()


def test_stalest_trains_it_while_version_0_is_within_the_bound_and_counts_it_apart():
    records = [generation("u", version=0, unknown=True), feedback("u")]
    out = run_processor(PROCESSOR, records, max_staleness=2, newest_checkpoint_version=2,
                        unknown_version=STALEST)
    assert out.outcome("u").outcome is Outcome.UNIT
    assert out.counts["unknown_version.unit"] == 1 and out.counts["generations.unit"] == 1


def test_stalest_takes_the_version_as_0_whatever_the_field_says():
    records = [generation("u", version=7, unknown=True), feedback("u")]
    out = run_processor(PROCESSOR, records, max_staleness=2, newest_checkpoint_version=7,
                        unknown_version=STALEST)
    assert out.outcome("u").outcome is Outcome.TOO_STALE
    reason = out.outcome("u").reason
    assert "unknown, taken as the stalest" in reason and "7 versions behind" in reason
    assert out.counts["unknown_version.too_stale"] == 1


def test_stalest_a_pending_one_goes_too_stale_at_the_next_checkpoint():
    records = [generation("u", unknown=True, group="grp", size=2), NewCheckpoint(3)]
    out = run_processor(PROCESSOR, records, max_staleness=2, newest_checkpoint_version=2,
                        unknown_version=STALEST)
    assert out.outcome("u").outcome is Outcome.TOO_STALE


def test_a_rejected_generation_is_remembered_across_a_restart():
    records = [generation("u", unknown=True), Restart(), generation("u", unknown=True)]
    out = run_processor(PROCESSOR, records)
    assert out.outcome("u").outcome is Outcome.UNKNOWN_VERSION
    assert [d.generation.generation_id for d in out.duplicates] == ["u"]


def test_the_dead_letter_names_the_reason():
    registry = SchemaRegistry()
    records = StepRecords(registry, units="ns.units.test", dead_letters="ns.dead-letters",
                          generations="ns.generations", feedback="ns.feedback",
                          max_unit_bytes=1 << 20)
    state = ProcessorState(PROCESSOR, recipe="test")
    step = state.offer_generation(generation("u", unknown=True), at=1)
    (record,) = records.of_step(step, Counter())
    letter = registry.decode(record.value, record.headers, DeadLetter)
    assert letter.error_type == "processor.unknown_version"
    assert "generation u unknown_version: its policy version is unknown" in letter.reason


def test_the_rule_is_validated_and_can_be_set_from_the_command_line():
    with pytest.raises(ConfigurationError, match="unknown_version must be one of"):
        Schedule(units_per_step=1, optimizer_batch_size=1, micro_batch_size=1, max_staleness=0,
                 unknown_version="guess")
    with pytest.raises(ConfigurationError, match="unknown_version"):
        ProcessorState(PROCESSOR, recipe="test", unknown_version="guess")
    from tests.recipes.good import recipe

    changed = apply_overrides(recipe, ["schedule.unknown_version=stalest"])
    assert changed.schedule.unknown_version == STALEST
    assert ProcessorState.for_recipe(changed).unknown_version == STALEST
    assert "taken as the stalest" in changed.schedule.describe()
    assert "stalest" not in recipe.schedule.describe()


class RecordingWriter:
    def __init__(self) -> None:
        self.written: dict[tuple, float] = {}

    def write(self, name: str, value: float, **labels: str) -> None:
        self.written[(name, *sorted(labels.items()))] = value

    def write_counts(self, name, counts, label) -> None:
        for key, count in counts.items():
            self.write(name, count, **{label: str(key)})


def test_per_version_metrics_label_it_unknown_not_0():
    out = run_processor(PROCESSOR, [generation("u", unknown=True), feedback("u"),
                                    generation("k"), feedback("k")], unknown_version=STALEST)
    stats = RecordStats()
    stats.observe([Step(generations=tuple(out.generations.values()), feedback=out.feedback)])
    writer = RecordingWriter()
    stats.write(writer)
    labels = {(name, dict(rest)["policy_version"]) for name, *rest in writer.written}
    assert (f"{metric_names.PROCESSOR_RESPONSE_TOKENS}.count", "unknown") in labels
    assert (f"{metric_names.PROCESSOR_REWARD}.count", "unknown") in labels
    assert writer.written[(f"{metric_names.PROCESSOR_RESPONSE_TOKENS}.count",
                           ("policy_version", "0"))] == 1  # the known one only


def test_the_processor_metric_counts_them_by_outcome():
    out = run_processor(PROCESSOR, [generation("u", unknown=True), generation("k"), feedback("k")])
    metrics = ProcessorMetrics.__new__(ProcessorMetrics)
    written = RecordingWriter()
    metrics.emit = lambda state, write, final=False: write(written, state())
    metrics.emit_counts(Counter(out.counts), 1, 0, RecordStats())
    unknown = metric_names.PROCESSOR_UNKNOWN_VERSION_GENERATIONS
    assert written.written[(unknown, ("outcome", "unknown_version"))] == 1
    assert written.written[(unknown, ("outcome", "unit"))] == 0
    assert written.written[(metric_names.PROCESSOR_GENERATIONS, ("outcome", "unknown_version"))] == 1
    none = RecordingWriter()
    metrics.emit = lambda state, write, final=False: write(none, state())
    clean = run_processor(PROCESSOR, [generation("k"), feedback("k")])
    metrics.emit_counts(Counter(clean.counts), 1, 0, RecordStats())
    assert not any(key[0] == unknown for key in none.written)


def test_under_stalest_the_unit_says_the_version_is_unknown_and_0():
    out = run_processor(PROCESSOR, [generation("u", version=7, unknown=True), feedback("u"),
                                    generation("k", version=2), feedback("k")],
                        unknown_version=STALEST)
    samples = {u.unit.members[0].generation_id: u.unit.members[0] for u in out.units}
    assert (samples["u"].policy_version, samples["u"].policy_version_known) == (0, False)
    assert (samples["k"].policy_version, samples["k"].policy_version_known) == (2, True)
