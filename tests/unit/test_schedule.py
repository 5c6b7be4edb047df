"""Schedule: batch geometry in rollout units, checking its own invariants."""

from __future__ import annotations

import dataclasses

import pytest

from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError


def schedule(**overrides) -> Schedule:
    fields = dict(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2, max_staleness=1)
    fields.update(overrides)
    return Schedule(**fields)


def test_a_consistent_schedule_and_what_follows_from_it():
    s = schedule(epochs=2, shuffle=False, seed=7)
    assert (s.optimizer_steps_per_epoch, s.accumulation_steps) == (2, 2)
    assert s.describe() == ("8 units per step, optimizer batch 4 (2 updates per epoch), micro batch "
                            "2 (2 accumulated), 2 epochs, shuffle off (seed 7), max staleness 1 "
                            "policy version")
    assert schedule(units_per_step=4, optimizer_batch_size=4, micro_batch_size=4,
                    max_staleness=0).accumulation_steps == 1


def test_defaults_one_epoch_shuffled_with_seed_zero():
    s = schedule()
    assert (s.epochs, s.shuffle, s.seed) == (1, True, 0)
    assert s.max_backlog_steps is None and s.max_backlog_units is None


def test_a_backlog_bound_in_steps_is_a_bound_in_units():
    s = schedule(max_backlog_steps=3)
    assert s.max_backlog_units == 24
    assert s.describe().endswith("max staleness 1 policy version, backlog at most 3 steps of units")


def test_a_checkpoint_cadence_widens_the_backlog_bound_by_the_steps_between_checkpoints():
    # The processor counts what the newest checkpoint has not taken: with a checkpoint every 4
    # steps the trainer may hold 3 trained steps no checkpoint shows yet.
    s = schedule(max_backlog_steps=2, checkpoint_every=4, max_staleness=3)
    assert s.max_backlog_units == (2 + 3) * 8
    assert s.describe().endswith("backlog at most 2 steps of units, a checkpoint every 4 steps")
    assert schedule().checkpoint_every == 1 and "checkpoint" not in schedule().describe()


def test_a_full_backlog_may_wait_for_a_checkpoint_before_shedding():
    s = schedule(max_backlog_steps=2, backlog_wait_s=0.5)
    assert s.max_backlog_units == 16
    assert s.describe().endswith("backlog at most 2 steps of units (held up to 0.5 s for a "
                                 "checkpoint before shedding)")
    assert schedule(max_backlog_steps=2).backlog_wait_s == 0.0
    assert "held" not in schedule(max_backlog_steps=2).describe()


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigurationError) as caught:
        schedule(units_per_step=10, optimizer_batch_size=4, micro_batch_size=3, epochs=0,
                 max_staleness=-1)
    assert caught.value.problems == [
        "schedule.epochs must be at least 1, got 0",
        "schedule.max_staleness must be at least 0, got -1",
        "schedule.units_per_step (10) must be a multiple of schedule.optimizer_batch_size (4)",
        "schedule.optimizer_batch_size (4) must be a multiple of schedule.micro_batch_size (3)",
    ]
    assert str(caught.value).startswith("4 problems:")


@pytest.mark.parametrize("overrides, problem", [
    ({"units_per_step": 0}, "schedule.units_per_step must be at least 1, got 0"),
    ({"micro_batch_size": 2.0}, "schedule.micro_batch_size must be an integer, got 2.0"),
    ({"epochs": True}, "schedule.epochs must be an integer, got True"),
    ({"seed": -3}, "schedule.seed must be at least 0, got -3"),
    ({"shuffle": 1}, "schedule.shuffle must be True or False, got 1"),
    ({"optimizer_batch_size": 3}, "schedule.units_per_step (8) must be a multiple of "
                                  "schedule.optimizer_batch_size (3)"),
    ({"max_backlog_steps": 0}, "schedule.max_backlog_steps must be None or an integer of at "
                               "least 1, got 0"),
    ({"max_backlog_steps": 1.5}, "schedule.max_backlog_steps must be None or an integer of at "
                                 "least 1, got 1.5"),
    ({"backlog_wait_s": -0.1, "max_backlog_steps": 2},
     "schedule.backlog_wait_s must be a number of seconds of at least 0, got -0.1"),
    ({"backlog_wait_s": float("nan"), "max_backlog_steps": 2},
     "schedule.backlog_wait_s must be a number of seconds of at least 0, got nan"),
    ({"backlog_wait_s": float("inf"), "max_backlog_steps": 2},
     "schedule.backlog_wait_s must be a number of seconds of at least 0, got inf"),
    ({"backlog_wait_s": True, "max_backlog_steps": 2},
     "schedule.backlog_wait_s must be a number of seconds of at least 0, got True"),
    ({"backlog_wait_s": 0.5}, "schedule.backlog_wait_s (0.5 s) holds a full backlog, and "
                              "schedule.max_backlog_steps is None (no bound): set both or "
                              "neither"),
    ({"checkpoint_every": 0}, "schedule.checkpoint_every must be at least 1, got 0"),
    ({"checkpoint_every": 3}, "schedule.checkpoint_every (3) must be at most max_staleness + 1 "
                              "(2): versions reach serving only at checkpoints, so every sample "
                              "would be too stale before the next one"),
])
def test_each_invariant(overrides, problem):
    with pytest.raises(ConfigurationError) as caught:
        schedule(**overrides)
    assert problem in caught.value.problems


def test_a_size_that_is_not_valid_skips_the_divisibility_checks_that_need_it():
    with pytest.raises(ConfigurationError) as caught:
        schedule(optimizer_batch_size=0)
    assert caught.value.problems == ["schedule.optimizer_batch_size must be at least 1, got 0"]


def test_a_schedule_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule().epochs = 3
    with pytest.raises(TypeError):
        Schedule(8, 4, 2, max_staleness=1)
