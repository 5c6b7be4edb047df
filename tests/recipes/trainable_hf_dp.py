"""``trainable`` on a tiny Hugging Face model for two data-parallel ranks: the model directory
is ``$REEF_TEST_HF_MODEL`` (the test builds it from a config and saves it with
``save_pretrained``); ``$REEF_TEST_HF_LORA`` set to a rank trains LoRA adapters of that rank
instead of every parameter. Run it with ``torchrun --nproc-per-node 2``."""

import dataclasses
import os

from reef_stream.engine.hf import HuggingFace, Lora
from tests.recipes.trainable import recipe as single

_lora = os.environ.get("REEF_TEST_HF_LORA")
recipe = dataclasses.replace(single, backend=dataclasses.replace(
    single.backend, data_parallel_size=2,
    model=HuggingFace(os.environ["REEF_TEST_HF_MODEL"],
                      lora=Lora(rank=int(_lora), alpha=2 * int(_lora)) if _lora else None)))
