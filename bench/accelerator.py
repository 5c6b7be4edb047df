"""The trainer on an accelerator: does a step run there, does a resumed trainer go on bitwise,
how far is it from the CPU, and what does a step cost against a generation.

    python bench/accelerator.py [--quick] [--out DIR] [--cost-model qwen0.5b|tiny]

No broker: the torch backend (``reef_stream.engine.training.TorchBackend``) trains Hugging
Face models built here from a config (random weights, saved with ``save_pretrained``, loaded
through ``reef_stream.engine.hf.HuggingFace`` as a recipe loads them) on seeded units, and
writes its checkpoints through ``CheckpointStore`` (safetensors, verified when loaded back).
It runs on the first CUDA device when there is one, else on the CPU.

Checks, one line each (``CHECK name ok=... detail``); the run exits 1 when one fails:

- ``resume.<model>``: a trainer restored from the checkpoint of step 1 trains steps 2..S to
  bitwise the weights of one that never stopped (the promise the trainer-kill tests make on
  a CPU);
- ``repeat.<model>``: two trainers built alike in one process train to bitwise the same
  weights (run-to-run determinism on this device);
- ``cpu.<model>`` (on an accelerator only): the logits of a fixed batch before step 1 and
  the step's loss, against the same on the CPU (a child process with
  ``CUDA_VISIBLE_DEVICES=``; the logits come back as safetensors): relative difference under
  1e-3 in float32, 3e-2 in bfloat16. The logits after the step are reported beside them.

The models of the checks: a small Llama in float32 (full fine-tuning), a Qwen2 with a tied
head in bfloat16 (full), a Llama in bfloat16 with LoRA adapters. Each check runs with torch's
defaults and again with ``torch.use_deterministic_algorithms(True)`` (``mode``).

Cost, one line each (``COST ...``), figures, never assertions: a model of Qwen2.5-0.5B's shape
(``--cost-model``, bfloat16) trains steps of 32 samples (prompt 256, completion 512 tokens) in
full and with LoRA, in ms per trained sample; and ``generate`` (Hugging Face's, sampling, 32
completions at once, 512 new tokens each) in ms per completion. Their ratio is what the demo's
device model (``--device-model gen_ms=G,train_ms=T``) takes as ``T/G``; Hugging Face's
generate is far slower than a serving engine (vLLM batches, pages its cache and captures
graphs), so the ratio measured here is a lower bound on training's share.

``--quick``: tiny models and cost sizes (a CPU run in seconds; the test suite runs it).
``--out DIR``: also writes the figures as ``accelerator.json`` there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# cuBLAS is deterministic only with a fixed workspace; it must be set before cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.api.recipe import AdamW  # noqa: E402
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, load  # noqa: E402
from reef_stream.engine.hf import HuggingFace, Lora  # noqa: E402
from reef_stream.engine.training import TorchBackend  # noqa: E402
from tests.recipes.trainable import recipe as trainable  # noqa: E402
from tests.unit_log import rollout_unit  # noqa: E402

STEPS = 3
#: Relative difference from the CPU's loss and logits allowed per dtype (a bfloat16 operand
#: alone is 1e-3 to 1e-2 off; a forward pass of several layers adds up).
CPU_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model built from a config: ``family`` is ``llama`` or ``qwen2`` (tied head)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_len: int


SHAPES = {
    "tiny": Shape("llama", 64, 2, 4, 2, 128, 300, 256),
    "small": Shape("llama", 256, 4, 8, 2, 688, 2048, 1024),
    "qwen-small": Shape("qwen2", 256, 4, 8, 2, 688, 2048, 1024),
    "qwen-tiny": Shape("qwen2", 64, 2, 4, 2, 128, 300, 256),
    # Qwen2.5-0.5B's config (its published config.json), random weights.
    "qwen0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 32768),
}


def build(shape: Shape, directory: Path) -> str:
    """``shape`` with seeded random weights, saved with ``save_pretrained``; the path."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[shape.family]
    config = config_class(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                          num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                          num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                          max_position_embeddings=shape.max_len,
                          tie_word_embeddings=shape.family == "qwen2")
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    return str(directory)


def recipe_of(model: HuggingFace, *, units: int, micro: int, lr: float = 1e-3) -> Any:
    """The trainable test recipe on ``model``: one AdamW update of ``units`` units a step."""
    schedule = dataclasses.replace(trainable.schedule, units_per_step=units,
                                   optimizer_batch_size=units, micro_batch_size=micro, epochs=1)
    return dataclasses.replace(trainable, schedule=schedule, backend=dataclasses.replace(
        trainable.backend, model=model, optimizer=AdamW(lr=lr)))


def units_of(step: int, recipe: Any, vocab: int, **sizes: int) -> list:
    n = recipe.schedule.units_per_step
    return [rollout_unit(i, vocab=vocab, **sizes) for i in range(step * n, (step + 1) * n)]


def train(backend: TorchBackend, recipe: Any, step: int, vocab: int, **sizes: int
          ) -> dict[str, float]:
    units = units_of(step, recipe, vocab, **sizes)
    result = recipe.objective.compute(units, recipe.objective.initial_state())
    return backend.train_step(units, result, step)


def stored(backend: TorchBackend, directory: Path, step: int) -> Any:
    """The backend's state written as a trainer checkpoint and loaded back (verified)."""
    weights, optimizer, rng = backend.state()
    written = CheckpointStore(directory).write(CheckpointContents(
        step=step, policy_version=step, model="m", recipe="trainable", trainer_group="g",
        weights=weights, optimizer=optimizer, rng=rng, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64)))
    return load(written.uri, written.sha256)


def weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in backend.state()[0].items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[int, float]:
    """How many tensors of ``a`` and ``b`` differ at all, and the largest absolute difference."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    names = [n for n in a if not torch.equal(a[n], b[n])]
    largest = max((float((a[n].float() - b[n].float()).abs().max()) for n in names), default=0.0)
    return len(names), largest


# --------------------------------------------------------------------------- checks


@dataclasses.dataclass(frozen=True)
class Setting:
    """A model of a check: its shape, the dtype it trains in, with or without LoRA."""

    name: str
    shape: str
    dtype: str
    lora: bool

    def model(self, path: str) -> HuggingFace:
        return HuggingFace(path, dtype=self.dtype, lora=Lora(rank=8, alpha=16) if self.lora
                           else None)


def settings(quick: bool) -> list[Setting]:
    llama, qwen = ("tiny", "qwen-tiny") if quick else ("small", "qwen-small")
    return [Setting("llama-fp32-full", llama, "float32", False),
            Setting("qwen-bf16-full-tied", qwen, "bfloat16", False),
            Setting("llama-bf16-lora", llama, "bfloat16", True)]


SIZES = {"prompt_len": 24, "completion_len": 40, "group_size": 4}


def check_resume_and_repeat(setting: Setting, path: str, scratch: Path, mode: str
                            ) -> list[dict[str, Any]]:
    """``resume.<model>`` and ``repeat.<model>`` under ``mode`` (``default`` or
    ``deterministic``)."""
    torch.use_deterministic_algorithms(mode == "deterministic")
    vocab = SHAPES[setting.shape].vocab
    recipe = recipe_of(setting.model(path), units=4, micro=2, lr=1e-2)
    straight = TorchBackend(recipe)
    train(straight, recipe, 1, vocab, **SIZES)
    checkpoint = stored(straight, scratch / f"{setting.name}-{mode}", 1)
    resumed = TorchBackend(recipe)
    resumed.restore(checkpoint.weights, checkpoint.optimizer, checkpoint.rng)
    again = TorchBackend(recipe)
    train(again, recipe, 1, vocab, **SIZES)
    for step in range(2, STEPS + 1):
        for backend in (straight, resumed, again):
            train(backend, recipe, step, vocab, **SIZES)
    reference = weights(straight)
    lines = []
    for check, other in (("resume", resumed), ("repeat", again)):
        count, largest = differing(reference, weights(other))
        lines.append({"check": f"{check}.{setting.name}", "mode": mode, "ok": count == 0,
                      "tensors_differing": count, "of": len(reference),
                      "max_abs_diff": largest})
    del straight, resumed, again
    torch.use_deterministic_algorithms(False)
    return lines


def one_step_on(setting: Setting, path: str, out: Path) -> None:
    """Step 1 of ``setting`` here: the logits of a fixed batch before it, its loss, and the
    logits after it, written to ``out`` (safetensors) for the comparison across devices."""
    from safetensors.torch import save_file

    vocab = SHAPES[setting.shape].vocab
    recipe = recipe_of(setting.model(path), units=4, micro=2, lr=1e-2)
    backend = TorchBackend(recipe)
    model = backend.accelerator.unwrap_model(backend.model)
    device = backend.accelerator.device
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 32, dtype=torch.bool)

    def logits() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(ids.to(device), mask.to(device)).float().cpu().contiguous()

    before = logits()
    metrics = train(backend, recipe, 1, vocab, **SIZES)
    save_file({"before": before, "after": logits(),
               "loss": torch.tensor([metrics["loss"]], dtype=torch.float64)}, str(out))


def check_against_cpu(setting: Setting, path: str, scratch: Path) -> dict[str, Any]:
    """``cpu.<model>``: the same step 1 here and in a CPU child process. The forward pass's
    numerics are checked (the logits before the step, the step's loss); the logits after it
    are a figure: AdamW's first update is about ``lr * sign(gradient)``, so a weight whose
    gradient is near 0 may move either way on either device."""
    from safetensors.torch import load_file

    here = scratch / f"{setting.name}-here.safetensors"
    there = scratch / f"{setting.name}-cpu.safetensors"
    one_step_on(setting, path, here)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, __file__, "--one-step", setting.name, path, str(there),
                    "--setting-shape", setting.shape, "--setting-dtype", setting.dtype,
                    *(["--setting-lora"] if setting.lora else [])], env=env, check=True)
    a, b = load_file(str(here)), load_file(str(there))

    def relative(name: str) -> float:
        return float((a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12))

    tolerance = CPU_TOLERANCE[setting.dtype]
    differences = {f"{name}_rel_diff": relative(name) for name in ("before", "loss", "after")}
    return {"check": f"cpu.{setting.name}", "mode": "default",
            "ok": differences["before_rel_diff"] < tolerance
            and differences["loss_rel_diff"] < tolerance, **differences, "tolerance": tolerance}


# --------------------------------------------------------------------------- cost


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_cost(path: str, shape: Shape, *, lora: bool, quick: bool) -> dict[str, Any]:
    """ms per trained sample: steps of 4 units x 8 samples (prompt 256, completion 512)."""
    sizes = ({"prompt_len": 16, "completion_len": 32, "group_size": 4} if quick else
             {"prompt_len": 256, "completion_len": 512, "group_size": 8})
    model = HuggingFace(path, dtype="bfloat16", lora=Lora(rank=16, alpha=32) if lora else None)
    recipe = recipe_of(model, units=4, micro=1)
    backend = TorchBackend(recipe)
    train(backend, recipe, 0, shape.vocab, **sizes)          # warm-up
    timed = 1 if quick else 3
    synchronize()
    start = time.perf_counter()
    for step in range(1, timed + 1):
        train(backend, recipe, step, shape.vocab, **sizes)
    synchronize()
    seconds = (time.perf_counter() - start) / timed
    samples = recipe.schedule.units_per_step * sizes["group_size"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    del backend
    return {"cost": f"train.{'lora' if lora else 'full'}", "ms_per_sample": 1000 * seconds / samples,
            "samples_per_step": samples, "step_s": seconds, "peak_gib": peak, **sizes}


def generate_cost(path: str, *, quick: bool) -> dict[str, Any]:
    """ms per completion: Hugging Face's generate, sampling, ``batch`` completions at once."""
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, prompt, new = (4, 16, 32) if quick else (32, 256, 512)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16
                                                              ).to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(5))
    ids = ids.to(device)
    kwargs = {"do_sample": True, "min_new_tokens": new, "max_new_tokens": new,
              "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
        synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        synchronize()
    seconds = time.perf_counter() - start
    assert out.shape == (batch, prompt + new), out.shape
    del model
    return {"cost": "generate.hf", "ms_per_completion": 1000 * seconds / batch,
            "batch": batch, "prompt_len": prompt, "new_tokens": new, "seconds": seconds}


# --------------------------------------------------------------------------- main


def describe() -> dict[str, Any]:
    import transformers

    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__}


def print_line(kind: str, record: dict[str, Any]) -> None:
    fields = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in record.items())
    print(f"{kind} {fields}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and sizes: a CPU run in seconds")
    parser.add_argument("--out", type=Path, help="also write accelerator.json here")
    parser.add_argument("--cost-model", choices=sorted(SHAPES), default=None,
                        help="the model whose step and generation are timed "
                             "(default: qwen0.5b, tiny with --quick)")
    parser.add_argument("--no-cost", action="store_true", help="the checks only")
    parser.add_argument("--models", default=None,
                        help="the checks' models, comma-separated (default: all of "
                             "llama-fp32-full, qwen-bf16-full-tied, llama-bf16-lora)")
    parser.add_argument("--compare-cpu", action="store_true",
                        help="run the cpu.<model> checks without an accelerator too (the CPU "
                             "against itself, in a child process: the check's own test)")
    parser.add_argument("--one-step", nargs=3, metavar=("NAME", "PATH", "OUT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--setting-shape", help=argparse.SUPPRESS)
    parser.add_argument("--setting-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--setting-lora", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_step:   # the CPU side of a cpu.<model> check, in its own process
        import transformers

        transformers.utils.logging.disable_progress_bar()
        name, path, out = args.one_step
        one_step_on(Setting(name, args.setting_shape, args.setting_dtype, args.setting_lora),
                    path, Path(out))
        return 0

    import transformers

    transformers.utils.logging.disable_progress_bar()
    about = describe()
    print_line("DEVICE", about)
    records: list[dict[str, Any]] = []
    failed = []
    with tempfile.TemporaryDirectory(prefix="reef-accelerator-") as tmp:
        scratch = Path(tmp)
        paths: dict[str, str] = {}
        chosen = settings(args.quick)
        if args.models:
            names = args.models.split(",")
            if unknown := sorted(set(names) - {s.name for s in chosen}):
                parser.error(f"--models: unknown {', '.join(unknown)} (known: "
                             f"{', '.join(s.name for s in chosen)})")
            chosen = [s for s in chosen if s.name in names]
        for setting in chosen:
            if setting.shape not in paths:
                paths[setting.shape] = build(SHAPES[setting.shape], scratch / setting.shape)
            checks = [line for mode in ("default", "deterministic")
                      for line in check_resume_and_repeat(setting, paths[setting.shape],
                                                          scratch, mode)]
            if torch.cuda.is_available() or args.compare_cpu:
                checks.append(check_against_cpu(setting, paths[setting.shape], scratch))
            for line in checks:
                print_line("CHECK", line)
                records.append(line)
                if not line["ok"]:
                    failed.append(f"{line['check']} ({line['mode']})")
        if not args.no_cost:
            name = args.cost_model or ("tiny" if args.quick else "qwen0.5b")
            path = build(SHAPES[name], scratch / f"cost-{name}")
            for cost in (lambda: train_cost(path, SHAPES[name], lora=False, quick=args.quick),
                         lambda: train_cost(path, SHAPES[name], lora=True, quick=args.quick),
                         lambda: generate_cost(path, quick=args.quick)):
                line = {"model": name, **cost()}
                print_line("COST", line)
                records.append(line)
                synchronize()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
            trained = {r["cost"]: r["ms_per_sample"] for r in records if "ms_per_sample" in r}
            generated = next(r["ms_per_completion"] for r in records
                             if r.get("cost") == "generate.hf")
            print(f"ACCELERATOR device={about['device'].replace(' ', '_')} model={name} "
                  f"train_full_ms={trained['train.full']:.3g} "
                  f"train_lora_ms={trained['train.lora']:.3g} gen_hf_ms={generated:.3g} "
                  f"train_over_gen={trained['train.full'] / generated:.3g} "
                  f"checks_failed={len(failed)}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "accelerator.json").write_text(json.dumps(
            {"about": about, "records": records, "failed": failed}, indent=1))
    if failed:
        print(f"FAILED: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
