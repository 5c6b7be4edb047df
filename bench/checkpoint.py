"""Checkpoints at a size that matters: training step vs checkpoint vs serving artifact.

    python bench/checkpoint.py [--sizes 100M,500M] [--modes full,lora] [--cadences 1,5,20]
                               [--steps 2] [--dtype float32|bfloat16] [--serving-dtype bfloat16]

For Hugging Face causal LMs built from a config (random weights, no hub), saved with
``save_pretrained`` into a temporary directory and loaded through the trainer's own loading
code (``reef_stream.engine.hf.HuggingFace``):

- ``100M``: Llama-style, vocab 32,000, hidden 768, 12 layers, 12 heads (4 KV heads), MLP 2,048,
  tied embeddings (100.1M parameters);
- ``500M``: Qwen2-style, Qwen2.5-0.5B's shape: vocab 151,936, hidden 896, 24 layers, 14 heads
  (2 KV heads), MLP 4,864, tied embeddings (494.0M parameters);
- ``tiny``: a few hundred thousand parameters, for the unit test.

each trained in full (every parameter, AdamW) and through LoRA (``--lora-rank`` 16, alpha twice
the rank, on every linear layer but the head: only the adapters train and are checkpointed).

A training step is ``TorchBackend.train_step`` on ``--units`` rollout units of ``--group-size``
samples, each a ``--prompt-len``-token prompt and a ``--completion-len``-token completion with
logprobs and a reward (default: 2 units of 4 = 8 samples of 32 + 96 = 128 tokens, one AdamW
update a step from two micro batches of 4 samples), advantages from a group baseline.

A checkpoint is what a trainer's acknowledgement writes, written the same way: the backend's
``state()`` (weights, optimizer state, RNG state) with the algorithm state, offsets and unit
hashes, through ``CheckpointStore.write`` (every file fsynced, the directory renamed and
fsynced, the manifest last) into ``--dir`` (default: a temporary directory on this machine's
disk); its time runs from ``state()`` to the write's return. What the acknowledgement adds
after that (a Checkpoint event to Kafka, an offset commit: milliseconds) is not here. The
serving artifact is ``write_serving_artifact`` in ``--serving-dtype`` (the full model's
weights, or the LoRA adapter alone, with its sha256 manifest), written once per window.

For every cadence C of ``--cadences`` the model trains one window of ``--steps`` real steps,
the trainer's rule deciding the checkpoints (one whenever C steps were trained since the
newest), and the window ends with a checkpoint (as a trainer's run does at ``max_steps``), so
every window writes at least one. The windows follow one another in one training run. Per
window it prints what the window measured (its mean step time, its checkpoints' mean write
time and size, the artifact's time and size, its wall time); per configuration the medians
over all its windows: ``step_s``, ``checkpoint_s``, ``artifact_s`` (medians, because other
processes on a shared machine make single steps slow: the load average is printed). Two
shares of wall time spent checkpointing:

- ``checkpoint_share``: a trainer's steady state at cadence C, ``checkpoint_s / (C * step_s +
  checkpoint_s)``, from the configuration's medians;
- ``window_share``: what the window itself measured (its checkpoints' time over its wall
  time); it is a whole number of cycles when ``--steps`` is a multiple of C (``--steps 20``
  makes every default cadence so), and higher otherwise (a short run ends with a checkpoint).

These are slow on a small machine (a 500M step takes 10 s to a minute and more on 2 shared
cores), so the default ``--steps`` is 2: two real steps per cadence window, six per
configuration; raise it for steadier figures. The default run took about 10 minutes on 2
cores with 500M in full in float32 skipped for memory, as it then was (below); that
configuration alone, ``--sizes 500M --modes full --steps 1``, takes about 5. Configurations
run one after the
other, never two at once. It ends with one line per (size, mode, cadence)::

    CHECKPOINT size=100M mode=lora cadence=5 step_s=... checkpoint_s=... checkpoint_mb=...
        artifact_s=... artifact_mb=... checkpoint_share=... window_share=...
        window_step_s=... window_checkpoint_s=...

Memory: a configuration whose estimated peak (``peak_bytes``) is more than this machine has
available is skipped, with a line saying so, unless ``--force``. ``CheckpointStore.write``
streams each tensor to disk from its own memory (it once serialised every file in memory
first, and 500M in full in float32 was killed at 18.6 GiB while it checkpointed), so the peak
is training's and the serving artifact's: 500M trained in full in float32 (8 GB of weights,
gradients and AdamW state) peaked at 14.0 GB.

Figures, never assertions. No network: HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: never a hub
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from reef_stream.api.objective import state_record  # noqa: E402
from reef_stream.api.processor import unit_id  # noqa: E402
from reef_stream.api.recipe import AdamW, Recipe  # noqa: E402
from reef_stream.engine.artifacts import SERVING_DTYPES, write_serving_artifact  # noqa: E402
from reef_stream.engine.checkpoints import (  # noqa: E402
    CheckpointContents,
    CheckpointStore,
    unit_hash,
)
from reef_stream.engine.hf import TRAIN_DTYPES, HuggingFace, Lora  # noqa: E402
from reef_stream.engine.training import TorchBackend  # noqa: E402
from reef_stream.core.events import RolloutUnit, Sample, TopicOffset  # noqa: E402
from tests.recipes.trainable import recipe as trainable  # noqa: E402

MODES = ("full", "lora")
MB = 1e6


@dataclass(frozen=True, slots=True)
class Shape:
    """A causal LM's shape, built from a config with random weights."""

    style: str  # "llama" or "qwen2"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_len: int = 2048

    def config(self):
        import transformers

        config_class = {"llama": transformers.LlamaConfig,
                        "qwen2": transformers.Qwen2Config}[self.style]
        return config_class(vocab_size=self.vocab, hidden_size=self.hidden,
                            num_hidden_layers=self.layers, num_attention_heads=self.heads,
                            num_key_value_heads=self.kv_heads,
                            intermediate_size=self.intermediate,
                            max_position_embeddings=self.max_len, tie_word_embeddings=True)

    def describe(self) -> str:
        return (f"{'Llama' if self.style == 'llama' else 'Qwen2'}-style, vocab {self.vocab:,}, "
                f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads "
                f"({self.kv_heads} KV), MLP {self.intermediate}, tied embeddings")


SIZES = {
    "tiny": Shape("llama", vocab=300, hidden=64, layers=2, heads=4, kv_heads=2,
                  intermediate=128, max_len=256),
    "100M": Shape("llama", vocab=32_000, hidden=768, layers=12, heads=12, kv_heads=4,
                  intermediate=2048),
    "500M": Shape("qwen2", vocab=151_936, hidden=896, layers=24, heads=14, kv_heads=2,
                  intermediate=4864),
}


@dataclass(frozen=True, slots=True)
class Batch:
    """A training step's units: ``units`` groups of ``group_size`` samples."""

    units: int = 2
    group_size: int = 4
    prompt_len: int = 32
    completion_len: int = 96

    def describe(self) -> str:
        units = "unit" if self.units == 1 else "units"
        micro = "micro batch" if self.units == 1 else "micro batches"
        return (f"{self.units * self.group_size} samples x "
                f"{self.prompt_len + self.completion_len} tokens a step ({self.units} {units} of "
                f"{self.group_size}, {self.prompt_len} prompt + {self.completion_len} completion"
                f" tokens), one AdamW update from {self.units} {micro}")


@dataclass(slots=True)
class Window:
    """What one cadence's window of real steps measured."""

    size: str
    mode: str
    cadence: int
    step_s: list[float] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    checkpoint_bytes: list[int] = field(default_factory=list)
    artifact_s: float = 0.0
    artifact_bytes: int = 0
    wall_s: float = 0.0

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.step_s))

    @property
    def mean_checkpoint_s(self) -> float:
        return float(np.mean(self.checkpoint_s))

    @property
    def checkpoint_mb(self) -> float:
        return float(np.mean(self.checkpoint_bytes)) / MB

    @property
    def window_share(self) -> float:
        """What the window measured: its checkpoints' time over its wall time."""
        return sum(self.checkpoint_s) / self.wall_s


@dataclass(frozen=True, slots=True)
class Medians:
    """One configuration's medians over every window: step, checkpoint, artifact seconds."""

    step_s: float
    checkpoint_s: float
    artifact_s: float

    @classmethod
    def of(cls, windows: Sequence[Window]) -> Medians:
        return cls(step_s=float(np.median([s for w in windows for s in w.step_s])),
                   checkpoint_s=float(np.median([c for w in windows for c in w.checkpoint_s])),
                   artifact_s=float(np.median([w.artifact_s for w in windows])))

    def share(self, cadence: int) -> float:
        """The steady state at ``cadence``: one checkpoint per ``cadence`` steps."""
        return self.checkpoint_s / (cadence * self.step_s + self.checkpoint_s)


def peak_bytes(params: int, mode: str, dtype: str, batch: Batch, vocab: int,
               serving_dtype: str = "bfloat16") -> int:
    """About the most memory one configuration takes: the weights; the gradients and AdamW's
    two moments of what trains (all of it in full, a few percent with LoRA); a checkpoint
    write (``CheckpointStore.write`` streams each tensor from its own memory: at most a copy
    of one tensor, counted as 1 GiB); the serving artifact's write (what it serves cast to
    the serving dtype, and ``save_pretrained``'s safetensors bytes of it twice); a micro
    batch's logits and their gradients; the interpreter and libraries. 500M in full in
    float32 peaked at 14.0 GB (estimated 13.4 GiB); 100M full at 4.9 GiB when the checkpoint
    write still held every file in memory."""
    width = 2 if dtype == "bfloat16" else 4
    trained = params if mode == "full" else params // 30
    state = params * width + 3 * trained * width
    checkpoint = 1 << 30
    artifact = 3 * (params if mode == "full" else trained) * (4 if serving_dtype == "float32"
                                                              else 2)
    logits = 4 * batch.group_size * (batch.prompt_len + batch.completion_len) * vocab * 4
    return state + checkpoint + artifact + logits + (2 << 30)  # the interpreter, torch, transformers


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def figure(value: float) -> str:
    """Three significant digits below 100, whole numbers above."""
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def say(text: str) -> None:
    """``text`` on stdout after the time of day, flushed (progress while it runs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def build_model_dir(shape: Shape, directory: Path, dtype: str, seed: int = 0) -> int:
    """A model of ``shape`` with random weights, written by ``save_pretrained`` in ``dtype``
    into ``directory``; returns its parameter count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(shape.config(), dtype=getattr(torch, dtype))
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    gc.collect()
    return count


def bench_recipe(path: Path, mode: str, dtype: str, batch: Batch, lora_rank: int,
                 max_cadence: int) -> Recipe:
    """The test recipe's objective (group baseline) on the model at ``path``: every step
    ``batch.units`` units, one optimizer update, micro batches of one unit."""
    lora = (Lora(rank=lora_rank, alpha=2.0 * lora_rank, target_modules=("all-linear",))
            if mode == "lora" else None)
    schedule = dataclasses.replace(trainable.schedule, units_per_step=batch.units,
                                   optimizer_batch_size=batch.units, micro_batch_size=1,
                                   epochs=1, seed=0, max_staleness=max_cadence,
                                   checkpoint_every=1)
    return dataclasses.replace(trainable, schedule=schedule, backend=dataclasses.replace(
        trainable.backend, model=HuggingFace(str(path), dtype=dtype, lora=lora),
        optimizer=AdamW(lr=1e-5)))


def make_units(batch: Batch, vocab: int, step: int) -> list[RolloutUnit]:
    """Step ``step``'s units: seeded token ids below ``vocab``, logprobs, rewards."""
    units = []
    for u in range(batch.units):
        rng = np.random.default_rng([step, u])
        members = tuple(Sample(
            generation_id=f"g{step}-{u}-{k}", prompt_id=f"p{step}-{u}", policy_version=step - 1,
            prompt_token_ids=rng.integers(0, vocab, batch.prompt_len).astype(np.int32),
            completion_token_ids=rng.integers(0, vocab, batch.completion_len).astype(np.int32),
            completion_logprobs=(-rng.random(batch.completion_len) * 4 - 0.1).astype(np.float32),
            reward=float(rng.random() < 0.5)) for k in range(batch.group_size))
        units.append(RolloutUnit(
            unit_id=unit_id(trainable.name, [m.generation_id for m in members]),
            recipe=trainable.name, group_key=f"p{step}-{u}", members=members,
            created_at=1_700_000_000_000 + step))
    return units


class Run:
    """One configuration's training run: the backend, its objective state, its checkpoint
    store, what it trained; a step, a checkpoint and an artifact as a trainer makes them."""

    def __init__(self, recipe: Recipe, store_url: Path, artifact_dir: Path, batch: Batch,
                 serving_dtype: str) -> None:
        self.recipe, self.batch, self.serving_dtype = recipe, batch, serving_dtype
        self.backend = TorchBackend(recipe)
        self.model = self.backend.accelerator.unwrap_model(self.backend.model)
        self.store = CheckpointStore(store_url)
        self.artifact_dir = artifact_dir
        self.state = recipe.objective.initial_state()
        self.step = self.durable_step = 0
        self.trained: set[int] = set()
        self.unacknowledged: list[str] = []
        self.metrics: dict[str, float] = {}

    def parameters(self) -> tuple[int, int]:
        """All parameters and those that train."""
        every = list(self.model.parameters())
        return sum(p.numel() for p in every), sum(p.numel() for p in every if p.requires_grad)

    def train(self) -> float:
        """One step (``TorchBackend.train_step``); its seconds."""
        self.step += 1
        units = make_units(self.batch, self.model.vocab_size, self.step)
        started = time.perf_counter()
        result = self.recipe.objective.compute(units, self.state)
        self.metrics = self.backend.train_step(units, result, self.step)
        seconds = time.perf_counter() - started
        self.state = result.proposed_state
        self.trained.update(unit_hash(u.unit_id) for u in units)
        self.unacknowledged.extend(u.unit_id for u in units)
        return seconds

    def checkpoint(self) -> tuple[float, int]:
        """The trainer's checkpoint of the newest step, written durably; its seconds and
        bytes. Older checkpoints are pruned afterwards (one kept), outside the timing."""
        started = time.perf_counter()
        weights, optimizer, rng = self.backend.state()
        contents = CheckpointContents(
            step=self.step, policy_version=self.step, model="bench", recipe=self.recipe.name,
            trainer_group="bench", weights=weights, optimizer=optimizer, rng=rng,
            algorithm_state=state_record(self.state),
            offsets=(TopicOffset(topic="bench.units.trainable", partition=0,
                                 offset=self.step * self.batch.units),),
            trained_units=np.unique(np.fromiter(self.trained, dtype=np.uint64,
                                                count=len(self.trained))),
            step_units=tuple(self.unacknowledged), metrics=self.metrics,
            created_at=int(time.time() * 1000))
        stored = self.store.write(contents)
        seconds = time.perf_counter() - started
        del weights, optimizer, contents
        self.durable_step, self.unacknowledged = self.step, []
        size = sum(p.stat().st_size for p in Path(stored.uri.removeprefix("file://")).iterdir())
        self.store.prune(1)
        return seconds, size

    def artifact(self) -> tuple[float, int]:
        """The serving artifact of the live model; its seconds and bytes."""
        started = time.perf_counter()
        written = write_serving_artifact(self.model, self.artifact_dir, self.serving_dtype,
                                         metadata={"policy_version": self.step})
        return time.perf_counter() - started, written.size

    def window(self, size: str, mode: str, cadence: int, steps: int) -> Window:
        """``steps`` real steps with a checkpoint every ``cadence`` (the trainer's rule) and
        one closing the window, then the serving artifact."""
        measured = Window(size=size, mode=mode, cadence=cadence)
        started = time.perf_counter()
        for _ in range(steps):
            measured.step_s.append(self.train())
            note = f"step {self.step}: {measured.step_s[-1]:.2f} s"
            if self.step - self.durable_step >= cadence or len(measured.step_s) == steps:
                seconds, written = self.checkpoint()
                measured.checkpoint_s.append(seconds)
                measured.checkpoint_bytes.append(written)
                note += f", checkpoint {seconds:.2f} s ({written / MB:.1f} MB)"
            say(f"  {size} {mode} cadence {cadence}: {note}")
        measured.wall_s = time.perf_counter() - started
        measured.artifact_s, measured.artifact_bytes = self.artifact()
        say(f"  {size} {mode} cadence {cadence}: serving artifact {measured.artifact_s:.2f} s "
            f"({measured.artifact_bytes / MB:.1f} MB)")
        return measured


def measure(size: str, mode: str, model_dir: Path, work: Path, args: argparse.Namespace
            ) -> tuple[list[Window], str]:
    """Every cadence's window for one configuration, and its table's title."""
    batch = Batch(args.units, args.group_size, args.prompt_len, args.completion_len)
    recipe = bench_recipe(model_dir, mode, args.dtype, batch, args.lora_rank,
                          max(args.cadences))
    started = time.perf_counter()
    run = Run(recipe, work / f"checkpoints-{size}-{mode}", work / f"artifact-{size}-{mode}",
              batch, args.serving_dtype)
    total, trained = run.parameters()
    say(f"{size} {mode}: loaded through HuggingFace(...) in {time.perf_counter() - started:.1f}"
        f" s; {total / 1e6:.1f}M parameters, {trained / 1e6:.2f}M trained")
    windows = [run.window(size, mode, cadence, args.steps) for cadence in args.cadences]
    lora = (f", LoRA rank {args.lora_rank} alpha {2 * args.lora_rank} on every linear layer"
            if mode == "lora" else "")
    title = (f"{size} {mode} ({SIZES[size].describe()}; {total / 1e6:.1f}M parameters, "
             f"{trained / 1e6:.2f}M trained{lora}), training in {args.dtype}, serving "
             f"{args.serving_dtype}; {batch.describe()}; {args.steps} real steps per cadence")
    del run
    gc.collect()
    shutil.rmtree(work / f"checkpoints-{size}-{mode}", ignore_errors=True)
    shutil.rmtree(work / f"artifact-{size}-{mode}", ignore_errors=True)
    return windows, title


def table(title: str, windows: Sequence[Window]) -> str:
    """One configuration's figures, a row per cadence."""
    medians = Medians.of(windows)
    header = ("cadence", "steps", "step s", "checkpoints", "checkpoint s", "checkpoint MB",
              "artifact s", "artifact MB", "window s", "window share", "steady share")
    rows = [header] + [(
        str(w.cadence), str(len(w.step_s)), figure(w.mean_step_s), str(len(w.checkpoint_s)),
        figure(w.mean_checkpoint_s), figure(w.checkpoint_mb), figure(w.artifact_s),
        figure(w.artifact_bytes / MB), figure(w.wall_s), f"{w.window_share:.1%}",
        f"{medians.share(w.cadence):.1%}") for w in windows]
    rows.append(("median", str(sum(len(w.step_s) for w in windows)), figure(medians.step_s),
                 str(sum(len(w.checkpoint_s) for w in windows)), figure(medians.checkpoint_s),
                 "", figure(medians.artifact_s), "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [title] + ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths))
                       for row in rows]
    return "\n".join(lines)


def result_line(w: Window, medians: Medians) -> str:
    """The machine-readable line of one (size, mode, cadence): the configuration's medians,
    the steady share from them, and what the cadence's window measured."""
    return (f"CHECKPOINT size={w.size} mode={w.mode} cadence={w.cadence} "
            f"step_s={medians.step_s:.3f} checkpoint_s={medians.checkpoint_s:.3f} "
            f"checkpoint_mb={w.checkpoint_mb:.2f} artifact_s={medians.artifact_s:.3f} "
            f"artifact_mb={w.artifact_bytes / MB:.2f} "
            f"checkpoint_share={medians.share(w.cadence):.4f} "
            f"window_share={w.window_share:.4f} window_step_s={w.mean_step_s:.3f} "
            f"window_checkpoint_s={w.mean_checkpoint_s:.3f}")


def _load() -> str:
    """This machine's load averages (other processes slow the figures down: say so)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} {five:.1f} {fifteen:.1f}"


def _names(allowed: Sequence[str]):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        wrong = [n for n in names if n not in allowed]
        if not names or wrong:
            raise argparse.ArgumentTypeError(
                f"{', '.join(wrong) or 'nothing'}: choose from {', '.join(allowed)}")
        return list(dict.fromkeys(names))
    return parse


def _cadences(text: str) -> list[int]:
    try:
        cadences = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cadences = []
    if not cadences or min(cadences) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive whole numbers of steps, e.g. 1,5,20")
    return list(dict.fromkeys(cadences))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/checkpoint.py",
        description="Training step time vs trainer checkpoint write time and size vs serving "
                    "artifact time and size, for Hugging Face causal LMs built from a config "
                    "(random weights, no hub), trained in full and through LoRA, and the share "
                    "of wall time spent checkpointing at each checkpoint cadence. Each cadence "
                    "gets a window of --steps real steps (the trainer's rule decides the "
                    "checkpoints, and one closes the window). Prints a table per "
                    "configuration and a CHECKPOINT line per (size, mode, cadence). The "
                    "default run takes about 15 minutes on 2 cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", type=_names(tuple(SIZES)), default=["100M", "500M"],
                        help="models, comma-separated: 100M (Llama-style, 100.1M parameters), "
                             "500M (Qwen2-style, Qwen2.5-0.5B's shape, 494.0M), tiny (tests)")
    parser.add_argument("--modes", type=_names(MODES), default=list(MODES),
                        help="full: every parameter trains and is checkpointed; lora: the "
                             "adapters alone")
    parser.add_argument("--cadences", type=_cadences, default=[1, 5, 20],
                        help="checkpoint every this many steps, comma-separated")
    parser.add_argument("--steps", type=_positive, default=2,
                        help="real training steps in each cadence's window (a multiple of "
                             "every cadence makes each window whole cycles)")
    parser.add_argument("--dtype", choices=TRAIN_DTYPES, default="float32",
                        help="the weights' dtype while training")
    parser.add_argument("--serving-dtype", choices=SERVING_DTYPES, default="bfloat16",
                        help="the serving artifact's dtype")
    parser.add_argument("--lora-rank", type=_positive, default=16,
                        help="LoRA rank (alpha: twice the rank; every linear layer but the head)")
    parser.add_argument("--units", type=_positive, default=2, help="rollout units a step")
    parser.add_argument("--group-size", type=_positive, default=4, help="samples a unit")
    parser.add_argument("--prompt-len", type=_positive, default=32, help="prompt tokens a sample")
    parser.add_argument("--completion-len", type=_positive, default=96,
                        help="completion tokens a sample")
    parser.add_argument("--force", action="store_true",
                        help="run a configuration even when its estimated peak memory is more "
                             "than this machine has available (otherwise it is skipped, and "
                             "says so)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where models, checkpoints and artifacts are written (default: a "
                             "temporary directory, removed at the end)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # SIGTERM ends the run as Ctrl-C does: the working directory (gigabytes) is removed.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="reef-bench-checkpoint-", dir=args.dir))
    given = " ".join(sys.argv[1:] if argv is None else argv) or "(the defaults)"
    say(f"bench/checkpoint.py {given}: "
        f"{torch.get_num_threads()} torch threads on {os.cpu_count()} CPUs, {_load()}; "
        f"writing under {work}")
    results: list[tuple[str, list[Window]]] = []
    skipped: list[str] = []
    try:
        for size in args.sizes:
            model_dir = work / f"model-{size}"
            started = time.perf_counter()
            count = build_model_dir(SIZES[size], model_dir, args.dtype)
            say(f"{size}: built from a config ({SIZES[size].describe()}), {count / 1e6:.1f}M "
                f"parameters, save_pretrained in {time.perf_counter() - started:.1f} s")
            for mode in args.modes:
                batch = Batch(args.units, args.group_size, args.prompt_len, args.completion_len)
                needed, free = peak_bytes(count, mode, args.dtype, batch, SIZES[size].vocab,
                                          args.serving_dtype), \
                    available_bytes()
                if free is not None and needed > free and not args.force:
                    reason = (f"needs about {needed / 2**30:.1f} GiB of memory at its peak (a "
                              f"checkpoint write), {free / 2**30:.1f} GiB available")
                    say(f"{size} {mode}: skipped: {reason}; --dtype bfloat16 about halves it, "
                        "--force runs it anyway")
                    skipped.append(f"CHECKPOINT size={size} mode={mode} skipped: {reason}")
                    continue
                say(f"{size} {mode}: needs about {needed / 2**30:.1f} GiB of memory at its peak"
                    + ("" if free is None else f", {free / 2**30:.1f} GiB available"))
                windows, title = measure(size, mode, model_dir, work, args)
                results.append((title, windows))
                print(table(title, windows), flush=True)
                say(f"{size} {mode}: done; peak memory of this process so far "
                    f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB; "
                    f"{_load()}")
            shutil.rmtree(model_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    print()
    for title, windows in results:
        print(table(title, windows))
        print()
    for _, windows in results:
        medians = Medians.of(windows)
        for w in windows:
            print(result_line(w, medians))
    for line in skipped:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
