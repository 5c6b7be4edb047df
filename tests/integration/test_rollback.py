"""Liveness after rejections, with every stage of the loop's second half real: a trainer, an
evaluator that rejects four candidates in a row, a replica that follows what is published, and
this test as the fleet (each unit it produces carries the version the replica serves).

Served version 1, rejected 2, 3 and 4, and ``max_staleness`` 2: at step 4 every unit the
fleet makes is too stale to train, and nothing newer can be served. The trainer must see the
stall by itself, roll back to version 1's weights as version 5 (the evaluator promotes it
without measuring: its own rule would reject 5), and train on what the fleet then serves."""

from __future__ import annotations

import threading

import torch

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
from reef_stream.consumers.trainer.trainer import Trainer
from reef_stream.core.events import Checkpoint, DeadLetter, Decision, Publication
from reef_stream.engine.checkpoints import load, load_weights
from reef_stream.serving.follower import Follower
from reef_stream.topics.declarations import checkpoints, dead_letters, publications
from tests.helpers import consume_events, reef, wait_until
from tests.integration.publishing import Loads, settings_for
from tests.unit_log import create_topics, produce_units, rollout_unit

RECIPE = "rejects_in_a_row"
GROUP = "rb"   # the trainable recipe names no model: the group's name is the model's
TARGET_STEP = 9


def test_a_trainer_stalled_by_rejections_rolls_back_and_the_loop_trains_on(
        kafka_bootstrap, redis_url, namespace, tmp_path, cli_env):
    create_topics(kafka_bootstrap, namespace, recipe=RECIPE)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    recipe = load_recipe(f"tests.recipes.{RECIPE}")
    store = tmp_path / "ckpt"
    trainer = Trainer(recipe, bootstrap=kafka_bootstrap, namespace=namespace, group=GROUP,
                      checkpoints=str(store), keep=0, settings=settings)
    # Each candidate decided on its own (not superseded by a newer one waiting with it).
    evaluator = EvaluatorWorker(recipe, settings=settings,
                                options=EvaluateOptions(keep_published=0, supersede=False))
    stages = [threading.Thread(target=stage.run, daemon=True) for stage in (trainer, evaluator)]
    for stage in stages:
        stage.start()
    loads, produced = Loads(), []
    try:
        with Follower(GROUP, on_version=loads, settings=settings, replica_id="r1",
                      fleet=None) as replica:
            def one_more_unit_until_the_target() -> bool:
                if trainer.step >= TARGET_STEP:
                    return True
                unit = rollout_unit(len(produced), recipe=RECIPE,
                                    policy_version=replica.policy_version or 0)
                produce_units(kafka_bootstrap, namespace, [unit], recipe=RECIPE)
                produced.append(unit)
                return False

            wait_until(one_more_unit_until_the_target, 180,
                       f"the trainer to reach step {TARGET_STEP} past four rejections",
                       poll_s=0.1)
            served = loads.versions
    finally:
        trainer.stop()
        evaluator.stop()
        for stage in stages:
            stage.join(60)
    assert not any(stage.is_alive() for stage in stages)
    assert trainer.summary.rollbacks == 1

    # The decisions: 1 promoted, 2-4 rejected by the evaluator's rule, 5 the rollback.
    decided = {p.policy_version: p for p in consume_events(
        kafka_bootstrap, publications(namespace), TARGET_STEP - 1, Publication)}
    assert [decided[v].decision for v in (1, 2, 3, 4, 5)] == [Decision.PROMOTED] + \
        [Decision.REJECTED] * 3 + [Decision.PROMOTED]
    assert decided[5].reason.startswith("rollback:"), decided[5].reason
    assert dict(decided[5].measurement) == dict(decided[1].measurement) == {"version": 1.0}
    assert all(decided[v].decision is Decision.PROMOTED for v in range(6, TARGET_STEP))

    # Version 5 is recorded as a rollback, and holds exactly version 1's weights.
    events = {c.policy_version: c for c in consume_events(
        kafka_bootstrap, checkpoints(namespace), TARGET_STEP, Checkpoint)}
    assert {v: c.rolled_back_to for v, c in events.items() if c.rolled_back_to is not None} \
        == {5: 1}
    rolled, first, fourth = (load(events[v].uri, events[v].sha256) for v in (5, 1, 4))
    assert rolled.step_units == () and rolled.offsets == fourth.offsets
    for name, tensor in first.weights.items():
        assert torch.equal(rolled.weights[name], tensor)
    assert any(not torch.equal(fourth.weights[n], t) for n, t in first.weights.items())
    # The replica loaded it (the published copy, verified) and went on to later versions.
    assert 5 in served and max(served) >= 6, served
    for name, tensor in load_weights(decided[5].uri, decided[5].sha256).items():
        assert torch.equal(tensor, first.weights[name])

    # Nothing lost: every unit is trained once, or dead-lettered as too stale (those the fleet
    # made while the trainer stood past version 1), or among the last few not taken yet.
    trained = [u for c in events.values() for u in load(c.uri, c.sha256).step_units]
    assert len(trained) == len(set(trained)) >= TARGET_STEP - 1
    stale = [letter for letter in consume_events(kafka_bootstrap, dead_letters(namespace), 1,
                                                 DeadLetter) if letter.error_type == "TooStale"]
    assert stale and all("behind the trainer's" in letter.reason for letter in stale)
    stale_ids = {letter.reason.split()[1] for letter in stale}
    assert not stale_ids & set(trained)
    unaccounted = {u.unit_id for u in produced} - set(trained) - stale_ids
    assert len(unaccounted) <= 3, unaccounted   # produced after the last step was taken

    # The operator sees it: reef top counts the rollback, reef trace says what it discarded.
    top = reef("top", "--once", env=cli_env).stdout
    assert "1, v5 = v1" in top, top
    traced = reef("trace", "--checkpoint", events[3].checkpoint_id, env=cli_env,
                  check=False).stdout   # incomplete, exit status 1: its effect was never served
    assert "rollback to the weights of version 1" in traced \
        and "was discarded, never served" in traced, traced
    traced = reef("trace", "--checkpoint", events[5].checkpoint_id, env=cli_env).stdout
    assert "a rollback: the weights of version 1 again" in traced, traced
