"""``tests.recipes.good`` made complete for ``reef check``: a model to train, the group size
replicas sample, and its feedback source declared as fed from outside (it has no reward)."""

import dataclasses

from reef_stream.engine.models import TinyCausalLM
from tests.recipes.good import recipe as good


def tiny_model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=64, dim=16)


recipe = dataclasses.replace(good, group_size=4, external_sources=("exact_match",),
                             backend=dataclasses.replace(good.backend, model=tiny_model))
