"""The pure parts of publication, without a broker: the publication store's copies, the ledger's
fold of decisions, publication keys, option checks, and a follower's generation guard."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import (
    EvaluateOptions,
    EvaluatorWorker,
    PublicationLedger,
    PublicationStore,
    publication_key,
)
from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import Checkpoint, Decision, Publication
from reef_stream.core.settings import load_settings
from reef_stream.engine.checkpoints import (
    CheckpointContents,
    CheckpointError,
    CheckpointStore,
    load_weights,
)
from reef_stream.serving.follower import Follower
from tests.faults.records import generation


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(3, 2) * step}


def _checkpoint(store, step: int, *, model: str = "m/1") -> Checkpoint:
    stored = CheckpointStore(store).write(CheckpointContents(
        step=step, policy_version=step, model=model, recipe="r", trainer_group="g",
        weights=_weights(step), optimizer={}, rng={}, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64)))
    return Checkpoint(checkpoint_id=stored.checkpoint_id, recipe="r", trainer_group="g",
                      step=step, model=model, policy_version=step, uri=stored.uri,
                      sha256=stored.sha256, offsets=(), trained_unit_count=0, created_at=1)


def _decision(version: int, decision: Decision, *, model: str = "m",
              checkpoint_id: str | None = None) -> Publication:
    return Publication(model=model, policy_version=version,
                       checkpoint_id=checkpoint_id or f"c{version}", uri="u", sha256="s",
                       decision=decision, reason="r", evaluator="e", evaluated=True,
                       created_at=1)


def test_a_published_copy_has_the_checksum_and_outlives_the_trainers_retention(tmp_path):
    source = tmp_path / "ckpt"
    candidates = [_checkpoint(source, step) for step in (1, 2, 3)]
    store = PublicationStore(tmp_path / "published")

    uris = [store.publish(candidate) for candidate in candidates]

    assert uris[0] == str(tmp_path / "published" / "m%2F1" / "v1")  # one path segment
    CheckpointStore(source).prune(keep=1)
    shutil.rmtree(candidates[2].uri)
    for candidate, uri in zip(candidates, uris):
        assert torch.equal(load_weights(uri, candidate.sha256)["w"], _weights(candidate.step)["w"])
    assert store.publish(candidates[2]) == uris[2]  # idempotent: the verified copy stays
    assert store.versions("m/1") == [1, 2, 3]
    assert store.prune("m/1", keep=2) == [1] and store.versions("m/1") == [2, 3]
    assert store.prune("m/1", keep=0) == []


def test_a_tampered_candidate_is_not_copied(tmp_path):
    candidate = _checkpoint(tmp_path / "ckpt", 1)
    (Path(candidate.uri) / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="meta.json does not match"):
        PublicationStore(tmp_path / "published").publish(candidate)
    assert not (tmp_path / "published" / "m%2F1" / "v1").exists()


def test_a_damaged_copy_is_replaced(tmp_path):
    candidate = _checkpoint(tmp_path / "ckpt", 1)
    store = PublicationStore(tmp_path / "published")
    uri = store.publish(candidate)
    (tmp_path / "published" / "m%2F1" / "v1" / "model.safetensors").write_bytes(b"rot")
    assert store.publish(candidate) == uri
    load_weights(uri, candidate.sha256)


def test_the_ledger_keeps_the_incumbent_and_the_newest_decided_version():
    ledger = PublicationLedger("127.0.0.1:1", "ns")  # nothing is read: record() only
    try:
        assert ledger.incumbent("m") is None and ledger.decided_version("m") is None
        ledger.record(_decision(1, Decision.PROMOTED))
        ledger.record(_decision(2, Decision.REJECTED))
        ledger.record(_decision(3, Decision.PROMOTED, model="other"))
        assert ledger.incumbent("m").policy_version == 1
        assert ledger.decided_version("m") == 2
        assert ledger.decision("c2").decision is Decision.REJECTED
        assert ledger.models() == ["m", "other"]
        ledger.record(_decision(1, Decision.PROMOTED))  # read back: idempotent
        assert ledger.incumbent("m").policy_version == 1 and ledger.decided_version("m") == 2
    finally:
        ledger.close()


def test_a_rejection_cannot_compact_away_the_promoted_version():
    assert publication_key(_decision(1, Decision.PROMOTED)) == b"m"
    assert publication_key(_decision(2, Decision.REJECTED)) == b"m#rejected"


def test_evaluator_options_are_checked_all_at_once(tmp_path):
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": "127.0.0.1:1",
                              "REEF_HOME": str(tmp_path)})
    with pytest.raises(ConfigurationError) as raised:
        EvaluatorWorker(load_recipe("tests.recipes.promoting"), settings=settings,
                        options=EvaluateOptions(keep_published=-1, retries=-1, idle_exit=0))
    assert len(raised.value.problems) == 3
    worker = EvaluatorWorker(load_recipe("tests.recipes.good"), settings=settings)
    assert "AcceptEverything" in worker.warning
    assert worker.group == "reef.evaluate.good"
    assert worker.store.root == str(tmp_path / "published" / "reef")


def test_a_follower_guard_checks_model_and_version_without_a_broker(tmp_path):
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": "127.0.0.1:1",
                              "REEF_HOME": str(tmp_path)})
    follower = Follower("tiny", on_version=lambda loaded: None, settings=settings,
                        initial_version=0, fleet=None)
    follower.check(generation(0))
    with pytest.raises(InvalidRecord, match="never served version 1"):
        follower.check(dataclasses.replace(generation(0), policy_version=1))
    with pytest.raises(InvalidRecord, match="serves model 'tiny'"):
        follower.check(dataclasses.replace(generation(0), model="big"))
    with pytest.raises(ConfigurationError) as raised:
        Follower("", on_version=None, settings=settings, heartbeat_s=0, retry_s=0)
    assert len(raised.value.problems) == 4
