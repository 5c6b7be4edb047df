"""A person's decision requests without a broker: what a command asks (``request_for``), what
the evaluator makes of it against its own ledger (``applied``, ``outcome_of``: the decision, or
a refusal saying why once the log moved on), which evaluator answers it (``owns``) and the line
the command prints."""

from __future__ import annotations

import pytest

from reef_stream.consumers.evaluator.requests import outcome_of, owns, requests_group
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Decision, DecisionKind, Publication
from reef_stream.publishing.decisions import (
    applied, approval, decision_line, rejection, request_for, rollback,
)
from tests.factories import ledger_of
from tests.factories import publication as pub


def waiting(version: int = 2) -> Publication:
    return pub(version, Decision.CANARY, share=0.0, awaiting="approval")


def test_a_request_carries_what_the_person_saw_and_the_evaluator_makes_the_same_decision():
    ledger = ledger_of(pub(1), waiting(2))
    seen = approval(ledger, "m", 2, by="ann", reason="read samples")
    request = request_for(DecisionKind.APPROVE, seen, reason="read samples")
    assert (request.kind, request.model, request.version, request.rolled_back_to,
            request.decided_by, request.reason) == \
        (DecisionKind.APPROVE, "m", 2, None, "ann", "read samples")
    made = applied(ledger, request)
    assert (made.decision, made.policy_version, made.decided_by, made.reason) == \
        (Decision.PROMOTED, 2, "ann", "approved by ann: read samples")
    assert decision_line(made) == "PROMOTED m version 2 by ann: approved by ann: read samples"

    rejected = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob",
                                                          reason="too long"), reason="too long")
    assert applied(ledger, rejected).reason == "rejected by bob: too long"
    assert request_for(DecisionKind.REJECT, made, reason="x").request_id != rejected.request_id


def test_a_request_the_log_moved_past_is_refused_with_the_reason():
    ledger = ledger_of(pub(1), waiting(2))
    bob = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob", reason="long"),
                      reason="long")
    ledger.record(approval(ledger, "m", 2, by="ann"))  # ann's decision landed first
    publication, outcome = outcome_of(ledger, bob, "reef.evaluate.approval")
    assert publication is None
    assert (outcome.request_id, outcome.applied, outcome.policy_version) == \
        (bob.request_id, False, None)
    assert outcome.text == ("version 2 of model 'm' is not waiting for a decision (nothing "
                            "is; it serves version 2)")
    assert outcome.evaluator_group == "reef.evaluate.approval"


def test_a_rollback_request_applies_only_to_the_version_the_person_saw():
    ledger = ledger_of(pub(1), pub(2, Decision.CANARY, share=0.5, awaiting="canary"))
    seen = rollback(ledger, "m", by="carl")  # the canary, back to 1: nothing to verify
    request = request_for(DecisionKind.ROLLBACK, seen, reason=None)
    assert (request.version, request.rolled_back_to) == (2, 1)
    publication, outcome = outcome_of(ledger, request, "g")
    assert (publication.decision, publication.policy_version, publication.rolled_back_to) == \
        (Decision.ROLLED_BACK, 2, 1)
    assert outcome.applied and outcome.text.endswith("; replicas serve version 1 again")

    ledger.record(publication)
    ledger.record(pub(3, Decision.CANARY, share=0.5, awaiting="canary"))  # a newer canary
    with pytest.raises(ConfigurationError, match="takes version 3 out of service, not "
                                                 "version 2 as asked"):
        applied(ledger, request)


def test_a_rejection_request_without_a_reason_is_refused():
    ledger = ledger_of(pub(1), waiting(2))
    request = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob", reason="x"),
                          reason=None)
    _, outcome = outcome_of(ledger, request, "g")
    assert (outcome.applied, outcome.text) == (False, "a rejection must say why (--reason)")


def test_the_evaluator_that_published_the_model_answers_its_requests():
    ledger = ledger_of(pub(1), waiting(2), pub(1, model="n", evaluator="other"))
    assert owns(ledger, "m", "e", None)
    assert not owns(ledger, "n", "e", None)
    assert not owns(ledger, "unknown", "e", None)
    assert owns(ledger, "n", "e", "n") and not owns(ledger, "m", "e", "n")
    assert requests_group("reef", "sao") == "reef.decide.sao"
