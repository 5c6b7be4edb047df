"""Candidate evaluators: measure without side effects, select purely, the default says so."""

from __future__ import annotations

import pytest

from reef_stream.errors import FatalError
from reef_stream.api.evaluator import (
    AcceptEverything,
    CandidateEvaluator,
    Incumbent,
    Measurement,
    Selection,
)
from reef_stream.topics.events import Checkpoint, Decision, Publication


def checkpoint(version: int = 4) -> Checkpoint:
    return Checkpoint(checkpoint_id=f"ckpt-{version}", recipe="good", trainer_group="t", step=9,
                      model="tiny", policy_version=version, uri="file:///tmp/ckpt", sha256="0" * 64,
                      offsets=(), trained_unit_count=72, created_at=0)


def test_accept_everything_promotes_every_candidate_and_says_so_loudly():
    evaluator = AcceptEverything()
    assert isinstance(evaluator, CandidateEvaluator)
    assert evaluator.evaluates is False
    assert "accept-everything" in evaluator.name and "unevaluated" in evaluator.name
    assert "WITHOUT evaluation" in evaluator.warning
    measurement = evaluator.measure(checkpoint())
    assert measurement == Measurement() and dict(measurement.values) == {}
    incumbent = Incumbent(policy_version=3, measurement=Measurement({"accuracy": 0.9}))
    for previous in (None, incumbent):
        selection = evaluator.select(measurement, previous)
        assert selection.decision is Decision.PROMOTED and selection.promoted
        assert "without evaluation" in selection.reason


class BeatTheIncumbent:
    """Promotes a candidate whose accuracy beats the incumbent's."""

    name = "beat-the-incumbent"
    evaluates = True
    warning = None

    def __init__(self, accuracy: float):
        self.accuracy = accuracy

    def measure(self, candidate: Checkpoint) -> Measurement:
        return Measurement({"accuracy": self.accuracy})

    def select(self, measurement: Measurement, incumbent: Incumbent | None) -> Selection:
        best = incumbent.measurement.values["accuracy"] if incumbent else float("-inf")
        if measurement.values["accuracy"] > best:
            return Selection(Decision.PROMOTED, f"accuracy {measurement.values['accuracy']} > {best}")
        return Selection(Decision.REJECTED, f"accuracy {measurement.values['accuracy']} <= {best}")


def test_a_measuring_evaluator_follows_the_protocol_and_compares_to_the_incumbent():
    publication = Publication(model="tiny", policy_version=3, checkpoint_id="ckpt-3", uri="u",
                              sha256="0" * 64, decision=Decision.PROMOTED, reason="r",
                              evaluator="beat-the-incumbent", evaluated=True,
                              measurement={"accuracy": 0.5}, created_at=0)
    incumbent = Incumbent.from_publication(publication)
    assert incumbent == Incumbent(3, Measurement({"accuracy": 0.5}))
    better, worse = BeatTheIncumbent(0.6), BeatTheIncumbent(0.4)
    assert isinstance(better, CandidateEvaluator)
    assert better.select(better.measure(checkpoint()), incumbent).promoted
    rejected = worse.select(worse.measure(checkpoint()), incumbent)
    assert rejected.decision is Decision.REJECTED and rejected.reason == "accuracy 0.4 <= 0.5"


def test_a_rejected_publication_is_no_incumbent():
    publication = Publication(model="tiny", policy_version=3, checkpoint_id="c", uri="u",
                              sha256="0" * 64, decision=Decision.REJECTED, reason="worse",
                              evaluator="e", evaluated=True, created_at=0)
    with pytest.raises(FatalError, match="only a promoted one"):
        Incumbent.from_publication(publication)


def test_measurements_and_selections_are_checked():
    with pytest.raises(FatalError, match="finite floats"):
        Measurement({"accuracy": float("nan")})
    with pytest.raises(FatalError, match="say why"):
        Selection(Decision.PROMOTED, "  ")
    with pytest.raises(FatalError, match="must be a Decision"):
        Selection("PROMOTED", "because")
    with pytest.raises(TypeError):
        Measurement({"a": 1.0}).values["a"] = 2.0
