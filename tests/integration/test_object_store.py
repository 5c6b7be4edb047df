"""Checkpoints in a real object store: S3Proxy, started by ``reef s3 up`` from Maven Central jars,
reached through fsspec's S3 filesystem (s3fs) with the credentials ``reef s3 env`` prints.

What the store must do for reef-stream: a checkpoint written at an ``s3://`` URL reads back
bitwise and verifies; an object corrupted in place is refused with an error naming it; a
write while the store is down fails with a clear error (no hang) and leaves the newest complete
checkpoint the latest; no URL or log line carries the secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from reef_stream.core.processes import listening_port
from reef_stream.engine.checkpoints import CheckpointError, CheckpointStore, load, verify
from reef_stream.servers.s3_local import LocalS3
from tests.unit.test_checkpoints import _contents, _trained_model_and_optimizer

BUCKET = "checkpoints"


def _reef(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REEF_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "reef_stream.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def store_home(tmp_path_factory):
    """A local object store started the way a user starts it, stopped at the end."""
    home = tmp_path_factory.mktemp("reef-home")
    port = listening_port()
    result = _reef(home, "s3", "up", "--port", str(port), "--bucket", BUCKET)
    assert result.returncode == 0, result.stdout + result.stderr
    yield home
    _reef(home, "s3", "down")


@pytest.fixture
def s3_env(store_home, monkeypatch):
    """The client environment ``reef s3 env`` prints, set in this process (s3fs reads it)."""
    result = _reef(store_home, "s3", "env")
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        monkeypatch.setenv(name, value)
    fsspec.filesystem("s3").clear_instance_cache()
    yield dict(os.environ)
    fsspec.filesystem("s3").clear_instance_cache()


def _store(store_home: Path) -> LocalS3:
    home = store_home / "s3"
    return LocalS3(home, Path(os.environ.get("REEF_CACHE_DIR",
                                             Path.home() / ".cache" / "reef-stream")))


def test_a_checkpoint_round_trips_through_the_object_store(s3_env, store_home, request):
    status = _reef(store_home, "s3", "status")
    assert "alive" in status.stdout and BUCKET in status.stdout, status.stdout
    model, optimizer = _trained_model_and_optimizer()
    store = CheckpointStore(f"s3://{BUCKET}/{request.node.name}")
    first = store.write(_contents(1, model, optimizer))
    second = store.write(_contents(2, model, optimizer))
    assert store.latest() == second and [s.step for s in store.steps()] == [1, 2]
    assert first.uri.startswith(f"s3://{BUCKET}/")

    back = load(second.uri, second.sha256)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.weights[name], tensor)
    assert back.step == 2 and back.metrics == {"loss": 1.25}
    assert set(verify(second.uri, second.sha256)) >= {"model.safetensors", "meta.json"}
    secret = s3_env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in second.uri and secret not in repr(second)


def test_an_object_corrupted_in_place_is_refused_by_name(s3_env, store_home, request):
    model, optimizer = _trained_model_and_optimizer()
    stored = CheckpointStore(f"s3://{BUCKET}/{request.node.name}").write(
        _contents(1, model, optimizer))
    key = stored.uri.removeprefix(f"s3://{BUCKET}/") + "/model.safetensors"
    client = _store(store_home).client()
    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify(stored.uri, stored.sha256)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(stored.uri, stored.sha256)


def test_a_write_while_the_store_is_down_fails_and_the_last_complete_checkpoint_stays(
        s3_env, store_home, request, monkeypatch):
    model, optimizer = _trained_model_and_optimizer()
    url = f"s3://{BUCKET}/{request.node.name}"
    first = CheckpointStore(url).write(_contents(1, model, optimizer))
    assert _reef(store_home, "s3", "down").returncode == 0
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # s3fs still retries: fail in seconds, not 50
    fsspec.filesystem("s3").clear_instance_cache()
    try:
        with pytest.raises(CheckpointError, match="could not write checkpoint step 2") as raised:
            CheckpointStore(url).write(_contents(2, model, optimizer))
        assert s3_env["AWS_SECRET_ACCESS_KEY"] not in str(raised.value)
    finally:
        assert _reef(store_home, "s3", "up").returncode == 0
    fsspec.filesystem("s3").clear_instance_cache()
    store = CheckpointStore(url)
    assert store.latest() == first
    assert store.write(_contents(2, model, optimizer)).step == 2
    assert store.latest().step == 2


def test_a_serving_artifact_in_the_object_store_is_fetched_for_the_engine(
        s3_env, store_home, request, tmp_path, monkeypatch):
    """An engine reads a local directory: the adapters' default fetches an ``s3://`` artifact
    into the cache, verified, and hands that over."""
    from types import SimpleNamespace

    from reef_stream.serving.adapters import artifact_dir_of_publication, check_artifact
    from tests.unit.test_engines import _artifact

    made = tmp_path / "made"
    sha256 = _artifact(made)
    fs = fsspec.filesystem("s3")
    uri = f"s3://{BUCKET}/{request.node.name}/llm/v1-serving"
    for path in made.iterdir():
        fs.put_file(str(path), f"{uri}/{path.name}")
    monkeypatch.setenv("REEF_HOME", str(tmp_path / "home"))
    version = SimpleNamespace(policy_version=1, artifact=uri, publication=SimpleNamespace(
        artifact_uri=uri, artifact_sha256=sha256, uri=f"s3://{BUCKET}/x/llm/v1"))
    local = artifact_dir_of_publication(version)
    assert local.is_relative_to(tmp_path / "home" / "cache")
    assert check_artifact(local, sha256) == "full"
    for path in made.iterdir():
        assert (local / path.name).read_bytes() == path.read_bytes()
