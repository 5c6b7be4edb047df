"""The scorecard's arithmetic (``reef_stream.ops.scorecard.fold``) on events built by hand, no
broker: a trainer restart does not lose or double its counts, percentiles come from the
trainer's bucketed histogram, time to target is the first promoted publication at or above
the target, goodput and the infra CPU share, and an empty namespace gives empty figures.
Every expected value is worked out in the comments beside it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import reef_stream.consumers.trainer.trainer as trainer_module
from reef_stream.core.events import DeadLetter, Decision, Metric, Publication
from reef_stream.core.metric_names import (
    FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, PROCESS_CPU_SECONDS, STAGE_EVALUATOR, STAGE_FOLLOWER,
    STAGE_PROCESSOR, STAGE_REWARD, STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES,
    TRAINER_STALENESS_SAMPLES, UNKNOWN_STALENESS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.join import Outcome
from reef_stream.ops.scorecard import (
    SHED_KINDS, TOO_STALE_KINDS, Distribution, GenerationsSpan, bucketed, counter_total, fold,
    is_shed,
)
from reef_stream.topics import declarations
from reef_stream.topics.dead_letters import headers_of
from tests.unit_log import rollout_unit

NS, RECIPE = "tscore", "sao"
T0 = 1_000_000  # ms: the first generation's timestamp
SPAN = GenerationsSpan(count=40, first_ms=T0, last_ms=T0 + 50_000)
TRAINER_LABELS = {"recipe": RECIPE, "group": "g"}


def metric(stage, name, value, at=T0, **labels):
    return Metric(stage=stage, name=name, value=float(value), labels=labels, created_at=at)


def staleness(value, versions, recipe=RECIPE):
    return metric(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, value, recipe=recipe, group="g",
                  staleness=str(versions))


def age(value, le):
    return metric(STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, value, le=le, **TRAINER_LABELS)


def cpu(stage, process, value, **labels):
    return metric(stage, PROCESS_CPU_SECONDS, value, process=process, **labels)


def publication(decision, accuracy, at, version=1):
    return Publication(model="m", policy_version=version, checkpoint_id=f"c{version}",
                       uri="file:///c", sha256="0" * 64, decision=decision, reason="r",
                       evaluator="e", evaluated=True,
                       measurement={} if accuracy is None else {"accuracy": accuracy},
                       created_at=at)


def letter(kind, stage=STAGE_PROCESSOR, source=None, value=None, headers=()):
    return DeadLetter(reason="why", error_type=kind,
                      source_topic=source or declarations.generations(NS), source_partition=0,
                      source_offset=0, value=value, headers=headers, stage=stage, created_at=T0)


# ----------------------------------------------------------------- the parts


def test_a_counter_total_adds_the_last_value_of_each_run_between_restarts():
    assert counter_total([]) == 0
    assert counter_total([3, 3, 3]) == 3
    assert counter_total([2, 5, 9, 1, 4]) == 9 + 4          # restarted after 9
    assert counter_total([0.5, 1.0, 0.2, 0.7]) == pytest.approx(1.0 + 0.7)
    assert counter_total([4, 0, 0, 2]) == 4 + 2              # a restart that wrote 0 first


def test_percentiles_of_a_histogram_are_bucket_bounds_and_its_mean_takes_midpoints():
    # per bucket: (0, .5] 10, (.5, 1] 30, (1, 2] 50, (2, 4] 9, (4, inf) 1: n = 100;
    # cumulative 10, 40, 90, 99, 100: rank 50 is in (1, 2], rank 99 in (2, 4]
    # mean of midpoints: (10 * .25 + 30 * .75 + 50 * 1.5 + 9 * 3 + 1 * 4) / 100 = 131 / 100
    d = bucketed({0.5: 10, 1.0: 30, 2.0: 50, 4.0: 9, math.inf: 1})
    assert d == Distribution(100, pytest.approx(1.31), 2.0, 4.0)
    # two samples, one above every bound: p99 (rank 2) is unbounded
    assert bucketed({1.0: 1, math.inf: 1}).p99 == math.inf
    # an empty bucket the writer left out still bounds the next one: (0.5, 1] has midpoint .75,
    # and (4, inf) counts at 4
    assert bucketed({1.0: 2}, bounds=(0.5, 1.0)).mean == 0.75
    assert bucketed({1.0: 1, math.inf: 1}, bounds=(1.0, 4.0)).mean == (0.5 + 4) / 2


def test_the_kinds_of_shed_and_too_stale_are_the_ones_the_code_writes():
    # the processor's letters are "processor.<outcome>" (consumers/processor/step_records.py), the
    # trainer's too-stale letter is "TooStale" (consumers/trainer/trainer.py)
    assert f"processor.{Outcome.SHED.value}" in SHED_KINDS
    assert f"processor.{Outcome.TOO_STALE.value}" in TOO_STALE_KINDS
    assert '"TooStale"' in Path(trainer_module.__file__).read_text()
    assert is_shed("processor.shed") and is_shed("trainer.shed")
    assert not is_shed("processor.too_stale") and not is_shed("TooStale")


# ----------------------------------------------------------------- a whole card


def _card(**overrides):
    registry = SchemaRegistry.default()
    unit_value, unit_headers = registry.encode(rollout_unit(0, recipe=RECIPE, group_size=4))
    units = declarations.units(NS, RECIPE)
    metrics = [
        # staleness 1: 2, 5, 9, then the trainer restarts: 1, 4 -> 9 + 4 = 13 samples
        *(staleness(v, 1) for v in (2, 5, 9)),
        staleness(4, 0),                                   # staleness 0: 4 samples
        staleness(1, 3), staleness(3, 3),                  # staleness 3: 1, 3, restart, 2
        *(staleness(v, 1) for v in (1, 4)),
        staleness(2, 3),                                   # -> 3 + 2 = 5 samples
        staleness(100, 0, recipe="grpo"),                  # another recipe's trainer: left out
        # ages (buckets ops/histograms.AGE_BOUNDS_S): le "1" is (0.75, 1]: 4, restart, 1, 2
        # -> 4 + 2 = 6 samples; le "2" is (1.5, 2]: 3; "+Inf" is above 256 s: 1
        age(4, "1"), age(3, "2"), age(1, "1"), age(2, "1"), age(1, "+Inf"),
        # checkpoint -> serving, one event per version loaded: 3, 1, 2, 10 s
        *(metric(STAGE_FOLLOWER, FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, s, replica=r, model="m")
          for s, r in ((3, "a"), (1, "b"), (2, "a"), (10, "b"))),
        # CPU: reward 3 s, processor 5 s, trainer 10 + 6 s (restarted: a new process),
        # evaluator 2 s
        cpu(STAGE_REWARD, "h.1", 1), cpu(STAGE_REWARD, "h.1", 2), cpu(STAGE_REWARD, "h.1", 3),
        cpu(STAGE_PROCESSOR, "h.2", 2), cpu(STAGE_PROCESSOR, "h.2", 5),
        cpu(STAGE_TRAINER, "h.3", 4, **TRAINER_LABELS),
        cpu(STAGE_TRAINER, "h.3", 10, **TRAINER_LABELS),
        cpu(STAGE_TRAINER, "h.4", 1, **TRAINER_LABELS),
        cpu(STAGE_TRAINER, "h.4", 6, **TRAINER_LABELS),
        cpu(STAGE_EVALUATOR, "h.5", 2),
        metric(STAGE_REWARD, "records", 7, at=T0 + 60_000),  # the last record seen
    ]
    publications = [
        publication(Decision.PROMOTED, 0.97, T0 + 40_000, 4),
        publication(Decision.PROMOTED, 0.5, T0 + 10_000, 1),
        publication(Decision.REJECTED, 0.95, T0 + 20_000, 2),  # above target, but rejected
        publication(Decision.PROMOTED, None, T0 + 25_000, 3),  # no accuracy measured
        publication(Decision.PROMOTED, 0.9, T0 + 30_000, 3),   # the first at the target
    ]
    letters = [
        *(letter("processor.shed") for _ in range(3)),
        *(letter("processor.too_stale") for _ in range(2)),
        letter("processor.expired"),
        letter("TooStale", STAGE_TRAINER, units, unit_value, headers_of(unit_headers)),
        letter("UntrainableUnit", STAGE_TRAINER, units),
        letter("TooStale", STAGE_TRAINER, declarations.units(NS, "grpo")),  # another recipe
    ]
    arguments = dict(generations=SPAN, publications=publications, metrics=metrics,
                     dead_letters=letters, target=0.9, extra_cpu={"broker": 4, "replica": 10},
                     ledger={"trained": 5, "trained_twice": 0, "lost": 0})
    return fold(NS, RECIPE, **{**arguments, **overrides})


def test_a_trainer_restart_neither_loses_nor_doubles_the_trained_samples():
    card = _card()
    assert card.trained == 13 + 4 + 5
    # 4 at 0, 13 at 1, 5 at 3 versions: mean 28 / 22; rank 11 is at 1, rank 22 at 3
    assert card.staleness_versions == Distribution(22, pytest.approx(28 / 22), 1.0, 3.0)
    # 6 in (0.75, 1], 3 in (1.5, 2], 1 above 256: n = 10, midpoints .875 and 1.75, and 256
    # for the unbounded bucket: mean (6 * .875 + 3 * 1.75 + 256) / 10 = 26.65; rank 5 is in
    # (0.75, 1], rank ceil(9.9) = 10 above 256
    assert card.staleness_seconds == Distribution(10, pytest.approx(26.65), 1.0, math.inf)


def test_time_to_target_is_the_first_promoted_publication_at_or_above_it():
    card = _card()
    assert card.time_to_target_s == 30.0       # the 0.9 at T0 + 30 s; not the rejected 0.95
    assert card.best == 0.97
    assert _card(target=0.98).time_to_target_s is None
    assert _card(target=None).time_to_target_s is None
    assert _card(target=0.5).time_to_target_s == 10.0
    # the starting policy met the target before the first generation: 0 s, not -5 s
    early = [publication(Decision.PROMOTED, 0.95, T0 - 5_000, 0)]
    assert _card(publications=early).time_to_target_s == 0.0


def test_goodput_cpu_and_the_infra_share():
    card = _card()
    assert card.generated == 40 and card.goodput == 22 / 40
    assert card.cpu_seconds == {"broker": 4, "evaluator": 2, "processor": 5, "replica": 10,
                                "reward": 3, "trainer": 16}
    # all: 3 + 5 + 16 + 2 + 4 + 10 = 40 s over 40 generations; plumbing: 3 + 5 + 4 = 12 s
    assert card.cpu_per_generation == 1.0
    assert card.infra_cpu_share == 12 / 40


def test_dead_letters_by_kind_shed_and_too_stale():
    card = _card()
    assert card.dead_lettered == {"TooStale": 1, "UntrainableUnit": 1, "processor.expired": 1,
                                  "processor.shed": 3, "processor.too_stale": 2}
    assert card.shed == {"processor.shed": 3}
    assert card.too_stale == 3
    assert card.too_stale_samples == 2 + 4      # two generations and a unit of four samples


def test_checkpoint_to_serving_and_the_run_length():
    card = _card()
    # 1, 2, 3, 10 s: mean 4, rank 2 is 2 s, rank 4 is 10 s
    assert card.checkpoint_to_serving_s == Distribution(4, 4.0, 2.0, 10.0)
    assert card.seconds == 60.0                 # T0 -> the reward worker's metric at T0 + 60 s


def test_the_line_and_the_block():
    card = _card()
    assert card.line() == (
        "time_to_target_s=30 generated=40 trained=22 goodput=0.55 staleness_mean=1.273 "
        "staleness_p99=3 staleness_s_p50=1 too_stale=3 checkpoint_to_serving_p50_s=2 "
        "infra_cpu_share=0.3 cpu_per_generation_ms=1000 too_stale_samples=6 shed=3 "
        "trained_twice=0 lost=0")
    block = "\n".join(card.lines())
    assert "time to target (accuracy >= 0.9), s: 30" in block
    assert "unit ledger: trained 5, trained_twice 0, lost 0" in block
    assert card.as_dict()["staleness_seconds"]["p99"] == "+Inf"


def test_an_empty_namespace_has_empty_figures_and_no_crash():
    card = fold(NS, RECIPE, generations=GenerationsSpan(0, None, None), target=0.9)
    assert (card.generated, card.trained, card.seconds) == (0, 0, 0.0)
    assert card.time_to_target_s is None and card.best is None
    assert card.goodput is None and card.cpu_per_generation is None
    assert card.infra_cpu_share is None
    assert card.staleness_versions == card.staleness_seconds == Distribution.empty()
    assert card.checkpoint_to_serving_s == Distribution.empty()
    assert card.shed == card.dead_lettered == card.cpu_seconds == {}
    assert card.ledger is None
    assert "goodput=na" in card.line() and "time_to_target_s=na" in card.line()
    assert len(card.lines()) > 10


def test_samples_of_unknown_version_are_trained_but_have_no_staleness():
    card = fold(NS, RECIPE, generations=SPAN, publications=[], dead_letters=[], metrics=[
        staleness(3, 0), staleness(1, 2), staleness(4, UNKNOWN_STALENESS)])
    assert card.trained == 8
    assert card.staleness_versions.count == 4 and card.staleness_versions.mean == 0.5


def _checkpoint(checkpoint_id: str, group: str):
    from reef_stream.core.events import Checkpoint

    return Checkpoint(checkpoint_id=checkpoint_id, recipe=RECIPE, trainer_group=group, step=1,
                      model="m", policy_version=1, uri="file:///c", sha256="0" * 64,
                      offsets=(), trained_unit_count=0, metrics={}, created_at=T0)


def test_the_figures_are_one_trainer_groups_and_another_group_replaying_is_apart():
    # The loop's group "g" trained 8 samples (staleness 1); a group "replay" trained the same
    # units topic again: 30 samples at staleness 40, with 9 s of CPU. Version 1 (checkpoint c1,
    # of "g") was promoted at 0.95; the replay's checkpoint c2 was promoted later at 0.99.
    metrics = [staleness(8, 1),
               metric(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, 30, recipe=RECIPE,
                      group="replay", staleness="40"),
               cpu(STAGE_TRAINER, "h.3", 5, **TRAINER_LABELS),
               cpu(STAGE_TRAINER, "h.9", 9, recipe=RECIPE, group="replay")]
    publications = [publication(Decision.PROMOTED, 0.95, T0 + 20_000, 1),
                    publication(Decision.PROMOTED, 0.99, T0 + 30_000, 2)]
    checkpoints = [_checkpoint("c1", "g"), _checkpoint("c2", "replay")]

    def card(**given):
        return fold(NS, RECIPE, generations=SPAN, metrics=metrics, publications=publications,
                    checkpoints=checkpoints, target=0.9, **given)

    # By default, the group whose checkpoint was promoted last: "replay".
    replay = card()
    assert (replay.group, replay.other_groups) == ("replay", ("g",))
    assert replay.trained == 30 and replay.staleness_versions.mean == 40.0
    assert replay.cpu_seconds == {STAGE_TRAINER: 9.0} and replay.best == 0.99
    assert replay.time_to_target_s == 30.0  # its own promoted version, not "g"'s at 20 s
    # Named, the loop's own group: 8 of the 40 generations trained, goodput 0.2.
    loop = card(group="g")
    assert loop.trained == 8 and loop.goodput == 8 / 40 and loop.staleness_versions.mean == 1.0
    assert loop.cpu_seconds == {STAGE_TRAINER: 5.0}
    assert (loop.best, loop.time_to_target_s) == (0.95, 20.0)
    assert "trainer group g (other groups: replay; --group names one)" in loop.lines()[0]
    # Without checkpoints to tell whose versions were promoted, two groups count together.
    both = fold(NS, RECIPE, generations=SPAN, metrics=metrics, publications=publications)
    assert both.group is None and both.trained == 38
    assert "every trainer group together" in both.lines()[0]
