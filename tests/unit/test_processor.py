"""The processor's join/group state machine, through run_processor (no broker)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources, Ungrouped
from reef_stream.api.processor import MissingFeedback, Origin, unit_id
from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import Feedback, Generation, RolloutUnit, SamplingParams
from reef_stream.engine.join import FeedbackFate, Outcome, ProcessorState
from reef_stream.engine.ledger import segment_key
from reef_stream.engine.snapshots import dumps_snapshot, loads_snapshot
from reef_stream.engine.testing import Advance, NewCheckpoint, Restart, run_processor
from tests import factories

TIMEOUT = 1_000


def generation(gid: str, group: str | None = None, size: int = 1, *, version: int = 5,
               created_at: int = 1_000) -> Generation:
    """The factory's generation (tests/factories.py) with a completion that depends on ``gid``
    and a metadata key that needs escaping."""
    return factories.generation(
        gid, request_id=f"req-{group or gid}", prompt_id=f"prompt-{group or gid}", group_id=group,
        group_size=size, policy_version=version, completion_token_ids=factories.ids([4, len(gid)]),
        completion_logprobs=factories.logprobs([-0.5, -0.25]),
        sampling=SamplingParams(max_tokens=8), created_at=created_at, metadata={"$odd": "key"})


def feedback(gid: str, source: str = "exact", reward: float = 1.0, *, group: str | None = None,
             created_at: int = 2_000) -> Feedback:
    return factories.feedback(gid, group_id=group, source=source, reward=reward,
                              components={"correct": reward}, created_at=created_at)


def processor(grouping=None, sources=("exact",), **policy):
    return ComposedProcessor(grouping=grouping or ByGroupId(),
                             feedback=RequireSources(sources, timeout_ms=TIMEOUT, **policy))


GROUPED = processor()


def kinds(out) -> dict[str, Outcome]:
    return {gid: o.outcome for gid, o in out.generations.items()}


# --------------------------------------------------------------------------- joins


@pytest.mark.parametrize("order", ["generation first", "feedback first"])
def test_an_ungrouped_generation_and_its_feedback_join_in_either_order(order):
    records = [generation("g1"), feedback("g1", reward=0.5)]
    if order == "feedback first":
        records.reverse()
    out = run_processor(GROUPED, records)
    (emitted,) = out.units
    assert emitted.unit_id == unit_id("test", ["g1"]) and emitted.member_ids == ("g1",)
    unit = emitted.unit
    assert isinstance(unit, RolloutUnit) and unit.group_key == "g1" and unit.recipe == "test"
    (sample,) = unit.members
    assert sample.reward == 0.5 and sample.policy_version == 5
    assert sample.reward_components == {"exact": 0.5, "exact.correct": 0.5}
    assert list(sample.completion_logprobs) == [-0.5, -0.25]
    assert out.outcome("g1").outcome is Outcome.UNIT
    assert out.outcome("g1").unit_id == emitted.unit_id
    assert out.fate(records[1 if order == "generation first" else 0]).fate is FeedbackFate.USED
    assert out.pending == ()


def test_a_group_in_every_arrival_order_gives_one_unit_with_the_same_id():
    records = [generation(g, "grp", 3) for g in ("a", "b", "c")]
    records += [feedback(g, reward=r, group="grp") for g, r in (("a", 1.0), ("b", 0.0), ("c", 0.5))]
    expected = unit_id("test", ["c", "a", "b"])
    units = set()
    for order in itertools.permutations(records):
        out = run_processor(GROUPED, order)
        (emitted,) = out.units
        assert emitted.unit_id == expected
        assert [m.generation_id for m in emitted.unit.members] == ["a", "b", "c"]
        assert [m.reward for m in emitted.unit.members] == [1.0, 0.0, 0.5]
        # created_at is the latest event time of members and feedback, not processing time
        assert emitted.unit.created_at == 2_000
        assert set(kinds(out).values()) == {Outcome.UNIT}
        units.add(emitted.unit_id)
    assert units == {expected}


def test_interleaved_groups_complete_independently():
    records = [generation("a1", "A", 2), generation("b1", "B", 2), feedback("a1", group="A"),
               generation("a2", "A", 2), feedback("b1", group="B"), feedback("a2", group="A"),
               generation("b2", "B", 2), feedback("b2", group="B")]
    out = run_processor(GROUPED, records)
    assert [(u.group_key, u.member_ids) for u in out.units] == [("A", ("a1", "a2")),
                                                                 ("B", ("b1", "b2"))]


def test_a_group_is_emitted_only_when_its_declared_size_is_scored():
    records = [generation("a", "grp", 3), generation("b", "grp", 3), generation("c", "grp", 3),
               feedback("a"), feedback("b")]
    out = run_processor(GROUPED, records)
    assert out.units == () and out.pending == ("a", "b", "c")
    out = run_processor(GROUPED, [*records, feedback("c")])
    assert out.units[0].member_ids == ("a", "b", "c")


def test_unit_id_is_pinned():
    """Checkpoints store unit ids to deduplicate: a change to the hashing would make an upgraded
    trainer train again the units it already trained. This literal must never change."""
    assert unit_id("sao", ["g1", "g2"]) == "9ada6728c6471c5afce8407007a5d61a"
    assert unit_id("sao", ["g2", "g1"]) == "9ada6728c6471c5afce8407007a5d61a"
    assert unit_id("sao", ("g2", "g1")) == unit_id("sao", iter(["g1", "g2"]))


def test_unit_ids_depend_on_members_and_recipe_only():
    assert unit_id("r", ["b", "a"]) == unit_id("r", ["a", "b"])
    assert unit_id("r", ["a", "b"]) != unit_id("other", ["a", "b"])
    assert unit_id("r", ["a,b"]) != unit_id("r", ["a", "b"])
    assert len(unit_id("r", ["a"])) == 32


def test_ungrouped_processors_make_one_sample_units_whatever_the_group_id():
    records = [generation("a", "grp", 2), generation("b", "grp", 2), feedback("b"), feedback("a")]
    out = run_processor(processor(Ungrouped()), records)
    assert [u.member_ids for u in out.units] == [("b",), ("a",)]
    assert [u.group_key for u in out.units] == ["b", "a"]


# --------------------------------------------------------------------------- feedback


def test_several_sources_are_awaited_then_combined_with_their_weights():
    p = processor(sources=("exact", "judge"), weights={"judge": 0.5})
    records = [generation("g"), feedback("g", "exact", 1.0)]
    assert run_processor(p, records).units == ()
    out = run_processor(p, [*records, feedback("g", "judge", 0.25)])
    (sample,) = out.units[0].unit.members
    assert sample.reward == 1.0 + 0.5 * 0.25
    assert sample.reward_components == {"exact": 1.0, "exact.correct": 1.0, "judge": 0.25,
                                        "judge.correct": 0.25}


def test_feedback_from_sources_the_processor_does_not_use_is_ignored_not_dead_lettered():
    other = feedback("g", "someone_else")
    out = run_processor(GROUPED, [other, generation("g"), feedback("g")])
    assert out.fate(other).fate is FeedbackFate.IGNORED
    assert not FeedbackFate.IGNORED.dead_letter
    assert len(out.units) == 1


def test_missing_feedback_expires_by_default_or_is_combined_from_what_arrived():
    records = [generation("g"), feedback("g", "exact", 1.0), Advance(TIMEOUT)]
    out = run_processor(processor(sources=("exact", "judge")), records)
    assert out.outcome("g").outcome is Outcome.EXPIRED
    assert "no complete feedback within 1000 ms" in out.outcome("g").reason
    assert "received ['exact']" in out.outcome("g").reason
    assert out.fates_of("g:exact")[0].fate is FeedbackFate.UNUSED

    lenient = processor(sources=("exact", "judge"), missing=MissingFeedback.COMBINE_RECEIVED)
    out = run_processor(lenient, records)
    assert out.outcome("g").outcome is Outcome.UNIT
    assert out.units[0].unit.members[0].reward_components == {"exact": 1.0, "exact.correct": 1.0}


def test_feedback_that_does_not_combine_makes_its_generation_invalid():
    broken = ComposedProcessor(grouping=ByGroupId(), feedback=_Refusing(GROUPED.feedback))
    out = run_processor(broken, [generation("g"), feedback("g")])
    assert out.outcome("g").outcome is Outcome.INVALID
    assert "does not combine" in out.outcome("g").reason
    assert out.fates_of("g:exact")[0].fate is FeedbackFate.UNUSED


class _Refusing:
    """A feedback policy whose combine always refuses."""

    def __init__(self, inner):
        self.inner = inner
        self.timeout_ms, self.missing, self.description = inner.timeout_ms, inner.missing, "refuses"

    def wants(self, source):
        return self.inner.wants(source)

    def ready(self, received):
        return self.inner.ready(received)

    def combine(self, generation, received):
        raise InvalidRecord("reward components disagree", field="components")


# --------------------------------------------------------------------------- time and staleness


def test_a_generation_without_feedback_expires_on_the_clock_and_its_feedback_is_late():
    late = feedback("g")
    out = run_processor(GROUPED, [generation("g"), Advance(TIMEOUT - 2), late], tick=1)
    assert out.outcome("g").outcome is Outcome.UNIT  # arrived at 999: in time

    out = run_processor(GROUPED, [generation("g"), Advance(TIMEOUT), late])
    expired = out.outcome("g")
    assert expired.outcome is Outcome.EXPIRED and expired.outcome.dead_letter
    assert out.fate(late).fate is FeedbackFate.LATE and FeedbackFate.LATE.dead_letter
    assert "concluded as EXPIRED" in out.fate(late).reason


def test_nothing_expires_without_the_clock_moving():
    out = run_processor(GROUPED, [generation("g")], tick=0)
    assert out.pending == ("g",)
    assert run_processor(GROUPED, [generation("g")], finish=True).outcome("g").outcome \
        is Outcome.EXPIRED


def test_feedback_whose_generation_never_arrives_is_orphaned():
    lost = feedback("ghost")
    out = run_processor(GROUPED, [lost, Advance(TIMEOUT)])
    assert out.fate(lost).fate is FeedbackFate.ORPHANED
    assert "no generation ghost arrived within 1000 ms" in out.fate(lost).reason
    assert out.state.keys() == []


def test_an_incomplete_group_expires_at_its_deadline_unless_the_grouping_accepts_it():
    records = [generation("a", "grp", 3), generation("b", "grp", 3), feedback("a"), feedback("b"),
               Advance(TIMEOUT)]
    out = run_processor(GROUPED, records)
    assert kinds(out) == {"a": Outcome.EXPIRED, "b": Outcome.EXPIRED}
    assert "incomplete" in out.outcome("a").reason and "2 of 3" in out.outcome("a").reason

    out = run_processor(processor(ByGroupId(min_members=2)), records)
    (emitted,) = out.units
    assert emitted.member_ids == ("a", "b") and emitted.unit_id == unit_id("test", ["a", "b"])
    late_member = generation("c", "grp", 3)
    out = run_processor(processor(ByGroupId(min_members=2)), [*records, late_member])
    assert out.outcome("c").outcome is Outcome.EXPIRED
    assert "after its group 'grp' closed" in out.outcome("c").reason


def test_generations_too_far_behind_the_newest_checkpoint_are_too_stale():
    records = [generation("old", version=2), generation("ok", version=3), feedback("old"),
               feedback("ok")]
    out = run_processor(GROUPED, records, max_staleness=2, newest_checkpoint_version=5)
    assert kinds(out) == {"old": Outcome.TOO_STALE, "ok": Outcome.UNIT}
    assert "3 versions behind the newest checkpoint 5 (max staleness 2)" in \
        out.outcome("old").reason
    assert out.fates_of("old:exact")[0].fate is FeedbackFate.LATE


def test_a_new_checkpoint_makes_waiting_generations_stale_and_their_group_cannot_complete():
    records = [generation("a", "grp", 2, version=1), generation("b", "grp", 2, version=4),
               feedback("b"), NewCheckpoint(4), feedback("a")]
    out = run_processor(GROUPED, records, max_staleness=2)
    assert kinds(out) == {"a": Outcome.TOO_STALE, "b": Outcome.EXPIRED}
    assert "can no longer complete" in out.outcome("b").reason
    assert out.fates_of("a:exact")[0].fate is FeedbackFate.LATE
    assert out.units == ()


def test_a_recipe_brings_its_name_and_max_staleness():
    from tests.recipes.good import recipe

    out = run_processor(recipe, [generation("g", version=1), feedback("g")],
                        newest_checkpoint_version=4)
    assert out.outcome("g").outcome is Outcome.TOO_STALE  # max_staleness 2
    out = run_processor(recipe, [generation("g", version=2), feedback("g", "exact_match")],
                        newest_checkpoint_version=4)
    assert out.units[0].unit.recipe == "good"
    assert out.units[0].unit_id == unit_id("good", ["g"])


# --------------------------------------------------------------------------- duplicates, late, invalid


def test_duplicate_generations_and_feedback_are_dropped_and_counted():
    records = [generation("g", "grp", 2), generation("g", "grp", 2), feedback("g"), feedback("g"),
               generation("h", "grp", 2), feedback("h"), generation("h", "grp", 2), feedback("h")]
    out = run_processor(GROUPED, records)
    assert len(out.units) == 1 and out.units[0].member_ids == ("g", "h")
    assert [d.generation.generation_id for d in out.duplicates] == ["g", "h"]
    assert out.counts == {"generations.unit": 2, "generations.duplicate": 2, "units": 1,
                          "feedback.used": 2, "feedback.duplicate": 2}
    assert not FeedbackFate.DUPLICATE.dead_letter


def test_feedback_after_its_generation_was_scored_or_emitted_is_late():
    records = [generation("a", "grp", 2), feedback("a"), feedback("a", "judge"),
               generation("b", "grp", 2), feedback("b"), feedback("b", "judge")]
    two_sources = ComposedProcessor(grouping=ByGroupId(),
                                    feedback=_AlsoWants(GROUPED.feedback, "judge"))
    out = run_processor(two_sources, records)
    assert [o.fate for o in out.fates_of("a:judge")] == [FeedbackFate.LATE]
    assert "after generation a was scored" in out.fates_of("a:judge")[0].reason
    assert [o.fate for o in out.fates_of("b:judge")] == [FeedbackFate.LATE]
    assert "concluded as UNIT" in out.fates_of("b:judge")[0].reason
    # a replay of a late record is a duplicate, not a second dead letter
    out = run_processor(two_sources, [*records, feedback("b", "judge")])
    assert [o.fate for o in out.fates_of("b:judge")] == [FeedbackFate.LATE, FeedbackFate.DUPLICATE]


class _AlsoWants:
    """A policy that also accepts (but never waits for) one more source."""

    def __init__(self, inner, extra):
        self.inner, self.extra = inner, extra
        self.timeout_ms, self.missing, self.description = inner.timeout_ms, inner.missing, "x"

    def wants(self, source):
        return source == self.extra or self.inner.wants(source)

    def ready(self, received):
        return self.inner.ready(received)

    def combine(self, generation, received):
        return self.inner.combine(generation, received)


def test_a_group_size_disagreement_invalidates_the_whole_group_in_any_order():
    members = [generation("a", "grp", 2), generation("b", "grp", 3), feedback("a"), feedback("b")]
    for order in itertools.permutations(members):
        out = run_processor(GROUPED, order)
        assert out.units == ()
        assert kinds(out) == {"a": Outcome.INVALID, "b": Outcome.INVALID}
        assert "group_size disagreement in group 'grp'" in out.outcome("a").reason
    late = generation("c", "grp", 2)
    out = run_processor(GROUPED, [*members, late])
    assert out.outcome("c").outcome is Outcome.INVALID
    assert "is closed" in out.outcome("c").reason


def test_more_generations_than_the_group_size_are_invalid():
    out = run_processor(GROUPED, [generation("a", "grp", 2), generation("b", "grp", 2),
                                  generation("c", "grp", 2)])
    assert set(kinds(out).values()) == {Outcome.INVALID}
    assert "more generations than its group_size 2" in out.outcome("c").reason
    out = run_processor(GROUPED, [generation("a", "grp", 1), feedback("a"),
                                  generation("b", "grp", 1)])
    assert out.outcome("a").outcome is Outcome.UNIT
    assert out.outcome("b").outcome is Outcome.INVALID
    assert "emitted as unit" in out.outcome("b").reason


def test_a_generation_that_cannot_be_grouped_is_invalid_with_the_reason():
    bad = generation("g", None, 3)
    early = feedback("g")
    out = run_processor(GROUPED, [early, bad])
    assert out.outcome("g").outcome is Outcome.INVALID
    assert "group_size 3 without a group_id" in out.outcome("g").reason
    assert out.fate(early).fate is FeedbackFate.UNUSED


# --------------------------------------------------------------------------- the invariants


def _stream(rng: random.Random, groups: int) -> list:
    """Generations of ``groups`` groups with their feedback, in a locally shuffled order; some
    feedback lost or from another source, some records doubled, the clock jumping now and then,
    a checkpoint appearing."""
    records: list[tuple[float, object]] = []
    for number in range(groups):
        size = rng.choice([1, 1, 2, 4])
        group = f"grp{number}" if size > 1 else None
        for member in range(size):
            gid = f"g{number}-{member}"
            batch = [generation(gid, group, size, version=rng.choice([3, 5, 5, 5, 5]))]
            if rng.random() < 0.95:
                batch.append(feedback(gid, rng.choice(["exact"] * 9 + ["other"]),
                                      reward=rng.random(), group=group))
            if rng.random() < 0.1:
                batch.append(batch[-1])  # a duplicate
            records += [(number + rng.uniform(0, 6), record) for record in batch]
    for _ in range(groups // 5):
        records.append((rng.uniform(0, groups), Advance(rng.choice([10, 300, TIMEOUT]))))
    records.append((rng.uniform(0, groups), NewCheckpoint(6)))
    return [record for _, record in sorted(records, key=lambda pair: pair[0])]


def _summary(out) -> tuple:
    return (
        sorted((u.unit_id, u.member_ids) for u in out.units),
        sorted((gid, o.outcome.name, o.reason) for gid, o in out.generations.items()),
        sorted((f.feedback.feedback_id, f.fate.name, f.reason) for f in out.feedback),
        out.counts,
    )


@pytest.mark.parametrize("seed", range(20))
def test_every_generation_gets_exactly_one_outcome_and_at_most_one_unit(seed):
    rng = random.Random(seed)
    records = _stream(rng, groups=30)
    out = run_processor(GROUPED, records, max_staleness=2, finish=True)
    generation_ids = {r.generation_id for r in records if isinstance(r, Generation)}
    assert set(out.generations) == generation_ids and out.pending == ()
    in_units = [gid for u in out.units for gid in u.member_ids]
    assert len(in_units) == len(set(in_units))
    assert {gid for gid, o in out.generations.items() if o.outcome is Outcome.UNIT} == set(in_units)
    assert all(o.reason for o in out.generations.values())
    for emitted in out.units:
        assert emitted.unit_id == unit_id("test", emitted.member_ids)
    feedback_records = [r for r in records if isinstance(r, Feedback)]
    assert len(out.feedback) == len(feedback_records)  # every record one fate, duplicates too
    assert out.state.waiting_feedback() == 0


@pytest.mark.parametrize("seed", range(5))
def test_outcomes_do_not_depend_on_arrival_order_when_nothing_expires(seed):
    rng = random.Random(seed)
    records = [r for r in _stream(rng, groups=12) if isinstance(r, (Generation, Feedback))]
    first = run_processor(GROUPED, records, tick=0, finish=True)
    for _ in range(5):
        rng.shuffle(records)
        again = run_processor(GROUPED, records, tick=0, finish=True)
        assert sorted((u.unit_id, u.member_ids) for u in again.units) == \
            sorted((u.unit_id, u.member_ids) for u in first.units)
        assert {g: o.outcome for g, o in again.generations.items()} == \
            {g: o.outcome for g, o in first.generations.items()}


@pytest.mark.parametrize("seed", range(6))
def test_a_restart_from_snapshots_anywhere_gives_the_same_result_as_no_restart(seed):
    rng = random.Random(100 + seed)
    records = _stream(rng, groups=10)
    expected = _summary(run_processor(GROUPED, records, max_staleness=2, finish=True))
    for position in range(0, len(records) + 1, 3):
        restarted = [*records[:position], Restart(), *records[position:]]
        out = run_processor(GROUPED, restarted, max_staleness=2, finish=True)
        assert _summary(out) == expected, f"restart before record {position}"


def test_snapshots_are_json_data_that_restore_and_are_dropped_when_empty():
    state = ProcessorState(GROUPED, recipe="r", max_staleness=None)
    where = Origin("reef.generations", 3, 41)
    step = state.offer_generation(generation("a", "grp", 2), at=10, origin=where)
    step = state.offer_feedback(feedback("b", group="grp"), at=11)
    assert step.touched == ("grp",)
    snapshot = state.snapshot("grp")
    _assert_plain(snapshot)
    json.loads(dumps_snapshot(snapshot))
    assert loads_snapshot(dumps_snapshot(snapshot)) == snapshot

    fresh = ProcessorState(GROUPED, recipe="r", max_staleness=None)
    fresh.restore("grp", loads_snapshot(dumps_snapshot(snapshot)))
    fresh.restore("grp", loads_snapshot(dumps_snapshot(snapshot)))  # idempotent
    assert fresh.snapshot("grp") == snapshot
    assert fresh.pending_generations() == ["a"] and fresh.waiting_feedback() == 1
    assert fresh.next_deadline() == 10 + TIMEOUT
    step = fresh.offer_generation(generation("b", "grp", 2), at=12)
    assert step.units == ()  # a still waits for its feedback
    step = fresh.offer_feedback(feedback("a", group="grp"), at=13)
    (emitted,) = step.units
    assert emitted.member_ids == ("a", "b")
    assert [o.origin for o in step.generations] == [where, None]
    # concluded, the group's key holds nothing; its ledger segment remembers it
    assert fresh.snapshot("grp") is None and fresh.keys() == [segment_key(0)]
    step = fresh.tick(13 + fresh.retention_ms)
    assert step.touched == (segment_key(0),) and fresh.snapshot(segment_key(0)) is None
    assert fresh.keys() == []
    # after the retention, the group's records are forgotten: a replay is new again
    assert fresh.offer_generation(generation("a", "grp", 2), at=10**8).duplicates == ()


def _assert_plain(value) -> None:
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value)
        for item in value.values():
            _assert_plain(item)
    elif isinstance(value, list):
        for item in value:
            _assert_plain(item)
    else:
        assert value is None or isinstance(value, (str, int, float, bool)), type(value)


def test_the_state_machine_refuses_a_processor_it_cannot_drive():
    with pytest.raises(ConfigurationError) as caught:
        ProcessorState(object(), recipe="r")
    assert len(caught.value.problems) == 3
    with pytest.raises(ConfigurationError, match="retention_ms"):
        ProcessorState(GROUPED, recipe="r", retention_ms=TIMEOUT)
    with pytest.raises(ConfigurationError) as caught:
        RequireSources((), timeout_ms=0, weights={"x": 1.0})
    assert len(caught.value.problems) == 3


def test_a_unit_builder_returning_the_wrong_type_is_fatal():
    class Wrong:
        unit_type = RolloutUnit

        def build(self, **kwargs):
            return "not a unit"

    wrong = ComposedProcessor(grouping=ByGroupId(), feedback=GROUPED.feedback, units=Wrong())
    with pytest.raises(FatalError, match="returned a str"):
        run_processor(wrong, [generation("g"), feedback("g")])
