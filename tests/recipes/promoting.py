"""The good recipe with an evaluator that measures candidates and promotes only improvements."""

import dataclasses

from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good

recipe = dataclasses.replace(good, name="promoting", evaluator=HeldOutScore())
