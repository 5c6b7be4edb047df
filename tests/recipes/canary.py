"""The promoting recipe released through a canary: half the replicas take a candidate the
held-out score promoted, and live feedback decides (``reef_stream.api.canary``)."""

import dataclasses

from reef_stream.api.canary import MeanDifference, Staged
from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good

recipe = dataclasses.replace(good, name="canary", evaluator=Staged(
    HeldOutScore(), canary=MeanDifference(share=0.5, min_samples=40, z=2.0, margin=0.05,
                                          source="exact")))
