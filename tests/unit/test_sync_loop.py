"""The synchronous lower bound (``reef_stream.demo.sync``) keeps its promises, not its speed:
units built by the recipe's own processor, steps and samples counted, the curve starting at
the untrained model's measurement, the time limit honoured. And ``bench/loop.py``, which
compares the live loop with it, explains itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reef_stream.api.recipe import load_recipe
from reef_stream.demo.sync import SynchronousLoop, run_synchronous
from reef_stream.demo.task import accuracy, initial_policy
from reef_stream.engine.testing import run_processor


@pytest.mark.parametrize("path", ["reef_stream.demo.recipes:sao", "reef_stream.demo.recipes:grpo"])
def test_units_are_the_recipe_processors_units(path):
    recipe = load_recipe(path, complete=True)
    loop = SynchronousLoop(recipe, seed=3)
    generations, feedback = loop.rollouts(4)
    assert len(generations) == len(feedback) == 4 * max(recipe.group_size, 1)
    assert {f.generation_id for f in feedback} == {g.generation_id for g in generations}
    units = loop.units_of(generations, feedback)
    # The same records through run_processor (the processor's state machine, as a test runs it)
    records = [r for g, f in zip(generations, feedback) for r in (g, f)]
    expected = run_processor(recipe, records, finish=True).units
    assert [u.unit_id for u in units] == [e.unit.unit_id for e in expected]
    assert len(units) == 4
    assert all(isinstance(u, recipe.objective.unit_type) for u in units)
    assert all(len(u.members) == max(recipe.group_size, 1) for u in units)


@pytest.mark.parametrize("path", ["reef_stream.demo.recipes:sao", "reef_stream.demo.recipes:grpo"])
def test_a_short_run_counts_steps_and_samples(path):
    recipe = load_recipe(path, complete=True)
    result = run_synchronous(recipe, target=1.01, time_limit=0.5, seed=1, measure_every=1,
                             threads=1)
    per_step = recipe.schedule.units_per_step * max(recipe.group_size, 1)
    assert not result.reached and result.steps >= 1
    assert result.samples == result.steps * per_step
    assert result.units == result.steps * recipe.schedule.units_per_step
    assert result.curve[0][:2] == (0, 0.0)
    assert result.curve[0][2] == accuracy(initial_policy(recipe.schedule.seed))
    assert [point[0] for point in result.curve] == list(range(result.steps + 1))
    assert result.seconds >= 0.5 and result.seconds == result.curve[-1][1]
    assert result.threads == 1
    assert "did NOT reach" in result.line()


def test_the_target_stops_the_run_at_the_first_measurement_reaching_it():
    result = run_synchronous("reef_stream.demo.recipes:sao", target=0.0, time_limit=60, seed=0)
    assert result.reached and result.steps == 0 and result.seconds == 0.0
    assert len(result.curve) == 1


def test_the_loop_bench_explains_itself():
    bench = Path(__file__).resolve().parents[2] / "bench" / "loop.py"
    result = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for said in ("--runs", "--recipe", "--time-limit", "--target", "SCORECARD sync_s=",
                 "--device-model", "--quick", "--sync-seeds", "SCORECARD device_model=", "overlap_efficiency="):
        assert said in result.stdout, said


def test_a_backlog_bound_sheds_nothing_in_the_synchronous_loop():
    # Its only queue is what a step's sampling made beyond the step: the bound (here one step)
    # never binds, and every sample is a unit. (Before the loop told its processor state so,
    # the state counted every unit ever emitted as waiting and shed all after the first two
    # steps: the run never finished a third.)
    import dataclasses

    sao = load_recipe("reef_stream.demo.recipes:sao", complete=True)
    bounded = dataclasses.replace(sao, schedule=dataclasses.replace(sao.schedule,
                                                                    max_backlog_steps=1))
    loop = SynchronousLoop(bounded, seed=1)     # three steps, not a time limit: a loaded
    for _ in range(3):                          # machine makes fewer steps in a second
        loop.step()
    assert loop.version == 3
    assert loop.samples == loop.units_trained == 3 * bounded.schedule.units_per_step


def test_a_lagged_loop_samples_from_the_weights_of_lag_steps_before():
    sao = load_recipe("reef_stream.demo.recipes:sao", complete=True)
    loop = SynchronousLoop(sao, seed=2, lag=2)
    rollouts, stamped = loop.rollouts, []

    def recording(prompts):
        generations, feedback = rollouts(prompts)
        versions = {g.policy_version for g in generations}
        sampled = {k: v.clone() for k, v in loop.lagged.state_dict().items()}
        stamped.append((versions, sampled))
        return generations, feedback

    loop.rollouts = recording
    weights = [loop._weights()]
    for _ in range(4):
        loop.step()
        weights.append(loop._weights())
    assert any(not torch.equal(weights[1][k], weights[0][k]) for k in weights[0])
    # Versions 0 and 1 sample version 0 (nothing older); 2 and 3 the versions 2 behind.
    assert [versions for versions, _ in stamped] == [{0}, {0}, {0}, {1}]
    for (versions, sampled), version in zip(stamped, (0, 0, 0, 1), strict=True):
        for name, tensor in weights[version].items():
            assert torch.equal(sampled[name], tensor), (version, name)


def test_the_staleness_bench_counts_each_variant_s_samples_per_lag():
    bench = Path(__file__).resolve().parents[2] / "bench" / "staleness.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--only", "grpo-proximal", "--lags", "0,1", "--seeds", "1",
         "--target", "1.01", "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # Two steps of 16 groups of 16 at each lag, the target out of reach.
    assert result.stdout.splitlines()[-1] == (
        "STALENESS variant=grpo-proximal target=1.01 seeds=1 lag0=512 lag1=512 ratio_lag1=1")
