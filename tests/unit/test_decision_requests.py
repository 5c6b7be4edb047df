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


def waiting(version: int = 2, **overrides) -> Publication:
    return pub(version, Decision.CANARY, share=0.0, awaiting="approval", **overrides)


def test_a_request_carries_what_the_person_saw_and_the_evaluator_makes_the_same_decision():
    ledger = ledger_of(pub(1), waiting(2))
    seen = approval(ledger, "m", 2, by="ann", reason="read samples")
    request = request_for(DecisionKind.APPROVE, seen, reason="read samples")
    assert (request.kind, request.model, request.version, request.rolled_back_to,
            request.decided_by, request.reason) == \
        (DecisionKind.APPROVE, "m", 2, None, "ann", "read samples")
    made = applied(ledger, request, recipe="sao")
    assert (made.decision, made.policy_version, made.decided_by, made.reason, made.recipe) == \
        (Decision.PROMOTED, 2, "ann", "approved by ann: read samples", "sao")
    assert decision_line(made) == "PROMOTED m version 2 by ann: approved by ann: read samples"

    rejected = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob",
                                                          reason="too long"), reason="too long")
    assert applied(ledger, rejected, recipe="sao").reason == "rejected by bob: too long"
    assert request_for(DecisionKind.REJECT, made, reason="x").request_id != rejected.request_id


def test_a_request_the_log_moved_past_is_refused_with_the_reason():
    ledger = ledger_of(pub(1), waiting(2))
    bob = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob", reason="long"),
                      reason="long")
    ledger.record(approval(ledger, "m", 2, by="ann"))  # ann's decision landed first
    publication, outcome = outcome_of(ledger, bob, "reef.evaluate.approval", recipe="approval")
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
    publication, outcome = outcome_of(ledger, request, "g", recipe="r")
    assert (publication.decision, publication.policy_version, publication.rolled_back_to,
            publication.recipe) == (Decision.ROLLED_BACK, 2, 1, "r")
    assert outcome.applied and outcome.text.endswith("; replicas serve version 1 again")

    ledger.record(publication)
    ledger.record(pub(3, Decision.CANARY, share=0.5, awaiting="canary"))  # a newer canary
    with pytest.raises(ConfigurationError, match="takes version 3 out of service, not "
                                                 "version 2 as asked"):
        applied(ledger, request, recipe="r")


def test_a_rejection_request_without_a_reason_is_refused():
    ledger = ledger_of(pub(1), waiting(2))
    request = request_for(DecisionKind.REJECT, rejection(ledger, "m", 2, by="bob", reason="x"),
                          reason=None)
    _, outcome = outcome_of(ledger, request, "g", recipe="r")
    assert (outcome.applied, outcome.text) == (False, "a rejection must say why (--reason)")


def test_of_two_recipes_whose_evaluators_share_a_name_only_the_publishing_one_answers():
    """Both evaluators are named ``e``: the recipe in the publications decides, so one
    model's request is answered by one fenced writer, not by both recipes'."""
    ledger = ledger_of(pub(1, recipe="a"), waiting(2, recipe="a"), pub(1, model="n", recipe="b"))
    assert owns(ledger, "m", recipe="a", evaluator="e", only=None)
    assert not owns(ledger, "m", recipe="b", evaluator="e", only=None)
    assert owns(ledger, "n", recipe="b", evaluator="e", only=None)
    assert not owns(ledger, "n", recipe="a", evaluator="e", only=None)
    assert not owns(ledger, "unknown", recipe="a", evaluator="e", only=None)
    # --model still decides alone
    assert owns(ledger, "n", recipe="a", evaluator="e", only="n")
    assert not owns(ledger, "m", recipe="a", evaluator="e", only="n")


def test_a_canary_passed_by_its_judge_is_still_the_recipes_to_approve_and_roll_back():
    """A canary's verdict names its judge as ``evaluator``, not the recipe's evaluator: the
    recipe it carries keeps the model with that recipe's evaluator."""
    passed = pub(2, Decision.CANARY, share=0.5, awaiting="approval",
                 evaluator="canary mean difference", recipe="a")
    ledger = ledger_of(pub(1, recipe="a"), passed)
    assert owns(ledger, "m", recipe="a", evaluator="e", only=None)
    ledger.record(applied(ledger, request_for(DecisionKind.APPROVE, approval(
        ledger, "m", 2, by="ann"), reason=None), recipe="a"))
    assert ledger.incumbent("m").evaluator == "canary mean difference"
    assert owns(ledger, "m", recipe="a", evaluator="e", only=None)  # reef rollback m


def test_a_publication_written_before_publications_named_their_recipe_is_owned_by_name():
    ledger = ledger_of(pub(1), waiting(2), pub(1, model="n", evaluator="other"))
    assert ledger.waiting("m").recipe is None
    assert owns(ledger, "m", recipe="a", evaluator="e", only=None)
    assert not owns(ledger, "n", recipe="a", evaluator="e", only=None)
    assert owns(ledger, "n", recipe="a", evaluator="e", only="n")
    assert not owns(ledger, "m", recipe="a", evaluator="e", only="n")
    # the evaluator that applies a request on it names its recipe from then on
    made = applied(ledger, request_for(DecisionKind.APPROVE, approval(ledger, "m", 2, by="ann"),
                                       reason=None), recipe="a")
    ledger.record(made)
    assert made.recipe == "a"
    assert not owns(ledger, "m", recipe="b", evaluator="e", only=None)


def test_the_requests_group_is_the_recipes():
    assert requests_group("reef", "sao") == "reef.decide.sao"
