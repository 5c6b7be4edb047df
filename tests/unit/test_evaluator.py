"""Candidate evaluators: measure without side effects, select purely, the default says so."""

from __future__ import annotations

import dataclasses

import pytest

from reef_stream.api.evaluator import (
    AcceptEverything, CandidateEvaluator, Incumbent, Measurement, Selection,
)
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluateSummary
from reef_stream.consumers.evaluator.superseding import superseded_reason, superseding
from reef_stream.core.errors import FatalError
from reef_stream.core.events import Checkpoint, Decision, Publication


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


# --------------------------------------------------------------------------- superseding


def candidate(version: int, model: str = "tiny", recipe: str = "good",
              rolled_back_to: int | None = None) -> Checkpoint:
    return dataclasses.replace(checkpoint(version), model=model, recipe=recipe,
                               rolled_back_to=rolled_back_to)


def test_the_newest_waiting_candidate_supersedes_every_older_one():
    assert superseding([candidate(v) for v in (1, 2, 3, 4, 5)]) == [5, 5, 5, 5, None]
    assert superseding([candidate(7)]) == [None]
    assert superseding([]) == []
    assert superseded_reason(5) == ("superseded: version 5 was waiting when this one's turn "
                                    "came; only the newest waiting candidate is measured")


def test_superseding_stays_within_a_recipe_and_model():
    assert superseding([candidate(1), candidate(7, recipe="other"), candidate(2, model="big"),
                        candidate(2), candidate(3, model="big"),
                        candidate(1, model="big", recipe="other")]) == \
        [2, None, 3, None, None, None]


def test_a_rollback_is_never_superseded_and_supersedes_nothing():
    assert superseding([candidate(5, rolled_back_to=1), candidate(6), candidate(7)]) == \
        [None, 7, None]
    assert superseding([candidate(4), candidate(5, rolled_back_to=1)]) == [None, None]
    assert superseding([candidate(3, rolled_back_to=1), candidate(4, rolled_back_to=1)]) == \
        [None, None]


def test_the_newest_version_is_never_superseded_however_often_it_waits():
    # A re-emitted event of the newest (same version) waits twice: neither is superseded, and
    # the evaluator's ledger finds the second decided. An older version after it is superseded
    # (the ledger would find it not newer than one decided anyway).
    assert superseding([candidate(1), candidate(2), candidate(2), candidate(1)]) == \
        [2, None, None, 2]


def test_supersede_is_on_by_default_and_counted_in_the_summary_line():
    assert EvaluateOptions().supersede and not EvaluateOptions(supersede=False).supersede
    line = EvaluateSummary(group="g", rejected=4, superseded=3).line()
    assert "rejected=4 superseded=3 duplicates=0" in line
