"""Units that decode but cannot be trained, against a real broker: the trainer dead-letters each
one with a reason naming the unit and what is wrong, trains every good unit around them, and a
restarted trainer of the same group does not trip over them either."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.trainer.trainer import Trainer
from reef_stream.core.events import DeadLetter, RolloutUnit
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import load_settings
from reef_stream.engine.checkpoints import CheckpointStore, load
from reef_stream.topics.declarations import dead_letters, units
from tests.helpers import consume_events
from tests.unit.test_untrainable_units import spoiled, with_logprob, with_token
from tests.unit_log import create_topics, produce_units, rollout_unit


def _trainer(kafka_bootstrap, namespace, store, **options) -> Trainer:
    return Trainer(load_recipe("tests.recipes.trainable"), bootstrap=kafka_bootstrap,
                   namespace=namespace, group="poison", checkpoints=str(store), keep=0,
                   settings=load_settings(), **options)


def _reasons(kafka_bootstrap, namespace, expected: int) -> dict[str, list[tuple[str, str]]]:
    """The trainer's dead letters of units, by unit id: (error type, reason) each."""
    registry, found = SchemaRegistry.default(), {}
    for letter in consume_events(kafka_bootstrap, dead_letters(namespace), expected, DeadLetter):
        assert letter.stage == "trainer" and letter.source_topic == units(namespace, "trainable")
        unit = registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                               RolloutUnit)
        found.setdefault(unit.unit_id, []).append((letter.error_type, letter.reason))
    return found


def test_untrainable_units_are_dead_lettered_with_their_reason_and_training_goes_on(
        kafka_bootstrap, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    good = [rollout_unit(i) for i in range(12)]
    vocabulary = with_token(100, "completion_token_ids", 3, 64)       # one past the last id
    nan_reward = spoiled(101, reward=float("nan"))
    lengths = spoiled(102, completion_logprobs=np.full(9, -1.0, np.float32))
    nan_logprob = with_logprob(103, 2, float("nan"))
    empty = dataclasses.replace(rollout_unit(104), members=())
    negative = with_token(105, "prompt_token_ids", 0, -7)
    infinite = spoiled(106, reward=float("-inf"))
    expected = {
        vocabulary.unit_id: f"unit {vocabulary.unit_id} cannot be trained: completion token id "
                            "64 at position 3 of generation g100-1 is outside the model's "
                            "vocabulary (0..63)",
        nan_reward.unit_id: f"unit {nan_reward.unit_id} cannot be trained: reward of generation "
                            "g101-1 is NaN",
        lengths.unit_id: f"unit {lengths.unit_id} cannot be trained: generation g102-1 has 10 "
                         "completion tokens but 9 completion logprobs (the loss needs one per "
                         "token)",
        nan_logprob.unit_id: f"unit {nan_logprob.unit_id} cannot be trained: completion logprob "
                             "at position 2 of generation g103-1 is NaN",
        empty.unit_id: f"unit {empty.unit_id} cannot be trained: it has no samples",
        negative.unit_id: f"unit {negative.unit_id} cannot be trained: prompt token id -7 at "
                          "position 0 of generation g105-1 is outside the model's vocabulary "
                          "(0..63)",
        infinite.unit_id: f"unit {infinite.unit_id} cannot be trained: reward of generation "
                          "g106-1 is -inf",
    }
    # Two steps of good units (units_per_step is 4) with bad ones between them, then two bad
    # ones after the second step: read, dead-lettered, but no step acknowledges their offsets.
    produce_units(kafka_bootstrap, namespace, [
        good[0], vocabulary, good[1], good[2], nan_reward, good[3], lengths, good[4], empty,
        good[5], nan_logprob, good[6], good[7], negative, infinite])

    first = _trainer(kafka_bootstrap, namespace, tmp_path / "ckpt", idle_exit=5).run()
    assert (first.steps, first.last_step, first.units_trained, first.invalid, first.stale,
            first.duplicates) == (2, 2, 8, 7, 0, 0)

    # A restarted trainer resumes after step 2: it reads again the bad units that step 2's
    # offsets do not cover, dead-letters them again (at least once: which ones depends on how
    # the partitions interleave, one or both of the last two in the runs so far) and trains
    # the next step; one restarted after step 3 goes past whatever step 3 did not cover.
    produce_units(kafka_bootstrap, namespace, good[8:])
    second = _trainer(kafka_bootstrap, namespace, tmp_path / "ckpt", max_steps=3).run()
    assert (second.resumed_from, second.steps, second.last_step, second.units_trained) == \
        (2, 1, 3, 4)
    third = _trainer(kafka_bootstrap, namespace, tmp_path / "ckpt", idle_exit=3).run()
    assert (third.resumed_from, third.steps, third.duplicates) == (3, 0, 0)
    again = second.invalid + third.invalid
    assert second.invalid <= 2 and again <= 4

    stored = [load(c.uri, c.sha256) for c in CheckpointStore(tmp_path / "ckpt").steps()]
    assert [c.step for c in stored] == [1, 2, 3]
    assert [list(c.step_units) for c in stored] == \
        [[u.unit_id for u in good[s * 4:(s + 1) * 4]] for s in range(3)]
    assert all(torch.isfinite(w).all() for c in stored for w in c.weights.values())
    assert all(np.isfinite(c.metrics["loss"]) for c in stored)

    letters = _reasons(kafka_bootstrap, namespace, 7 + again)
    assert set(letters) == set(expected)
    assert sum(len(found) for found in letters.values()) == 7 + again
    for unit_id, reason in expected.items():   # each at least once, always with its reason
        assert letters[unit_id] and set(letters[unit_id]) == {("UntrainableUnit", reason)}, \
            unit_id
