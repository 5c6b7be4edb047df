"""Serving artifacts: what an inference engine loads, separate from the trainer's checkpoint.

A trainer checkpoint (``reef_stream.engine.checkpoints``) holds everything training needs to
continue (weights in the training dtype, optimizer state, RNG states, offsets). A serving
replica needs much less, in another form: ``write_serving_artifact`` writes it from a
``HuggingFaceLM`` (``reef_stream.engine.hf``) into a directory (a local path, or any fsspec
URL)::

    full weights (kind "full")                 LoRA (kind "lora")
        config.json                                adapter_config.json
        generation_config.json                     adapter_model.safetensors
        model.safetensors (or shards + index)      MANIFEST.json
        tokenizer files of the source, if any
        MANIFEST.json

The full kind is what ``save_pretrained`` writes, in the serving dtype (``config.json`` says
it), so ``AutoModelForCausalLM.from_pretrained(dir)``, vLLM's ``--model dir`` or its
``reload_weights`` load it; the LoRA kind is what ``PeftModel.save_pretrained`` writes (the
adapter alone, for ``PeftModel.from_pretrained`` or vLLM's ``/v1/load_lora_adapter``), its
tensors in the serving dtype.

``MANIFEST.json`` is written last, as a checkpoint's is: every other file with its size and
sha256, the ``kind``, the serving ``dtype``, the ``source`` the base was loaded from and the
caller's ``metadata``. The artifact's ``sha256`` is that of the manifest's bytes, so a
publication naming it pins every file; ``verify_artifact`` checks them (streaming: a 14 GB
artifact is not read into memory) before an engine is told to load the directory.

Nothing is pickled: tensors are safetensors, everything else JSON.

To publish a checkpoint rather than the live model, build the model again and load the
checkpoint's weights into it::

    model = recipe.backend.model()              # HuggingFace(...)(): the base from its path
    model.load_state_dict(load_weights(uri, sha256))
    artifact = write_serving_artifact(model, "/artifacts/v42", dtype="bfloat16")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch

from reef_stream.core.errors import ConfigurationError
from reef_stream.engine import checkpoints
from reef_stream.engine.checkpoints import (
    MANIFEST, CheckpointError, remove_tree, storage_errors,
)

__all__ = ["KINDS", "SERVING_DTYPES", "TOKENIZER_FILES", "ArtifactError", "ServingArtifact",
           "verify_artifact", "write_serving_artifact"]

#: What an artifact carries: a whole model ("full") or a LoRA adapter alone ("lora").
KINDS = ("full", "lora")
#: The dtypes an artifact's tensors may be written in.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
#: The tokenizer files a full artifact copies from the model's source directory, where it has
#: them (an engine serving the directory tokenizes prompts with them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "spiece.model", "chat_template.jinja", "chat_template.json")
_CHUNK = 1 << 20


class ArtifactError(CheckpointError):
    """A serving artifact is missing, unreadable or does not match its manifest (or its
    manifest the announced sha256): do not load it."""


@dataclass(frozen=True, slots=True)
class ServingArtifact:
    """A complete artifact: where it is, the sha256 of its manifest (which pins every file),
    its ``kind`` (``KINDS``), its tensors' ``dtype`` and its files' total ``size`` in bytes."""

    uri: str
    sha256: str
    kind: str
    dtype: str
    size: int


def write_serving_artifact(model: Any, directory: str | os.PathLike[str], dtype: str | None = None,
                           *, metadata: Mapping[str, Any] | None = None) -> ServingArtifact:
    """Write what serving loads of ``model`` (a ``HuggingFaceLM``) into ``directory``.

    Kind "lora" when the model trains LoRA adapters (the adapter alone), "full" otherwise.
    ``dtype``: the serving dtype (``SERVING_DTYPES``; None: the model's own). ``metadata``:
    JSON values kept in the manifest (e.g. the policy version and the checkpoint it came
    from). Blocks until every file and the manifest are written (and, on a local disk,
    fsynced); a complete artifact already at ``directory`` is replaced, and a crash leaves
    no directory without a manifest under that name. The model is not changed.
    ``ConfigurationError`` for a model that is not a ``HuggingFaceLM`` or an unknown dtype;
    ``ArtifactError`` when the directory cannot be written.
    """
    lm = getattr(model, "module", model)  # a data-parallel wrapper's module
    if not (hasattr(lm, "hf") and hasattr(lm, "lora") and hasattr(lm, "source")):
        raise ConfigurationError(
            f"write_serving_artifact takes the Hugging Face model of a recipe "
            f"(reef_stream.engine.hf.HuggingFace(...)()), got a {type(lm).__name__}")
    kind = "lora" if lm.lora is not None else "full"
    serving = dtype or str(next(lm.base.parameters()).dtype).removeprefix("torch.")
    if serving not in SERVING_DTYPES:
        raise ConfigurationError(f"serving dtype {serving!r} is not one of "
                                 f"{', '.join(SERVING_DTYPES)}")
    url = os.fspath(directory)
    fs, final = fsspec.core.url_to_fs(url)
    final = final.rstrip("/")
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol))
    try:
        if local:
            Path(final).parent.mkdir(parents=True, exist_ok=True)
            staging = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                return _finish(lm, kind, serving, metadata, staging, url, fs, final, local)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="reef-artifact-") as staging:
            return _finish(lm, kind, serving, metadata, staging, url, fs, final, local)
    except storage_errors() as exc:
        raise ArtifactError(f"could not write the serving artifact {url}: {exc}") from exc


def _finish(lm: Any, kind: str, serving: str, metadata: Mapping[str, Any] | None, staging: str,
            url: str, fs: Any, final: str, local: bool) -> ServingArtifact:
    """Save into the local ``staging`` directory, then make it ``final`` with its manifest last."""
    os.makedirs(staging, exist_ok=True)
    if kind == "lora":
        _save_adapter(lm, staging, getattr(torch, serving))
    else:
        _save_full(lm, staging, getattr(torch, serving))
    entries = {}
    for name in sorted(os.listdir(staging)):
        entries[name] = _hash_and_sync(os.path.join(staging, name))
    manifest = json.dumps({
        "format": 1, "kind": kind, "dtype": serving, "source": lm.source,
        "files": entries, "metadata": dict(metadata or {}),
    }, sort_keys=True, indent=1).encode()
    if local:
        checkpoints.write_durably(fs, os.path.join(staging, MANIFEST), manifest, local=True)
        checkpoints.fsync_dir(staging)
        if os.path.exists(final):  # an artifact written before under this name: replace it
            old = f"{final}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
        checkpoints.fsync_dir(os.path.dirname(final) or ".")
    else:  # an object store has no rename: the files, then the manifest last
        if fs.exists(final):
            remove_tree(fs, final)
        fs.makedirs(final, exist_ok=True)
        for name in entries:
            fs.put_file(os.path.join(staging, name), f"{final}/{name}")
        checkpoints.write_durably(fs, f"{final}/{MANIFEST}", manifest, local=False)
    return ServingArtifact(uri=url, sha256=hashlib.sha256(manifest).hexdigest(), kind=kind,
                           dtype=serving, size=sum(e["bytes"] for e in entries.values()))


def _cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` on the CPU in ``dtype`` (floating ones), tensors sharing storage still
    sharing it (so the writer recognises tied weights and keeps one)."""
    done: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in done:
            moved = tensor.to("cpu")
            done[key] = moved.to(dtype) if moved.is_floating_point() else moved
        out[name] = done[key]
    return out


def _save_full(lm: Any, staging: str, dtype: torch.dtype) -> None:
    """The Hugging Face directory of the whole model, its tensors and config in ``dtype``."""
    base = lm.base
    base.save_pretrained(staging, state_dict=_cast(base.state_dict(), dtype))
    config = base.config.__class__.from_dict(base.config.to_dict())
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(staging)  # save_pretrained wrote the training dtype
    source = Path(lm.source)
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, os.path.join(staging, name))


def _save_adapter(lm: Any, staging: str, dtype: torch.dtype) -> None:
    """peft's adapter directory (config and safetensors) of the model's adapters, in ``dtype``."""
    adapters = {name: p for name, p in lm.hf.named_parameters() if p.requires_grad}
    lm.hf.save_pretrained(staging, selected_adapters=["default"],
                          state_dict=_cast(adapters, dtype))
    card = os.path.join(staging, "README.md")  # peft's model card: nothing an engine loads
    if os.path.exists(card):
        os.remove(card)
    # peft writes target_modules from a set, in hash order: sorted, the same adapter gives
    # the same bytes (and the same sha256) in every process.
    config_path = os.path.join(staging, "adapter_config.json")
    with open(config_path) as file:
        config = json.load(file)
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    with open(config_path, "w") as file:
        file.write(json.dumps(config, indent=2, sort_keys=True))


def _hash_and_sync(path: str) -> dict[str, Any]:
    """The manifest entry of a staged file (read in chunks), after fsyncing it."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(file.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def verify_artifact(directory: str | os.PathLike[str], sha256: str | None = None
                    ) -> dict[str, Any]:
    """The manifest of the artifact at ``directory`` once every file checks out: its bytes
    match ``sha256`` (when given), every file it lists has its size and sha256 (read in
    chunks), and the directory holds no other file. ``ArtifactError`` naming the first
    problem otherwise. Reads every byte; changes nothing."""
    url = os.fspath(directory)
    try:
        fs, path = fsspec.core.url_to_fs(url)
        path = path.rstrip("/")
        manifest_bytes = fs.cat_file(f"{path}/{MANIFEST}")
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"serving artifact {url} has no readable {MANIFEST} (incomplete, "
                            f"or not an artifact): {exc}") from exc
    actual = hashlib.sha256(manifest_bytes).hexdigest()
    if sha256 is not None and actual != sha256:
        raise ArtifactError(f"serving artifact {url}: its manifest's sha256 is {actual}, the "
                            f"publication says {sha256} (changed or replaced since)")
    try:
        manifest = json.loads(manifest_bytes)
        entries = manifest["files"]
        kind = manifest["kind"]
        if kind not in KINDS or not isinstance(entries, dict):
            raise ValueError(f"kind {kind!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"serving artifact {url}: unreadable manifest: {exc}") from exc
    present = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    extra = sorted(present - set(entries) - {MANIFEST})
    if extra:
        raise ArtifactError(f"serving artifact {url} holds files its manifest does not list: "
                            f"{', '.join(extra)}")
    for name, entry in sorted(entries.items()):
        digest, size = hashlib.sha256(), 0
        try:
            with fs.open(f"{path}/{name}", "rb") as file:
                while chunk := file.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
        except storage_errors() as exc:
            raise ArtifactError(f"serving artifact {url}: {name} cannot be read: {exc}") from exc
        if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            raise ArtifactError(f"serving artifact {url}: {name} does not match its size and "
                                "sha256 in the manifest (corrupted or tampered with)")
    return manifest
