"""Recipes: loaded from a dotted path, every binding checked at once; `reef check` shows the contract."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from reef_stream.api.evaluator import AcceptEverything
from reef_stream.api.losses import POLICY_GRADIENT, VALUE_REGRESSION
from reef_stream.api.recipe import (
    Backend, NamedReward, Recipe, Reward, RewardFunction, check_recipe, feedback_for, load_recipe,
    recipe_problems,
)
from reef_stream.cli.main import main
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Generation
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import SCHEMAS_DIR
from tests.recipes.bad_units import PairUnit
from tests.recipes.good import recipe as GOOD
from tests.unit.test_processor import generation


def problems_of(path: str) -> list[str]:
    with pytest.raises(ConfigurationError) as caught:
        load_recipe(path)
    return caught.value.problems


def test_a_sound_recipe_loads_by_module_or_module_attribute():
    assert load_recipe("tests.recipes.good") is GOOD
    assert load_recipe("tests.recipes.good:recipe") is GOOD
    assert isinstance(GOOD.evaluator, AcceptEverything)  # the default
    assert recipe_problems(GOOD) == []


def test_a_loss_family_the_backend_does_not_support_is_reported_with_every_other_problem():
    problems = problems_of("tests.recipes.bad_loss")
    assert len(problems) == 3
    assert all(p.startswith("tests.recipes.bad_loss: ") for p in problems)
    assert "needs the loss family 'policy_gradient', which the backend 'values-only' does not " \
           "support (it supports: value_regression)" in problems[0]
    assert "x the backend's data_parallel_size (4)" in problems[1]
    assert "no candidate evaluator" in problems[2]


def test_an_inconsistent_schedule_fails_at_load_with_all_its_problems():
    problems = problems_of("tests.recipes.bad_schedule")
    assert problems == [
        "tests.recipes.bad_schedule (while importing): schedule.epochs must be at least 1, got 0",
        "tests.recipes.bad_schedule (while importing): schedule.units_per_step (10) must be a "
        "multiple of schedule.optimizer_batch_size (4)",
        "tests.recipes.bad_schedule (while importing): schedule.optimizer_batch_size (4) must be "
        "a multiple of schedule.micro_batch_size (3)",
    ]


def test_unit_type_mismatch_string_loss_family_and_unknown_schema_are_all_listed():
    problems = problems_of("tests.recipes.bad_units")
    assert len(problems) == 4
    text = "\n".join(problems)
    assert "recipe name 'bad units' must be" in text
    assert "declares loss family 'policy_gradient', not a reef_stream.api.losses.LossFamily" in text
    assert "no current schema named 'tests.PairUnit'" in text
    assert "the processor emits PairUnit units but the objective 'group-baseline' consumes " \
           "RolloutUnit" in text


@pytest.mark.parametrize("path, words", [
    ("tests.recipes.nope", "recipe module 'tests.recipes.nope' not found"),
    ("tests.recipes.broken", "recipe module 'tests.recipes.broken' failed to import: "
                             "RuntimeError: the judge's API key is not configured"),
    ("tests.recipes.good:nope", "module 'tests.recipes.good' has no nope attribute"),
    ("tests.recipes.parts", "has no recipe or RECIPE attribute"),
    ("tests/recipes/good.py", "is not a dotted module path"),
    ("tests.recipes.parts:GroupBaseline", "expected a reef_stream.api.recipe.Recipe, got type"),
])
def test_a_bad_path_is_one_clear_error(path, words):
    assert any(words in problem for problem in problems_of(path))


def test_only_the_named_module_is_imported():
    import sys

    sys.modules.pop("tests.recipes.bad_loss", None)
    load_recipe("tests.recipes.good")
    assert "tests.recipes.bad_loss" not in sys.modules


def test_a_methods_own_unit_type_needs_its_schema_in_the_registry(tmp_path):
    pair_schema = {"type": "record", "name": "PairUnit", "namespace": "tests",
                   "fields": [{"name": "unit_id", "type": "string"}]}
    for path in SCHEMAS_DIR.glob("*.avsc"):
        shutil.copy(path, tmp_path)
    (tmp_path / "pair_unit.avsc").write_text(json.dumps(pair_schema))
    registry = SchemaRegistry(schemas_dir=tmp_path)

    @dataclasses.dataclass(frozen=True)
    class PairObjective:
        name: str = "pairs"
        unit_type: type = PairUnit
        loss_family: object = POLICY_GRADIENT

        def initial_state(self):
            return None

        def compute(self, units, state):
            raise NotImplementedError

    pairs = dataclasses.replace(
        GOOD, name="pairs", objective=PairObjective(),
        processor=dataclasses.replace(GOOD.processor, units=dataclasses.replace(
            GOOD.processor.units, unit_type=PairUnit)))
    assert check_recipe(pairs, registry=registry) is pairs
    assert "no current schema named 'tests.PairUnit'" in " ".join(recipe_problems(pairs))

    pair_schema["fields"].append({"name": "score", "type": "double"})
    (tmp_path / "pair_unit.avsc").write_text(json.dumps(pair_schema))
    (problem,) = recipe_problems(pairs, registry=SchemaRegistry(schemas_dir=tmp_path))
    assert "has fields ['unit_id'] but its schema tests.PairUnit (pair_unit.avsc) has " \
           "['unit_id', 'score']" in problem


def test_backends_support_families_by_identity():
    backend = Backend(name="torch", loss_families=(POLICY_GRADIENT,))
    assert backend.supports(POLICY_GRADIENT) and not backend.supports(VALUE_REGRESSION)
    lookalike = dataclasses.replace(POLICY_GRADIENT)
    assert not backend.supports(lookalike)
    problems = recipe_problems(dataclasses.replace(
        GOOD, backend=Backend(name="b", loss_families=("policy_gradient",), data_parallel_size=0)))
    assert len(problems) == 2 and "give LossFamily objects" in problems[0]


def test_reward_functions_sync_or_async_and_the_feedback_they_make():
    reward = NamedReward("exact_match", lambda g: Reward(reward=1.0, components={"format": 0.5}))
    assert isinstance(reward, RewardFunction)
    g = generation("g7", "grp", 2)
    feedback = feedback_for(g, reward(g), source=reward.source, created_at=5)
    assert (feedback.feedback_id, feedback.generation_id, feedback.group_id) == \
        ("g7:exact_match", "g7", "grp")
    assert (feedback.reward, feedback.components) == (1.0, {"format": 0.5})

    async def judge(generation: Generation) -> Reward:
        return Reward(reward=float(np.mean(generation.completion_logprobs)))

    assert recipe_problems(dataclasses.replace(GOOD, reward=NamedReward("exact_match", judge))
                           ) == []
    (problem,) = recipe_problems(dataclasses.replace(GOOD, reward=judge))
    assert "NamedReward(source, function)" in problem


def test_reef_check_prints_the_contract():
    result = CliRunner().invoke(main, ["check", "--recipe", "tests.recipes.checkable"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("recipe good (tests.recipes.checkable): the bindings check out")
    for expected in [
        "unit:      reef.events.RolloutUnit (RolloutUnit, rollout_unit.avsc",
        "to topic <ns>.units.good",
        "members: array<reef.events.Sample>",
        "  completion_logprobs: bytes (packed <f4)",
        "created_at: long (timestamp-millis)",
        "grouping:  by group_id (an ungrouped generation by its generation_id); complete when "
        "its declared group_size members are scored; incomplete groups expire",
        "feedback:  requires feedback from exact_match; reward = 1 x exact_match; waits 60000 ms",
        "objective: group-baseline: consumes RolloutUnit, loss family policy_gradient",
        "backend:   torch-test: supports policy_gradient, value_regression; data-parallel size 1",
        "schedule:  8 units per step, optimizer batch 4",
        "max staleness 2 policy versions",
        "evaluator: accept-everything (unevaluated): evaluates nothing; its publications are "
        "marked unevaluated",
        "WARNING: the candidate evaluator is AcceptEverything",
        "reward:    none",
        "            external feedback sources: exact_match",
        "sampling:  groups of 4 completions per prompt under one group_id",
        "model:     tests.recipes.checkable.tiny_model; optimizer AdamW (lr 1e-3, the default)",
    ]:
        assert expected in out, expected


def test_reef_check_refuses_a_recipe_the_whole_loop_cannot_run_which_a_stage_may_load():
    """tests.recipes.good loads for `reef process` (no reward, no model, no group size), but
    `reef check` asks whether the whole loop runs from it: every problem at once."""
    result = CliRunner().invoke(main, ["check", "--recipe", "tests.recipes.good"])
    assert result.exit_code == 2
    error = " ".join(result.stderr.split())
    assert error.startswith("error: 3 problems:"), error
    assert "the processor waits for feedback from 'exact_match', which nothing in the recipe " \
           "produces (no reward function; external_sources: [])" in error
    assert "the backend 'torch-test' has no model, and a recipe that trains needs one" in error
    assert "declares no group size: set Recipe(group_size=N)" in error
    with pytest.raises(ConfigurationError, match="has no model, and a recipe that trains"):
        load_recipe("tests.recipes.good", trains=True)


def test_reef_check_lists_every_problem_and_exits_2():
    result = CliRunner().invoke(main, ["check", "--recipe", "tests.recipes.bad_loss"])
    assert result.exit_code == 2
    error = " ".join(result.stderr.split())  # rich wraps long lines
    assert error.startswith("error: 6 problems:")   # the 3 at load, and 3 of `reef check`'s
    assert "backend 'values-only' does not support" in error and "no candidate evaluator" in error
    assert result.stdout == ""


def test_a_recipe_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GOOD.name = "other"
    assert isinstance(GOOD, Recipe)
