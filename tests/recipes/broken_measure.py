"""The good recipe with an evaluator whose measure always raises."""

import dataclasses

from tests.recipes.evaluators import BrokenMeasure
from tests.recipes.good import recipe as good

recipe = dataclasses.replace(good, name="broken-measure", evaluator=BrokenMeasure())
