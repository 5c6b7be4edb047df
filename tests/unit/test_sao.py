"""methods/sao without a broker: processor, objective and loss against values computed by hand,
the recipe's bindings, and the parts learning a bandit through the torch backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from methods.sao.loss import SAO_TRUNCATED_PG, TruncatedPolicyGradient
from methods.sao.objective import RewardStats, StreamingAdvantage, decayed
from methods.sao.processor import FEEDBACK_TIMEOUT_MS
from methods.sao.processor import processor as sao_processor
from reef_stream.api.losses import (
    POLICY_GRADIENT, PolicyGradientInputs, is_registered, loss_family, register_loss_family,
)
from reef_stream.api.objective import state_from_record, state_record
from reef_stream.api.processor import unit_id
from reef_stream.api.recipe import Backend, Recipe, load_recipe
from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import (
    Feedback, Generation, RolloutUnit, Sample, SamplingParams,
)
from reef_stream.engine.join import Outcome
from reef_stream.engine.models import TinyCausalLM
from reef_stream.engine.testing import Advance, run_processor
from reef_stream.engine.training import TorchBackend, inputs_builder, policy_gradient_inputs
from tests import factories

#: The source the tests' feedback comes from (the demo task's reward, as it happens).
REWARD_SOURCE = "exact_match"
processor = sao_processor((REWARD_SOURCE,))

def sample(prompt_id: str, reward: float, gid: str | None = None) -> Sample:
    return factories.sample(gid or f"{prompt_id}-{reward}", prompt_id=prompt_id,
                            prompt_token_ids=factories.ids([1]),
                            completion_token_ids=factories.ids([2]),
                            completion_logprobs=factories.logprobs([-1.0]), reward=reward)


def units_of(*samples: Sample) -> list[RolloutUnit]:
    """One unit per sample, as SAO's processor emits them."""
    return [RolloutUnit(unit_id=unit_id("sao", [s.generation_id]), recipe="sao",
                        group_key=s.generation_id, members=(s,), created_at=0) for s in samples]


# --------------------------------------------------------------------------- processor


def generation(gid: str, group: str | None = None, size: int = 1) -> Generation:
    """The factory's generation (tests/factories.py), shorter, at policy version 3."""
    return factories.generation(
        gid, request_id=f"req-{gid}", prompt_id="prompt-7", group_id=group, group_size=size,
        policy_version=3, prompt_token_ids=factories.ids([1, 2]),
        completion_token_ids=factories.ids([5]), completion_logprobs=factories.logprobs([-0.5]),
        sampling=SamplingParams(max_tokens=4), created_at=1_000)


def feedback(gid: str, reward: float = 1.0, source: str = REWARD_SOURCE) -> Feedback:
    return factories.feedback(gid, source=source, reward=reward, created_at=2_000)


def test_one_generation_and_its_reward_make_one_unit_of_one_sample():
    out = run_processor(processor, [generation("g"), feedback("g", 1.0)], recipe_name="sao")
    (emitted,) = out.units
    assert out.outcome("g").outcome is Outcome.UNIT
    unit = emitted.unit
    assert isinstance(unit, RolloutUnit) and emitted.unit_id == unit_id("sao", ["g"])
    (member,) = unit.members
    assert (member.generation_id, member.prompt_id, member.reward, member.policy_version) == \
        ("g", "prompt-7", 1.0, 3)
    assert member.reward_components == {REWARD_SOURCE: 1.0}


def test_sao_ignores_groups_and_other_sources_and_expires_unrewarded_generations():
    records = [generation("a", "grp", 3), generation("b", "grp", 3), feedback("a", 0.0),
               feedback("b", 1.0, source="judge"), generation("c"), Advance(FEEDBACK_TIMEOUT_MS)]
    out = run_processor(processor, records, finish=True)
    assert [u.member_ids for u in out.units] == [("a",)]    # grouped, yet a unit on its own
    assert out.outcome("b").outcome is Outcome.EXPIRED      # only a judge's feedback
    assert out.outcome("c").outcome is Outcome.EXPIRED      # none at all
    assert out.fates_of("b:judge")[0].fate.value == "ignored"


# --------------------------------------------------------------------------- objective

#: decay 0.5 per key (alpha 0.5), 0.75 globally (alpha 0.25); before anything: mean 0, var 1.
OBJECTIVE = StreamingAdvantage(decay=0.5, global_decay=0.75, initial_mean=0.0,
                               initial_variance=1.0, std_floor=0.1)


def test_the_decayed_update_by_hand():
    # alpha 0.5, d = 1 - 0 = 1: mean 0.5, var 0.5 * (1 + 0.5 * 1) = 0.75
    assert decayed(0.0, 1.0, 1.0, 0.5) == (0.5, 0.75)
    # d = 0 - 0.5: mean 0.25, var 0.5 * (0.75 + 0.5 * 0.25) = 0.4375
    assert decayed(0.5, 0.75, 0.0, 0.5) == (0.25, 0.4375)


def test_a_first_step_uses_the_global_fallback_and_proposes_per_key_statistics():
    state = OBJECTIVE.initial_state()
    assert state == RewardStats(global_mean=0.0, global_variance=1.0)
    result = OBJECTIVE.compute(units_of(sample("p", 1.0), sample("p", 0.0), sample("q", 1.0)),
                               state)
    # Every key unseen: baseline 0 and std 1 (the global statistics before the step).
    assert result.advantages.values.tolist() == [1.0, 0.0, 1.0]
    assert result.advantages.values.dtype == np.float32
    assert result.loss_family is SAO_TRUNCATED_PG
    new = result.proposed_state
    assert new.step == 1 and new.keys == ("p", "q") and new.last_step == (1, 1)
    # p: (0, 1) -r=1-> (0.5, 0.75) -r=0-> (0.25, 0.4375); q: (0, 1) -r=1-> (0.5, 0.75)
    assert new.means == (0.25, 0.5) and new.variances == (0.4375, 0.75)
    # global, alpha 0.25: (0, 1) -1-> (0.25, 0.75 * 1.25) -0-> (0.1875, 0.75 * (0.9375 + 0.25
    # * 0.0625)) -1-> (0.390625, 0.75 * (0.71484375 + 0.25 * 0.8125 ** 2))
    assert new.global_mean == pytest.approx(0.390625)
    assert new.global_variance == pytest.approx(0.75 * (0.71484375 + 0.25 * 0.8125 ** 2))
    assert dict(result.metrics) == pytest.approx({
        "baseline": 0.0, "advantage_mean": 2 / 3, "advantage_std": math.sqrt(2 / 9),
        "reward_mean": 2 / 3, "known_key_fraction": 0.0, "keys": 2.0})


def test_a_known_key_uses_its_own_statistics_and_a_new_key_starts_from_the_global_ones():
    first = OBJECTIVE.compute(units_of(sample("p", 1.0), sample("p", 0.0), sample("q", 1.0)),
                              OBJECTIVE.initial_state()).proposed_state
    g_mean, g_var = first.global_mean, first.global_variance
    result = OBJECTIVE.compute(units_of(sample("p", 1.0), sample("r", 0.0)), first)
    # p: (1 - 0.25) / sqrt(0.4375); r is unseen: (0 - global mean) / global std
    assert result.advantages.values.tolist() == pytest.approx(
        [0.75 / math.sqrt(0.4375), -g_mean / math.sqrt(g_var)], rel=1e-6)
    assert result.metrics["baseline"] == pytest.approx((0.25 + g_mean) / 2)
    assert result.metrics["known_key_fraction"] == 0.5
    new = result.proposed_state
    assert new.step == 2 and new.keys == ("p", "q", "r") and new.last_step == (2, 1, 2)
    # p: d = 0.75: (0.25 + 0.375, 0.5 * (0.4375 + 0.5 * 0.5625)); q untouched;
    # r starts from the global statistics before this step, then takes r = 0.
    assert new.means == pytest.approx((0.625, 0.5, g_mean / 2))
    assert new.variances == pytest.approx(
        (0.5 * (0.4375 + 0.28125), 0.75, 0.5 * (g_var + 0.5 * g_mean ** 2)))


def test_a_key_without_variance_divides_by_the_std_floor():
    state = RewardStats(step=4, keys=("p",), means=(1.0,), variances=(0.0,), last_step=(4,))
    result = OBJECTIVE.compute(units_of(sample("p", 0.0), sample("p", 1.0, gid="again")), state)
    assert result.advantages.values.tolist() == pytest.approx([-10.0, 0.0])  # (0 - 1) / 0.1


def test_the_keys_kept_are_capped_dropping_the_least_recently_updated():
    capped = StreamingAdvantage(decay=0.5, global_decay=0.75, max_keys=2)
    state = RewardStats(step=2, global_mean=0.5, global_variance=0.25, keys=("a", "b"),
                        means=(1.0, 0.0), variances=(0.25, 0.25), last_step=(1, 2))
    new = capped.compute(units_of(sample("c", 1.0)), state).proposed_state
    assert new.keys == ("b", "c") and new.last_step == (2, 3)   # a, updated at step 1, is gone
    # ... so a falls back to the global statistics again: (1 - g_mean) / g_std.
    again = capped.compute(units_of(sample("a", 1.0)), new)
    assert again.metrics["known_key_fraction"] == 0.0
    assert again.advantages.values[0] == pytest.approx(
        (1.0 - new.global_mean) / math.sqrt(new.global_variance))
    # A step touching more keys than the cap keeps the first ones in key order.
    many = capped.compute(units_of(*(sample(k, 1.0) for k in "zyx")), state).proposed_state
    assert many.keys == ("x", "y")


def test_a_replayed_step_gives_the_same_result_and_the_state_checkpoints():
    units = units_of(sample("p", 1.0), sample("q", 0.0), sample("p", 0.5, gid="third"))
    state = OBJECTIVE.compute(units, OBJECTIVE.initial_state()).proposed_state
    first, second = OBJECTIVE.compute(units, state), OBJECTIVE.compute(units, state)
    assert first.advantages.values.tolist() == second.advantages.values.tolist()
    assert first.proposed_state == second.proposed_state and dict(first.metrics) == dict(
        second.metrics)
    record = state_record(first.proposed_state)
    assert state_from_record(RewardStats, record) == first.proposed_state
    assert record["keys"] == ["p", "q"] and isinstance(record["means"], list)


def test_bad_settings_are_listed_together():
    with pytest.raises(ConfigurationError) as caught:
        StreamingAdvantage(decay=1.0, std_floor=0.0, max_keys=0)
    assert len(caught.value.problems) == 3


# --------------------------------------------------------------------------- loss


def _inputs(current, behaviour, advantages, mask):
    logprobs = torch.tensor([current], dtype=torch.float64, requires_grad=True)
    return PolicyGradientInputs(
        logprobs=logprobs,
        behaviour_logprobs=torch.tensor([behaviour], dtype=torch.float64, requires_grad=True),
        advantages=torch.tensor([advantages], dtype=torch.float64),
        mask=torch.tensor([mask]))


def test_the_truncated_weight_by_hand():
    # ratios 0.5, 1, 3 (and a masked one); advantages 2, -1, 1 (and 5, masked); truncation 2
    inputs = _inputs([math.log(0.25), math.log(0.5), math.log(0.3), 0.0],
                     [math.log(0.5), math.log(0.5), math.log(0.1), -3.0],
                     [2.0, -1.0, 1.0, 5.0], [True, True, True, False])
    out = TruncatedPolicyGradient(truncation=2.0)(inputs)
    # weights 0.5, 1, min(3, 2) = 2: loss = -(0.5*2*log .25 + 1*-1*log .5 + 2*1*log .3) / 3
    expected = -(1.0 * math.log(0.25) - math.log(0.5) + 2.0 * math.log(0.3)) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert dict(out.metrics) == pytest.approx(
        {"ratio_mean": 1.5, "truncated_fraction": 1 / 3, "weight_mean": 3.5 / 3})
    out.loss.backward()
    # d loss / d logprob = -weight * advantage / 3; nothing flows into the weight or the
    # behaviour logprobs, nothing from the masked token.
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-1 / 3, 1 / 3, -2 / 3, 0.0])
    assert inputs.behaviour_logprobs.grad is None


def test_a_looser_bound_weights_the_stale_token_fully():
    inputs = _inputs([math.log(0.3)], [math.log(0.1)], [1.0], [True])
    TruncatedPolicyGradient(truncation=10.0)(inputs).loss.backward()
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-3.0])     # the ratio, untruncated


def test_on_policy_it_has_the_gradient_of_the_clipped_policy_gradient():
    logprobs = [math.log(0.2), math.log(0.7), math.log(0.4)]
    grads = []
    for loss in (TruncatedPolicyGradient(truncation=1.0), POLICY_GRADIENT.reference):
        inputs = _inputs(logprobs, logprobs, [1.5, -0.5, 2.0], [True, True, True])
        loss(inputs).loss.backward()
        grads.append(inputs.logprobs.grad[0].tolist())
    assert grads[0] == pytest.approx(grads[1])


def test_a_micro_batch_of_padding_has_loss_zero():
    out = SAO_TRUNCATED_PG.reference(_inputs([0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [False, False]))
    assert out.loss.item() == 0.0 and out.metrics["truncated_fraction"] == 0.0


def test_the_family_is_registered_and_the_torch_backend_builds_its_inputs():
    assert is_registered(SAO_TRUNCATED_PG) and loss_family("sao_truncated_pg") is SAO_TRUNCATED_PG
    assert register_loss_family(SAO_TRUNCATED_PG) is SAO_TRUNCATED_PG      # idempotent
    assert SAO_TRUNCATED_PG.inputs is PolicyGradientInputs
    assert inputs_builder(SAO_TRUNCATED_PG) is policy_gradient_inputs
    with pytest.raises(ConfigurationError):
        TruncatedPolicyGradient(truncation=0.0)


# --------------------------------------------------------------------------- the parts together


def test_the_sao_parts_learn_a_bandit_through_the_torch_backend():
    """Prompt token 1 is answered by token 3, prompt 2 by token 5 (chance: 1 in 8). Each step
    samples 16 one-token completions per prompt from the policy of the step before (stale by
    one version: the truncated weights correct it), scores them by exact match, and trains."""
    targets = {1: 3, 2: 5}
    bandit = Recipe(
        name="sao-bandit", processor=processor, objective=StreamingAdvantage(),
        schedule=Schedule(units_per_step=32, optimizer_batch_size=32, micro_batch_size=32,
                          seed=3, max_staleness=1),
        backend=Backend(name="torch", loss_families=(SAO_TRUNCATED_PG,),
                        model=lambda: TinyCausalLM(vocab_size=8, dim=16),
                        optimizer=lambda params: torch.optim.Adam(params, lr=0.03),
                        losses={SAO_TRUNCATED_PG: TruncatedPolicyGradient(truncation=1.0)}))
    backend, state = TorchBackend(bandit), bandit.objective.initial_state()
    prompts = torch.tensor([[1], [2]])
    generator = torch.Generator().manual_seed(0)

    def policy() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(backend.model(prompts, torch.ones_like(prompts, dtype=bool))
                                     [:, -1].float(), dim=-1)

    behaviour, rewards = policy(), []
    for step in range(1, 21):
        samples = []
        for row, prompt in enumerate((1, 2)):
            tokens = torch.multinomial(behaviour[row].exp(), 16, replacement=True,
                                       generator=generator)
            samples += [Sample(generation_id=f"s{step}-{prompt}-{i}", prompt_id=f"p{prompt}",
                               policy_version=step - 1,
                               prompt_token_ids=np.array([prompt], np.int32),
                               completion_token_ids=np.array([token], np.int32),
                               completion_logprobs=np.array([behaviour[row, token]], np.float32),
                               reward=float(token == targets[prompt]))
                        for i, token in enumerate(tokens.tolist())]
        behaviour = policy()    # the next step samples from the weights before this one
        units = units_of(*samples)
        result = bandit.objective.compute(units, state)
        metrics = backend.train_step(units, result, step)
        assert np.isfinite(metrics["loss"]) and 0.0 <= metrics["truncated_fraction"] <= 1.0
        state, rewards = result.proposed_state, rewards + [result.metrics["reward_mean"]]
    assert rewards[0] < 0.4, rewards                        # chance is 1 in 8
    final = policy().exp()
    assert final[0, 3] > 0.9 and final[1, 5] > 0.9, (final, rewards[::5])
    assert state.keys == ("p1", "p2") and state.means[0] > 0.7


# --------------------------------------------------------------------------- the recipe


def test_the_recipe_loads_with_its_bindings():
    recipe = load_recipe("reef_stream.demo.recipes:sao", complete=True)
    assert recipe.name == "sao" and recipe.processor == processor
    assert recipe.objective.loss_family is SAO_TRUNCATED_PG
    assert recipe.backend.supports(SAO_TRUNCATED_PG) and recipe.evaluator.evaluates
    assert recipe.reward is not None and recipe.reward.source == REWARD_SOURCE
    assert processor.feedback.wants(recipe.reward.source)
    assert isinstance(recipe.backend.losses[SAO_TRUNCATED_PG], TruncatedPolicyGradient)


def test_reef_check_prints_the_sao_contract():
    from reef_stream.cli.main import main

    result = CliRunner().invoke(main, ["check", "--recipe", "reef_stream.demo.recipes:sao"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("recipe sao (reef_stream.demo.recipes:sao): the bindings check out")
    for expected in [
        "unit:      reef.events.RolloutUnit (RolloutUnit",
        "to topic <ns>.units.sao",
        "grouping:  ungrouped: each scored generation is a unit of its own",
        "feedback:  requires feedback from exact_match; reward = 1 x exact_match; waits 60000 ms",
        "objective: sao: consumes RolloutUnit, loss family sao_truncated_pg (current and "
        "behaviour logprobs",
        "backend:   torch: supports sao_truncated_pg",
        "schedule:  256 units per step",
        "max staleness 16 policy versions",
        "evaluates candidates before promoting them",
        "reward:    feedback source 'exact_match' (reef reward)",
        "sampling:  ungrouped: one completion per prompt",
        "model:     reef_stream.demo.task.policy_model; optimizer AdamW(lr=0.0004",
    ]:
        assert expected in out, expected


def test_the_method_package_is_a_factory_that_load_recipe_refuses_unbound():
    with pytest.raises(ConfigurationError, match="recipe factory .* not a recipe bound to a task"):
        load_recipe("methods.sao")


def test_the_readme_snippet_runs():
    from pathlib import Path

    import methods.sao

    readme = (Path(methods.sao.__file__).parent / "README.md").read_text()
    (snippet,) = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    exec(compile(snippet, "methods/sao/README.md", "exec"), {})
