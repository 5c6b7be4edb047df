"""The good recipe (named ``gated``) with an evaluator that scores like ``HeldOutScore`` but
holds each measurement at a gate: it writes ``measuring-v<version>`` into the directory
``REEF_TEST_GATE`` names, then waits until a file ``go`` is there. A test pauses an evaluator
at that moment, inside a decision, without sleeping on a guess."""

import dataclasses
import os
import time
from pathlib import Path

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.events import Checkpoint
from tests.recipes.evaluators import HeldOutScore
from tests.recipes.good import recipe as good

#: The longest a measurement waits at the gate before it goes on anyway.
GATE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class GatedScore:
    """``HeldOutScore``, each measurement held at the gate (see the module docstring)."""

    name: str = "gated-held-out-score"
    evaluates: bool = True
    warning: str | None = None

    def measure(self, candidate: Checkpoint) -> Measurement:
        """Blocks at the gate (up to ``GATE_TIMEOUT_S``), then loads and scores."""
        gate = Path(os.environ["REEF_TEST_GATE"])
        (gate / f"measuring-v{candidate.policy_version}").touch()
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not (gate / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return HeldOutScore().measure(candidate)

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """Pure."""
        return HeldOutScore(name=self.name).select(measurement, incumbent)


recipe = dataclasses.replace(good, name="gated", evaluator=GatedScore())
