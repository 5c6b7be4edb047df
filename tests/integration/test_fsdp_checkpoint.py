"""FSDP on the CPU, and what a checkpoint of it must hold.

Two ranks (torchrun, gloo) shard a tiny Hugging Face model loaded through the backend's own
``HuggingFace(path)`` with torch's FSDP (``fully_shard``, FSDP2): each rank then holds half of
every parameter and half of AdamW's moments. A checkpoint written from rank 0's own
``optimizer.state_dict()`` would hold half of the optimizer; the one written here is the full
state gathered from every rank's shard (``get_state_dict(..., full_state_dict=True)``, a
collective every rank calls), through ``CheckpointStore.write``. Restored into a fresh sharded
model and optimizer (``set_state_dict``) on both ranks, training goes on bitwise as if it had
never stopped.

This tests the checkpoint side of FSDP with torch's FSDP directly, and the ranks' weight check
(``Ranks.weights_differ`` with each rank's shards) against a rank whose shard or replicated
buffer drifted. Then the trainer's own backend, sharded (``HuggingFace(path, sharding="fsdp")``),
restores a checkpoint one process wrote to the same tensors, and its next step, each rank on
half the units, has one process's loss, gradient norm and (to float tolerance) weights. The
trainer itself sharded, against the broker: test_trainer_fsdp.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # noqa: E402 - a dependency: missing, the test fails rather than skips
from safetensors.torch import load_file

from reef_stream.core.processes import free_ports
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore
from reef_stream.engine.hf import HuggingFace, Lora
from reef_stream.engine.training import TorchBackend
from tests.recipes.trainable import recipe as single
from tests.unit_log import rollout_unit

WORKER = textwrap.dedent('''
    import json, os, sys
    import numpy as np, torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, load
    from reef_stream.engine.hf import HuggingFace

    model_dir, store_url = sys.argv[1], sys.argv[2]

    def report(name, figures):   # a file each: the ranks' stdout lines may interleave
        with open(os.path.join(os.path.dirname(sys.argv[5]), f"{name}.json"), "w") as out:
            json.dump(figures, out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def sharded():
        torch.manual_seed(0)
        lm = HuggingFace(model_dir)()
        for layer in lm.hf.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(lm, mesh=mesh)
        return lm, torch.optim.AdamW(lm.parameters(), lr=1e-2)

    def step(lm, optimizer, n):
        ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(n))
        mine = ids[rank * 2:(rank + 1) * 2]   # this rank's rows of the step
        logits = lm(mine, torch.ones_like(mine, dtype=torch.bool))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96),
                                                 mine[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    lm, optimizer = sharded()
    for n in range(2):
        step(lm, optimizer, n)
    local = sum(v.to_local().numel() for s in optimizer.state.values()
                for k, v in s.items() if k == "exp_avg")
    weights, optim = get_state_dict(lm, optimizer, options=FULL)   # every rank calls it
    stored = None
    if rank == 0:
        stored = CheckpointStore(store_url).write(CheckpointContents(
            step=2, policy_version=2, model="m", recipe="r", trainer_group="g",
            weights=weights, optimizer=optim, rng={}, algorithm_state={}, offsets=(),
            trained_units=np.zeros(0, dtype=np.uint64)))
    where = [stored and (stored.uri, stored.sha256)]
    dist.broadcast_object_list(where, src=0)   # a test's own control data, not the trainer's
    for n in range(2, 4):
        step(lm, optimizer, n)
    straight, _ = get_state_dict(lm, optimizer, options=FULL)

    back = load(*where[0])
    fresh, fresh_optimizer = sharded()
    set_state_dict(fresh, fresh_optimizer, model_state_dict=dict(back.weights),
                   optim_state_dict=back.optimizer, options=FULL)
    for n in range(2, 4):
        step(fresh, fresh_optimizer, n)
    resumed, _ = get_state_dict(fresh, fresh_optimizer, options=FULL)

    # The ranks' weight check (the trainer's, at each checkpoint): each rank's shard against
    # rank 0's expectation of it from the gathered weights.
    from reef_stream.consumers.trainer.ranks import Ranks
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    ranks = Ranks(rank, world)
    agreed = ranks.weights_differ(resumed, held=dict(fresh.state_dict()))
    with torch.no_grad():   # rank 1's shard is no longer what rank 0 gathered
        if rank == 1:
            fresh.hf.model.norm.weight.to_local().add_(1.0)
    drifted = ranks.weights_differ(resumed, held=dict(fresh.state_dict()))
    # A replicated tensor (a persistent buffer: FSDP does not shard buffers) that drifted on
    # rank 1: the gathered state holds rank 0's.
    counted = torch.nn.Linear(4, 4)
    counted.register_buffer("seen", torch.zeros(3))
    fully_shard(counted, mesh=mesh)
    if rank == 1:
        counted.seen.add_(1)
    buffer = ranks.weights_differ(get_model_state_dict(counted, options=FULL),
                                  held=dict(counted.state_dict()))
    report(f"rank{rank}", {"agreed": agreed, "drifted": drifted, "buffer": buffer})
    if rank == 0:
        full = sum(t.numel() for k, v in back.optimizer["state"].items()
                   for name, t in v.items() if name == "exp_avg")
        report("figures", {
            "params": sum(t.numel() for t in weights.values()),
            "local_exp_avg": local, "checkpoint_exp_avg": full,
            "checkpoint_keys": sorted(back.optimizer["state"])[:3],
            "bitwise": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "moved": any(not torch.equal(weights[k], straight[k]) for k in straight)})

    # The trainer's backend, sharded: it restores the checkpoint one process wrote (every rank
    # gives the whole of it), gathers it back unchanged, and trains the next step with each
    # rank on its half of the units, as the trainer does.
    import dataclasses
    from safetensors.torch import save_file
    from reef_stream.engine.training import TorchBackend, select_rows
    from tests.recipes.trainable_dp import recipe as dp
    from tests.unit_log import rollout_unit
    solo = load(sys.argv[3], sys.argv[4])
    configured = dataclasses.replace(dp, schedule=dataclasses.replace(
        dp.schedule, optimizer_batch_size=4, micro_batch_size=1, epochs=1),
        backend=dataclasses.replace(dp.backend, model=HuggingFace(model_dir, sharding="fsdp"),
                                    max_grad_norm=0.05))   # clipped: the norm is ~0.1
    backend = TorchBackend(configured, rank=rank, ranks=world)
    backend.restore(solo.weights, solo.optimizer, {"rank1.torch": solo.rng["rank0.torch"],
                                                   **solo.rng})
    restored, restored_optimizer, _ = backend.state()
    units = [rollout_unit(i) for i in range(4, 8)]
    result = configured.objective.compute(units, configured.objective.initial_state())
    sizes = [len(u.members) for u in units]
    first = sum(sizes[:2 * rank])
    rows = np.arange(first, first + sum(sizes[2 * rank:2 * rank + 2]))
    metrics = backend.train_step(units[2 * rank:2 * rank + 2], dataclasses.replace(
        result, advantages=select_rows(result.advantages, rows)), 2)
    trained, _, _ = backend.state()
    if rank == 0:
        save_file(trained, sys.argv[5])
        report("backend", {
            "sharded": backend.sharded is not None,
            "restored": all(torch.equal(restored[k], solo.weights[k]) for k in solo.weights)
            and restored.keys() == solo.weights.keys(),
            "restored_optimizer": all(
                torch.equal(restored_optimizer["state"][i][n], t)
                for i, values in solo.optimizer["state"].items() for n, t in values.items())
            and restored_optimizer["param_groups"] == solo.optimizer["param_groups"],
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})

    # LoRA under FSDP: the frozen base and the adapters sharded together, the adapters alone
    # trained and gathered; a first step from the same seeded adapters as one process's.
    from reef_stream.engine.hf import Lora
    lora = dataclasses.replace(configured, backend=dataclasses.replace(
        configured.backend, model=HuggingFace(model_dir, sharding="fsdp", lora=Lora(rank=2))))
    adapters = TorchBackend(lora, rank=rank, ranks=world)
    units = [rollout_unit(i) for i in range(4)]
    result = lora.objective.compute(units, lora.objective.initial_state())
    rows = np.arange(first, first + sum(sizes[2 * rank:2 * rank + 2]))
    metrics = adapters.train_step(units[2 * rank:2 * rank + 2], dataclasses.replace(
        result, advantages=select_rows(result.advantages, rows)), 1)
    weights, optimizer, _ = adapters.state()
    check = ranks.weights_differ(weights, held=adapters.held())
    if rank == 0:
        save_file(weights, sys.argv[6])
        report("lora", {"check": check, "loss": metrics["loss"],
                        "grad_norm": metrics["grad_norm"],
                        "optimizer_entries": len(optimizer["state"])})
    dist.barrier()   # no rank tears the group down while another still writes (seen: SIGABRT)
    dist.destroy_process_group()
    # Every figure is in its file. Skip the interpreter's finalization: gloo's threads may
    # still hold work whose tensors reference Python objects, and destroying them then aborts
    # ("terminate called without an active exception"; pytorch/pytorch#179291): rank 1
    # aborted so in two clean-clone CI runs, once before the barrier above was added and once
    # after it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
''')


def _one_process(model, store=None, steps=2):
    """One process's backend on ``model``: a step on units 0-3 (checkpointed to ``store``),
    then one on units 4-7, gradients clipped to norm 0.05. Returns the stored checkpoint, the weights and the last step's
    metrics."""
    configured = dataclasses.replace(single, schedule=dataclasses.replace(
        single.schedule, optimizer_batch_size=4, micro_batch_size=1, epochs=1),
        backend=dataclasses.replace(single.backend, model=model, max_grad_norm=0.05))
    backend = TorchBackend(configured)
    metrics, stored = {}, None
    for step, first in ((1, 0), (2, 4))[:steps]:
        units = [rollout_unit(i) for i in range(first, first + 4)]
        metrics = backend.train_step(units, configured.objective.compute(
            units, configured.objective.initial_state()), step)
        if step == 1 and store is not None:
            weights, optimizer, rng = backend.state()
            stored = CheckpointStore(store).write(CheckpointContents(
                step=1, policy_version=1, model="m", recipe=configured.name,
                trainer_group="solo", weights=weights, optimizer=optimizer, rng=rng,
                algorithm_state={}, offsets=(), trained_units=np.zeros(0, dtype=np.uint64)))
    return stored, backend.state()[0], metrics


def test_an_fsdp_checkpoint_holds_every_ranks_optimizer_shard_and_resumes_bitwise(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=96, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    solo, solo_weights, solo_metrics = _one_process(HuggingFace(str(tmp_path / "llama")),
                                                    tmp_path / "solo")
    _, lora_weights, lora_metrics = _one_process(
        HuggingFace(str(tmp_path / "llama"), lora=Lora(rank=2)), steps=1)
    (tmp_path / "worker.py").write_text(WORKER)
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_ports(1)[0]), str(tmp_path / "worker.py"),
         str(tmp_path / "llama"), str(tmp_path / "ckpt"), solo.uri, solo.sha256,
         str(tmp_path / "fsdp_step2.safetensors"), str(tmp_path / "lora.safetensors")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(root), os.environ.get("PYTHONPATH", "")])},
        capture_output=True, text=True, timeout=300, check=False, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    def reported(name):
        return json.loads((tmp_path / f"{name}.json").read_text())
    figures = reported("figures")
    assert figures["local_exp_avg"] * 2 == figures["params"], figures   # a rank holds half
    assert figures["checkpoint_exp_avg"] == figures["params"], figures  # the checkpoint, all
    assert all("." in key for key in figures["checkpoint_keys"]), figures  # by parameter name
    assert figures["moved"] and figures["bitwise"], figures
    # The weight check: the ranks agree, then a drifted shard and a drifted replicated buffer
    # on rank 1 are found, by both ranks alike.
    checks = {rank: reported(f"rank{rank}") for rank in (0, 1)}
    assert checks[0]["agreed"] is None and checks[1]["agreed"] is None, checks
    for what in ("drifted", "buffer"):
        assert checks[0][what] == checks[1][what], checks
        assert checks[0][what].startswith("the sharded ranks do not hold the weights rank 0 "
                                          "gathered for the checkpoint"), checks
        mismatched = re.findall(r"rank (\d): ([0-9a-f]{16}) / ([0-9a-f]{16})", checks[0][what])
        assert [(r, a == e) for r, a, e in mismatched] == [("0", True), ("1", False)], checks

    # The trainer's sharded backend restored one process's checkpoint to the same tensors, and
    # its next step, each rank on half the units, is one process's step on all of them: the
    # same loss and gradient norm (the ranks' gradients averaged, as DDP's), and weights.
    backend = reported("backend")
    assert backend["sharded"] and backend["restored"] and backend["restored_optimizer"], backend
    assert backend["loss"] == pytest.approx(solo_metrics["loss"], rel=1e-5)
    assert backend["grad_norm"] == pytest.approx(solo_metrics["grad_norm"], rel=1e-5)
    trained = load_file(str(tmp_path / "fsdp_step2.safetensors"))
    assert trained.keys() == solo_weights.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, solo_weights[name], rtol=1e-4, atol=1e-5)

    # LoRA sharded: the adapters alone gathered, every rank's shard checked, one process's step.
    lora = reported("lora")
    assert lora["check"] is None, lora
    assert lora["loss"] == pytest.approx(lora_metrics["loss"], rel=1e-5)
    assert lora["grad_norm"] == pytest.approx(lora_metrics["grad_norm"], rel=1e-5)
    adapters = load_file(str(tmp_path / "lora.safetensors"))
    assert adapters.keys() == lora_weights.keys() and all("lora_" in n for n in adapters)
    assert lora["optimizer_entries"] == len(adapters)
    for name, tensor in adapters.items():
        torch.testing.assert_close(tensor, lora_weights[name], rtol=1e-4, atol=1e-5)
