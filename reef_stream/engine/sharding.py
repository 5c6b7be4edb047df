"""Fully sharded data parallelism (torch's FSDP2, ``fully_shard``) for the trainer's backend.

Under plain data parallelism (accelerate's DDP) every rank holds the whole model and the whole
optimizer state. A model asking for ``sharding="fsdp"`` (``HuggingFace(path,
sharding="fsdp")``, ``reef_stream.engine.hf``; ``--set backend.model.sharding=fsdp``), trained
by more than one rank, is sharded instead (``FullySharded``): ``fully_shard`` on each of its
blocks (a Hugging Face model's decoder layers: ``HuggingFaceLM.blocks``), then on the whole
model, over a one-dimensional mesh of the ranks. Each rank then holds 1/N of every parameter,
of its gradient and of the optimizer's moments (the optimizer is built on the sharded
parameters); a block's parameters are gathered for its forward and backward passes only.
Gradients are averaged over the ranks by reduce-scatter, as DDP averages them by all-reduce,
so the backend's loss scaling (times ranks) is the same.

A checkpoint is the same whatever the sharding: ``state`` gathers the full state from every
rank's shard (``get_state_dict(..., StateDictOptions(full_state_dict=True,
cpu_offload=True))``, a collective every rank calls; rank 0 receives it all, the others
nothing), keyed as a single process keys it (the weights by the model's ``state_dict`` names,
the optimizer's state by parameter index, ``optimizer_by_index``), so a checkpoint written by
sharded ranks is restored by one process, by DDP ranks, or by another number of sharded ranks
(``restore``: ``set_state_dict`` with the full state, which every rank has loaded), and the
evaluator reads it like any other. The whole state passes through rank 0's memory: a model
whose weights and optimizer state do not fit one host needs sharded checkpoints, which
``CheckpointStore`` does not write.

The ranks' weight check at a checkpoint (``reef_stream.consumers.trainer.ranks.Ranks.weights_differ``)
compares each rank's own shard (``local_pieces``) with the piece of the gathered weights rank 0
writes that this rank should hold (``expected_pieces``): a rank whose shard is not what the
checkpoint says it holds, or whose replicated tensors (a buffer) drifted, fails it.

Only torch's own collectives over the trainer's process group are used (gloo on the CPU,
tested here; NCCL on GPUs, untested).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.metric_names import TRAINER_UPDATE_RATIO

__all__ = ["SHARDINGS", "FullySharded", "expected_pieces", "local_pieces", "optimizer_by_index",
           "optimizer_by_name", "parameter_names", "sharding_of", "trained_copy",
           "trained_parameters", "update_ratio"]

log = logging.getLogger(__name__)

#: What a model may ask for: ``"none"`` (DDP through accelerate), ``"fsdp"`` (``fully_shard``).
SHARDINGS = ("none", "fsdp")


def sharding_of(spec: Any) -> str:
    """The sharding the recipe's ``Backend.model`` asks for (its ``sharding``, else
    ``"none"``); ``ConfigurationError`` for one that is not in ``SHARDINGS``."""
    sharding = getattr(spec, "sharding", "none")
    if sharding not in SHARDINGS:
        raise ConfigurationError(f"the model's sharding must be one of {', '.join(SHARDINGS)}, "
                                 f"got {sharding!r}")
    return sharding


def _is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own piece of ``tensor`` (a DTensor's local shard; a plain tensor whole)."""
    return tensor.to_local() if _is_sharded(tensor) else tensor


class FullySharded:
    """A model sharded over the trainer's ranks with ``fully_shard``, and its optimizer.

    Built with the model (``shard``, in place), then bound to the optimizer made of the sharded
    parameters (``bind``). Every method that gathers or reduces is a collective: every rank
    calls it at the same point, as the backend's other collectives.
    """

    def __init__(self, model: Any, *, device: torch.device, rank: int, ranks: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.rank, self.ranks = rank, ranks
        mesh = init_device_mesh(device.type, (ranks,))
        model.to(device)
        blocks = list(model.blocks()) if hasattr(model, "blocks") else []
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer: Any = None
        self.names: list[str] = []
        log.info("rank %d of %d: %s sharded with fully_shard (%d blocks, then the whole model)",
                 rank, ranks, type(model).__name__, len(blocks))

    @classmethod
    def of(cls, model: Any, spec: Any, *, device: torch.device, rank: int,
           ranks: int) -> FullySharded | None:
        """``model`` sharded when ``spec`` (the recipe's ``Backend.model``) asks for FSDP and
        more than one rank trains it; None otherwise (the backend's DDP). One rank holds the
        whole model either way: it trains unsharded, and says so."""
        if sharding_of(spec) != "fsdp":
            return None
        if ranks == 1:
            log.warning("sharding='fsdp' with one trainer process: nothing to shard across, "
                        "the model trains unsharded (its checkpoints are the same)")
            return None
        return cls(model, device=device, rank=rank, ranks=ranks)

    def bind(self, optimizer: Any) -> Any:
        """Use ``optimizer`` (built on the sharded parameters); returns it."""
        self.optimizer = optimizer
        self.names = parameter_names(self.model, optimizer)
        return optimizer

    # ----------------------------------------------------------------- state

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The full weights and optimizer state, gathered from every rank's shard onto rank 0
        (on its CPU), keyed as a single process keys them; the other ranks get empty ones.
        Logs how much of the optimizer state this rank holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        held, total = self.optimizer_share()
        log.info("rank %d of %d holds %d of the optimizer state's %d values (%.1f%%)",
                 self.rank, self.ranks, held, total, 100.0 * held / max(total, 1))
        weights, optimizer = get_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}, {}
        return dict(weights), optimizer_by_index(optimizer, self.names)

    def restore(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any]) -> None:
        """Put a full checkpoint (every rank has loaded it) back into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=dict(weights),
                       optim_state_dict=optimizer_by_name(optimizer, self.names),
                       options=StateDictOptions(full_state_dict=True))

    def held(self) -> dict[str, torch.Tensor]:
        """What this rank holds of the weights: the model's sharded state dict (DTensors, and
        plain tensors for what is replicated), under the checkpoint's names."""
        return dict(self.model.state_dict())

    def optimizer_share(self) -> tuple[int, int]:
        """(values this rank holds, values of the whole optimizer state), over its tensors
        with more than one value (the moments; not the step counts)."""
        held = total = 0
        for values in self.optimizer.state.values():
            for value in values.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    held += _local(value).numel()
                    total += value.numel()
        return held, total

    # ----------------------------------------------------------------- gradients

    def clip_gradients(self, parameters: Sequence[torch.Tensor], max_norm: float | None) -> float:
        """The gradient's global norm over every shard before clipping (every rank gets the
        same); clipped to ``max_norm`` when set."""
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        return float(total.full_tensor() if _is_sharded(total) else total)


# --------------------------------------------------------------------------- optimizer keys


def parameter_names(model: Any, optimizer: Any) -> list[str]:
    """The name of each parameter of ``optimizer``, in the order ``optimizer.state_dict()``
    numbers them (param group by param group)."""
    names = {id(p): name for name, p in model.named_parameters()}
    missing = [i for group in optimizer.param_groups for i, p in enumerate(group["params"])
               if id(p) not in names]
    if missing:
        raise ConfigurationError("the optimizer holds parameters that are not the model's: "
                                 "build it from the model's parameters (Backend.optimizer)")
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekeyed(state: Mapping[str, Any], key: Callable[[Any], Any]) -> dict[str, Any]:
    return {"state": {key(k): v for k, v in state.get("state", {}).items()},
            "param_groups": [{**group, "params": [key(p) for p in group["params"]]}
                             for group in state.get("param_groups", [])]}


def optimizer_by_index(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (``get_state_dict``'s) keyed by index
    instead, as ``optimizer.state_dict()`` of one process keys it (``names``: the parameter
    names in index order, ``parameter_names``). An index-keyed state is returned as it is."""
    index = {name: i for i, name in enumerate(names)}

    def key(k: Any) -> Any:
        if isinstance(k, int):
            return k
        if k not in index:
            raise ConfigurationError(f"the optimizer state names parameter {k!r}, which the "
                                     "optimizer does not hold")
        return index[k]
    return _rekeyed(state, key)


def optimizer_by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter index (a checkpoint's) keyed by name, as
    ``set_state_dict`` takes it; a name-keyed one is returned as it is."""
    def key(k: Any) -> Any:
        if isinstance(k, str) and not k.isdigit():
            return k
        if not 0 <= int(k) < len(names):
            raise ConfigurationError(f"the checkpoint's optimizer state has parameter {k}, but "
                                     f"the optimizer holds {len(names)}: a checkpoint of "
                                     "another model or optimizer?")
        return names[int(k)]
    return _rekeyed(state, key)


# --------------------------------------------------------------------------- the weight check


def local_pieces(held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's own piece of every tensor it holds (``FullySharded.held``), on the CPU."""
    return {name: _local(t).detach().cpu().contiguous() for name, t in held.items()}


def expected_pieces(weights: Mapping[str, torch.Tensor], held: Mapping[str, torch.Tensor],
                    rank: int, ranks: int) -> dict[str, torch.Tensor]:
    """The piece of the full ``weights`` (rank 0's gathered state) that ``rank`` of ``ranks``
    holds, sharded as this rank's ``held`` tensors are (each rank shards the same model the
    same way): a tensor sharded on dim ``d`` is split as ``torch.chunk(full, ranks, d)`` (a rank
    past the chunks holds an empty piece), a replicated or plain one is whole.
    ``ConfigurationError`` when the names differ or a placement is not one of those."""
    if set(weights) != set(held):
        raise ConfigurationError(
            f"the gathered weights and a rank's shards name different tensors: "
            f"{sorted(set(weights) ^ set(held))[:5]}")
    pieces = {}
    for name, tensor in held.items():
        full = weights[name]
        if _is_sharded(tensor):
            if len(tensor.placements) != 1:
                raise ConfigurationError(f"{name}: sharded over a {len(tensor.placements)}-d "
                                         "mesh; the trainer shards over one dimension")
            placement = tensor.placements[0]
            if placement.is_shard():
                dim = placement.dim
                chunks = torch.chunk(full, ranks, dim=dim)
                full = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
            elif not placement.is_replicate():
                raise ConfigurationError(f"{name}: placement {placement} is neither sharded "
                                         "nor replicated")
        pieces[name] = full.detach().cpu().contiguous()
    return pieces


# --------------------------------------------------------------------------- update ratio


def trained_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters that are trained: those requiring a gradient (a LoRA model's frozen
    base is not), in ``model.parameters()`` order. What the optimizer is given and what
    ``trained_copy`` and ``update_ratio`` measure."""
    return [p for p in model.parameters() if p.requires_grad]


def trained_copy(model: Any) -> list[torch.Tensor]:
    """A copy of this rank's piece of every trained parameter (``trained_parameters``; the
    whole parameter unsharded), for ``update_ratio``."""
    return [_local(p).detach().clone() for p in trained_parameters(model)]


def update_ratio(model: Any, before: Sequence[torch.Tensor]) -> dict[str, float]:
    """``update_ratio``: ``||theta_after - theta_before|| / ||theta_before||`` over every
    trained parameter (one global L2 norm each), ``before`` from ``trained_copy``; left out
    when ``||theta_before||`` is 0. Unsharded, every rank holds the same weights and needs no
    reduction; sharded, the squared norms of the ranks' pieces are summed over the ranks (one
    all-reduce, which every rank calls)."""
    if not before:
        return {}
    after = trained_parameters(model)
    sharded = any(_is_sharded(p) for p in after)
    with torch.no_grad():
        norms = torch.stack([torch.linalg.vector_norm(b, dtype=torch.float64) for b in before])
        deltas = torch.stack([torch.linalg.vector_norm(_local(p).detach() - b,
                                                       dtype=torch.float64)
                              for p, b in zip(after, before, strict=True)])
        if sharded:
            import torch.distributed as dist

            squares = torch.stack([norms.square().sum(), deltas.square().sum()]).to(
                before[0].device)
            dist.all_reduce(squares, op=dist.ReduceOp.SUM)
            norm, delta = squares.sqrt().tolist()
        else:
            norm = float(torch.linalg.vector_norm(norms))
            delta = float(torch.linalg.vector_norm(deltas))
    if norm == 0.0:
        return {}
    return {TRAINER_UPDATE_RATIO: delta / norm}
