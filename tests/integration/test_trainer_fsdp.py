"""The trainer sharded with FSDP: two ranks (torchrun, gloo on the CPU) train a tiny Llama-style
Hugging Face model with ``HuggingFace(path, sharding="fsdp")`` (torch's ``fully_shard``) against
the real broker, each on its own partitions.

While they train, each rank holds half of the optimizer state (each logs its share at every
checkpoint). Each checkpoint is full: the same names, shapes and optimizer keys a single
process writes, restored by a one-process backend to the same tensors. At every checkpoint
each rank's shard is the piece of the checkpoint's weights it should hold (each rank logs the
sha256 of its shard; the test hashes the same piece of the checkpoint's weights itself). A run
SIGKILLed before its third checkpoint resumes from the second on restart and ends bitwise where
an uninterrupted run ends, optimizer state included."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time

import psutil
import torch

from reef_stream.core.processes import free_ports
from reef_stream.engine.checkpoints import CheckpointStore, load, safetensors_sha256
from reef_stream.engine.hf import HuggingFace
from reef_stream.engine.training import TorchBackend
from tests.integration.test_trainer_data_parallel import STEPS, _torchrun, spread_units
from tests.recipes.trainable import recipe as single

RECIPE = "tests.recipes.trainable_hf_fsdp"
SHARE = re.compile(r"rank (\d) of 2 holds (\d+) of the optimizer state's (\d+) values")
SHARD = re.compile(r"rank (\d) of 2 holds its shard of the weights rank 0 writes "
                   r"\(sha256 ([0-9a-f]{64})\)")


def _start(env, group: str, store, **streams) -> subprocess.Popen:
    """Two trainer ranks under torchrun, ``STEPS`` steps, a checkpoint each."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_ports(1)[0]), "-m", "reef_stream.cli", "train",
         "--recipe", RECIPE, "--group", group, "--checkpoints", str(store), "--keep", "0",
         "--max-steps", str(STEPS)], env=env, text=True, **streams)


def _killed_before_checkpoint(env, group: str, store, step: int) -> str:
    """Start the ranks with a failpoint before the checkpoint of ``step``; once they hang
    there, SIGKILL torchrun and every rank. Returns their stderr."""
    trainer = _start({**env, "REEF_FAILPOINTS": f"trainer.before-checkpoint@{step}"}, group,
                     store, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while lines.count(f"failpoint trainer.before-checkpoint reached (step {step})\n") < 2:
            line = trainer.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-4000:]
            lines.append(line)
    finally:
        everyone = [trainer.pid, *(c.pid for c in psutil.Process(trainer.pid).children(
            recursive=True))]
        for pid in everyone:   # the ranks run in sessions of their own: each is killed
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        trainer.wait(timeout=30)
    return "".join(lines)


def _equal(a, b) -> bool:
    """The same nested optimizer state: equal keys, bitwise-equal tensors, equal scalars."""
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_fsdp_ranks_shard_the_optimizer_write_full_checkpoints_and_resume_bitwise(
        llama_dir, kafka_bootstrap, cli_env, namespace, tmp_path):
    spread_units(kafka_bootstrap, namespace)
    env = {**cli_env, "REEF_TEST_HF_MODEL": str(llama_dir)}

    straight = _torchrun(env, "fsdp1", tmp_path / "fsdp1", RECIPE)
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert "sharded with fully_shard (2 blocks, then the whole model)" in straight.stderr, \
        straight.stderr[-3000:]
    assert straight.stdout.count(f"now at step {STEPS}") == 2, straight.stdout
    stored = CheckpointStore(tmp_path / "fsdp1").steps()
    assert [c.step for c in stored] == list(range(1, STEPS + 1))
    steps = [load(c.uri, c.sha256) for c in stored]

    # While training, each rank held about half of the optimizer's moments, together all.
    shares: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for rank, held, total in SHARE.findall(straight.stderr):
        shares[int(rank)].append((int(held), int(total)))
    assert len(shares[0]) == len(shares[1]) == STEPS, shares
    for (held0, total), (held1, total1) in zip(shares[0], shares[1]):
        assert total == total1 and held0 + held1 == total, shares
        assert 0.4 < held0 / total < 0.6, shares

    # Full checkpoints: what a single process holds, by the same names, shapes and keys.
    solo = TorchBackend(dataclasses.replace(single, backend=dataclasses.replace(
        single.backend, model=HuggingFace(str(llama_dir)))))
    weights, optimizer, _ = solo.state()
    total_params = sum(t.numel() for t in weights.values())
    assert shares[0][0][1] == 2 * total_params   # exp_avg and exp_avg_sq of every parameter
    for contents in steps:
        assert {n: t.shape for n, t in contents.weights.items()} == \
            {n: t.shape for n, t in weights.items()}
        assert sorted(contents.optimizer["state"]) == list(range(len(weights)))
        assert [g["params"] for g in contents.optimizer["param_groups"]] == \
            [g["params"] for g in optimizer["param_groups"]]
        assert {k.split(".")[0] for k in contents.rng} == {"rank0", "rank1"}
    moved = [n for n in weights if not torch.equal(weights[n], steps[-1].weights[n])]
    assert len(moved) == len(weights), sorted(set(weights) - set(moved))[:5]
    # ... which a single process restores to the same tensors.
    last = steps[-1]
    solo.restore(last.weights, last.optimizer, last.rng)
    weights, optimizer, _ = solo.state()
    assert _equal(dict(weights), dict(last.weights))
    assert _equal(optimizer["state"], last.optimizer["state"])

    # At every checkpoint, each rank's shard is its piece of the checkpoint's weights.
    logged: dict[int, list[str]] = {0: [], 1: []}
    for rank, digest in SHARD.findall(straight.stderr):
        logged[int(rank)].append(digest)
    for rank in (0, 1):
        pieces = [safetensors_sha256({n: torch.chunk(t, 2, dim=0)[rank].contiguous()
                                      for n, t in c.weights.items()}) for c in steps]
        assert logged[rank] == pieces, (rank, logged, pieces)

    # SIGKILLed before its third checkpoint, then restarted: it resumes from the second and
    # ends bitwise where the uninterrupted run ended.
    err = _killed_before_checkpoint(env, "fsdp2", tmp_path / "fsdp2", 3)
    assert [c.step for c in CheckpointStore(tmp_path / "fsdp2").steps()] == [1, 2], err[-3000:]
    restarted = _torchrun(env, "fsdp2", tmp_path / "fsdp2", RECIPE)
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    assert "group fsdp2 at step 2" in restarted.stderr, restarted.stderr[-3000:]
    resumed = [load(c.uri, c.sha256) for c in CheckpointStore(tmp_path / "fsdp2").steps()]
    assert [c.step for c in resumed] == list(range(1, STEPS + 1))
    for theirs, ours in zip(steps, resumed):
        assert theirs.step_units == ours.step_units
        assert _equal(dict(theirs.weights), dict(ours.weights)), theirs.step
        assert _equal(theirs.optimizer, ours.optimizer), theirs.step
