"""Checkpoints: what is written is read back exactly, incomplete ones are invisible, and a
changed byte is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from reef_stream.core.events import TopicOffset
from reef_stream.engine.checkpoints import (
    CheckpointContents,
    CheckpointError,
    CheckpointStore,
    load,
    load_weights,
    unit_hash,
    verify,
)


def _trained_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _contents(step: int, model, optimizer) -> CheckpointContents:
    return CheckpointContents(
        step=step, policy_version=step, model="m", recipe="r", trainer_group="g",
        weights=model.state_dict(), optimizer=optimizer.state_dict(),
        rng={"torch": torch.get_rng_state()}, algorithm_state={"baseline": 0.5, "seen": [1, 2]},
        offsets=(TopicOffset(topic="t", partition=0, offset=7),
                 TopicOffset(topic="t", partition=1, offset=0)),
        trained_units=np.array(sorted({unit_hash("a"), unit_hash("b")}), dtype=np.uint64),
        step_units=("a", "b"), metrics={"loss": 1.25}, created_at=123)


def test_a_checkpoint_reads_back_exactly_and_restores_the_optimizer(tmp_path):
    model, optimizer = _trained_model_and_optimizer()
    store = CheckpointStore(tmp_path / "ckpt")
    stored = store.write(_contents(3, model, optimizer))
    assert store.latest() == stored and stored.step == 3

    back = load(stored.uri, stored.sha256)
    assert back.step == 3 and back.step_units == ("a", "b") and back.metrics == {"loss": 1.25}
    assert back.offsets == (TopicOffset(topic="t", partition=0, offset=7),
                            TopicOffset(topic="t", partition=1, offset=0))
    assert back.algorithm_state == {"baseline": 0.5, "seen": [1, 2]}
    assert set(back.trained_units.tolist()) == {unit_hash("a"), unit_hash("b")}
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.weights[name], tensor)
    assert torch.equal(back.rng["torch"], torch.get_rng_state())

    # A fresh optimizer loaded from the checkpoint takes the very same next step.
    twin, _ = _trained_model_and_optimizer()
    twin.load_state_dict(back.weights)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_optimizer.load_state_dict(back.optimizer)
    batch = torch.randn(5, 4)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_incomplete_checkpoint_is_invisible_and_rewritten(tmp_path):
    model, optimizer = _trained_model_and_optimizer()
    store = CheckpointStore(tmp_path)
    first = store.write(_contents(1, model, optimizer))
    (tmp_path / "step-00000002").mkdir()           # a crash before the manifest
    (tmp_path / "step-00000002" / "model.safetensors").write_bytes(b"half")
    assert store.latest() == first
    second = store.write(_contents(2, model, optimizer))
    assert store.latest() == second
    verify(second.uri, second.sha256)


def test_a_changed_byte_or_a_swapped_manifest_is_refused(tmp_path):
    model, optimizer = _trained_model_and_optimizer()
    store = CheckpointStore(tmp_path)
    stored = store.write(_contents(1, model, optimizer))
    weights = Path(stored.uri) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match"):
        load_weights(stored.uri, stored.sha256)

    # Rewriting the manifest to match the tampered file changes the checkpoint's sha256.
    manifest_path = Path(stored.uri) / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["model.safetensors"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest sha256 is"):
        load_weights(stored.uri, stored.sha256)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_weights(str(tmp_path / "step-00000009"), stored.sha256)


def test_prune_keeps_the_newest_and_fsspec_urls_work():
    model, optimizer = _trained_model_and_optimizer()
    store = CheckpointStore("memory://reef-test/ckpt")
    for step in range(1, 6):
        store.write(_contents(step, model, optimizer))
    assert store.prune(keep=2) == [1, 2, 3]
    assert [c.step for c in store.steps()] == [4, 5]
    latest = store.latest()
    assert latest.uri.startswith("memory://")
    assert load(latest.uri, latest.sha256).step == 5
