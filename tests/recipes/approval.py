"""The promoting recipe with a person in the loop: what the held-out score promotes waits for
``reef approve`` (``reef_stream.api.canary.Staged(require_approval=True)``)."""

import dataclasses

from reef_stream.api.canary import Staged
from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good

recipe = dataclasses.replace(good, name="approval",
                             evaluator=Staged(HeldOutScore(), require_approval=True))
