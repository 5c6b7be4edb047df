"""The loop's second half with every real stage: `reef train` checkpoints, `reef evaluate`
publishes, `reef follow` loads the newest promoted version, verified, and `reef fleet` shows it."""

from __future__ import annotations

import torch

from reef_stream.core.events import Checkpoint, Metric, Publication
from reef_stream.core.metric_names import (
    FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, FOLLOWER_PUBLICATION_TO_SERVING_SECONDS, STAGE_FOLLOWER,
)
from reef_stream.engine.checkpoints import CheckpointStore, load, load_weights
from reef_stream.topics.declarations import checkpoints, metrics, publications
from tests.helpers import consume_events, reef
from tests.unit_log import create_topics, produce_units, rollout_unit


def test_trained_checkpoints_are_published_and_followed(kafka_bootstrap, cli_env, namespace,
                                                        tmp_path):
    create_topics(kafka_bootstrap, namespace)
    produce_units(kafka_bootstrap, namespace, [rollout_unit(i, policy_version=i // 4)
                                               for i in range(8)])
    store = tmp_path / "ckpt"
    trained = reef("train", "--recipe", "tests.recipes.trainable", "--group", "run1",
                   "--checkpoints", str(store), "--max-steps", "2", env=cli_env)
    assert "now at step 2" in trained.stdout, trained.stdout

    evaluated = reef("evaluate", "--recipe", "tests.recipes.trainable", "--max-candidates", "2",
                     env=cli_env)
    assert "every checkpoint is promoted" in evaluated.stderr, evaluated.stderr

    decisions = consume_events(kafka_bootstrap, publications(namespace), 2, Publication)
    assert [(p.model, p.policy_version, p.decision.value, p.evaluated) for p in decisions] == \
        [("run1", 1, "PROMOTED", False), ("run1", 2, "PROMOTED", False)]
    newest = CheckpointStore(store).latest()
    assert decisions[-1].sha256 == newest.sha256
    for name, tensor in load(newest.uri, newest.sha256).weights.items():
        assert torch.equal(load_weights(decisions[-1].uri, decisions[-1].sha256)[name], tensor)

    checkpoints_made = sorted(consume_events(kafka_bootstrap, checkpoints(namespace), 2, Checkpoint),
                              key=lambda c: c.policy_version)
    assert [p.checkpoint_created_at for p in decisions] == [c.created_at for c in checkpoints_made]

    followed = reef("follow", "--model", "run1", "--once", "--replica-id", "r1", env=cli_env)
    assert "version 2" in followed.stdout, followed.stdout + followed.stderr
    # The replica reports how long version 2 took from the trainer's checkpoint, and from the
    # evaluator's decision, to serving: the times between those events and its metric's.
    reported = {m.name: m for m in consume_events(kafka_bootstrap, metrics(namespace), 1, Metric)
                if m.stage == STAGE_FOLLOWER}
    for name, since in ((FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, checkpoints_made[-1].created_at),
                        (FOLLOWER_PUBLICATION_TO_SERVING_SECONDS, decisions[-1].created_at)):
        metric = reported[name]
        assert 0 <= metric.value <= (metric.created_at - since) / 1000 + 0.001, (name, metric)
        assert metric.value > (metric.created_at - since) / 1000 - 1, (name, metric)
    assert reported[FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS].value \
        > reported[FOLLOWER_PUBLICATION_TO_SERVING_SECONDS].value
    fleet = reef("fleet", env=cli_env)
    assert "run1" in fleet.stdout, fleet.stdout
