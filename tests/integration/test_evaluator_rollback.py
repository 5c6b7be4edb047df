"""A trainer's rollback checkpoint (``rolled_back_to`` set) at the evaluator, against the real
broker: one whose weights are the incumbent's is promoted, and one that does not verify (its
files are verified as its weights load) is REJECTED with the reason any candidate that fails
verification gets. The checkpoints are written here (no trainer), as in test_evaluation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from reef_stream.core.events import Decision, Publication
from reef_stream.topics.declarations import publications
from tests.helpers import events_to_end
from tests.integration.publishing import (
    create_topics, produce_checkpoints, run_evaluator, settings_for, write_checkpoint,
)


def test_a_rollback_is_promoted_and_a_tampered_one_is_rejected(
        kafka_bootstrap, redis_url, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    first = write_checkpoint(tmp_path / "ckpt", 1, 0.5)
    # Rollbacks to version 1: its very weights; the second's weights file then corrupted.
    back = dataclasses.replace(write_checkpoint(tmp_path / "ckpt", 2, 0.5), rolled_back_to=1)
    tampered = dataclasses.replace(write_checkpoint(tmp_path / "bad", 3, 0.5), rolled_back_to=1)
    weights_file = Path(tampered.uri) / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    produce_checkpoints(kafka_bootstrap, namespace, first, back, tampered)

    summary = run_evaluator("promoting", settings, supersede=False)

    assert (summary.promoted, summary.rejected) == (2, 1)
    decided = {p.policy_version: p for p in events_to_end(
        kafka_bootstrap, publications(namespace), Publication)}
    assert [decided[v].decision for v in (1, 2, 3)] == [
        Decision.PROMOTED, Decision.PROMOTED, Decision.REJECTED]
    assert decided[2].reason.startswith("rollback: "), decided[2].reason
    assert decided[3].reason.startswith("the candidate failed verification: "), decided[3].reason
    assert "model.safetensors does not match its sha256" in decided[3].reason
