"""The processor sheds units while too many wait for the trainer (``max_backlog``,
``schedule.max_backlog_steps``): ``ProcessorState`` directly, no broker."""

from __future__ import annotations

import pytest

from reef_stream.api.schedule import Schedule
from reef_stream.consumers.processor.backlog import BacklogWait, UnitBacklog, share
from reef_stream.core.errors import ConfigurationError
from reef_stream.engine.join import Outcome, ProcessorState
from reef_stream.engine.snapshots import dumps_snapshot, loads_snapshot
from tests.unit.test_processor import GROUPED, feedback, generation


def _state(max_backlog: int | None = 2) -> ProcessorState:
    state = ProcessorState(GROUPED, recipe="test", max_staleness=8, max_backlog=max_backlog)
    state.observe_checkpoint(5)
    return state


def _joined(state: ProcessorState, gid: str, at: int, group: str | None = None, size: int = 1):
    """Offer generation ``gid`` and its feedback; every outcome decided, and units emitted."""
    first = state.offer_generation(generation(gid, group, size), at=at)
    second = state.offer_feedback(feedback(gid, group=group), at=at + 1)
    return ([(o.generation.generation_id, o.outcome, o.reason)
             for o in first.generations + second.generations],
            [u.unit_id for u in first.units + second.units])


def test_units_are_shed_while_the_backlog_is_full_and_emitted_again_once_it_drains():
    state = _state(max_backlog=2)
    state.observe_backlog(1)
    outcomes, units = _joined(state, "g1", 10)
    assert [o[:2] for o in outcomes] == [("g1", Outcome.UNIT)] and len(units) == 1
    # 1 measured + 1 emitted since = 2 = the bound: the next complete unit is shed.
    outcomes, units = _joined(state, "g2", 20)
    assert units == [] and outcomes == [("g2", Outcome.SHED, "2 units wait for the trainer "
                                         "(max_backlog 2), so this unit would be trained stale")]
    assert Outcome.SHED.dead_letter
    state.observe_backlog(0)                       # the trainer caught up
    outcomes, units = _joined(state, "g3", 30)
    assert [o[:2] for o in outcomes] == [("g3", Outcome.UNIT)] and len(units) == 1


def test_a_shed_generation_sent_again_is_a_duplicate_not_a_second_outcome():
    state = _state(max_backlog=1)
    state.observe_backlog(5)
    outcomes, _ = _joined(state, "g1", 10)
    assert outcomes[0][1] is Outcome.SHED
    again = state.offer_generation(generation("g1"), at=50)
    assert not again.generations and len(again.duplicates) == 1


def test_a_group_is_shed_whole_and_a_member_arriving_after_it_is_shed_too():
    state = _state(max_backlog=1)
    state.observe_backlog(3)
    first, _ = _joined(state, "a", 10, group="G", size=2)
    assert first == []                                 # waits for its second member
    second, units = _joined(state, "b", 20, group="G", size=2)
    assert units == [] and sorted(o[:2] for o in second) == [("a", Outcome.SHED),
                                                              ("b", Outcome.SHED)]
    late = state.offer_generation(generation("c", "G", 2), at=30)
    assert [(o.generation.generation_id, o.outcome) for o in late.generations] == [
        ("c", Outcome.SHED)]


def test_nothing_is_shed_before_a_checkpoint_shows_a_trainer_exists_or_without_a_bound():
    no_trainer = ProcessorState(GROUPED, recipe="test", max_staleness=8, max_backlog=1)
    no_trainer.observe_backlog(1_000)
    assert [o[1] for o in _joined(no_trainer, "g1", 10)[0]] == [Outcome.UNIT]
    unbounded = _state(max_backlog=None)
    unbounded.observe_backlog(1_000_000)
    assert [o[1] for o in _joined(unbounded, "g1", 10)[0]] == [Outcome.UNIT]


def test_the_bound_comes_from_the_schedule_in_units_and_must_be_positive():
    schedule = Schedule(units_per_step=8, optimizer_batch_size=8, micro_batch_size=8,
                        max_staleness=4, max_backlog_steps=3)
    assert schedule.max_backlog_units == 24
    with pytest.raises(ConfigurationError, match="max_backlog must be at least 1 unit, got 0"):
        ProcessorState(GROUPED, recipe="test", max_backlog=0)


def test_what_was_shed_is_remembered_across_a_restart_from_the_snapshots():
    state = _state(max_backlog=1)
    state.observe_backlog(9)
    _joined(state, "g1", 10)
    _joined(state, "a", 20, group="G", size=2)
    _joined(state, "b", 30, group="G", size=2)
    restored = _state(max_backlog=1)
    for key in state.keys():
        restored.restore(key, json_round_trip(state.snapshot(key)))
    assert restored.keys() == state.keys()
    assert len(restored.offer_generation(generation("g1"), at=40).duplicates) == 1
    late = restored.offer_generation(generation("c", "G", 2), at=50)
    assert [(o.generation.generation_id, o.outcome) for o in late.generations] == [
        ("c", Outcome.SHED)]


def json_round_trip(snapshot):
    return loads_snapshot(dumps_snapshot(snapshot))


# ---------------------------------------------------------------- the count: UnitBacklog


def test_the_backlog_counts_committed_units_until_a_checkpoint_passes_them():
    backlog = UnitBacklog()
    for offset in (0, 2, 4):                   # units at 0, 2, 4: a commit marker between each
        backlog.delivered(0, offset)
    backlog.delivered(1, 7)
    assert backlog.units == 0                  # not committed yet: no reader sees them
    backlog.committed()
    assert backlog.units == 4                  # units, not offsets (the end is 8 on partition 1)
    backlog.passed({0: 3})                     # the trainer took 0 and 2; partition 1 untouched
    assert backlog.units == 2
    backlog.passed({0: 5, 1: 8})
    assert backlog.units == 0


def test_an_aborted_transaction_s_units_never_count():
    backlog = UnitBacklog()
    backlog.delivered(0, 10)
    backlog.aborted()
    backlog.delivered(0, 12)
    backlog.committed()
    assert backlog.units == 1


def test_units_a_checkpoint_already_passed_when_they_commit_do_not_count():
    backlog = UnitBacklog()
    backlog.passed({0: 20})
    backlog.delivered(0, 15)                   # e.g. reported late, after the checkpoint
    backlog.delivered(0, 21)
    backlog.committed()
    assert backlog.units == 1


@pytest.mark.parametrize("mine, of, expected", [(4, 4, 3), (2, 4, 6), (1, 3, 9), (3, 4, 4), (0, 4, 0)])
def test_an_instance_scales_its_own_units_by_its_share_of_the_partitions(mine, of, expected):
    backlog = UnitBacklog()
    for offset in range(3):
        backlog.delivered(0, offset)
    backlog.committed()
    assert backlog.estimate(mine, of) == expected   # 3 * of / mine, rounded down


@pytest.mark.parametrize("of", [1, 2, 3, 4, 6])
def test_an_instance_s_own_units_reach_its_share_exactly_when_its_estimate_reaches_the_bound(of):
    for bound in range(1, 30):
        for mine in range(1, of + 1):
            for units in range(0, 2 * bound + 2):
                estimate = UnitBacklog().estimate(mine, of, emitted=units)
                assert (units >= share(bound, mine, of)) == (estimate >= bound), (
                    bound, mine, of, units)


def _one_batch(instances: int, partitions: int, bound: int, complete_per_partition: int) -> int:
    """Units emitted by ``instances`` processors of one group, each holding an equal part of
    ``partitions`` and an empty backlog, in one batch in which ``complete_per_partition``
    single-generation units complete on every partition: their states bounded as the
    runtime bounds them (``share``) and told the instance's units as the runtime tells them
    (its count, plus what its other partitions emitted in the batch)."""
    mine, emitted_by_all = partitions // instances, 0
    for _ in range(instances):
        backlog, emitted = UnitBacklog(), 0
        for p in range(mine):
            state = ProcessorState(GROUPED, recipe="test", max_staleness=8,
                                   max_backlog=share(bound, mine, partitions))
            state.observe_checkpoint(5)
            state.observe_backlog(backlog.units + emitted)
            for g in range(complete_per_partition):
                emitted += len(_joined(state, f"p{p}-g{g}", 10 * g)[1])
        emitted_by_all += emitted
        assert backlog.estimate(mine, partitions, emitted) >= bound
    return emitted_by_all


@pytest.mark.parametrize("instances", [1, 2, 4])
def test_instances_of_a_group_emit_the_bound_together_in_one_batch_not_each_of_them(instances):
    # 4 partitions, a bound of 16 units, 10 units complete on every partition in one batch:
    # each instance emits its share (16 / instances), all of them 16, not 16 each.
    assert _one_batch(instances, partitions=4, bound=16, complete_per_partition=10) == 16


def test_a_full_backlog_holds_for_the_wait_from_when_it_was_first_found_full():
    wait = BacklogWait(0.5)
    assert not wait.holding(full=False, now=9.0)
    assert wait.holding(full=True, now=10.0)          # first found full: the wait starts
    assert wait.holding(full=True, now=10.49)
    assert not wait.holding(full=True, now=10.5)      # waited 0.5 s: shed from here on
    assert not wait.holding(full=True, now=12.0)      # still full: no second wait
    assert not wait.holding(full=False, now=12.1)     # room (a checkpoint passed units)
    assert wait.holding(full=True, now=13.0)          # full again: a wait of its own
    assert not wait.holding(full=True, now=13.5)


def test_a_wait_of_zero_never_holds():
    wait = BacklogWait(0.0)
    assert not any(wait.holding(full=True, now=t) for t in (0.0, 0.0, 1.0))


def test_the_room_left_is_the_bound_less_the_backlog_and_none_while_nothing_is_shed():
    state = ProcessorState(GROUPED, recipe="test", max_staleness=8, max_backlog=2)
    assert state.backlog_room() is None            # no checkpoint yet: no trainer, no shed
    state.observe_checkpoint(5)
    assert state.backlog_room() == 2
    _, units = _joined(state, "a", at=1)
    assert len(units) == 1 and state.backlog_room() == 1   # each unit emitted counts
    state.observe_backlog(7)
    assert state.backlog_room() == 0               # past the bound: 0, not negative
    assert ProcessorState(GROUPED, recipe="test", max_staleness=8).backlog_room() is None
