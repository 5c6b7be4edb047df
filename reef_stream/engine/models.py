"""Tiny models for tests, demos and benchmarks (this project reaches no model hub).

``TinyCausalLM`` follows the trainer's model contract (``reef_stream.engine.training.CausalLM``):
``model(input_ids, attention_mask) -> logits`` and ``model.value(input_ids,
attention_mask) -> values``. It is an embedding, a one-layer GRU (causal by
construction) and two heads; small enough to train on a CPU in milliseconds,
deterministic on one.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyCausalLM(nn.Module):
    """A causal language model of ``vocab_size`` tokens and width ``dim``, with a value head.

    Shapes: ``input_ids: long[B, L]``, ``attention_mask: bool[B, L]`` (True on
    real tokens, left-aligned) -> logits ``float[B, L, vocab_size]``;
    ``value`` -> ``float[B]``, read at each sequence's last real token.
    """

    def __init__(self, vocab_size: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab_size)
        self.value_head = nn.Linear(dim, 1)

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids.clamp(0, self.vocab_size - 1)))
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self._hidden(input_ids))

    def value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._hidden(input_ids)
        last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
        return self.value_head(hidden[torch.arange(hidden.shape[0]), last]).squeeze(-1)
