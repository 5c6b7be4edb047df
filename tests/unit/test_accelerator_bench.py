"""``bench/accelerator.py``, the trainer's check on an accelerator, run here on the CPU: its
checks must pass where they are known to hold (a resumed trainer is bitwise on a CPU, the CPU
equals itself), and its cost lines must come out, so that the script a device run depends on
works before a device is lent.

What it found on an H200 is in docs/benchmarks.md ("The trainer on an accelerator").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_accelerator_bench_checks_and_costs_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "accelerator.py"), "--quick", "--compare-cpu",
         "--models", "llama-bf16-lora", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "accelerator.json").read_text())
    assert report["about"]["device"] == "cpu" and report["failed"] == []
    checks = {(r["check"], r["mode"]): r for r in report["records"] if "check" in r}
    assert sorted(checks) == [("cpu.llama-bf16-lora", "default"),
                              ("repeat.llama-bf16-lora", "default"),
                              ("repeat.llama-bf16-lora", "deterministic"),
                              ("resume.llama-bf16-lora", "default"),
                              ("resume.llama-bf16-lora", "deterministic")]
    for record in checks.values():
        assert record["ok"] is True
    assert checks[("resume.llama-bf16-lora", "default")]["tensors_differing"] == 0
    assert checks[("resume.llama-bf16-lora", "default")]["of"] == 16   # A and B, 4 x 2 layers
    assert checks[("cpu.llama-bf16-lora", "default")]["loss_rel_diff"] == 0.0
    costs = {r["cost"]: r for r in report["records"] if "cost" in r}
    assert sorted(costs) == ["generate.hf", "train.full", "train.lora"]
    assert all(r["ms_per_sample"] > 0 for n, r in costs.items() if n.startswith("train."))
    assert costs["generate.hf"]["ms_per_completion"] > 0
    assert "ACCELERATOR device=cpu model=tiny" in done.stdout


def test_a_model_it_does_not_know_is_refused_by_name(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "accelerator.py"), "--quick", "--no-cost",
         "--models", "llama-fp16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--models: unknown llama-fp16 (known: llama-fp32-full" in done.stderr
