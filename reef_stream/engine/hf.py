"""Pretrained Hugging Face causal LMs as the trainer's model, in full or through LoRA adapters.

    backend = Backend(
        name="torch", loss_families=(POLICY_GRADIENT,), optimizer=AdamW(lr=1e-4),
        model=HuggingFace("/models/qwen2.5-0.5b", dtype="bfloat16",
                          gradient_checkpointing=True, lora=Lora(rank=8, alpha=16)))

``HuggingFace`` is frozen data (``--set backend.model.lora.rank=16`` changes it) and the
zero-argument callable ``Backend.model`` wants: called once, after torch is seeded, it loads
``AutoModelForCausalLM.from_pretrained(path)`` and returns a ``HuggingFaceLM``, the trainer's
``CausalLM`` (``vocab_size`` and ``max_len`` from the config; no tokenizer needed). With
``lora`` only the adapters are trained and checkpointed (the base comes from ``path`` again);
without, every parameter is (each tied tensor once). With ``sharding="fsdp"`` each decoder
layer (``HuggingFaceLM.blocks``) and then the model is FSDP-wrapped; checkpoints stay full.
The serving artifact is ``reef_stream.engine.artifacts``. A bad directory, config or LoRA
target is a ``ConfigurationError`` when the model is built; transformers and peft are
imported then, not at import. The long form: ``docs/design-notes.md`` ("Hugging Face models").
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reef_stream.core.errors import ConfigurationError

__all__ = ["TRAIN_DTYPES", "HuggingFace", "HuggingFaceLM", "Lora"]

#: The dtypes a model trains in (float16 needs loss scaling, which the backend does not do).
TRAIN_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class Lora:
    """LoRA adapters (``peft.LoraConfig``): rank ``rank`` matrices on every module whose name
    is, or ends with ``.`` plus, one of ``target_modules`` (``("all-linear",)``: every linear
    layer but the output head), scaled by ``alpha / rank``, with ``dropout`` on their input.
    Only the adapters are trained; the base stays bitwise as loaded."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (list, str)):
            targets = (self.target_modules,) if isinstance(self.target_modules, str) else \
                tuple(self.target_modules)
            object.__setattr__(self, "target_modules", targets)
        problems = []
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            problems.append(f"Lora.rank must be a positive int, got {self.rank!r}")
        if (not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool)
                or not self.alpha > 0 or self.alpha == float("inf")):
            problems.append(f"Lora.alpha must be a positive finite number, got {self.alpha!r}")
        if (not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool)
                or not 0 <= self.dropout < 1):
            problems.append(f"Lora.dropout must be within [0, 1), got {self.dropout!r}")
        if (not isinstance(self.target_modules, tuple) or not self.target_modules
                or not all(isinstance(t, str) and t for t in self.target_modules)):
            problems.append("Lora.target_modules must name at least one module (e.g. "
                            f"('q_proj', 'v_proj')), got {self.target_modules!r}")
        if problems:
            raise ConfigurationError(problems)


@dataclass(frozen=True, slots=True)
class HuggingFace:
    """A Hugging Face causal LM to train: ``Backend(model=HuggingFace(path, ...))``.

    ``path``: a local directory ``save_pretrained`` wrote (or a hub name, where a hub is
    reachable). ``dtype``: the weights' dtype while training, ``"float32"`` or
    ``"bfloat16"`` (bfloat16 weights are updated in bfloat16, with no float32 master copy;
    LoRA adapters stay float32, as peft makes them). ``gradient_checkpointing``: recompute activations in the backward pass
    (less memory, about a third more compute; the same loss and gradients). ``lora``: train
    LoRA adapters only (``Lora``); None trains every parameter. ``sharding``: ``"fsdp"`` shards
    the model, its gradients and optimizer state over the trainer's ranks (torch FSDP2);
    ``"none"``: every rank holds all of them.

    Calling it loads the model (blocks while the weights are read) and returns a
    ``HuggingFaceLM``; each call loads a fresh copy.
    """

    path: str
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora: Lora | None = None
    sharding: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        problems = []
        if not isinstance(self.path, str) or not self.path:
            problems.append(f"HuggingFace.path must name a model directory, got {self.path!r}")
        if self.dtype not in TRAIN_DTYPES:
            problems.append(f"HuggingFace.dtype must be one of {', '.join(TRAIN_DTYPES)}, got "
                            f"{self.dtype!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            problems.append("HuggingFace.gradient_checkpointing must be True or False, got "
                            f"{self.gradient_checkpointing!r}")
        if self.sharding not in ("none", "fsdp"):
            problems.append("HuggingFace.sharding must be 'none' (each data-parallel rank holds "
                            "the whole model) or 'fsdp' (sharded over the ranks), got "
                            f"{self.sharding!r}")
        if self.lora is not None and not isinstance(self.lora, Lora):
            problems.append(f"HuggingFace.lora must be a Lora(...) or None, got {self.lora!r}")
        if problems:
            raise ConfigurationError(problems)

    def __call__(self) -> HuggingFaceLM:
        """The loaded model, wrapped as the trainer's ``CausalLM``; ``ConfigurationError``
        when ``path`` holds no causal LM or ``lora`` targets modules it does not have."""
        from transformers import AutoModelForCausalLM

        location, config = self._config()
        try:
            model = AutoModelForCausalLM.from_pretrained(location, config=config,
                                                         dtype=getattr(torch, self.dtype))
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"the Hugging Face model at {self.path!r} could not be "
                                     f"loaded: {exc}") from exc
        if self.gradient_checkpointing:
            # Non-reentrant: correct with frozen inputs (LoRA) and without the inputs needing
            # a gradient. transformers 5 renamed the method (the old name warns).
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            model = self._with_adapters(model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        max_len = getattr(text, "max_position_embeddings", None)
        return HuggingFaceLM(model, source=location, lora=self.lora,
                             vocab_size=int(text.vocab_size),
                             max_len=max_len if isinstance(max_len, int) and max_len > 0 else None)

    def _config(self) -> tuple[str, Any]:
        """Where the model is (a local directory, ``~`` expanded, or a hub name) and its
        config, checked to be a causal LM's, before any weight is read."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        where = Path(self.path).expanduser()
        local = where.is_absolute() or self.path.startswith((".", "~")) or where.exists()
        if local and not where.is_dir():
            raise ConfigurationError(
                f"HuggingFace.path {self.path!r}: no such directory (give the directory "
                "save_pretrained wrote, holding config.json and the weights)")
        if local and not (where / "config.json").is_file():
            found = ", ".join(sorted(p.name for p in where.iterdir())[:12]) or "nothing"
            raise ConfigurationError(
                f"HuggingFace.path {self.path!r} is not a Hugging Face model directory: it has "
                f"no config.json (it holds: {found})")
        location = str(where) if local else self.path
        try:
            config = AutoConfig.from_pretrained(location)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(
                f"HuggingFace.path {self.path!r}: no model config could be read (not a local "
                f"directory, and not a model on a reachable hub): {exc}") from exc
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ConfigurationError(
                f"HuggingFace.path {self.path!r} holds a {type(config).__name__} (model_type "
                f"{getattr(config, 'model_type', '?')!r}), which is not a causal language "
                "model: AutoModelForCausalLM cannot load it, and the trainer needs next-token "
                "logits")
        return location, config

    def _with_adapters(self, model: Any) -> Any:
        """``model`` with LoRA adapters from peft, its base frozen."""
        from peft import LoraConfig, get_peft_model

        lora = self.lora
        assert lora is not None
        targets = list(lora.target_modules)
        if targets != ["all-linear"]:
            names = [name for name, _ in model.named_modules() if name]
            missing = [t for t in targets
                       if not any(n == t or n.endswith("." + t) for n in names)]
            if missing:
                linear = sorted({name.rsplit(".", 1)[-1] for name, module in
                                 model.named_modules() if isinstance(module, nn.Linear)})
                raise ConfigurationError(
                    f"Lora.target_modules {missing} match no module of the model at "
                    f"{self.path!r} ({type(model).__name__}); its linear layers are: "
                    f"{', '.join(linear)}")
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=targets[0] if targets == ["all-linear"] else targets,
                            bias="none", task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # peft asks transformers 5 by a name it deprecated
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                    category=FutureWarning)
            return get_peft_model(model, config)


class HuggingFaceLM(nn.Module):
    """A Hugging Face causal LM (or a peft model around one) as the trainer's ``CausalLM``.

    ``forward(input_ids: long[B, L], attention_mask: bool[B, L]) -> float[B, L, V]``: the
    model's logits (in its dtype), inputs moved to its device. ``vocab_size``, ``max_len``:
    from its config. ``hf``: the Hugging Face (or peft) model itself. ``source``: where it was
    loaded from. ``lora``: its adapters' settings, or None.

    ``state_dict()`` holds what training changes: with LoRA only the adapters' tensors,
    without it every parameter (a tied one once) and persistent buffer. ``load_state_dict``
    takes exactly those keys (``ConfigurationError`` otherwise: the checkpoint is of another
    model or another LoRA setting).
    """

    def __init__(self, model: Any, *, source: str, lora: Lora | None, vocab_size: int,
                 max_len: int | None) -> None:
        super().__init__()
        self.hf = model
        self.source = source
        self.lora = lora
        self.vocab_size = vocab_size
        self.max_len = max_len
        self._held = self._held_names()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        device = self.hf.get_input_embeddings().weight.device
        return self.hf(input_ids=input_ids.to(device),
                       attention_mask=attention_mask.to(device=device, dtype=torch.long),
                       use_cache=False).logits

    def blocks(self) -> list[nn.Module]:
        """The model's repeated blocks (its decoder layers: the modules of the classes its
        ``_no_split_modules`` names), each sharded on its own under FSDP."""
        kinds = set(getattr(self.base, "_no_split_modules", None) or ())
        return [module for module in self.hf.modules() if type(module).__name__ in kinds]

    @property
    def base(self) -> Any:
        """The Hugging Face model (under the adapters, with LoRA)."""
        return self.hf.get_base_model() if self.lora is not None else self.hf

    def _held_names(self) -> list[str]:
        """The ``state_dict`` keys this module keeps (see the class docstring), in order."""
        if self.lora is not None:
            return [name for name, p in self.named_parameters() if p.requires_grad]
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        held = []
        for name, tensor in super().state_dict(keep_vars=True).items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                   tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                held.append(name)
        return held

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """The tensors training changes (the adapters alone, with LoRA), by name."""
        if args:
            raise TypeError("HuggingFaceLM.state_dict takes keyword arguments only")
        every = super().state_dict(keep_vars=keep_vars)
        out = OrderedDict() if destination is None else destination
        for name in self._held:
            out[prefix + name] = every[name]
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Put ``state_dict`` (this module's ``state_dict`` keys) back. ``ConfigurationError``
        naming the differences when its keys are not this module's."""
        given, held = set(state_dict), set(self._held)
        missing, unexpected = sorted(held - given), sorted(given - held)
        if unexpected or (strict and missing):
            what = "the LoRA adapters" if self.lora is not None else "every parameter"
            raise ConfigurationError(
                f"these weights do not fit the model from {self.source!r} (its state holds "
                f"{what}: {len(held)} tensors): {len(missing)} missing (first: "
                f"{missing[:3]}), {len(unexpected)} unexpected (first: {unexpected[:3]}); a "
                "checkpoint of another model, or of another LoRA setting?")
        result = super().load_state_dict(dict(state_dict), strict=False, assign=assign)
        return type(result)(missing_keys=missing, unexpected_keys=[])
