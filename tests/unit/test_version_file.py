"""The follower's served-version file (``reef_stream.serving.version_file``): its content, its
atomic replacement, and its order relative to the engine's load, as the recording proxy reads
it (``reef_stream.intake.proxy.Versions``). No broker: ``Follower._load`` is driven directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Decision, Publication
from reef_stream.intake.proxy import Versions
from reef_stream.serving import follower as follower_module
from reef_stream.serving.follower import Follower, LoadedVersion
from reef_stream.serving.version_file import ServedVersionFile, replace_atomically


def _publication(version: int) -> Publication:
    return Publication(model="m", policy_version=version, checkpoint_id=f"ckpt-{version}",
                       uri=f"file:///nowhere/{version}", sha256="0" * 64,
                       decision=Decision.PROMOTED, reason="test", evaluator="test",
                       evaluated=True, created_at=1_000 + version)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_content_is_json_the_proxy_reads(tmp_path):
    path = tmp_path / "served-version"
    file = ServedVersionFile(path, model="m", replica_id="r-1")
    versions = Versions(path)

    file.starting(None)
    assert _read(path)["state"] == "starting"
    assert versions.from_file() is None

    file.reloading(_publication(3), None)
    content = _read(path)
    assert (content["policy_version"], content["state"], content["loading"]) == (None, "reloading", 3)
    assert versions.from_file() is None

    file.serving(3, _publication(3))
    content = _read(path)
    assert content["policy_version"] == 3 and content["state"] == "serving"
    assert (content["model"], content["replica_id"], content["checkpoint_id"]) == ("m", "r-1", "ckpt-3")
    assert content["published_at"] == 1_003 and content["loaded_at"] >= content["published_at"]
    assert versions.from_file() == 3


def test_every_write_changes_the_content(tmp_path):
    """A reload back to the same version is still seen by a reader comparing before and after."""
    path = tmp_path / "served-version"
    file = ServedVersionFile(path, model="m", replica_id="r")
    versions = Versions(path)
    file.serving(3, _publication(3))
    before = versions.read_file()
    file.reloading(_publication(3), 3)
    file.serving(3, _publication(3))
    after = versions.read_file()
    assert before.version == after.version == 3
    assert before != after


def test_replace_is_atomic_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "served-version"
    replace_atomically(path, "old\n")
    inode = os.stat(path).st_ino
    replace_atomically(path, "new\n")
    assert path.read_text() == "new\n"
    assert os.stat(path).st_ino != inode  # a new file renamed over, never written in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served-version"]

    def failing_replace(source, target):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        replace_atomically(path, "half\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served-version"]


@pytest.fixture
def no_weights(monkeypatch):
    """Versions verify without a checkpoint: the follower's load is only the engine's part."""
    monkeypatch.setattr(follower_module, "load_weights", lambda uri, sha256: {})


def _follower(path: Path, on_version) -> Follower:
    return Follower("m", on_version=on_version, bootstrap="127.0.0.1:1", fleet=None,
                    replica_id="r", version_file=path)


def test_the_file_is_unknown_while_the_engine_loads_and_names_the_version_after(
        tmp_path, no_weights):
    path = tmp_path / "served-version"
    seen_during_load: list[dict] = []

    def engine(loaded: LoadedVersion) -> None:
        seen_during_load.append(_read(path))

    follower = _follower(path, engine)
    follower._start_version_file()
    assert _read(path)["state"] == "starting"
    follower._load(_publication(4))
    assert [c["state"] for c in seen_during_load] == ["reloading"]
    assert seen_during_load[0]["policy_version"] is None
    assert seen_during_load[0]["loading"] == 4
    assert _read(path)["policy_version"] == 4 == follower.policy_version

    follower._load(_publication(5))
    assert seen_during_load[1]["serving_before"] == 4
    assert _read(path)["policy_version"] == 5


def test_a_refused_load_names_the_version_served_before_again(tmp_path, no_weights):
    path = tmp_path / "served-version"
    fail = {"on": False}

    def engine(loaded: LoadedVersion) -> None:
        if fail["on"]:
            raise RuntimeError("engine said no")

    follower = _follower(path, engine)
    follower._load(_publication(4))
    first = path.read_text()
    fail["on"] = True
    follower._load(_publication(5))
    assert 5 in follower.refused
    content = _read(path)
    assert (content["policy_version"], content["state"]) == (4, "serving")
    assert path.read_text() != first  # a request that straddled the failed load is unknown


def test_a_version_whose_marker_cannot_be_written_is_not_loaded(tmp_path, no_weights,
                                                                monkeypatch):
    path = tmp_path / "served-version"
    loads: list[int] = []
    follower = _follower(path, lambda loaded: loads.append(loaded.policy_version))
    follower._load(_publication(4))

    def broken(self, publication, serving):
        raise OSError("read-only file system")

    monkeypatch.setattr(ServedVersionFile, "reloading", broken)
    follower._load(_publication(5))
    assert loads == [4]
    assert "could not be marked reloading" in follower.refused[5]
    assert _read(path)["policy_version"] == 4


def test_a_failed_write_after_a_load_leaves_the_file_saying_less(tmp_path, no_weights,
                                                                 monkeypatch):
    path = tmp_path / "served-version"
    follower = _follower(path, lambda loaded: None)
    real = ServedVersionFile.serving

    def broken(self, version, publication):
        raise OSError("disk full")

    monkeypatch.setattr(ServedVersionFile, "serving", broken)
    follower._load(_publication(4))
    assert follower.policy_version == 4
    assert _read(path)["state"] == "reloading"  # unknown: never more than is served
    monkeypatch.setattr(ServedVersionFile, "serving", real)
    assert follower._version_file_behind
    follower._write_version_file()  # what the next poll does
    assert _read(path)["policy_version"] == 4 and not follower._version_file_behind


def test_a_file_that_cannot_be_written_at_the_start_is_a_configuration_error(tmp_path):
    follower = _follower(tmp_path / "missing-directory" / "served-version", lambda loaded: None)
    with pytest.raises(ConfigurationError, match="missing-directory"):
        follower._start_version_file()
