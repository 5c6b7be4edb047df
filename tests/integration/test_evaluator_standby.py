"""Evaluators of one recipe in one group: the member the group assigns the checkpoints holds
the recipe's fence, a standby holds none, and a member that handed the checkpoints over and
gets them back takes the fence again and decides on, instead of failing fenced.

A standby B joins while A decides. The group's assignor (range, librdkafka's default) gives
the checkpoints' one partition to the member whose id sorts first, and a member id is the
client's ``client.id`` followed by a random UUID, so B's ``client.id`` sorts before A's (the
default ``rdkafka``): B is handed the checkpoints at its first join, which fences A's producer.
B then leaves, A is assigned again and decides the next candidate. Had A kept the producer B
fenced, that decision would have been A's last write (``EvaluatorFenced``).

(Joining B again until the assignor happened to pick it failed in CI: A keeps its member id,
so every join of B had the same odds, those of a random id sorting before A's, which were 1
in 100 for an A whose UUID began with 03.)
"""

from __future__ import annotations

import threading

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
from reef_stream.publishing.publications import PublicationLedger
from tests.integration.publishing import (
    create_topics, eventually, produce_checkpoints, settings_for, write_checkpoint,
)

#: The standby's ``client.id``: it sorts before librdkafka's default, A's.
FIRST_IN_ORDER = "a-standby"


class Member:
    """A ``reef evaluate`` of tests.recipes.promoting in ``group``, on a thread until ``stop``;
    what ``run`` raised is kept in ``error``."""

    def __init__(self, settings, group: str, client_id: str | None = None) -> None:
        self.worker = EvaluatorWorker(
            load_recipe("tests.recipes.promoting"), settings=settings,
            options=EvaluateOptions(group=group, supersede=False),
            consumer_config={"client.id": client_id} if client_id else None)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as error:  # noqa: BLE001 - the test asserts it
            self.error = error

    @property
    def joined(self) -> bool:
        """Whether the group gave this member its first assignment (empty for a standby), and
        it took the fence if it was handed the checkpoints."""
        return self.worker._last_assigned is not None

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()


def decided(bootstrap: str, namespace: str) -> list:
    with PublicationLedger(bootstrap, namespace) as ledger:
        return ledger.catch_up()


def test_a_member_that_handed_the_checkpoints_over_takes_the_fence_again(
        kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    group, store = f"{namespace}.evaluate.promoting", tmp_path / "ckpt"
    produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 1, 0.5))
    a = Member(settings, group)
    try:
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 1, 30, "version 1")
        assert a.worker.active
        b = Member(settings, group, client_id=FIRST_IN_ORDER)
        eventually(lambda: b.joined, 60, "the standby's first assignment")
        handed_over = b.worker.active
        b.stop()
        assert b.error is None, b.error
        assert handed_over, ("the range assignor did not hand the checkpoints to the member "
                             "whose id sorts first")
        eventually(lambda: a.worker.active, 60, "A assigned the checkpoints again")
        produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(store, 2, 0.8))
        eventually(lambda: len(decided(kafka_bootstrap, namespace)) == 2 or a.error, 30,
                   "version 2")
        assert a.error is None, a.error
    finally:
        a.stop()
    assert [p.policy_version for p in decided(kafka_bootstrap, namespace)] == [1, 2]
    assert a.error is None, a.error
