"""The author contract without silent failures (no broker).

- a reward's source and the feedback the processor waits for are checked against each other;
- the group size of grouped sampling is ``Recipe.group_size``, what the demo's replicas use;
- a recipe that trains needs ``Backend.model``; a result's ``loss_family`` must be the bound one;
- ``Sample`` carries the generation's finish reason and temperature;
- ``methods/`` knows no task: both methods bind to a second task written in the tests and train;
- ``--set FIELD=VALUE`` overrides a recipe's fields on every stage; the cwd comes first on
  ``sys.path`` when a recipe is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from methods.grpo import recipe as grpo_recipe
from methods.sao import recipe as sao_recipe
from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages, rollout_samples
from reef_stream.api.recipe import (
    AdamW, NamedReward, apply_overrides, check_recipe, feedback_for, load_recipe, recipe_problems,
)
from reef_stream.cli.main import main
from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.events import FinishReason, RolloutUnit, events_equal, to_avro
from reef_stream.core.serde import SchemaRegistry, schema_fingerprint
from reef_stream.core.settings import PROJECT_ROOT, SCHEMAS_DIR, load_settings
from reef_stream.engine.join import Outcome
from reef_stream.engine.testing import run_processor
from reef_stream.engine.training import TorchBackend
from tests.recipes import second_task
from tests.recipes.second_task import GreedySuccessor, Successor, generation, successor_model

METHODS = PROJECT_ROOT / "methods"


def reef(*args: str):
    return CliRunner().invoke(main, list(args))


# --------------------------------------------------------------------------- reward sources


def test_a_reward_source_the_processor_does_not_want_is_an_error_at_load_and_in_reef_check():
    typo = dataclasses.replace(second_task.sao, reward=NamedReward("sucessor", Successor()))
    (problem,) = recipe_problems(typo)       # at load, for every stage
    assert problem == ("the reward function's feedback source 'sucessor' is not one the "
                       "processor's feedback policy wants (it waits for 'successor'): its "
                       "feedback would be ignored and every generation would expire waiting")
    result = reef("check", "--recipe", "tests.recipes.typo_source")
    assert result.exit_code == 2, result.output
    assert "feedback source 'exact_mach' is not one" in " ".join(result.stderr.split())


def test_reef_check_requires_every_awaited_source_to_be_produced_or_declared_external():
    sources = dataclasses.replace(second_task.sao.processor.feedback,
                                  sources=("successor", "judge"))
    waits_for_judge = dataclasses.replace(
        second_task.sao, processor=dataclasses.replace(second_task.sao.processor,
                                                       feedback=sources))
    assert recipe_problems(waits_for_judge) == []          # a stage may still load it
    (problem,) = recipe_problems(waits_for_judge, complete=True)
    assert problem.startswith("the processor waits for feedback from 'judge', which nothing in "
                              "the recipe produces (the reward function's source is "
                              "'successor'; external_sources: [])")
    assert recipe_problems(dataclasses.replace(waits_for_judge, external_sources=("judge",)),
                           complete=True) == []


@pytest.mark.parametrize(("method", "name"), [(sao_recipe, "methods.sao.recipe"),
                                             (grpo_recipe, "methods.grpo.recipe")])
def test_a_method_waits_for_its_reward_and_the_external_sources_and_refuses_none(method, name):
    bound = method(model=successor_model, reward=NamedReward("successor", Successor()),
                          evaluator=GreedySuccessor(), external_sources=("judge",))
    assert bound.processor.feedback.sources == ("successor", "judge")
    external_only = method(model=successor_model, reward=None, evaluator=GreedySuccessor(),
                           external_sources=("judge",))
    assert external_only.processor.feedback.sources == ("judge",)
    with pytest.raises(ConfigurationError, match=rf"^{name} needs a reward function or "
                       "external_sources: the feedback its processor waits for$"):
        method(model=successor_model, reward=None, evaluator=GreedySuccessor())


# --------------------------------------------------------------------------- group size


def _demo(tmp_path, recipe: str, *overrides: str):
    from reef_stream.demo.run import Demo, DemoOptions

    settings = load_settings({"REEF_HOME": str(tmp_path / "home")})
    return Demo(DemoOptions(recipe=recipe, overrides=overrides, run_dir=tmp_path / "run"),
                settings=settings, bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0")


def test_the_demo_samples_the_recipes_group_size_and_gives_every_stage_its_binding(tmp_path):
    import reef_stream.demo.run as run

    assert not hasattr(run, "sampling_of")    # no GROUP_SIZE found by reflection any more
    demo = _demo(tmp_path, "methods.grpo", "group_size=8", "schedule.max_staleness=4")
    assert demo.recipe.group_size == 8 and demo.recipe.schedule.max_staleness == 4
    expected = ["--recipe", "reef_stream.demo.recipes:grpo", "--set", "group_size=8",
                "--set", "schedule.max_staleness=4"]
    for name, stage in demo.stages.items():
        argv = list(stage.argv) if hasattr(stage, "argv") else list(stage.args)
        at = argv.index("--recipe")
        assert argv[at:at + len(expected)] == expected, (name, argv)
        if name.startswith("replica"):
            assert argv[argv.index("--group-size") + 1] == "8" and "--grouped" in argv
    sao = _demo(tmp_path, "methods.sao")
    replica = sao.stages["replica-0"]
    argv = list(replica.argv) if hasattr(replica, "argv") else list(replica.args)
    assert "--grouped" not in argv and sao.recipe_path == "reef_stream.demo.recipes:sao"


# --------------------------------------------------------------------------- model, loss family


def test_a_recipe_that_trains_needs_a_model():
    modelless = dataclasses.replace(
        second_task.sao, backend=dataclasses.replace(second_task.sao.backend, model=None))
    assert recipe_problems(modelless) == []     # reef process / reward / evaluate need none
    with pytest.raises(ConfigurationError, match="has no model, and a recipe that trains"):
        check_recipe(modelless, trains=True)


def test_reef_train_refuses_a_recipe_without_a_model_before_it_connects(monkeypatch):
    monkeypatch.delenv("REEF_BOOTSTRAP_SERVERS", raising=False)
    result = reef("train", "--recipe", "tests.recipes.good", "--group", "g")
    assert result.exit_code == 2, result.output
    assert "the backend 'torch-test' has no model, and a recipe that trains needs one" in \
        " ".join(result.stderr.split())


def test_the_trainer_refuses_a_result_for_another_loss_family_than_the_bound_one():
    recipe = second_task.sao
    backend = TorchBackend(recipe)
    units = _rollout(backend, recipe, step=0, generator=torch.Generator().manual_seed(0))
    result = recipe.objective.compute(units, recipe.objective.initial_state())
    other = ObjectiveResult(advantages=result.advantages, metrics={},
                            proposed_state=result.proposed_state, loss_family=POLICY_GRADIENT)
    with pytest.raises(FatalError, match="asks for the loss family 'policy_gradient' but the "
                                         "recipe bound 'sao_truncated_pg'"):
        backend.train_step(units, other, 1)
    assert np.isfinite(backend.train_step(units, result, 1)["loss"])


# --------------------------------------------------------------------------- Sample


def test_a_sample_carries_its_generations_finish_reason_and_temperature():
    records = [generation("cut", 2, 9, -1.5, finish=FinishReason.LENGTH, temperature=0.7),
               generation("ok", 3, 7, -0.5)]
    records += [feedback_for(g, Successor()(g), source="successor", created_at=1_500)
                for g in list(records)]
    out = run_processor(second_task.sao, records)
    cut, ok = out.unit_of("cut").unit.members[0], out.unit_of("ok").unit.members[0]
    assert (cut.finish_reason, cut.temperature) == (FinishReason.LENGTH, 0.7)
    assert (ok.finish_reason, ok.temperature) == (FinishReason.STOP, 1.0)

    registry = SchemaRegistry.default()       # through Avro and back
    unit = out.unit_of("cut").unit
    assert events_equal(registry.decode(*registry.encode(unit), RolloutUnit), unit)
    # A unit written before the fields existed (rollout_unit v1) reads with their defaults.
    v1 = json.loads((SCHEMAS_DIR / "history" / "rollout_unit" / "v1.avsc").read_text())
    old = registry.by_fingerprint(schema_fingerprint(v1))
    record = to_avro(unit)
    for member in record["members"]:
        del member["finish_reason"], member["temperature"], member["created_at"]
        del member["policy_mask"]  # and the multi-turn mask (rollout_unit v4)
        del member["policy_version_known"]  # and whether its version is known (v5)
    read = registry.decode(*registry.encode_record(old, record), RolloutUnit).members[0]
    assert (read.finish_reason, read.temperature) == (FinishReason.UNKNOWN, 1.0)


@dataclasses.dataclass(frozen=True)
class MaskTruncated:
    """An objective wrapping another: a truncated completion (LENGTH) gets advantage 0, and
    every advantage is divided by its sample's temperature."""

    inner: object
    name: str = "mask-truncated"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def compute(self, units, state):
        result = self.inner.compute(units, state)
        samples = rollout_samples(units)
        keep = np.array([s.finish_reason is not FinishReason.LENGTH for s in samples])
        temperature = np.array([s.temperature for s in samples], np.float32)
        values = np.asarray(result.advantages.values) * keep / temperature
        return dataclasses.replace(result, advantages=PerSampleAdvantages(values))


def test_an_objective_can_mask_truncated_completions_and_correct_for_temperature():
    from methods.grpo.objective import GroupNormalisedAdvantage

    group = [generation(f"g{i}", 1, token, -1.0, group="grp", size=4, temperature=0.5,
                        finish=FinishReason.LENGTH if i == 0 else FinishReason.STOP)
             for i, token in enumerate((5, 5, 6, 7))]
    records = group + [feedback_for(g, Successor()(g), source="successor", created_at=1_500)
                       for g in group]
    (emitted,) = run_processor(second_task.grpo, records).units
    objective = MaskTruncated(GroupNormalisedAdvantage())
    plain = GroupNormalisedAdvantage().compute([emitted.unit], objective.initial_state())
    masked = objective.compute([emitted.unit], objective.initial_state())
    assert [s.finish_reason for s in emitted.unit.members][0] is FinishReason.LENGTH
    np.testing.assert_allclose(masked.advantages.values,
                               [0.0, *(np.asarray(plain.advantages.values[1:]) / 0.5)])


# --------------------------------------------------------------------------- task-agnostic methods


def test_the_methods_import_nothing_of_the_demo():
    for path in sorted(METHODS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("reef_stream.demo") for n in names), (path, names)
    code = ("import sys, methods.sao, methods.grpo\n"
            "print(sorted(m for m in sys.modules if m.startswith('reef_stream.demo')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_an_unbound_method_is_a_clear_error_and_the_demo_binds_it():
    from reef_stream.demo.recipes import stage_recipe

    with pytest.raises(ConfigurationError, match="methods.grpo is a method's recipe factory"):
        load_recipe("methods.grpo")
    assert stage_recipe("methods.grpo") == "reef_stream.demo.recipes:grpo"
    assert stage_recipe("reef_stream.methods.sao") == "reef_stream.demo.recipes:sao"
    assert stage_recipe("tests.recipes.second_task:grpo") == "tests.recipes.second_task:grpo"


@pytest.mark.parametrize("name", ["sao", "grpo"])
def test_both_methods_bind_to_a_second_task_and_train_offline(name):
    recipe = load_recipe(f"tests.recipes.second_task:{name}", complete=True)
    assert recipe.reward.source == "successor" and isinstance(recipe.evaluator, GreedySuccessor)
    assert recipe.processor.feedback.sources == ("successor",)
    assert recipe.backend.optimizer == AdamW(lr=0.01)
    backend = TorchBackend(recipe)
    before = [p.detach().clone() for p in backend.model.parameters()]
    generator = torch.Generator().manual_seed(1)
    state = recipe.objective.initial_state()
    for step in range(1, 6):
        units = _rollout(backend, recipe, step - 1, generator)
        assert len(units) == recipe.schedule.units_per_step
        result = recipe.objective.compute(units, state)
        metrics = backend.train_step(units, result, step)
        assert np.isfinite(metrics["loss"]), metrics
        state = result.proposed_state
    after = list(backend.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    assert state != recipe.objective.initial_state()
    assert recipe.evaluator.select(_measurement(backend), None).promoted


def _measurement(backend):
    from reef_stream.api.evaluator import Measurement

    return Measurement({"accuracy": second_task.accuracy(
        backend.accelerator.unwrap_model(backend.model))})


def _rollout(backend, recipe, step: int, generator: torch.Generator) -> list:
    """Sample from the backend's model (group_size completions per prompt), score with the
    recipe's reward, and assemble exactly one step of units with the recipe's processor."""
    model = backend.accelerator.unwrap_model(backend.model)
    size = recipe.group_size
    # A unit is a group of ``size`` (one sample, ungrouped): one prompt per unit.
    digits = [d % second_task.DIGITS for d in range(step, step + recipe.schedule.units_per_step)]
    rows = [d for d in digits for _ in range(size)]
    prompts = torch.from_numpy(np.stack([second_task.prompt_tokens(d) for d in rows]).astype(
        np.int64))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(prompts, torch.ones_like(prompts, dtype=torch.bool))
                                     [:, -1].float(), dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
    generations = [
        generation(f"s{step}-{i}", d, int(t), float(logprobs[i, t]), version=step,
                   group=f"s{step}-p{i // size}" if size > 1 else None, size=size)
        for i, (d, t) in enumerate(zip(rows, tokens))]
    records = [*generations, *(feedback_for(g, recipe.reward(g), source=recipe.reward.source,
                                            created_at=1_500) for g in generations)]
    out = run_processor(recipe, records)
    assert all(out.outcome(g.generation_id).outcome is Outcome.UNIT for g in generations)
    return [emitted.unit for emitted in out.units][:recipe.schedule.units_per_step]


# --------------------------------------------------------------------------- --set


def test_set_overrides_typed_fields_of_the_frozen_configs():
    recipe = apply_overrides(second_task.sao, [
        "schedule.max_staleness=4", "schedule.shuffle=false", "backend.optimizer.lr=3e-4",
        "backend.max_grad_norm=none", "objective.decay=0.8", "group_size=2",
        "processor.feedback.timeout_ms=5000"])
    assert recipe.schedule.max_staleness == 4 and recipe.schedule.shuffle is False
    assert recipe.backend.optimizer.lr == 3e-4 and recipe.backend.max_grad_norm is None
    assert recipe.objective.decay == 0.8 and recipe.group_size == 2
    assert recipe.processor.feedback.timeout_ms == 5000
    assert second_task.sao.schedule.max_staleness == 16          # the original is untouched
    assert apply_overrides(second_task.sao, []) is second_task.sao


def test_a_bad_set_is_one_configuration_error_listing_every_problem():
    with pytest.raises(ConfigurationError) as caught:
        apply_overrides(second_task.sao, [
            "schedule.max_stalness=4", "schedule.seed=x", "objective.decay=1.5",
            "backend.losses.x=1", "nothing"])
    problems = caught.value.problems
    assert problems == [
        "--set 'nothing': expected FIELD=VALUE (e.g. schedule.max_staleness=4)",
        "--set schedule.max_stalness: schedule (Schedule) has no field 'max_stalness'; its "
        "fields: units_per_step, optimizer_batch_size, micro_batch_size, epochs, shuffle, seed, "
        "max_staleness, max_backlog_steps, backlog_wait_s, checkpoint_every, unknown_version",
        "--set schedule.seed: schedule.seed takes an integer, got 'x'",
        "--set objective.decay: StreamingAdvantage.decay must be in [0, 1), got 1.5",
        "--set backend.losses.x: backend.losses is a dict, which has no fields to set; edit the "
        "recipe instead",
    ]
    with pytest.raises(ConfigurationError) as caught:   # values the config itself refuses
        apply_overrides(second_task.sao, ["schedule.units_per_step=3", "schedule.epochs=2"])
    assert caught.value.problems == [
        "--set schedule.units_per_step, schedule.epochs: schedule.units_per_step (3) must be a "
        "multiple of schedule.optimizer_batch_size (8)"]


def test_set_reads_a_tuple_as_comma_separated_items_and_the_checks_still_run():
    both = apply_overrides(second_task.sao, ["processor.feedback.sources=successor,judge",
                                             "external_sources=judge"])
    assert both.processor.feedback.sources == ("successor", "judge")
    assert check_recipe(both, complete=True) is both
    with pytest.raises(ConfigurationError, match="'judge', which nothing in the recipe produces"):
        check_recipe(apply_overrides(second_task.sao,
                                     ["processor.feedback.sources=successor,judge"]),
                     complete=True)


def test_set_applies_a_configs_fields_together_whatever_their_order():
    bigger = apply_overrides(second_task.sao, ["schedule.units_per_step=32",
                                               "schedule.micro_batch_size=16",
                                               "schedule.optimizer_batch_size=16",
                                               "schedule.max_staleness=1",
                                               "schedule.max_staleness=2"])
    assert (bigger.schedule.units_per_step, bigger.schedule.optimizer_batch_size,
            bigger.schedule.micro_batch_size, bigger.schedule.max_staleness) == (32, 16, 16, 2)


def test_every_stage_command_takes_set_and_reef_check_shows_its_effect():
    for command in ("check", "train", "process", "reward", "evaluate", "demo"):
        result = reef(command, "--help")
        assert "--set FIELD=VALUE" in result.output, command
    from reef_stream.demo.replica import main as replica

    assert "--set FIELD=VALUE" in CliRunner().invoke(replica, ["--help"]).output
    result = reef("check", "--recipe", "reef_stream.demo.recipes:sao",
                  "--set", "schedule.max_staleness=4", "--set", "backend.optimizer.lr=3e-4")
    assert result.exit_code == 0, result.output
    assert "max staleness 4 policy versions" in result.stdout
    assert "optimizer AdamW(lr=0.0003" in result.stdout
    result = reef("check", "--recipe", "reef_stream.demo.recipes:sao",
                  "--set", "schedule.max_stalness=4")
    assert result.exit_code == 2
    error = " ".join(result.stderr.split())
    assert "reef_stream.demo.recipes:sao: --set schedule.max_stalness: schedule (Schedule) has " \
           "no field 'max_stalness'; its fields: units_per_step," in error


# --------------------------------------------------------------------------- sys.path


def test_load_recipe_puts_the_current_directory_first(tmp_path, monkeypatch):
    (tmp_path / "cwd_first_recipe.py").write_text(
        "from tests.recipes.second_task import sao as recipe\n")
    monkeypatch.chdir(tmp_path)
    saved = sys.path[:]     # the interpreter's import path, restored whatever happens
    sys.path[:] = [p for p in saved if p not in ("", str(tmp_path))] + [str(PROJECT_ROOT)]
    try:
        assert load_recipe("cwd_first_recipe") is second_task.sao
        assert sys.path[0] == str(tmp_path)
    finally:
        sys.path[:] = saved


def test_the_reef_console_script_loads_a_recipe_module_of_the_current_directory(tmp_path):
    """A console script puts its own bin/ first on sys.path, not the cwd (unlike python -m)."""
    (tmp_path / "my_recipes.py").write_text(
        "from reef_stream.demo.recipes import sao as recipe\n")
    script = Path(sys.executable).parent / "reef"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(script), "check", "--recipe", "my_recipes",
                             "--set", "schedule.max_staleness=3"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "recipe sao (my_recipes): the bindings check out" in result.stdout
    assert "max staleness 3 policy versions" in result.stdout
