"""A paused trainer that wakes up after its replacement took over is fenced by Kafka itself.

Trainer A of a group is stopped (SIGSTOP, as a paused container or a long GC would be) after
it acknowledged a few steps; a replacement B of the same group and store starts, fences A
(``init_transactions`` with the group's transactional id), resumes from the newest committed
checkpoint and trains to the end; then A is resumed (SIGCONT). A fails at its first
acknowledgement, says so in one line and exits. Each step has exactly one committed
``Checkpoint`` event, in order (one lineage), and none of A's after B started. Before the
acknowledgement was a transaction, A trained on and every step after its pause had two
events with two different manifests."""

from __future__ import annotations

import os
import signal

from reef_stream.consumers.trainer.trainer import committed_checkpoint
from reef_stream.core.events import Checkpoint
from reef_stream.topics.declarations import checkpoints
from tests.faults.test_trainer_kills import _start, started  # noqa: F401 - the fixture
from tests.helpers import events_to_end, wait_until
from tests.unit_log import create_topics, produce_units, rollout_unit

STEPS = 40
GROUP = "fenced"


def _writer(event: Checkpoint) -> str:
    """The writer id in a checkpoint's directory name (``step-NNNNNNNN.<writer>``)."""
    return event.uri.rstrip("/").rsplit("/", 1)[-1].partition(".")[2]


def test_a_paused_trainer_is_fenced_by_its_replacement_and_trains_no_further_step(
        kafka_bootstrap, cli_env, namespace, tmp_path, started):  # noqa: F811
    create_topics(kafka_bootstrap, namespace)
    produce_units(kafka_bootstrap, namespace,
                  [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4)])
    store = tmp_path / "store"

    zombie = _start(cli_env, GROUP, store, started=started, max_steps=STEPS)

    def acknowledged(step: int) -> bool:
        newest = committed_checkpoint(kafka_bootstrap, namespace, "trainable", GROUP)
        return newest is not None and newest.step >= step

    wait_until(lambda: acknowledged(3) or zombie.poll() is not None, timeout=180,
               message="trainer A acknowledged no third step")
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        paused_at = committed_checkpoint(kafka_bootstrap, namespace, "trainable", GROUP).step
        assert paused_at < STEPS, "trainer A finished before it could be paused"
        replacement = _start(cli_env, GROUP, store, started=started, max_steps=STEPS)
        out, err = replacement.communicate(timeout=300)
        assert replacement.returncode == 0, err[-3000:]
        assert f"now at step {STEPS}" in out, out
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    zombie.wait(timeout=120)
    zombie.reader.join(5)
    said = "".join(zombie.lines)
    assert zombie.returncode != 0, said[-3000:]
    assert "was fenced" in said, said[-3000:]

    events = [e for e in events_to_end(kafka_bootstrap, checkpoints(namespace), Checkpoint)
              if e.trainer_group == GROUP]
    assert [e.step for e in events] == list(range(1, STEPS + 1)), [e.step for e in events]
    # One lineage: A's steps, then B's, and none of A's after B's first. A acknowledged at
    # most the step whose commit was already on its way when it was paused.
    writers = [_writer(e) for e in events]
    by_a = writers.index(writers[-1])
    assert set(writers[:by_a]) == {writers[0]} and set(writers[by_a:]) == {writers[-1]}, writers
    assert paused_at <= by_a <= paused_at + 1, (paused_at, writers)
