"""``bench/checkpoint.py`` works end to end, at a tiny size (seconds, not the bench's minutes).

The bench's own code runs: a tiny Llama-style model built from a config, saved with
``save_pretrained``, loaded through ``HuggingFace``, trained by ``TorchBackend`` in full and
through LoRA, checkpointed through ``CheckpointStore.write`` and written as a serving artifact;
what is checked is that it prints a table per configuration and a CHECKPOINT line per (size,
mode, cadence) with positive figures. Never how fast anything is.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub reads it: never reach a hub
pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "checkpoint.py"
LINE = re.compile(r"CHECKPOINT size=(\S+) mode=(\S+) cadence=(\d+) (.*)")


def _bench():
    """The bench script as a module (its name is not importable: bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("reef_bench_checkpoint", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Offline even when huggingface_hub was imported (and read the variable) earlier."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_help_explains_the_options():
    result = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--sizes", "--modes", "--cadences", "--steps", "--dtype", "--serving-dtype"):
        assert option in result.stdout
    assert "100M" in result.stdout and "500M" in result.stdout


def test_a_bad_option_is_a_usage_error(capsys):
    bench = _bench()
    for wrong in (["--sizes", "7B"], ["--modes", "qlora"], ["--cadences", "0,5"],
                  ["--steps", "0"]):
        with pytest.raises(SystemExit) as exited:
            bench.parse_args(wrong)
        assert exited.value.code == 2, wrong
    assert "choose from" in capsys.readouterr().err


def test_a_tiny_run_prints_every_configuration_with_positive_figures(tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--sizes", "tiny", "--modes", "full,lora", "--cadences", "1,2",
                       "--steps", "2", "--units", "1", "--group-size", "2", "--prompt-len", "4",
                       "--completion-len", "8", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    found = {}
    for line in out.splitlines():
        match = LINE.fullmatch(line)
        if match:
            size, mode, cadence, rest = match.groups()
            found[(size, mode, int(cadence))] = {
                k: float(v) for k, v in (item.split("=") for item in rest.split())}
    assert set(found) == {("tiny", mode, cadence) for mode in ("full", "lora")
                          for cadence in (1, 2)}
    names = {"step_s", "checkpoint_s", "checkpoint_mb", "artifact_s", "artifact_mb",
             "checkpoint_share", "window_share", "window_step_s", "window_checkpoint_s"}
    for figures in found.values():
        assert set(figures) == names
        assert all(value > 0 for value in figures.values()), figures
        assert figures["checkpoint_share"] < 1 and figures["window_share"] < 1
    # LoRA checkpoints and artifacts hold the adapters alone: smaller than the full model's.
    assert found[("tiny", "lora", 1)]["checkpoint_mb"] < found[("tiny", "full", 1)][
        "checkpoint_mb"]
    assert found[("tiny", "lora", 1)]["artifact_mb"] < found[("tiny", "full", 1)]["artifact_mb"]
    assert out.count("steady share") >= 2  # a table per configuration
    assert list(tmp_path.iterdir()) == []  # its working directory is removed


def test_the_named_sizes_are_the_sizes_they_say():
    """100M and 500M are about that many parameters (counted from the config, on the meta
    device: nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    bench = _bench()
    for name, low, high in (("100M", 90e6, 110e6), ("500M", 450e6, 550e6)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.SIZES[name].config())
        assert low < sum(p.numel() for p in model.parameters()) < high, name


def test_a_configuration_that_would_not_fit_in_memory_is_skipped_and_says_so(tmp_path, capsys,
                                                                             monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "available_bytes", lambda: 1 << 20)
    assert bench.main(["--sizes", "tiny", "--modes", "full", "--cadences", "1", "--steps", "1",
                       "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not LINE.search(out)
    assert "CHECKPOINT size=tiny mode=full skipped: needs about" in out
    assert "--force runs it anyway" in out
