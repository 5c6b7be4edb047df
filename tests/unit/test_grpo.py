"""methods/grpo without a broker: groups complete at their declared size, group-normalised
advantages and the clipped loss against values computed by hand, the recipe's bindings, and
the parts learning a bandit through the torch backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from methods.grpo.objective import GroupNormalisedAdvantage, GroupState
from methods.grpo.processor import FEEDBACK_TIMEOUT_MS
from methods.grpo.processor import processor as grpo_processor
from reef_stream.api.losses import POLICY_GRADIENT, ClippedPolicyGradient, PolicyGradientInputs
from reef_stream.api.objective import state_from_record, state_record
from reef_stream.api.processor import unit_id
from reef_stream.api.recipe import Backend, Recipe, check_recipe, load_recipe
from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import (
    Feedback, Generation, RolloutUnit, Sample, SamplingParams,
)
from reef_stream.engine.join import Outcome
from reef_stream.engine.models import TinyCausalLM
from reef_stream.engine.testing import Advance, run_processor
from reef_stream.engine.training import TorchBackend
from tests import factories

#: The source the tests' feedback comes from (the demo task's reward, as it happens).
REWARD_SOURCE = "exact_match"
processor = grpo_processor((REWARD_SOURCE,))

def unit(key: str, *rewards: float) -> RolloutUnit:
    members = tuple(factories.sample(f"{key}-{i}", prompt_id=key,
                                     prompt_token_ids=factories.ids([1]),
                                     completion_token_ids=factories.ids([2]),
                                     completion_logprobs=factories.logprobs([-1.0]), reward=reward)
                    for i, reward in enumerate(rewards))
    return factories.rollout_unit(*members, recipe="grpo", group_key=key, created_at=0)


# --------------------------------------------------------------------------- processor


def generation(gid: str, group: str, size: int) -> Generation:
    """The factory's generation (tests/factories.py), shorter, grouped, at policy version 2."""
    return factories.generation(
        gid, request_id=f"req-{group}", prompt_id=f"prompt-{group}", group_id=group,
        group_size=size, policy_version=2, prompt_token_ids=factories.ids([1, 2]),
        completion_token_ids=factories.ids([5]), completion_logprobs=factories.logprobs([-0.5]),
        sampling=SamplingParams(max_tokens=4), created_at=1_000)


def feedback(gid: str, reward: float, group: str) -> Feedback:
    return factories.feedback(gid, group_id=group, source=REWARD_SOURCE, reward=reward,
                              created_at=2_000)


def test_a_group_is_one_unit_only_once_its_declared_size_is_scored():
    records = [generation("c", "grp", 3), generation("a", "grp", 3), feedback("c", 1.0, "grp"),
               generation("b", "grp", 3), feedback("a", 0.0, "grp")]
    out = run_processor(processor, records, recipe_name="grpo")
    assert out.units == () and sorted(out.pending) == ["a", "b", "c"]    # 2 of 3 scored
    out = run_processor(processor, [*records, feedback("b", 1.0, "grp")], recipe_name="grpo")
    (emitted,) = out.units
    assert emitted.group_key == "grp" and emitted.member_ids == ("a", "b", "c")
    assert emitted.unit_id == unit_id("grpo", ["a", "b", "c"])
    assert [(m.generation_id, m.reward) for m in emitted.unit.members] == \
        [("a", 0.0), ("b", 1.0), ("c", 1.0)]                          # ordered by generation id


def test_a_group_that_cannot_complete_expires_whole():
    records = [generation("a", "grp", 2), generation("b", "grp", 2), feedback("a", 1.0, "grp"),
               Advance(FEEDBACK_TIMEOUT_MS)]
    out = run_processor(processor, records, finish=True)
    assert out.units == ()
    assert {out.outcome(g).outcome for g in "ab"} == {Outcome.EXPIRED}


def test_groups_complete_independently_at_their_own_sizes():
    records = [generation("x1", "x", 1), generation("y1", "y", 2), feedback("x1", 1.0, "x"),
               generation("y2", "y", 2), feedback("y2", 0.0, "y"), feedback("y1", 1.0, "y")]
    out = run_processor(processor, records)
    assert [u.member_ids for u in out.units] == [("x1",), ("y1", "y2")]


# --------------------------------------------------------------------------- objective


def test_group_normalised_advantages_by_hand():
    objective = GroupNormalisedAdvantage(epsilon=0.5)
    result = objective.compute([unit("p", 1.0, 0.0, 0.0, 1.0), unit("q", 1.0, 1.0, 1.0),
                                unit("r", 2.0, 0.0, 1.0)], objective.initial_state())
    # p: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 0.5); q: all equal -> 0; r: mean 1, std sqrt(2/3)
    r = 1.0 / (math.sqrt(2 / 3) + 0.5)
    assert result.advantages.values.tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, r, -r, 0.0], rel=1e-6)
    assert result.advantages.values.dtype == np.float32
    assert result.loss_family is POLICY_GRADIENT
    assert result.proposed_state == GroupState(step=1)
    values = np.array([0.5, -0.5, -0.5, 0.5, 0, 0, 0, r, -r, 0])
    assert dict(result.metrics) == pytest.approx({
        "reward_mean": 8 / 10, "reward_std": (0.5 + 0.0 + math.sqrt(2 / 3)) / 3,
        "advantage_mean": 0.0, "advantage_std": float(values.std()),
        "zero_std_fraction": 1 / 3, "group_size": 10 / 3}, abs=1e-7)


def test_the_default_epsilon_gives_unit_variance_groups():
    objective = GroupNormalisedAdvantage()
    result = objective.compute([unit("p", 1.0, 0.0, 0.0, 0.0)], GroupState(step=4))
    values = result.advantages.values
    # mean 0.25, std sqrt(3) / 4: (0.75, -0.25 x 3) / (sqrt(3) / 4 + 1e-4)
    std = math.sqrt(3) / 4
    assert values.tolist() == pytest.approx([0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3,
                                            rel=1e-6)


def test_a_replayed_step_gives_the_same_result_and_the_state_checkpoints():
    objective, units = GroupNormalisedAdvantage(), [unit("p", 1.0, 0.0), unit("q", 0.0, 0.5)]
    first, second = objective.compute(units, GroupState(3)), objective.compute(units, GroupState(3))
    assert first.advantages.values.tolist() == second.advantages.values.tolist()
    assert first.proposed_state == second.proposed_state == GroupState(step=4)
    assert state_from_record(GroupState, state_record(first.proposed_state)) == GroupState(4)
    with pytest.raises(ConfigurationError):
        GroupNormalisedAdvantage(epsilon=0.0)


def test_grpo_advantages_through_the_clipped_loss_by_hand():
    # One group of two one-token samples, rewards 1 and 0, epsilon 1: advantages +-0.5 / 1.5.
    advantages = GroupNormalisedAdvantage(epsilon=1.0).compute(
        [unit("p", 1.0, 0.0)], GroupState()).advantages.values
    a = 0.5 / 1.5
    assert advantages.tolist() == pytest.approx([a, -a])
    # Ratios 1.5 and 0.5: the positive advantage is clipped at 1.2, the negative at 0.8.
    logprobs = torch.tensor([[math.log(1.5)], [math.log(0.5)]], dtype=torch.float64,
                            requires_grad=True)
    inputs = PolicyGradientInputs(
        logprobs=logprobs, behaviour_logprobs=torch.zeros(2, 1, dtype=torch.float64),
        advantages=torch.tensor(advantages[:, None], dtype=torch.float64),
        mask=torch.ones(2, 1, dtype=torch.bool))
    out = ClippedPolicyGradient(epsilon=0.2)(inputs)
    assert out.loss.item() == pytest.approx(-(1.2 * a + 0.8 * -a) / 2)
    assert out.metrics["clip_fraction"] == 1.0
    out.loss.backward()
    assert logprobs.grad.flatten().tolist() == [0.0, 0.0]     # both clipped: no gradient


# --------------------------------------------------------------------------- the parts together


def test_the_grpo_parts_learn_a_bandit_through_the_torch_backend():
    """Prompt token 1 is answered by token 3, prompt 2 by token 5 (chance: 1 in 8). Each step
    samples two groups of 8 one-token completions per prompt on policy, scores them by exact
    match, and trains two epochs with the clipped loss."""
    targets = {1: 3, 2: 5}
    bandit = Recipe(
        name="grpo-bandit", processor=processor, objective=GroupNormalisedAdvantage(),
        schedule=Schedule(units_per_step=4, optimizer_batch_size=4, micro_batch_size=4,
                          epochs=2, seed=3, max_staleness=0),
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,),
                        model=lambda: TinyCausalLM(vocab_size=8, dim=16),
                        optimizer=lambda params: torch.optim.Adam(params, lr=0.03)))
    backend, state = TorchBackend(bandit), bandit.objective.initial_state()
    prompts = torch.tensor([[1], [2]])
    generator = torch.Generator().manual_seed(0)

    def policy() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(backend.model(prompts, torch.ones_like(prompts, dtype=bool))
                                     [:, -1].float(), dim=-1)

    rewards = []
    for step in range(1, 16):
        behaviour, units = policy(), []
        for row, prompt in [(0, 1), (1, 2), (0, 1), (1, 2)]:
            tokens = torch.multinomial(behaviour[row].exp(), 8, replacement=True,
                                       generator=generator).tolist()
            key = f"s{step}-{len(units)}"
            members = tuple(
                Sample(generation_id=f"{key}-{i}", prompt_id=f"p{prompt}", policy_version=step,
                       prompt_token_ids=np.array([prompt], np.int32),
                       completion_token_ids=np.array([token], np.int32),
                       completion_logprobs=np.array([behaviour[row, token]], np.float32),
                       reward=float(token == targets[prompt]))
                for i, token in enumerate(tokens))
            units.append(RolloutUnit(unit_id=key, recipe="grpo-bandit", group_key=key,
                                     members=members, created_at=0))
        result = bandit.objective.compute(units, state)
        metrics = backend.train_step(units, result, step)
        assert np.isfinite(metrics["loss"]) and 0.0 <= metrics["clip_fraction"] <= 1.0
        state, rewards = result.proposed_state, rewards + [result.metrics["reward_mean"]]
    assert rewards[0] < 0.4, rewards                        # chance is 1 in 8
    final = policy().exp()
    assert final[0, 3] > 0.9 and final[1, 5] > 0.9, (final, rewards[::5])
    assert state == GroupState(step=15)


# --------------------------------------------------------------------------- the recipe


def test_the_recipe_loads_with_its_bindings():
    from methods.grpo.recipe import GROUP_SIZE

    recipe = load_recipe("reef_stream.demo.recipes:grpo", complete=True)
    assert recipe.name == "grpo" and recipe.processor == processor
    assert recipe.group_size == GROUP_SIZE == 16
    assert recipe.objective.loss_family is POLICY_GRADIENT and recipe.backend.supports(
        POLICY_GRADIENT)
    assert recipe.backend.losses[POLICY_GRADIENT] == ClippedPolicyGradient(epsilon=0.2)
    assert recipe.evaluator.evaluates and recipe.reward.source == REWARD_SOURCE
    assert processor.feedback.wants(recipe.reward.source) and GROUP_SIZE > 1


def test_reef_check_prints_the_grpo_contract():
    from reef_stream.cli.main import main

    result = CliRunner().invoke(main, ["check", "--recipe", "reef_stream.demo.recipes:grpo"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("recipe grpo (reef_stream.demo.recipes:grpo): the bindings check out")
    for expected in [
        "to topic <ns>.units.grpo",
        "grouping:  by group_id (an ungrouped generation by its generation_id); complete when "
        "its declared group_size members are scored; incomplete groups expire",
        "feedback:  requires feedback from exact_match",
        "objective: grpo: consumes RolloutUnit, loss family policy_gradient",
        "backend:   torch: supports policy_gradient",
        "evaluates candidates before promoting them",
        "reward:    feedback source 'exact_match' (reef reward)",
        "sampling:  groups of 16 completions per prompt under one group_id",
    ]:
        assert expected in out, expected


def test_a_grpo_recipe_without_a_group_size_is_a_reef_check_error():
    import dataclasses

    from reef_stream.demo.recipes import grpo

    ungrouped = dataclasses.replace(grpo, group_size=1)
    with pytest.raises(ConfigurationError, match=r"groups generations by group_id \(ByGroupId\) "
                       r"but the recipe declares no group size: set Recipe\(group_size=N\)"):
        check_recipe(ungrouped, complete=True)
    check_recipe(ungrouped)    # the processor, reward and trainer stages need no group size
    from reef_stream.cli.main import main

    result = CliRunner().invoke(main, ["check", "--recipe", "reef_stream.demo.recipes:grpo",
                                       "--set", "group_size=1"])
    assert result.exit_code == 2 and "declares no group size" in result.output, result.output
