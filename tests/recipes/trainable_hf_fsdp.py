"""``trainable`` on a tiny Hugging Face model, sharded with FSDP over two trainer ranks
(``HuggingFace(..., sharding="fsdp")``): the model directory is ``$REEF_TEST_HF_MODEL`` (the
test builds it from a config and saves it with ``save_pretrained``). Run it with ``torchrun
--nproc-per-node 2``."""

import dataclasses
import os

from reef_stream.engine.hf import HuggingFace
from tests.recipes.trainable import recipe as single

recipe = dataclasses.replace(single, backend=dataclasses.replace(
    single.backend, data_parallel_size=2,
    model=HuggingFace(os.environ["REEF_TEST_HF_MODEL"], sharding="fsdp")))
