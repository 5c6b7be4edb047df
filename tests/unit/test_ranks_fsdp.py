"""Launched for accelerate's FSDP, a trainer refuses to start, saying why (accelerate would train
DDP on CPUs, and checkpoint rank 0's optimizer shard alone on GPUs) and what to ask for instead
(``HuggingFace(path, sharding="fsdp")``, the trainer's own FSDP); launched without it, a process
joins as usual."""

from __future__ import annotations

import pytest

from reef_stream.consumers.trainer.ranks import Ranks
from reef_stream.core.errors import ConfigurationError
from tests.recipes.trainable import recipe as single
from tests.recipes.trainable_dp import recipe


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_accelerates_fsdp_is_refused_pointing_at_the_trainers_own(monkeypatch, value):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", value)
    with pytest.raises(ConfigurationError) as refused:
        Ranks.join(recipe)
    message = " ".join(str(refused.value).split())
    assert "on CPUs accelerate ignores FSDP and trains DDP" in message
    assert "rank 0's shard of the optimizer alone" in message
    assert "HuggingFace(path, sharding='fsdp') (--set backend.model.sharding=fsdp)" in message


def test_without_fsdp_a_process_joins_as_rank_0_of_1(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    world = Ranks.join(single)
    assert (world.rank, world.ranks) == (0, 1)
