"""The trainer's data-parallel ranks: who this process is among them, and what they exchange.

``torchrun`` / ``accelerate launch`` set the ranks in the environment; a plain process is
rank 0 of 1, and every exchange below is then the identity, with no process group.

Ranks exchange bytes only, never pickled objects (``torch.distributed``'s and accelerate's
object collectives pickle): units as their Avro records, offsets as JSON, RNG states as
safetensors, carried in uint8 tensors on the process group's device (CUDA under NCCL). Every call blocks until every rank has made the same call; ranks make them in
the same order (``reef_stream.consumers.trainer.trainer``: between the same steps).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from reef_stream.core.errors import ConfigurationError

log = logging.getLogger(__name__)


class Ranks:
    """This process's place among the recipe's ``data_parallel_size`` ranks."""

    def __init__(self, rank: int = 0, ranks: int = 1) -> None:
        self.rank, self.ranks = rank, ranks

    @classmethod
    def join(cls, recipe: Any, timeout_s: float | None = None) -> Ranks:
        """This process's rank as the launcher set it; ``ConfigurationError`` when the number
        of processes launched is not the recipe's ``data_parallel_size``.

        ``timeout_s``: how long any exchange between the ranks (``gather_bytes``, the gradient
        all-reduce, ...) waits for the others before it raises on this rank (None: torch's
        default, 30 minutes). A rank whose host is cut off from the others meets no one; with
        a bound, every rank's next exchange raises, the trainer exits and ``torchrun`` fails
        the job, instead of waiting half an hour (``tests/faults/test_trainer_hosts.py``). It
        must be longer than a rank may work between two exchanges: rank 0's checkpoint write
        and acknowledgement, during which the others wait."""
        from datetime import timedelta

        from accelerate import PartialState

        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1"):
            raise ConfigurationError(
                "ACCELERATE_USE_FSDP is set (accelerate launch with an FSDP configuration), but "
                "the trainer does not shard through accelerate: on CPUs accelerate ignores FSDP "
                "and trains DDP, and on GPUs its FSDP checkpoint would hold rank 0's shard of "
                "the optimizer alone. Ask the model for it instead: "
                "HuggingFace(path, sharding='fsdp') (--set backend.model.sharding=fsdp), and "
                "launch the ranks without accelerate's FSDP (torchrun, or distributed_type "
                "MULTI_GPU or MULTI_CPU); docs/deployment.md, 'The trainer across hosts'")
        options = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        state = PartialState(cpu=not torch.cuda.is_available(), **options)
        rank, ranks = state.process_index, state.num_processes
        declared = recipe.backend.data_parallel_size
        if ranks != declared:
            raise ConfigurationError(
                f"recipe {recipe.name!r} declares data_parallel_size {declared} but "
                f"{ranks} trainer process(es) were launched: launch {declared} "
                f"(torchrun --nproc-per-node {declared} -m reef_stream.cli train ...) or change "
                "the recipe's Backend")
        return cls(rank, ranks)

    def leave(self) -> None:
        """Tear down the ranks' process group, once every rank is done with it (each trains
        to the same step, and stops at the same meeting). Unless it is torn down before the
        interpreter finalizes, gloo's threads may still hold work then, and the rank aborts
        after a clean run ("terminate called without an active exception", seen in
        tests/integration/test_fsdp_checkpoint.py). Local for gloo; nothing for one rank."""
        if self.ranks == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """``data`` of every rank, in rank order."""
        if self.ranks == 1:
            return [data]
        import torch.distributed as dist

        device = _device()
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [torch.zeros_like(length) for _ in range(self.ranks)]
        dist.all_gather(lengths, length)
        size = max(int(n) for n in lengths)
        padded = torch.zeros(size, dtype=torch.uint8, device=device)
        if data:
            padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = [torch.empty(size, dtype=torch.uint8, device=device)
                    for _ in range(self.ranks)]
        dist.all_gather(everyone, padded)
        return [bytes(t[:int(n)].cpu().numpy()) for t, n in zip(everyone, lengths)]

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data``, on every rank."""
        if self.ranks == 1:
            return data
        import torch.distributed as dist

        device = _device()
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(length, src=0)
        buffer = torch.zeros(int(length), dtype=torch.uint8, device=device)
        if self.rank == 0 and data:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(buffer, src=0)
        return bytes(buffer.cpu().numpy())

    def weights_differ(self, weights: Mapping[str, torch.Tensor],
                       held: Mapping[str, torch.Tensor] | None = None) -> str | None:
        """None when every rank holds these very ``weights``, bitwise; else what differs.

        Under data parallelism every rank applies the same averaged gradients to the same
        weights, so after a step they hold the same bytes; a rank that does not (a
        nondeterministic kernel, a fault) must not have its twin's weights acknowledged for
        it. Each rank hashes the safetensors bytes of its weights (``safetensors_sha256``: the
        sha256 a checkpoint's ``model.safetensors`` gets, streamed, never all in memory) and
        the digests are compared. Every rank gets the same answer. One rank: None, at once.

        Sharded (FSDP: ``held`` is this rank's shards, ``TorchBackend.held``; ``weights`` the
        full weights gathered on rank 0, empty elsewhere), no two ranks hold the same bytes:
        each rank hashes its own pieces (``reef_stream.engine.sharding.local_pieces``), rank 0
        hashes the piece of what it writes that each rank should hold (``expected_pieces``),
        and each rank's digest is compared with rank 0's expectation of it. A rank whose
        shard is not the checkpoint's (or whose replicated tensors drifted) fails the check.
        """
        if self.ranks == 1:
            return None
        if held is not None:
            return self._shards_differ(weights, held)
        from reef_stream.engine.checkpoints import safetensors_sha256

        digests = [d.decode() for d in self.gather_bytes(safetensors_sha256(weights).encode())]
        if len(set(digests)) == 1:
            log.info("rank %d of %d holds the weights of every rank (sha256 %s)", self.rank,
                     self.ranks, digests[0])
            return None
        return ("the data-parallel ranks hold different weights after this step (sha256 of "
                "their safetensors bytes by rank: "
                + ", ".join(f"rank {r}: {d[:16]}" for r, d in enumerate(digests)) + ")")

    def _shards_differ(self, weights: Mapping[str, torch.Tensor],
                       held: Mapping[str, torch.Tensor]) -> str | None:
        """``weights_differ`` for sharded ranks (see there)."""
        from reef_stream.engine.checkpoints import safetensors_sha256
        from reef_stream.engine.sharding import expected_pieces, local_pieces

        mine = safetensors_sha256(local_pieces(held))
        actual = [d.decode() for d in self.gather_bytes(mine.encode())]
        expected: list[str] = []
        if self.rank == 0:
            expected = [safetensors_sha256(expected_pieces(weights, held, r, self.ranks))
                        for r in range(self.ranks)]
        expected = json.loads(self.broadcast_bytes(json.dumps(expected).encode()))
        if actual == expected:
            log.info("rank %d of %d holds its shard of the weights rank 0 writes (sha256 %s)",
                     self.rank, self.ranks, mine)
            return None
        return ("the sharded ranks do not hold the weights rank 0 gathered for the checkpoint "
                "(sha256 of each rank's shard, held / expected: "
                + ", ".join(f"rank {r}: {a[:16]} / {e[:16]}"
                            for r, (a, e) in enumerate(zip(actual, expected))) + ")")

    def gather_shares(self, mine: list[Any], offsets: dict[int, int], registry: Any,
                      unit_type: type) -> list[tuple[list[Any], dict[int, int]]]:
        """Every rank's pending units (encoded with ``registry``, decoded as ``unit_type``)
        and next offsets, in rank order."""
        if self.ranks == 1:
            return [(mine, offsets)]
        encoded = [registry.encode(u) for u in mine]
        share = json.dumps({
            "units": [[base64.b64encode(value).decode(),
                       [[k, base64.b64encode(v).decode()] for k, v in headers]]
                      for value, headers in encoded],
            "offsets": sorted(offsets.items())}).encode()
        shares = []
        for blob in self.gather_bytes(share):
            decoded = json.loads(blob)
            units = [registry.decode(base64.b64decode(value),
                                     [(k, base64.b64decode(v)) for k, v in headers], unit_type)
                     for value, headers in decoded["units"]]
            shares.append((units, {int(p): int(o) for p, o in decoded["offsets"]}))
        return shares


def _device() -> torch.device:
    """Where the process group's collectives take their tensors: NCCL (accelerate's group on
    GPUs) carries only CUDA tensors, gloo CPU ones. Untested on GPUs here (no GPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
