"""Micro-batch size and data-parallel rank count are memory and speed choices only: every
built-in loss, normalised by the optimizer batch's totals (``BatchTotals``), gives the same loss
and gradient for the whole batch in one micro batch, in micro batches of 1 and 2, and split
over 2 ranks (each rank's gradient summed, as DDP's average times the rank count)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from methods.sao.loss import SAO_TRUNCATED_PG, TruncatedPolicyGradient
from reef_stream.api.losses import (
    POLICY_GRADIENT, VALUE_REGRESSION, ClippedPolicyGradient, ClippedWeightPolicyGradient,
    MaskedSquaredError, PolicyGradientInputs, ValueRegressionInputs,
)
from reef_stream.api.objective import ObjectiveResult, PerSampleAdvantages
from reef_stream.api.recipe import Backend
from reef_stream.api.schedule import Schedule
from reef_stream.api.variants import (
    BatchTotals, BehaviourWeightLevel, BehaviourWeightMode, ConstantNormaliser, DecoupledProximal,
    EntropyBonus, KLEstimator, KLPenalty, RatioLevel, SequenceMeanTokenMean, SequenceMeanTokenSum,
)
from reef_stream.engine.training import TorchBackend, select_rows
from tests.recipes.trainable import recipe
from tests.unit_log import rollout_unit

#: Every built-in policy-gradient loss, with each of its options on at least once.
POLICY_LOSSES = {
    "ppo clip (default)": ClippedPolicyGradient(),
    "clip-higher + dual clip": ClippedPolicyGradient(epsilon=0.2, epsilon_high=0.28,
                                                     dual_clip=3.0),
    "gspo sequence ratio": ClippedPolicyGradient(ratio_level=RatioLevel.SEQUENCE,
                                                 aggregation=SequenceMeanTokenMean()),
    "seq-mean-token-sum": ClippedPolicyGradient(aggregation=SequenceMeanTokenSum()),
    "constant normaliser": ClippedPolicyGradient(aggregation=ConstantNormaliser(16)),
    "kl k3 + entropy": ClippedPolicyGradient(kl=KLPenalty(0.1, KLEstimator.K3),
                                             entropy=EntropyBonus(0.01)),
    "decoupled proximal": ClippedPolicyGradient(proximal=DecoupledProximal(weight_cap=1.5)),
    "rollout correction, sequence truncated": ClippedPolicyGradient(proximal=DecoupledProximal(
        4.0, BehaviourWeightLevel.SEQUENCE, weight_floor=0.25)),
    "rollout correction, token mask": ClippedPolicyGradient(proximal=DecoupledProximal(
        2.0, weight_mode=BehaviourWeightMode.MASK, weight_floor=0.5)),
    "rollout correction, geometric mask + gspo": ClippedPolicyGradient(
        ratio_level=RatioLevel.SEQUENCE, aggregation=SequenceMeanTokenMean(),
        proximal=DecoupledProximal(1.5, BehaviourWeightLevel.SEQUENCE_GEOMETRIC,
                                   BehaviourWeightMode.MASK)),
    "cispo": ClippedWeightPolicyGradient(epsilon_high=0.3, epsilon_low=0.5,
                                         kl=KLPenalty(0.05, KLEstimator.K2)),
    "sao truncated": TruncatedPolicyGradient(truncation=1.0),
}

LENGTHS = [[3, 7, 1, 9], [5, 2], [8, 8, 4], [1, 6, 2]]   # completion tokens of 4 groups


def _policy_batch(seed: int = 0):
    """12 samples of unequal lengths (padding to 9), a sample per row, and its tensors."""
    rng = np.random.default_rng(seed)
    rows = [n for group in LENGTHS for n in group]
    b, t = len(rows), max(rows)
    mask = torch.tensor([[k < n for k in range(t)] for n in rows])
    tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return dict(
        logprobs=tensor(-rng.random((b, t)) * 3) * mask,
        behaviour_logprobs=tensor(-rng.random((b, t)) * 3) * mask,
        advantages=tensor(np.repeat(rng.normal(size=(b, 1)), t, axis=1)) * mask,
        mask=mask,
        reference_logprobs=tensor(-rng.random((b, t)) * 3) * mask,
        proximal_logprobs=tensor(-rng.random((b, t)) * 3) * mask,
        entropy=tensor(rng.random((b, t)) * 2) * mask)


def _loss_and_gradient(loss, fields, splits, totals):
    """Sum of the losses and of the gradients (w.r.t. logprobs and entropy) over the row
    ``splits``, each given ``totals``."""
    leaves = {name: fields[name].clone().requires_grad_(True) for name in ("logprobs", "entropy")}
    total = 0.0
    for rows in splits:
        part = {k: (leaves[k] if k in leaves else v)[rows] for k, v in fields.items()}
        out = loss(PolicyGradientInputs(**part, totals=totals))
        out.loss.backward()
        total += float(out.loss.detach())
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
             for leaf in leaves.values()]
    return total, torch.cat(grads, dim=1)


def _splits(size: int, n: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_policy_loss_is_the_same_in_micro_batches_and_over_two_ranks(name):
    loss, fields = POLICY_LOSSES[name], _policy_batch()
    n = fields["mask"].shape[0]
    whole, gradient = _loss_and_gradient(loss, fields, [list(range(n))], None)
    assert math.isfinite(whole) and gradient.abs().sum() > 0
    totals = BatchTotals.of(fields["mask"])
    for size in (1, 2, 5):
        split, split_gradient = _loss_and_gradient(loss, fields, _splits(size, n), totals)
        assert split == pytest.approx(whole, rel=1e-12), size
        torch.testing.assert_close(split_gradient, gradient, rtol=1e-12, atol=1e-14)
    # Two ranks, each its half in micro batches of 2 with the totals agreed over both ranks:
    # DDP averages the ranks' gradients of (loss x ranks), i.e. sums their gradients.
    halves = [list(range(0, n // 2)), list(range(n // 2, n))]
    ranks = [_loss_and_gradient(loss, fields, [r for r in _splits(2, n) if r[0] in half], totals)
             for half in halves]
    assert sum(r[0] for r in ranks) == pytest.approx(whole, rel=1e-12)
    torch.testing.assert_close(ranks[0][1] + ranks[1][1], gradient, rtol=1e-12, atol=1e-14)


def test_without_the_totals_a_micro_batch_of_one_is_a_different_loss():
    """What the totals fix (issue 18): each micro batch's own token mean, weighted by its share
    of samples, is not the batch's token mean when lengths differ."""
    loss, fields = ClippedPolicyGradient(), _policy_batch()
    n = fields["mask"].shape[0]
    whole, _ = _loss_and_gradient(loss, fields, [list(range(n))], None)
    per_sample = sum(float(loss(PolicyGradientInputs(**{k: v[[i]] for k, v in fields.items()})
                                ).loss) / n for i in range(n))
    assert abs(per_sample - whole) > 1e-3


def test_squared_error_is_the_same_in_micro_batches_and_over_two_ranks():
    predictions = torch.linspace(-1, 2, 10, dtype=torch.float64)
    targets = torch.arange(10, dtype=torch.float64) / 5
    mask = torch.tensor([True] * 7 + [False, True, True])
    totals = BatchTotals.of(mask)

    def run(splits, totals):
        leaf = predictions.clone().requires_grad_(True)
        value = sum(float(out.loss.backward() or out.loss.detach()) for out in (
            MaskedSquaredError()(ValueRegressionInputs(leaf[r], targets[r], mask[r], totals))
            for r in splits))
        return value, leaf.grad

    whole, gradient = run([list(range(10))], None)
    for splits in (_splits(1, 10), _splits(3, 10), [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]):
        value, split_gradient = run(splits, totals)
        assert value == pytest.approx(whole, rel=1e-12)
        torch.testing.assert_close(split_gradient, gradient, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the backend


def _units():
    """4 groups whose samples have unequal completion lengths (token counts differ between
    micro batches, as in the measurement of issue 18)."""
    units = []
    for i, lengths in enumerate(LENGTHS):
        unit = rollout_unit(i, group_size=len(lengths), completion_len=10)
        members = tuple(dataclasses.replace(
            m, completion_token_ids=m.completion_token_ids[:n],
            completion_logprobs=m.completion_logprobs[:n]) for m, n in zip(unit.members, lengths))
        units.append(dataclasses.replace(unit, members=members))
    return units


def _backend(loss, family, micro_batch_size, objective=recipe.objective, units=4):
    schedule = Schedule(units_per_step=units, optimizer_batch_size=units,
                        micro_batch_size=micro_batch_size, epochs=1, seed=3, max_staleness=3)
    configured = dataclasses.replace(
        recipe, schedule=schedule, objective=dataclasses.replace(objective, loss_family=family),
        backend=Backend(name="torch", loss_families=(family,), model=recipe.backend.model,
                        losses={family: loss}))
    return TorchBackend(configured), configured


def _gradients(backend):
    return torch.cat([p.grad.flatten() for p in backend.model.parameters() if p.grad is not None])


BACKEND_LOSSES = {
    "ppo clip (default)": (POLICY_GRADIENT, ClippedPolicyGradient()),
    "gspo, kl, entropy, proximal": (POLICY_GRADIENT, ClippedPolicyGradient(
        ratio_level=RatioLevel.SEQUENCE, aggregation=SequenceMeanTokenMean(),
        kl=KLPenalty(0.1), entropy=EntropyBonus(0.01), proximal=DecoupledProximal())),
    "cispo, constant normaliser": (POLICY_GRADIENT, ClippedWeightPolicyGradient(
        aggregation=ConstantNormaliser(12))),
    "sao truncated": (SAO_TRUNCATED_PG, TruncatedPolicyGradient()),
    "squared error": (VALUE_REGRESSION, MaskedSquaredError()),
}


@pytest.mark.parametrize("name", BACKEND_LOSSES)
def test_a_backend_step_is_the_same_for_micro_batches_of_one_two_and_the_whole_batch(name):
    family, loss = BACKEND_LOSSES[name]
    units = _units()
    runs = []
    for micro in (4, 2, 1):
        backend, configured = _backend(loss, family, micro)
        result = configured.objective.compute(units, configured.objective.initial_state())
        if family is VALUE_REGRESSION:   # targets: the rewards
            result = dataclasses.replace(result, advantages=PerSampleAdvantages(
                np.array([m.reward for u in units for m in u.members], dtype=np.float32)))
        metrics = backend.train_step(units, result, 1)
        runs.append((metrics["loss"], _gradients(backend)))
    (loss_whole, gradient_whole), *others = runs
    assert math.isfinite(loss_whole) and gradient_whole.abs().sum() > 0
    for value, gradient in others:
        assert value == pytest.approx(loss_whole, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(gradient, gradient_whole, rtol=1e-4, atol=1e-6)


def test_dropped_samples_count_in_neither_the_loss_nor_its_normaliser():
    """``PerSampleAdvantages.keep`` (dynamic sampling): a step over 4 groups with the first
    dropped has the loss and gradient of a step over the other 3 alone, in any micro batch."""
    units = _units()
    objective = recipe.objective
    result = objective.compute(units, objective.initial_state())
    sizes = [len(u.members) for u in units]
    keep = np.repeat([False, True, True, True], sizes)
    dropped = dataclasses.replace(result, advantages=PerSampleAdvantages(
        result.advantages.values, keep))
    backend, _ = _backend(ClippedPolicyGradient(), POLICY_GRADIENT, 1)
    with_drop = backend.train_step(units, dropped, 1)["loss"]
    gradient = _gradients(backend)
    backend, _ = _backend(ClippedPolicyGradient(), POLICY_GRADIENT, 3, units=3)
    rest = ObjectiveResult(advantages=PerSampleAdvantages(result.advantages.values[sizes[0]:]),
                           metrics={}, proposed_state=result.proposed_state,
                           loss_family=POLICY_GRADIENT)
    assert backend.train_step(units[1:], rest, 1)["loss"] == pytest.approx(with_drop, rel=1e-5)
    torch.testing.assert_close(_gradients(backend), gradient, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- two real ranks


def _data_parallel_rank(out: Path) -> None:
    """One of 2 torchrun ranks (gloo): its half of the units (2 groups, micro batches of 1), the
    objective over all 4 as the trainer computes it, one step; writes its gradients (after
    DDP's all-reduce) and the step's loss."""
    from safetensors.torch import save_file

    rank = int(os.environ["RANK"])
    units = _units()
    loss = ClippedPolicyGradient(aggregation=SequenceMeanTokenMean())
    schedule = Schedule(units_per_step=4, optimizer_batch_size=4, micro_batch_size=1, epochs=1,
                        seed=3, max_staleness=3)
    configured = dataclasses.replace(recipe, schedule=schedule, backend=Backend(
        name="torch", loss_families=(POLICY_GRADIENT,), model=recipe.backend.model,
        losses={POLICY_GRADIENT: loss}, data_parallel_size=2))
    backend = TorchBackend(configured, rank=rank, ranks=2)
    result = configured.objective.compute(units, configured.objective.initial_state())
    sizes = [len(u.members) for u in units]
    first = sum(sizes[:2 * rank])
    rows = np.arange(first, first + sum(sizes[2 * rank:2 * rank + 2]))
    local = dataclasses.replace(result, advantages=select_rows(result.advantages, rows))
    metrics = backend.train_step(units[2 * rank:2 * rank + 2], local, 1)
    save_file({"gradient": _gradients(backend).contiguous(),
               "loss": torch.tensor([metrics["loss"]], dtype=torch.float64)},
              str(out / f"rank{rank}.safetensors"))


def test_two_data_parallel_ranks_agree_on_the_totals_and_train_the_whole_batch(tmp_path):
    """Two torchrun ranks (gloo on the CPU), each half the step in micro batches of 1, give the
    loss and gradient of one process training the whole batch at once: the ranks all-reduce the
    batch's totals before the backward pass, and DDP's average of loss x ranks is the sum."""
    from safetensors.torch import load_file

    root = Path(__file__).parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "tests.unit.test_loss_invariance",
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=240, cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    torch.testing.assert_close(ranks[0]["gradient"], ranks[1]["gradient"])   # DDP: the same
    backend, configured = _backend(ClippedPolicyGradient(aggregation=SequenceMeanTokenMean()),
                                   POLICY_GRADIENT, 4)
    units = _units()
    whole = backend.train_step(units, configured.objective.compute(
        units, configured.objective.initial_state()), 1)
    assert float(ranks[0]["loss"]) == pytest.approx(whole["loss"], rel=1e-5)
    assert float(ranks[1]["loss"]) == pytest.approx(whole["loss"], rel=1e-5)
    torch.testing.assert_close(ranks[0]["gradient"], _gradients(backend), rtol=1e-4, atol=1e-6)


def _free_port() -> int:
    from reef_stream.core.processes import free_ports

    return free_ports(1)[0]


if __name__ == "__main__":   # a rank of the test above, under torchrun
    _data_parallel_rank(Path(sys.argv[1]))
