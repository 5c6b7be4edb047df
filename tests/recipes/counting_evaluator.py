"""The good recipe (named ``counting``) with an evaluator that scores like ``HeldOutScore`` and
records the version of every candidate it measures, so a test can count the calls of
``measure``. A test takes a fresh one (``CountingScore()``) for its own count."""

import dataclasses

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.events import Checkpoint
from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good


@dataclasses.dataclass(frozen=True)
class CountingScore:
    """``HeldOutScore``, with ``measured``: the policy version of each candidate measured, in
    the order measured (appended to: the one thing ``measure`` changes)."""

    name: str = "counting-held-out-score"
    evaluates: bool = True
    warning: str | None = None
    measured: list[int] = dataclasses.field(default_factory=list)

    def measure(self, candidate: Checkpoint) -> Measurement:
        self.measured.append(candidate.policy_version)
        return HeldOutScore().measure(candidate)

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """Pure."""
        return HeldOutScore(name=self.name).select(measurement, incumbent)


recipe = dataclasses.replace(good, name="counting", evaluator=CountingScore())
