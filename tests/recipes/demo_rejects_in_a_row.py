"""SAO bound to the demo task, with an evaluator that rejects every candidate from version 2
to 21 (twenty in a row, more than SAO's ``max_staleness`` of 16) and otherwise decides as the
demo's ``HeldOutAccuracy``: the trainer runs more than ``max_staleness`` past the version
replicas serve, the loop stalls, and must roll back by itself and still reach its target
(``bench/rollback.py``; the short version is ``tests/integration/test_rollback.py``)."""

import dataclasses

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.events import Checkpoint, Decision
from reef_stream.demo.recipes import TOLERANCE, sao
from reef_stream.demo.task import HeldOutAccuracy

REJECTED_VERSIONS = range(2, 22)


@dataclasses.dataclass(frozen=True)
class RejectingHeldOutAccuracy:
    """``HeldOutAccuracy``, except that versions in ``REJECTED_VERSIONS`` are rejected."""

    held_out: HeldOutAccuracy = HeldOutAccuracy(tolerance=TOLERANCE)
    name: str = "held-out-accuracy, rejecting versions 2-21"
    evaluates: bool = True
    warning: str | None = None

    def measure(self, candidate: Checkpoint) -> Measurement:
        measured = self.held_out.measure(candidate)
        return Measurement({**measured.values, "version": float(candidate.policy_version)})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        version = int(measurement.values["version"])
        if version in REJECTED_VERSIONS:
            return Selection(Decision.REJECTED, f"version {version} is rejected by the bench "
                                                f"(versions {REJECTED_VERSIONS.start}-"
                                                f"{REJECTED_VERSIONS.stop - 1})")
        return self.held_out.select(measurement, incumbent)


recipe = dataclasses.replace(sao, name="sao_rejects", evaluator=RejectingHeldOutAccuracy())
