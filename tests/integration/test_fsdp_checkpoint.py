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
buffer drifted; the trainer itself sharded: test_trainer_fsdp.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import torch
import transformers  # noqa: E402 - a dependency: missing, the test fails rather than skips

from reef_stream.ops.processes import free_ports

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np, torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, load
    from reef_stream.engine.hf import HuggingFace

    model_dir, store_url = sys.argv[1], sys.argv[2]
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
    from reef_stream.consumers.ranks import Ranks
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
    print(json.dumps({"rank": rank, "agreed": agreed, "drifted": drifted, "buffer": buffer}))
    if rank == 0:
        full = sum(t.numel() for k, v in back.optimizer["state"].items()
                   for name, t in v.items() if name == "exp_avg")
        print(json.dumps({
            "rank": "figures", "params": sum(t.numel() for t in weights.values()),
            "local_exp_avg": local, "checkpoint_exp_avg": full,
            "checkpoint_keys": sorted(back.optimizer["state"])[:3],
            "bitwise": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "moved": any(not torch.equal(weights[k], straight[k]) for k in straight)}))
    dist.destroy_process_group()
''')


def test_an_fsdp_checkpoint_holds_every_ranks_optimizer_shard_and_resumes_bitwise(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=96, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    (tmp_path / "worker.py").write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_ports(1)[0]), str(tmp_path / "worker.py"),
         str(tmp_path / "llama"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    figures = next(line for line in lines if line["rank"] == "figures")
    assert figures["local_exp_avg"] * 2 == figures["params"], figures   # a rank holds half
    assert figures["checkpoint_exp_avg"] == figures["params"], figures  # the checkpoint, all
    assert all("." in key for key in figures["checkpoint_keys"]), figures  # by parameter name
    assert figures["moved"] and figures["bitwise"], figures
    # The weight check: the ranks agree, then a drifted shard and a drifted replicated buffer
    # on rank 1 are found, by both ranks alike.
    checks = {line["rank"]: line for line in lines if line["rank"] in (0, 1)}
    assert checks[0]["agreed"] is None and checks[1]["agreed"] is None, checks
    for what in ("drifted", "buffer"):
        assert checks[0][what] == checks[1][what], checks
        assert checks[0][what].startswith("the sharded ranks do not hold the weights rank 0 "
                                          "gathered for the checkpoint"), checks
        mismatched = re.findall(r"rank (\d): ([0-9a-f]{16}) / ([0-9a-f]{16})", checks[0][what])
        assert [(r, a == e) for r, a, e in mismatched] == [("0", True), ("1", False)], checks
