"""The trainable recipe, one unit per step and ``max_staleness`` 2, with an evaluator that
rejects versions 2 to 5 (from version 2 on, four candidates in a row) and promotes every
other version: a trainer at step 4 with replicas serving version 1 has stalled, and must roll
back by itself (its rollback, version 5, is not measured, so the rejection of 5 never applies)."""

import dataclasses

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.events import Checkpoint, Decision
from tests.recipes.trainable import recipe as trainable

REJECTED_VERSIONS = frozenset({2, 3, 4, 5})


@dataclasses.dataclass(frozen=True)
class RejectVersions:
    """Measures a candidate's version; rejects those in ``REJECTED_VERSIONS``."""

    name: str = "reject-versions"
    evaluates: bool = True
    warning: str | None = None

    def measure(self, candidate: Checkpoint) -> Measurement:
        return Measurement({"version": float(candidate.policy_version)})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        version = int(measurement.values["version"])
        if version in REJECTED_VERSIONS:
            return Selection(Decision.REJECTED, f"version {version} is rejected by the test")
        return Selection(Decision.PROMOTED, f"version {version} is promoted by the test")


recipe = dataclasses.replace(
    trainable, name="rejects_in_a_row", evaluator=RejectVersions(),
    schedule=dataclasses.replace(trainable.schedule, units_per_step=1, optimizer_batch_size=1,
                                 max_staleness=2))
