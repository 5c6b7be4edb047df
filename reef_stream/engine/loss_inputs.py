"""What the torch backend adds to a loss's inputs beyond one forward pass: completion logprobs
and entropies from logits, the optimizer batch's loss-token totals (the exact normaliser), the
proximal logprobs of decoupled PPO, and the mask of the samples a step trains on.

Pure torch helpers of ``reef_stream.engine.training`` (which re-exports ``completion_logprobs``
and ``completion_entropy``); nothing here touches an optimizer or a process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from reef_stream.api.variants import BatchTotals
from reef_stream.core.errors import ConfigurationError


def completion_logprobs(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """``float[B, T]``: the log-probability the model gives each completion token (0 on padding)
    of a ``SampleBatch``."""
    rows = _completion_rows(logits, batch)
    chosen = rows.gather(2, batch.completion_ids[:, :, None]).squeeze(-1)
    return chosen * batch.completion_mask


def completion_entropy(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """``float[B, T]``: the entropy of the model's next-token distribution at the position
    predicting each completion token (0 on padding); differentiable."""
    rows = _completion_rows(logits, batch)
    return -(rows.exp() * rows).sum(dim=-1) * batch.completion_mask


def _completion_rows(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """``float[B, T, V]``: the log-softmax at the position predicting each completion token."""
    t = batch.completion_ids.shape[1]
    positions = (batch.completion_start[:, None]
                 + torch.arange(t, device=batch.completion_start.device)[None, :] - 1).clamp(
        0, logits.shape[1] - 1)
    return torch.log_softmax(logits.float(), dim=-1).gather(
        1, positions[:, :, None].expand(-1, -1, logits.shape[-1]))


def local_totals(micros: Sequence[tuple[torch.Tensor, torch.Tensor]], *, per_sample: bool
                 ) -> tuple[float, float]:
    """``(tokens, sequences)`` of this rank's share of an optimizer batch, from each micro
    batch's ``completion_mask: bool[B, T]`` and ``keep: bool[B]`` (the samples trained on),
    before any forward pass. A sequence counts when it has a loss token. ``per_sample``: the
    loss has one entry a sample (``value_regression``): tokens = sequences = kept samples."""
    tokens = sequences = 0.0
    for completion_mask, keep in micros:
        if per_sample:
            tokens += float(keep.sum())
            sequences += float(keep.sum())
            continue
        mask = completion_mask & keep[:, None]
        tokens += float(mask.sum())
        sequences += float(mask.any(dim=1).sum())
    return tokens, sequences


def restricted(inputs: Any, keep: torch.Tensor, totals: BatchTotals) -> Any:
    """``inputs`` (a family's, with ``mask`` and ``totals``) whose mask leaves out the samples
    not kept, normalised by ``totals``."""
    mask = inputs.mask & keep.to(inputs.mask.device).reshape(-1, *([1] * (inputs.mask.ndim - 1)))
    return dataclasses.replace(inputs, mask=mask, totals=totals)


def proximal_logprobs(model: Any, batches: Sequence[tuple[Any, np.ndarray]]
                      ) -> dict[int, torch.Tensor]:
    """Per advantage row: its completion logprobs (``float[completion length]``, on the CPU)
    under ``model`` as it is, without gradient, from ``(SampleBatch, rows)`` micro batches.
    Called at the start of a step (the proximal policy of ``DecoupledProximal``), in the
    training mode of the step's own forward passes, so an unchanged model gives exactly the
    logprobs of the step's first forward pass."""
    proximal: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for batch, rows in batches:
            logprobs = completion_logprobs(model(batch.input_ids, batch.attention_mask),
                                           batch).float().cpu()
            lengths = batch.completion_mask.sum(dim=1)
            for row, index in enumerate(rows):
                width = int(_last_true(batch.completion_mask[row])) if lengths[row] else 0
                proximal[int(index)] = logprobs[row, :width]
    return proximal


def proximal_rows(proximal: Mapping[int, torch.Tensor], rows: np.ndarray, batch: Any
                  ) -> torch.Tensor:
    """``float[B, T]``: the proximal logprobs of the samples at ``rows`` in ``batch``'s layout
    (0 on padding)."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    for row, index in enumerate(rows):
        values = proximal[int(index)]
        out[row, :values.shape[0]] = values
    return out.to(batch.completion_mask.device) * batch.completion_mask


def _last_true(mask: torch.Tensor) -> int:
    """One past the last True of a 1-d bool mask."""
    return int(torch.nonzero(mask).max()) + 1


def load_reference(reference: torch.nn.Module, uri: str) -> None:
    """Load the weights of the checkpoint at ``uri`` (``KLPenalty.reference``), verified
    against its manifest, into the frozen ``reference`` model. Every tensor of the checkpoint
    must be one of the model's with its shape (a LoRA checkpoint holds the adapter alone: the
    base stays the initial one); ``ConfigurationError`` naming those that are not. Blocks on
    reading the checkpoint."""
    from reef_stream.engine.checkpoints import load_weights

    weights = load_weights(uri, None)
    own = reference.state_dict()
    wrong = sorted(name for name, tensor in weights.items()
                   if name not in own or own[name].shape != tensor.shape)
    if wrong:
        raise ConfigurationError(
            f"KLPenalty.reference {uri} does not fit the recipe's model: "
            f"{len(wrong)} of its tensors are not the model's, or differ in shape "
            f"({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''})")
    reference.load_state_dict(weights, strict=False)
