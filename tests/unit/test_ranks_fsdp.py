"""A trainer launched for accelerate's FSDP refuses to start, saying why (it would checkpoint
rank 0's optimizer shard alone), instead of training DDP and writing half an optimizer."""

from __future__ import annotations

import pytest

from reef_stream.consumers.ranks import Ranks
from reef_stream.errors import ConfigurationError
from tests.recipes.trainable import recipe as single
from tests.recipes.trainable_dp import recipe


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_accelerates_fsdp_is_refused_naming_what_it_would_lose(monkeypatch, value):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", value)
    with pytest.raises(ConfigurationError, match="rank 0's shard of the optimizer alone"):
        Ranks.join(recipe)


def test_without_fsdp_a_process_joins_as_rank_0_of_1(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    world = Ranks.join(single)
    assert (world.rank, world.ranks) == (0, 1)
