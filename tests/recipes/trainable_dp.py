"""``trainable`` for two data-parallel ranks: the same processor, objective, schedule and model,
a backend that declares two ranks (run it with ``torchrun --nproc-per-node 2``)."""

import dataclasses

from tests.recipes.trainable import recipe as single

recipe = dataclasses.replace(single, backend=dataclasses.replace(single.backend,
                                                                 data_parallel_size=2))
