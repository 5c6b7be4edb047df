"""The policy of ``reef demo --engine vllm``: a tiny Qwen2-style Hugging Face model, built once.

    path = demo_model_dir(settings.home)      # $REEF_HOME/models/demo-qwen2-<spec hash>
    ensure_demo_model(path)                   # builds it on first use; returns at once after

The tokenizer is built here over the task's characters: a word-level tokenizer whose
vocabulary is exactly the toy task's (``reef_stream.demo.task.VOCABULARY``: ``<pad>``,
``<bos>``, ``<eos>``, the ten digits, ``+``, ``=``, ids 0-14, each character one token), so a
prompt's token ids, the reward (``exact_match``), the processor and the held-out evaluation
are the toy task's unchanged, and the model's vocabulary size is the tokenizer's (15). The
model is a Qwen2 causal LM from a config (``SPEC``: 2 layers, hidden 64, 2 heads of head_dim
32 -- vLLM's CPU attention takes head_dim 32, 64, 80, ... --, 1 KV head), random weights
seeded with ``SPEC["seed"]``, float32, saved with ``save_pretrained`` (safetensors) beside the
tokenizer: a directory that ``HuggingFace(path)`` trains and vLLM serves. The directory's name
carries a hash of ``SPEC``, so a change of the spec builds a new one; ``BUILT`` is written last,
so a half-built directory is rebuilt, never used. Concurrent builders are serialised by a lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from reef_stream.demo.task import BOS, EOS, PAD, VOCABULARY

__all__ = ["BUILT", "SPEC", "demo_model_dir", "ensure_demo_model"]

#: The model's shape and seed. ``initializer_range`` 0.1, not Qwen2's 0.02: with 0.02 an
#: untrained policy's outputs hardly depend on the prompt (see ``task.TinyTransformer``).
SPEC = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 256, "initializer_range": 0.1, "seed": 3}
#: Written last into a complete model directory.
BUILT = ".reef-demo-model.json"


def demo_model_dir(home: Path) -> Path:
    """``<home>/models/demo-qwen2-<12 hex of SPEC's sha256>``."""
    digest = hashlib.sha256(json.dumps(SPEC, sort_keys=True).encode()).hexdigest()[:12]
    return Path(home) / "models" / f"demo-qwen2-{digest}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_demo_model(path: Path, progress: Callable[[str], None] = lambda line: None) -> bool:
    """Build the demo's model and tokenizer in ``path`` unless a complete build is there; True
    if this call built it. Blocks (a second or two: transformers' import, a tiny model)."""
    path = Path(path)
    with _locked(path):
        if (path / BUILT).is_file():
            return False
        if path.exists():
            shutil.rmtree(path)
        progress(f"building the demo's Qwen2-style model and tokenizer in {path}")
        staging = path.with_name(path.name + ".building")
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        count = _build(staging)
        (staging / BUILT).write_text(json.dumps({**SPEC, "parameters": count}, indent=2) + "\n")
        staging.rename(path)
        progress(f"built the demo model ({count:,} parameters, vocabulary {len(VOCABULARY)})")
        return True


def _build(where: Path) -> int:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocabulary = {text: i for i, text in enumerate(VOCABULARY)}
    word_level = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=VOCABULARY[PAD]))
    word_level.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level,
                                        pad_token=VOCABULARY[PAD], bos_token=VOCABULARY[BOS],
                                        eos_token=VOCABULARY[EOS], unk_token=VOCABULARY[PAD])
    assert len(tokenizer) == len(VOCABULARY)
    spec = {k: v for k, v in SPEC.items() if k != "seed"}
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=False,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                         torch_dtype="float32", use_sliding_window=False, **spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SPEC["seed"])
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)
    return sum(p.numel() for p in model.parameters())
