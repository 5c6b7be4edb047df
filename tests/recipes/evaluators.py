"""Candidate evaluators for the evaluation and serving tests, and the tiny model they measure.

The model is ``torch.nn.Linear(4, 2)``; the held-out task is ``y = x @ TARGET.T``, so a
candidate scores ``-mse`` against it (0 is perfect). Tests write checkpoints with
``weights(alpha)`` (``alpha * TARGET``, no bias): the closer ``alpha`` is to 1, the better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.core.events import Checkpoint, Decision
from reef_stream.engine.checkpoints import load_weights

TARGET = torch.tensor([[1.0, -1.0, 0.5, 2.0], [0.0, 1.0, -2.0, 1.0]])
_HELD_OUT = torch.linspace(-1, 1, 32).reshape(8, 4)


def weights(alpha: float) -> dict[str, torch.Tensor]:
    """The state dict of a ``Linear(4, 2)`` at ``alpha`` of the way to the target."""
    return {"weight": TARGET * alpha, "bias": torch.zeros(2)}


def score(state: dict[str, torch.Tensor]) -> float:
    """Minus the mean squared error on the held-out inputs."""
    predicted = _HELD_OUT @ state["weight"].T + state["bias"]
    return -float(((predicted - _HELD_OUT @ TARGET.T) ** 2).mean())


@dataclass(frozen=True, slots=True)
class HeldOutScore:
    """Measures ``score`` on the held-out set (loading the verified weights); promotes a
    candidate that beats the incumbent by ``min_gain`` and reaches ``threshold``."""

    name: str = "held-out-score"
    evaluates: bool = True
    warning: str | None = None
    min_gain: float = 0.0
    threshold: float = float("-inf")

    def measure(self, candidate: Checkpoint) -> Measurement:
        """Loads the candidate and scores it. Blocks for the load; no side effects."""
        return Measurement({"score": score(load_weights(candidate.uri, candidate.sha256))})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        """Pure."""
        value = measurement.values["score"]
        if value < self.threshold:
            return Selection(Decision.REJECTED, f"score {value:.4f} is below the threshold "
                                                f"{self.threshold:g}")
        if incumbent is None:
            return Selection(Decision.PROMOTED, f"score {value:.4f}; no incumbent")
        best = incumbent.measurement.values.get("score", float("-inf"))
        if value > best + self.min_gain:
            return Selection(Decision.PROMOTED, f"score {value:.4f} beats version "
                                                f"{incumbent.policy_version}'s {best:.4f}")
        return Selection(Decision.REJECTED, f"score {value:.4f} does not beat version "
                                            f"{incumbent.policy_version}'s {best:.4f}")


@dataclass(frozen=True, slots=True)
class BrokenMeasure:
    """An evaluator whose measure always raises: every candidate must end REJECTED, with why."""

    name: str = "broken-measure"
    evaluates: bool = True
    warning: str | None = None

    def measure(self, candidate: Checkpoint) -> Measurement:
        raise RuntimeError("the judge is down")

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        return Selection(Decision.PROMOTED, "never reached")
