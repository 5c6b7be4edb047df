"""``trainable_dp`` whose objective returns a NaN advantage for the samples of prompt ``p5``
(unit 5 of ``tests.unit_log``): the rank that trains unit 5 finds its advantages non-finite and
the other rank's are all finite, so the two ranks must agree to abandon the step."""

import dataclasses

import numpy as np

from reef_stream.api.objective import PerSampleAdvantages
from tests.recipes.parts import GroupBaseline
from tests.recipes.trainable_dp import recipe as two_ranks

DIVERGING_GROUP = "p5"


class DivergesOnOneGroup(GroupBaseline):
    def compute(self, units, state):
        result = super().compute(units, state)
        values = np.array(result.advantages.values)
        first = 0
        for unit in units:
            if unit.group_key == DIVERGING_GROUP:
                values[first:first + len(unit.members)] = np.nan
            first += len(unit.members)
        return dataclasses.replace(result, advantages=PerSampleAdvantages(values))


recipe = dataclasses.replace(two_ranks, name="trainable", objective=DivergesOnOneGroup())
