"""``rejects_in_a_row`` for two data-parallel ranks (run it with ``torchrun --nproc-per-node
2``): the same evaluator (versions 2 to 5 rejected), ``max_staleness`` 2, two units per step (one
per rank). Its model writes, at each forward pass, a digest of its parameters to
``$REEF_TEST_DIGESTS/rank<RANK>`` when that is set, so a test can check that every rank trains
the same model, step after step, through a rollback."""

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from reef_stream.engine.models import TinyCausalLM
from tests.recipes.rejects_in_a_row import recipe as one_rank


class DigestingLM(TinyCausalLM):
    """``TinyCausalLM`` that records the digest of its parameters before each forward pass."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if folder := os.environ.get("REEF_TEST_DIGESTS"):
            digest = hashlib.sha256()
            for parameter in self.parameters():
                digest.update(parameter.detach().numpy().tobytes())
            with (Path(folder) / f"rank{os.environ.get('RANK', '0')}").open("a") as out:
                out.write(digest.hexdigest() + "\n")
        return super().forward(input_ids, attention_mask)


recipe = dataclasses.replace(
    one_rank, name="rejects_in_a_row_dp",
    schedule=dataclasses.replace(one_rank.schedule, units_per_step=2, optimizer_batch_size=2),
    backend=dataclasses.replace(one_rank.backend, data_parallel_size=2,
                                model=lambda: DigestingLM(vocab_size=64, dim=16)))
