"""The good recipe with an evaluator that measures candidates and rejects every one of them
(a threshold no candidate reaches)."""

import dataclasses

from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good

recipe = dataclasses.replace(good, name="rejecting",
                             evaluator=HeldOutScore(name="unreachable-threshold", threshold=1.0))
