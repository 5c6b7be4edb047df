"""SAO bound to the demo task with a typo in the reward's source: `reef check` must refuse it
(the processor waits for 'exact_match', the reward emits 'exact_mach')."""

import dataclasses

from reef_stream.api.recipe import NamedReward
from reef_stream.demo.recipes import sao
from reef_stream.demo.task import exact_match

recipe = dataclasses.replace(sao, reward=NamedReward("exact_mach", exact_match))
