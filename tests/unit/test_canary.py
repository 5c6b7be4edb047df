"""Staged publication without a broker: the ledger's fold of stages (canary, rollback, approval),
the keys compaction keeps per stage, canary cohorts, the live-reward fold, the decision rule, the
publication cadence and a person's decisions."""

from __future__ import annotations

import dataclasses
import random

import pytest

from reef_stream.api.canary import Action, Arm, MeanDifference, Staged
from reef_stream.consumers.evaluator.canary import (
    Release, Tally, cadence_reason, judged, stage, verdict_publication, waiting_reason,
)
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import (
    Checkpoint, Decision, Feedback, Generation, SamplingParams,
)
from reef_stream.publishing.decisions import approval, rejection
from reef_stream.publishing.decisions import rollback as rollback_of
from reef_stream.publishing.publications import (
    canary_slot, publication_key, takes_canary,
)
from tests import factories
from tests.factories import ledger_of
from tests.factories import publication as pub
from tests.recipes.evaluators import HeldOutScore


def test_each_stage_has_its_key_and_a_decided_canary_replaces_its_canary_record():
    assert publication_key(pub(1)) == b"m"
    assert publication_key(pub(2, Decision.REJECTED)) == b"m#rejected"
    canary = pub(3, Decision.CANARY, share=0.5, awaiting="canary")
    assert publication_key(canary) == b"m#canary"
    ended = dataclasses.replace(canary, decision=Decision.ROLLED_BACK, rolled_back_to=1)
    assert publication_key(ended) == b"m#canary"
    assert publication_key(dataclasses.replace(canary, decision=Decision.REJECTED)) == b"m#canary"
    assert publication_key(pub(3, Decision.ROLLED_BACK, rolled_back_to=1)) == b"m#rolled_back"


def test_the_ledger_folds_a_canary_its_rollback_and_a_later_promotion():
    canary = pub(2, Decision.CANARY, share=0.5, awaiting="canary")
    ledger = ledger_of(pub(1), canary)
    assert ledger.incumbent("m").policy_version == 1
    assert ledger.waiting("m") == canary
    rolled = verdict_publication(canary, pub(1), _verdict(Action.ROLL_BACK), Release(), "c",
                                 recipe="r")
    assert (rolled.decision, rolled.rolled_back_to, rolled.uri, rolled.recipe) == \
        (Decision.ROLLED_BACK, 1, "/pub/v1", "r")
    ledger.record(rolled)
    ledger.record(canary)  # read back after its own end (record first): stays ended
    assert ledger.waiting("m") is None and ledger.incumbent("m").policy_version == 1
    assert ledger.decided_version("m") == 2
    ledger.record(pub(3, Decision.CANARY, share=0.5, awaiting="canary"))
    ledger.record(pub(3))
    assert ledger.waiting("m") is None and ledger.incumbent("m").policy_version == 3


def test_of_two_recipes_whose_evaluators_share_a_name_only_the_one_that_opened_a_canary_judges_it():
    """Both evaluators are named ``e``: the recipe in the canary's publication decides, so one
    canary is judged by one fenced writer, not by both recipes'."""
    ledger = ledger_of(pub(1, recipe="a"), pub(2, Decision.CANARY, share=0.5, awaiting="canary",
                                               recipe="a"),
                       pub(1, model="n", recipe="b"),
                       pub(2, Decision.CANARY, model="n", share=0.5, awaiting="canary",
                           recipe="b"))
    assert judged(ledger, recipe="a", evaluator="e") == ["m"]
    assert judged(ledger, recipe="b", evaluator="e") == ["n"]
    assert judged(ledger, recipe="a", evaluator="e", only="m") == ["m"]
    assert judged(ledger, recipe="a", evaluator="e", only="n") == []  # --model: still its own
    assert judged(ledger, recipe="c", evaluator="e") == []


def test_a_canary_opened_before_publications_named_their_recipe_is_judged_by_name():
    ledger = ledger_of(pub(1), pub(2, Decision.CANARY, share=0.5, awaiting="canary"),
                       pub(1, model="n", evaluator="other"),
                       pub(2, Decision.CANARY, model="n", share=0.5, awaiting="canary",
                           evaluator="other"))
    assert judged(ledger, recipe="a", evaluator="e") == ["m"]
    assert judged(ledger, recipe="b", evaluator="other") == ["n"]
    assert judged(ledger, recipe="a", evaluator="e", only="n") == []


def test_a_compacted_log_keeps_what_replicas_serve():
    """Only the latest record per key survives compaction; the fold of what is left agrees."""
    log = [pub(1), pub(2, Decision.CANARY, share=0.5, awaiting="canary"),
           pub(2, Decision.ROLLED_BACK, share=0.5, rolled_back_to=1),
           pub(3, Decision.REJECTED), pub(4), pub(4, Decision.ROLLED_BACK, rolled_back_to=1,
                                                  uri="/pub/v1", sha256="sha1")]
    latest = {publication_key(p): i for i, p in enumerate(log)}
    compacted = [p for i, p in enumerate(log) if latest[publication_key(p)] == i]
    for publications in (log, compacted):
        ledger = ledger_of(*publications)
        assert ledger.waiting("m") is None
        incumbent = ledger.incumbent("m")
        assert (incumbent.policy_version, incumbent.uri, incumbent.sha256) == \
            (1, "/pub/v1", "sha1")


def test_a_person_rolls_the_incumbent_back_and_a_newer_promotion_follows():
    ledger = ledger_of(pub(1), pub(2), pub(3))
    with pytest.raises(ConfigurationError, match="not earlier"):
        rollback_of(ledger, "m", by="ann", to=3)
    with pytest.raises(ConfigurationError, match="no PROMOTED publication"):
        rollback_of(ledger, "m", by="ann", to=0)
    with pytest.raises(ConfigurationError, match="no longer verifies"):
        rollback_of(ledger, "m", by="ann")  # /pub/v2 does not exist
    event = dataclasses.replace(pub(3), decision=Decision.ROLLED_BACK, rolled_back_to=2,
                                uri="/pub/v2", sha256="sha2", decided_by="ann")
    ledger.record(event)
    assert ledger.incumbent("m") == pub(2)
    assert ledger.promoted_versions("m") == [1, 2]
    ledger.record(pub(4))
    assert ledger.incumbent("m").policy_version == 4


def test_approval_and_rejection_apply_to_the_waiting_version_only():
    waiting = pub(2, Decision.CANARY, share=0.0, awaiting="approval")
    ledger = ledger_of(pub(1), waiting)
    with pytest.raises(ConfigurationError, match="not waiting for a decision"):
        approval(ledger, "m", 1, by="ann")
    with pytest.raises(ConfigurationError, match="must say why"):
        rejection(ledger, "m", 2, by="ann", reason=" ")
    approved = approval(ledger, "m", 2, by="ann", reason="read samples")
    assert (approved.decision, approved.decided_by, approved.share) == \
        (Decision.PROMOTED, "ann", None)
    assert approved.reason == "approved by ann: read samples"
    rejected = rejection(ledger, "m", 2, by="bob", reason="too long")
    assert (rejected.decision, rejected.share, publication_key(rejected)) == \
        (Decision.REJECTED, 0.0, b"m#canary")
    ledger.record(rejected)
    assert ledger.waiting("m") is None and ledger.incumbent("m").policy_version == 1


def test_canary_cohorts_are_deterministic_and_exact_with_numbered_slots():
    canary = pub(7, Decision.CANARY, share=0.5, awaiting="canary")
    for n in (2, 4, 10):
        taken = [takes_canary(canary, i / n) for i in range(n)]
        assert sum(taken) == n // 2, n
    ids = [f"replica-{i}" for i in range(2000)]
    share = sum(takes_canary(canary, canary_slot(r)) for r in ids) / len(ids)
    assert 0.45 < share < 0.55
    assert canary_slot("replica-3") == canary_slot("replica-3")
    other = dataclasses.replace(canary, policy_version=8)
    assert [takes_canary(canary, canary_slot(r)) for r in ids] != \
        [takes_canary(other, canary_slot(r)) for r in ids]  # another cohort per version
    assert not takes_canary(dataclasses.replace(canary, share=0.0), 0.3)
    assert takes_canary(dataclasses.replace(canary, share=1.0), 0.3)
    ledger = ledger_of(pub(6), canary)
    assert {ledger.serving("m", i / 4).policy_version for i in range(4)} == {6, 7}


def _generation(gid: str, version: int, created_at: int = 5000, model: str = "m") -> Generation:
    return factories.generation(
        gid, request_id=gid, prompt_id="p", model=model, policy_version=version, replica_id="r",
        prompt_token_ids=factories.ids([1]), completion_token_ids=factories.ids([2]),
        completion_logprobs=factories.logprobs([-0.1]), sampling=SamplingParams(max_tokens=1),
        created_at=created_at)


def _feedback(gid: str, reward: float, source: str = "exact") -> Feedback:
    return factories.feedback(gid, feedback_id=f"f-{gid}-{source}", source=source, reward=reward,
                              created_at=6000)


def test_the_tally_joins_in_any_order_once_per_generation_and_only_in_the_window():
    """The two topics interleave in any way; one generation's feedback records keep their order
    (they share a partition: keyed by generation id)."""
    rng = random.Random(3)
    blocks = []
    for i in range(200):
        version = (2, 1)[i % 2]
        blocks.append([_generation(f"g{i}", version)])
        blocks.append([_feedback(f"g{i}", float(version == 2) + rng.random()),
                       _feedback(f"g{i}", 100.0)])  # a second feedback: not counted
    blocks += [[_generation("old", 2, created_at=10)], [_feedback("old", 50.0)],
               [_generation("other", 3)], [_feedback("other", 50.0)],
               [_generation("m2", 2, model="n")], [_feedback("m2", 50.0)],
               [_generation("src", 2)], [_feedback("src", 50.0, source="judge")]]
    arms = []
    for order in range(3):
        shuffled = list(blocks)
        if order:
            random.Random(order).shuffle(shuffled)
        tally = Tally("m", candidate=2, incumbent=1, since_ms=1000, source="exact")
        for event in (event for block in shuffled for event in block):
            (tally.generation if isinstance(event, Generation) else tally.feedback)(event)
        arms.append(tally.arms())
    for canary, incumbent in arms:
        assert (canary.count, incumbent.count) == (100, 100)
        assert canary.mean == pytest.approx(arms[0][0].mean)
        assert canary.mean - incumbent.mean == pytest.approx(1.0, abs=0.15)


def test_mean_difference_waits_then_promotes_or_rolls_back():
    rule = MeanDifference(min_samples=50, z=2.0, margin=0.05)
    assert rule.judge(Arm(2, 10, 1.0, 0.1), Arm(1, 500, 0.0, 0.1)).action is Action.WAIT
    assert rule.judge(Arm(2, 100, 0.5, 0.04), Arm(1, 100, 0.8, 0.04)).action is Action.ROLL_BACK
    promote = rule.judge(Arm(2, 100, 0.8, 0.04), Arm(1, 100, 0.7, 0.04))
    assert promote.action is Action.PROMOTE and "not worse" in promote.reason
    assert promote.figures["difference"] == pytest.approx(0.1)
    assert rule.judge(Arm(2, 60, 0.69, 0.04), Arm(1, 60, 0.7, 0.04)).action is Action.WAIT
    capped = MeanDifference(min_samples=50, max_samples=60, margin=0.05)
    assert capped.judge(Arm(2, 60, 0.69, 0.04), Arm(1, 60, 0.7, 0.04)).action is Action.PROMOTE
    with pytest.raises(ConfigurationError, match="share"):
        MeanDifference(share=0)
    assert Arm.of(1, [1.0, 3.0]) == Arm(1, 2, 2.0, 2.0)


def _checkpoint(version: int, created_at: int) -> Checkpoint:
    return Checkpoint(checkpoint_id=f"c{version}", recipe="r", trainer_group="g", step=version,
                      model="m", policy_version=version, uri="/x", sha256="s", offsets=(),
                      trained_unit_count=0, created_at=created_at)


def test_the_publication_cadence_counts_on_the_trainers_clock():
    incumbent = pub(1, checkpoint_created_at=10_000)
    assert cadence_reason(_checkpoint(2, 14_000), incumbent, None) is None
    reason = cadence_reason(_checkpoint(2, 14_000), incumbent, 5.0)
    assert reason.startswith("publication cadence:") and "4.0 s" in reason
    assert cadence_reason(_checkpoint(3, 15_000), incumbent, 5.0) is None
    assert cadence_reason(_checkpoint(2, 11_000), None, 5.0) is None
    rollback = dataclasses.replace(_checkpoint(2, 11_000), rolled_back_to=1)
    assert cadence_reason(rollback, incumbent, 5.0) is None


def test_the_release_policy_stages_what_the_offline_gate_promoted():
    evaluator = Staged(HeldOutScore(), canary=MeanDifference(share=0.25), publish_every_s=3.0)
    release = Release.of(evaluator)
    assert (release.canary.share, release.require_approval, release.publish_every_s) == \
        (0.25, False, 3.0)
    assert Release.of(evaluator, canary_share=0.5).canary.share == 0.5
    assert Release.of(evaluator, canary_share=0).canary is None
    assert Release.of(HeldOutScore(), canary_share=0.5).canary == MeanDifference(share=0.5)
    promoted = pub(2)
    staged = stage(promoted, release, has_incumbent=True)
    assert (staged.decision, staged.share, staged.awaiting) == (Decision.CANARY, 0.25, "canary")
    assert stage(promoted, release, has_incumbent=False) == promoted  # a first version
    approval_only = Release(require_approval=True)
    held = stage(promoted, approval_only, has_incumbent=False)
    assert (held.decision, held.share, held.awaiting) == (Decision.CANARY, 0.0, "approval")
    assert "approval" in waiting_reason(held)
    passed = verdict_publication(staged, pub(1), _verdict(Action.PROMOTE),
                                 Release(canary=release.canary, require_approval=True), "c",
                                 recipe="r")
    assert (passed.decision, passed.awaiting, passed.measurement["canary_mean"]) == \
        (Decision.CANARY, "approval", 0.5)
    assert Staged(HeldOutScore()).name == "held-out-score" and Staged(HeldOutScore()).evaluates


def _verdict(action: Action):
    from reef_stream.api.canary import Verdict

    return Verdict(action, f"{action.value} by the test", {"canary_mean": 0.5})


def test_the_dashboard_shows_the_version_waiting_for_a_decision():
    from reef_stream.ops.dashboard.card import first_row

    def measurement_tile(*publications):
        return {t["id"]: t for t in first_row([], publications)}["measurement"]

    canary = pub(2, Decision.CANARY, share=0.5, awaiting="canary", measurement={"accuracy": 0.7})
    tile = measurement_tile(pub(1, measurement={"accuracy": 0.6}), canary)
    assert "waiting for a decision: m v2 (canary, canary 50%)" in tile["value"]
    assert tile["figures"]["waiting"] == [["m", 2, 0.5, "canary"]]
    ended = dataclasses.replace(canary, decision=Decision.ROLLED_BACK, rolled_back_to=1)
    assert "waiting" not in measurement_tile(pub(1), canary, ended)["value"]
    held = pub(3, Decision.CANARY, share=0.0, awaiting="approval")
    assert "m v3 (approval)" in measurement_tile(pub(1), held)["value"]


def test_the_demo_report_plots_each_canary_decided_on_live_feedback():
    from reef_stream.demo.report import canary_decisions

    live = {"canary_mean": 0.4, "incumbent_mean": 0.5, "score": 1.0}
    publications = [(0.0, pub(1)), (1.0, pub(2, Decision.CANARY, share=0.5, measurement=live)),
                    (2.0, pub(2, Decision.ROLLED_BACK, share=0.5, rolled_back_to=1,
                              measurement=live)),
                    (3.0, pub(3, measurement={**live, "canary_mean": 0.6}))]
    assert canary_decisions(publications) == [(2, 0.4, 0.5, Decision.ROLLED_BACK),
                                              (3, 0.6, 0.5, Decision.PROMOTED)]


def test_after_a_persons_rollback_the_trainer_rolls_back_to_that_version_and_not_while_staged():
    """Versions stay monotonic: the rolled-back-to version is the incumbent, a trainer too far
    past it stalls and rolls back to its weights as its next version, which the evaluator's
    check promotes; a staged version is no stall."""
    import logging

    import torch

    from reef_stream.publishing.rollback import StallWatch, check_rollback, stall_reason

    ledger = ledger_of(pub(1), pub(5), pub(5, Decision.ROLLED_BACK, rolled_back_to=1,
                                           uri="/pub/v1", sha256="sha1"))
    incumbent = ledger.incumbent("m")
    reason = stall_reason(9, 2, incumbent, decided_version=9)
    assert reason is not None and "replicas serve version 1" in reason
    weights = {"w": torch.ones(2)}
    assert check_rollback(1, incumbent, weights, weights)[0] is Decision.PROMOTED

    watch = StallWatch("unused:9092", "ns", model="m", max_staleness=2,
                       log=logging.getLogger("test"))
    watch.ledger = ledger_of(pub(1), pub(9, Decision.REJECTED))
    watch.ledger.poll = lambda timeout: []  # a fold-only ledger: nothing more arrives
    assert watch.target(9, None)[0].policy_version == 1
    watch.ledger.record(pub(10, Decision.CANARY, share=0.5, awaiting="canary"))
    assert watch.target(10, None) is None
