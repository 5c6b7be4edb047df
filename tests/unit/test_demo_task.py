"""The demo's toy task without Kafka: vocabulary, prompts and answers, the untrained policy at
chance, the exact-match reward, the held-out-accuracy evaluator's decisions, and the learning
check: group-baseline policy gradient through reef-stream's own ``TorchBackend`` takes held-out
greedy accuracy from chance to at least 0.9.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from reef_stream.api.evaluator import CandidateEvaluator, Incumbent, Measurement
from reef_stream.api.losses import POLICY_GRADIENT, LossFamily
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages
from reef_stream.api.recipe import Backend, RewardFunction
from reef_stream.api.schedule import Schedule
from reef_stream.core.events import Checkpoint, Decision, FinishReason, RolloutUnit, Sample, now_ms
from reef_stream.demo.task import (
    ALL_PROBLEMS, BOS, DEMO_SEED, DIGIT_TOKENS, EOS, PROMPT_LEN, VOCAB_SIZE, HeldOutAccuracy,
    Problem, ProblemStream, accuracy, decode, encode, exact_match, greedy, held_out_problems,
    initial_policy, make_generation, parse_prompt, policy_model, prompt_tensor, sample,
)
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointError, CheckpointStore
from reef_stream.engine.training import TorchBackend, collate, completion_logprobs
from reef_stream.intake.validation import validate

# --------------------------------------------------------------------------- vocabulary, prompts


def test_vocabulary_round_trips_and_prompts_parse_back():
    assert VOCAB_SIZE == 15 and decode(DIGIT_TOKENS) == "0123456789"
    assert decode(encode("7+5=")) == "7+5="
    problem = Problem(7, 5)
    assert problem.text == problem.prompt_id == "7+5=" and problem.answer == "2"
    assert problem.token_ids.dtype == np.int32 and problem.token_ids.shape == (PROMPT_LEN,)
    assert problem.token_ids[0] == BOS and decode(problem.token_ids[1:]) == "7+5="
    assert decode([problem.answer_token]) == "2"
    assert parse_prompt(problem.token_ids) == problem
    for bad in ([BOS, *encode("7+5")], [*encode("7+5=")], [BOS, *encode("7=5+")],
                [BOS, *encode("75+5=")][:PROMPT_LEN], [BOS, EOS, *encode("+5=")]):
        with pytest.raises(ValueError, match="not a demo prompt"):
            parse_prompt(bad)
    with pytest.raises(ValueError, match="not in the demo vocabulary"):
        encode("7-5=")
    with pytest.raises(ValueError, match="digits 0-9"):
        Problem(10, 3)


def test_answers_are_the_last_digit_and_balanced_over_the_held_out_set():
    assert {(p.a, p.b) for p in ALL_PROBLEMS} == {(a, b) for a in range(10) for b in range(10)}
    assert all(int(p.answer) == (p.a + p.b) % 10 for p in ALL_PROBLEMS)
    answers = np.bincount([int(p.answer) for p in held_out_problems()], minlength=10)
    assert answers.tolist() == [len(held_out_problems()) // 10] * 10  # any constant guess: 0.1


def test_training_prompts_are_a_seeded_stream():
    first, again, other = ProblemStream(3), ProblemStream(3), ProblemStream(4)
    drawn = first.take(500)
    assert drawn == again.take(500) and drawn != other.take(500)
    assert len(set(drawn)) > 90  # covers (nearly) every problem
    assert prompt_tensor(drawn[:4]).dtype == torch.int64
    assert prompt_tensor(drawn[:4]).shape == (4, PROMPT_LEN)


# --------------------------------------------------------------------------- the policy


def test_the_policy_follows_the_model_contract_and_ignores_what_follows():
    model = initial_policy(DEMO_SEED).eval()
    ids = torch.randint(0, VOCAB_SIZE, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        logits, values = model(ids, mask), model.value(ids, mask)
        changed = ids.clone()
        changed[:, 4:] = 0
        causal = model(changed, mask)
    assert logits.shape == (3, 7, VOCAB_SIZE) and logits.dtype == torch.float32
    assert values.shape == (3,)
    assert torch.allclose(logits[:, :4], causal[:, :4], atol=1e-6)  # causal: later tokens unseen


def test_initial_policy_is_what_the_trainer_starts_from_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    served = initial_policy(DEMO_SEED).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    backend = TorchBackend(_learning_recipe(seed=DEMO_SEED))
    trained = backend.accelerator.unwrap_model(backend.model).state_dict()
    assert served.keys() == trained.keys()
    assert all(torch.equal(served[k], trained[k].cpu()) for k in served)
    assert not torch.equal(initial_policy(DEMO_SEED + 1).state_dict()["embed.weight"],
                           served["embed.weight"])


def test_an_untrained_policy_scores_at_most_chance():
    assert accuracy(initial_policy(DEMO_SEED)) <= 0.1
    # At chance on average over seeds, too (each of 100 prompts is a 1-in-10 guess or worse).
    assert np.mean([accuracy(initial_policy(seed)) for seed in range(10)]) <= 0.1


def test_sampling_is_seeded_and_its_logprobs_are_the_trainers():
    model = initial_policy(DEMO_SEED)
    prompts = prompt_tensor(ALL_PROBLEMS[:16])
    one = sample(model, prompts, temperature=1.0, generator=torch.Generator().manual_seed(5))
    two = sample(model, prompts, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert one.token_ids.shape == one.logprobs.shape == (16, 1)
    assert one.token_ids.dtype == np.int32 and one.logprobs.dtype == np.float32
    assert np.array_equal(one.token_ids, two.token_ids)
    assert np.array_equal(one.logprobs, two.logprobs)
    # The behaviour logprobs are what the trainer computes for the same tokens (temperature 1).
    batch = collate([Sample(generation_id=str(i), prompt_id=p.prompt_id, policy_version=0,
                            prompt_token_ids=p.token_ids, completion_token_ids=one.token_ids[i],
                            completion_logprobs=one.logprobs[i], reward=0.0)
                     for i, p in enumerate(ALL_PROBLEMS[:16])])
    with torch.no_grad():
        recomputed = completion_logprobs(model(batch.input_ids, batch.attention_mask), batch)
    assert torch.allclose(recomputed, torch.from_numpy(one.logprobs), atol=1e-5)
    assert greedy(model, prompts).shape == (16, 1)
    with pytest.raises(Exception, match="temperature > 0"):
        sample(model, prompts, temperature=0.0, generator=torch.Generator())


def test_make_generation_builds_a_valid_grouped_or_ungrouped_event():
    problem = Problem(3, 9)
    ungrouped = make_generation(model="demo", policy_version=4, replica_id="r0", problem=problem,
                                token_ids=np.array([DIGIT_TOKENS[2]], dtype=np.int32),
                                logprobs=np.array([-0.5], dtype=np.float32), temperature=1.0)
    validate(ungrouped)
    assert (ungrouped.group_id, ungrouped.group_size, ungrouped.policy_version) == (None, 1, 4)
    assert ungrouped.prompt_id == "3+9=" and ungrouped.finish_reason is FinishReason.LENGTH
    assert ungrouped.sampling.max_tokens == 1 and ungrouped.sampling.temperature == 1.0
    assert ungrouped.request_id == ungrouped.generation_id
    grouped = make_generation(model="demo", policy_version=0, replica_id="r0", problem=problem,
                              token_ids=np.array([[DIGIT_TOKENS[1]]]), logprobs=np.array([[-2.0]]),
                              temperature=1.0, group_id="g1", group_size=8, generation_id="x")
    validate(grouped)
    assert (grouped.group_id, grouped.group_size, grouped.generation_id) == ("g1", 8, "x")
    assert grouped.completion_token_ids.shape == (1,)
    assert grouped.completion_token_ids.dtype == np.int32
    assert make_generation(model="demo", policy_version=0, replica_id="r0", problem=problem,
                           token_ids=np.array([3]), logprobs=np.array([-1.0]),
                           temperature=1.0).generation_id != ungrouped.generation_id


# --------------------------------------------------------------------------- reward


def _answered(problem: Problem, completion: Sequence[int]):
    return make_generation(model="demo", policy_version=0, replica_id="r0", problem=problem,
                           token_ids=np.array(completion, dtype=np.int32),
                           logprobs=np.full(len(completion), -1.0, dtype=np.float32),
                           temperature=1.0)


def test_exact_match_rewards_exactly_the_answer():
    assert isinstance(exact_match, RewardFunction) and exact_match.source == "exact_match"
    problem = Problem(7, 5)
    right = exact_match(_answered(problem, [DIGIT_TOKENS[2]]))
    assert right.reward == 1.0 and dict(right.components) == {"exact_match": 1.0}
    assert exact_match(_answered(problem, [DIGIT_TOKENS[2], EOS])).reward == 1.0
    for wrong in ([DIGIT_TOKENS[1]], [DIGIT_TOKENS[1], DIGIT_TOKENS[2]], [EOS], [0], [],
                  encode("12").tolist(), [DIGIT_TOKENS[2], DIGIT_TOKENS[2]]):
        assert exact_match(_answered(problem, wrong)).reward == 0.0, decode(wrong)
    for p in ALL_PROBLEMS:
        assert exact_match(_answered(p, [p.answer_token])).reward == 1.0


def test_exact_match_refuses_a_generation_of_another_task():
    alien = make_generation(model="demo", policy_version=0, replica_id="r0", problem=Problem(1, 1),
                            token_ids=np.array([3]), logprobs=np.array([-1.0]), temperature=1.0)
    alien = dataclasses.replace(alien, prompt_token_ids=np.array([BOS, 3, 4], dtype=np.int32))
    with pytest.raises(ValueError, match="not a demo prompt"):
        exact_match(alien)


# --------------------------------------------------------------------------- evaluator


def _incumbent(version: int, value: float | None) -> Incumbent:
    return Incumbent(policy_version=version,
                     measurement=Measurement({} if value is None else {"accuracy": value}))


def test_held_out_accuracy_selects_unless_it_regresses_beyond_the_tolerance():
    evaluator = HeldOutAccuracy()
    assert isinstance(evaluator, CandidateEvaluator)
    assert evaluator.evaluates is True and evaluator.warning is None
    assert evaluator.tolerance == 0.02

    first = evaluator.select(Measurement({"accuracy": 0.12}), None)
    assert first.decision is Decision.PROMOTED
    assert "0.120" in first.reason and "no version is promoted yet" in first.reason

    better = evaluator.select(Measurement({"accuracy": 0.7}), _incumbent(3, 0.5))
    assert better.decision is Decision.PROMOTED and "0.700" in better.reason
    assert "0.500" in better.reason and "version 3" in better.reason

    within = evaluator.select(Measurement({"accuracy": 0.49}), _incumbent(3, 0.5))
    assert within.decision is Decision.PROMOTED
    at_the_edge = evaluator.select(Measurement({"accuracy": 0.48}), _incumbent(3, 0.5))
    assert at_the_edge.decision is Decision.PROMOTED

    regressed = evaluator.select(Measurement({"accuracy": 0.47}), _incumbent(3, 0.5))
    assert regressed.decision is Decision.REJECTED
    assert "0.470" in regressed.reason and "0.500" in regressed.reason
    assert "0.030" in regressed.reason and "tolerance 0.020" in regressed.reason

    assert HeldOutAccuracy(tolerance=0.05).select(
        Measurement({"accuracy": 0.47}), _incumbent(3, 0.5)).decision is Decision.PROMOTED
    assert HeldOutAccuracy(tolerance=0.0).select(
        Measurement({"accuracy": 0.49}), _incumbent(3, 0.5)).decision is Decision.REJECTED

    unmeasured = evaluator.select(Measurement({"accuracy": 0.2}), _incumbent(2, None))
    assert unmeasured.decision is Decision.PROMOTED and "no measured accuracy" in unmeasured.reason
    with pytest.raises(Exception, match="within"):
        HeldOutAccuracy(tolerance=-0.1)


def _stored(tmp_path, weights, step: int = 1) -> Checkpoint:
    stored = CheckpointStore(tmp_path / "store").write(CheckpointContents(
        step=step, policy_version=step, model="demo", recipe="demo", trainer_group="t",
        weights=weights, optimizer={}, rng={}, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64), created_at=now_ms()))
    return Checkpoint(checkpoint_id=stored.checkpoint_id, recipe="demo", trainer_group="t",
                      step=step, model="demo", policy_version=step, uri=stored.uri,
                      sha256=stored.sha256, offsets=(), trained_unit_count=0, created_at=now_ms())


def test_held_out_accuracy_measures_the_candidates_verified_weights(tmp_path):
    policy = initial_policy(DEMO_SEED)
    candidate = _stored(tmp_path, policy.state_dict())
    measured = HeldOutAccuracy().measure(candidate)
    assert dict(measured.values) == {"accuracy": accuracy(policy)}
    assert HeldOutAccuracy().measure(candidate) == measured  # the same candidate, the same
    with pytest.raises(CheckpointError, match="manifest sha256"):
        HeldOutAccuracy().measure(dataclasses.replace(candidate, sha256="0" * 64))


# --------------------------------------------------------------------------- the learning check


@dataclass(frozen=True, slots=True)
class Steps:
    """The check's algorithm state: steps taken."""

    count: int = 0


@dataclass(frozen=True, slots=True)
class GroupNormalised:
    """Advantage = (reward - its group's mean) / (its group's std + 1e-4): GRPO's."""

    name: str = "group-normalised"
    unit_type: type = RolloutUnit
    loss_family: LossFamily = POLICY_GRADIENT

    def initial_state(self) -> Steps:
        return Steps()

    def compute(self, units: Sequence[RolloutUnit], state: Steps) -> ObjectiveResult:
        advantages, rewards = [], []
        for unit in units:
            r = np.array([m.reward for m in unit.members], dtype=np.float32)
            advantages.append((r - r.mean()) / (r.std() + 1e-4))
            rewards += r.tolist()
        return ObjectiveResult(advantages=PerSampleAdvantages(np.concatenate(advantages)),
                               metrics={"reward_mean": float(np.mean(rewards))},
                               proposed_state=Steps(state.count + 1),
                               loss_family=self.loss_family)


@dataclass(frozen=True, slots=True)
class LearningRecipe:
    """What ``TorchBackend`` reads of a recipe: no processor, no Kafka."""

    name: str
    objective: Any
    schedule: Schedule
    backend: Backend


#: The learning check's geometry: PROMPTS groups of GROUP_SIZE samples per step, one optimizer
#: update per step (the whole step in one micro batch), AdamW at LEARNING_RATE.
PROMPTS, GROUP_SIZE, LEARNING_RATE = 32, 16, 1e-3


def _learning_recipe(seed: int) -> LearningRecipe:
    return LearningRecipe(
        name="demo-check", objective=GroupNormalised(),
        schedule=Schedule(units_per_step=PROMPTS, optimizer_batch_size=PROMPTS,
                          micro_batch_size=PROMPTS, epochs=1, seed=seed, max_staleness=0),
        backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,), model=policy_model,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=LEARNING_RATE)))


def _rollout(model, problems: list[Problem], step: int, generator: torch.Generator
             ) -> list[RolloutUnit]:
    """One group of GROUP_SIZE samples per problem, scored by the exact-match reward."""
    completions = sample(model, prompt_tensor([p for p in problems for _ in range(GROUP_SIZE)]),
                         temperature=1.0, generator=generator)
    units = []
    for i, problem in enumerate(problems):
        members = []
        for k in range(i * GROUP_SIZE, (i + 1) * GROUP_SIZE):
            generation = make_generation(
                model="demo", policy_version=step, replica_id="check", problem=problem,
                token_ids=completions.token_ids[k], logprobs=completions.logprobs[k],
                temperature=1.0, group_id=f"{step}-{i}", group_size=GROUP_SIZE,
                generation_id=f"{step}-{k}", created_at=0)
            members.append(Sample(
                generation_id=generation.generation_id, prompt_id=generation.prompt_id,
                policy_version=step, prompt_token_ids=generation.prompt_token_ids,
                completion_token_ids=generation.completion_token_ids,
                completion_logprobs=generation.completion_logprobs,
                reward=exact_match(generation).reward))
        units.append(RolloutUnit(unit_id=f"{step}-{i}", recipe="demo-check",
                                 group_key=problem.prompt_id, members=tuple(members),
                                 created_at=0))
    return units


def test_group_baseline_policy_gradient_learns_the_task_from_reward_alone():
    """From chance to >= 0.9 held-out greedy accuracy, on one thread, through TorchBackend.

    Seeded end to end (weights, prompts, samples), so the curve is the same on every run on
    the same torch build; ~200 steps (~100k samples) for DEMO_SEED. Prints the figures.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recipe = _learning_recipe(seed=DEMO_SEED)
        backend = TorchBackend(recipe)
        model = backend.accelerator.unwrap_model(backend.model)
        problems = ProblemStream(seed=DEMO_SEED + 1)
        generator = torch.Generator().manual_seed(DEMO_SEED + 2)
        state = recipe.objective.initial_state()
        curve = [(0, accuracy(model))]
        assert curve[0][1] <= 0.1
        started = time.monotonic()
        for step in range(1, 401):
            units = _rollout(model, problems.take(PROMPTS), step - 1, generator)
            result = recipe.objective.compute(units, state)
            backend.train_step(units, result, step)
            state = result.proposed_state
            if step % 25 == 0:
                curve.append((step, accuracy(model)))
                if curve[-1][1] >= 0.9:
                    break
        seconds = time.monotonic() - started
    finally:
        torch.set_num_threads(threads)
    print(f"\nlearning check: held-out accuracy {curve[0][1]:.2f} -> {curve[-1][1]:.2f} in "
          f"{step} steps ({step * PROMPTS * GROUP_SIZE} samples), {seconds:.1f} s on one thread; "
          f"curve {curve}")
    assert curve[-1][1] >= 0.9, curve
