"""The Hugging Face backend and its serving artifacts, without a broker and without a hub.

Tiny models are built from a config (Llama- and Qwen2-style), saved with ``save_pretrained``
into a temporary directory and loaded through the real loading code (``HuggingFace``). What is
checked is what the backend promises: the Hugging Face model's own logits, the dtype asked
for, gradient checkpointing that changes nothing but memory, LoRA that trains and checkpoints
the adapters alone through the project's own ``TorchBackend``, and artifacts that
``from_pretrained`` loads back to the trained model's logits.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # noqa: E402 - a dependency: missing, the tests fail rather than skip

from reef_stream.api.recipe import AdamW
from reef_stream.core.errors import ConfigurationError
from reef_stream.engine.artifacts import ArtifactError, verify_artifact, write_serving_artifact
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore, load
from reef_stream.engine.hf import HuggingFace, HuggingFaceLM, Lora
from reef_stream.engine.training import TorchBackend, UnitLimits, model_limits
from tests.recipes.trainable import recipe as trainable
from tests.unit_log import rollout_unit

VOCAB, MAX_LEN = 300, 128


def _small(config_class, **extra):
    return config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                        max_position_embeddings=MAX_LEN, **extra)


def _tokenizer_files(directory):
    """A word-level tokenizer, saved as a Hugging Face fast tokenizer's files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat".split())}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(
        directory)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama-style model with random weights and a tokenizer, as save_pretrained writes it."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_small(transformers.LlamaConfig)).save_pretrained(directory)
    _tokenizer_files(directory)
    return str(directory)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A Qwen2-style model whose output head is tied to its embedding (as Qwen2.5-0.5B's)."""
    directory = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(_small(transformers.Qwen2Config,
                                                 tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(directory)
    return str(directory)


def _batch():
    """Two right-padded rows, as ``collate`` builds them."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    return ids, mask


def _recipe(model):
    """The trainable test recipe on ``model``: one AdamW update a step (4 units, micro 2)."""
    schedule = dataclasses.replace(trainable.schedule, optimizer_batch_size=4,
                                   micro_batch_size=2, epochs=1)
    return dataclasses.replace(trainable, schedule=schedule, backend=dataclasses.replace(
        trainable.backend, model=model, optimizer=AdamW(lr=1e-2)))


def _train(backend, recipe, step, first_unit=0):
    units = [rollout_unit(i) for i in range(first_unit, first_unit + 4)]
    result = recipe.objective.compute(units, recipe.objective.initial_state())
    return backend.train_step(units, result, step)


def _logits(model, ids, mask):
    model.eval()
    with torch.no_grad():
        return model(ids, mask)


def _stored(tmp_path, backend, step=1):
    """The backend's state written as a trainer checkpoint and loaded back (verified)."""
    weights, optimizer, rng = backend.state()
    stored = CheckpointStore(tmp_path / "checkpoints").write(CheckpointContents(
        step=step, policy_version=step, model="m", recipe="trainable", trainer_group="g",
        weights=weights, optimizer=optimizer, rng=rng, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64)))
    return load(stored.uri, stored.sha256)


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("which", ["llama_dir", "qwen_dir"])
def test_the_wrapper_gives_the_hugging_face_models_own_logits(which, request):
    path = request.getfixturevalue(which)
    model = HuggingFace(path)()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = _batch()
    logits = _logits(model, ids, mask)
    assert logits.shape == (2, 9, VOCAB) and logits.dtype == torch.float32
    with torch.no_grad():
        expected = reference.eval()(input_ids=ids, attention_mask=mask.long()).logits
    assert torch.equal(logits, expected)
    assert model_limits(model) == UnitLimits(vocab_size=VOCAB, max_length=MAX_LEN)
    assert all(p.requires_grad for p in model.parameters())


def test_bfloat16_loads_as_bfloat16(llama_dir):
    model = HuggingFace(llama_dir, dtype="bfloat16")()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids, mask = _batch()
    logits = _logits(model, ids, mask)
    assert logits.dtype == torch.bfloat16
    full = _logits(HuggingFace(llama_dir)(), ids, mask)
    torch.testing.assert_close(logits.float(), full, atol=5e-2, rtol=5e-2)
    adapted = HuggingFace(llama_dir, dtype="bfloat16", lora=Lora(rank=4))()
    assert {grad: {p.dtype for p in adapted.parameters() if p.requires_grad == grad}
            for grad in (True, False)} == {True: {torch.float32}, False: {torch.bfloat16}}


@pytest.mark.parametrize("lora", [None, Lora(rank=4)])
def test_gradient_checkpointing_recomputes_and_gives_the_same_loss_and_gradients(llama_dir, lora):
    ids, mask = _batch()
    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(5)  # the same LoRA initialisation in both
        model = HuggingFace(llama_dir, gradient_checkpointing=checkpointing, lora=lora)()
        model.train()
        mlp, calls = model.base.model.layers[0].mlp, []
        forward = mlp.forward
        mlp.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
        logits = model(ids, mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][mask[:, 1:]],
                                                 ids[:, 1:][mask[:, 1:]])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[checkpointing] = (float(loss.detach()), grads, len(calls))
    (loss_off, grads_off, calls_off), (loss_on, grads_on, calls_on) = runs[False], runs[True]
    assert (calls_off, calls_on) == (1, 2)  # the layer's forward ran again in the backward
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- LoRA


def test_lora_trains_and_checkpoints_the_adapters_alone(llama_dir, tmp_path):
    recipe = _recipe(HuggingFace(llama_dir, lora=Lora(rank=4, alpha=8)))
    backend = TorchBackend(recipe)
    model = backend.accelerator.unwrap_model(backend.model)
    assert isinstance(model, HuggingFaceLM)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 4 * 2  # A and B, four projections, two layers
    optimized = [p for group in backend.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(trainable) and all(p.requires_grad for p in optimized)
    assert list(model.state_dict()) == trainable

    base_before = {n: p.detach().clone() for n, p in model.named_parameters()
                   if not p.requires_grad}
    adapters_before = {n: t.clone() for n, t in model.state_dict().items()}
    ids, mask = _batch()
    logits_before = _logits(model, ids, mask)
    metrics = _train(backend, recipe, 1)
    assert np.isfinite(metrics["loss"]) and metrics["update_ratio"] > 0
    for name, tensor in base_before.items():
        assert torch.equal(dict(model.named_parameters())[name], tensor), name
    after = model.state_dict()
    assert all(not torch.equal(after[n], t) for n, t in adapters_before.items()
               if ".lora_B." in n)  # B starts at zero; A's gradient is zero until B moves
    trained_logits = _logits(model, ids, mask)
    assert not torch.equal(trained_logits, logits_before)

    # The checkpoint holds the adapters only; a fresh model of another seed loads them back.
    loaded = _stored(tmp_path, backend)
    assert sorted(loaded.weights) == sorted(trainable)
    torch.manual_seed(99)
    fresh = HuggingFace(llama_dir, lora=Lora(rank=4, alpha=8))()
    assert not torch.equal(_logits(fresh, ids, mask), trained_logits)
    fresh.load_state_dict(loaded.weights)
    assert torch.equal(_logits(fresh, ids, mask), trained_logits)

    # Resumed from that checkpoint, the next step gives bitwise the adapters of a straight run.
    resumed = TorchBackend(recipe)
    resumed.restore(loaded.weights, loaded.optimizer, loaded.rng)
    _train(backend, recipe, 2, first_unit=4)
    _train(resumed, recipe, 2, first_unit=4)
    for name, tensor in backend.state()[0].items():
        assert torch.equal(resumed.state()[0][name], tensor), name


def test_weights_of_another_setting_are_refused_by_name(llama_dir):
    small = HuggingFace(llama_dir, lora=Lora(rank=4))()
    other = HuggingFace(llama_dir, lora=Lora(rank=4, target_modules=("q_proj",)))()
    with pytest.raises(ConfigurationError, match="missing.*another LoRA setting"):
        other.load_state_dict(small.state_dict())
    with pytest.raises(ConfigurationError, match="unexpected"):
        HuggingFace(llama_dir)().load_state_dict(small.state_dict())


# --------------------------------------------------------------------------- full fine-tuning


def test_full_fine_tuning_of_a_tied_model_trains_checkpoints_and_restores(qwen_dir, tmp_path):
    recipe = _recipe(HuggingFace(qwen_dir))
    backend = TorchBackend(recipe)
    model = backend.accelerator.unwrap_model(backend.model)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    assert list(before) == names  # the tied head once (no buffers to persist)
    assert "hf.lm_head.weight" not in before
    _train(backend, recipe, 1)
    after = model.state_dict()
    assert all(not torch.equal(after[n], t) for n, t in before.items())
    assert model.base.lm_head.weight is model.base.model.embed_tokens.weight  # still tied

    loaded = _stored(tmp_path, backend)
    ids, mask = _batch()
    fresh = HuggingFace(qwen_dir)()
    fresh.load_state_dict(loaded.weights)
    assert torch.equal(_logits(fresh, ids, mask), _logits(model, ids, mask))


# --------------------------------------------------------------------------- artifacts


def test_a_full_artifact_loads_back_to_the_trained_logits_in_its_dtype(qwen_dir, llama_dir,
                                                                       tmp_path):
    recipe = _recipe(HuggingFace(qwen_dir))
    backend = TorchBackend(recipe)
    _train(backend, recipe, 1)
    model = backend.accelerator.unwrap_model(backend.model)
    ids, mask = _batch()
    trained = _logits(model, ids, mask)
    auto = transformers.AutoModelForCausalLM

    exact = write_serving_artifact(model, tmp_path / "fp32", metadata={"policy_version": 1})
    assert exact.kind == "full" and exact.dtype == "float32"
    manifest = verify_artifact(exact.uri, exact.sha256)
    assert manifest["kind"] == "full" and manifest["metadata"] == {"policy_version": 1}
    assert {"config.json", "model.safetensors"} <= set(manifest["files"])
    with torch.no_grad():
        served = auto.from_pretrained(exact.uri, dtype=torch.float32).eval()
        assert torch.equal(served(input_ids=ids, attention_mask=mask.long()).logits, trained)

    half = write_serving_artifact(model, tmp_path / "bf16", dtype="bfloat16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    source = json.loads((Path(qwen_dir) / "config.json").read_text())
    assert config.pop("dtype") == "bfloat16" and source.pop("dtype") == "float32"
    assert config == source  # the source's config, but for the serving dtype
    assert half.size < exact.size * 0.6
    served = auto.from_pretrained(half.uri)  # the config's dtype: bfloat16
    assert served.dtype == torch.bfloat16
    weights = model.base.state_dict()
    for name, tensor in served.state_dict().items():  # the trained weights, rounded once
        assert torch.equal(tensor, weights[name].to(torch.bfloat16)), name
    with torch.no_grad():
        got = served.eval()(input_ids=ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(got.float(), trained, atol=5e-2, rtol=5e-2)
    assert next(model.parameters()).dtype == torch.float32  # the trained model is unchanged

    # The source's tokenizer travels with a full artifact.
    with_tokenizer = write_serving_artifact(HuggingFace(llama_dir)(), tmp_path / "llama")
    assert "tokenizer.json" in verify_artifact(with_tokenizer.uri)["files"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(with_tokenizer.uri)
    assert tokenizer("the cat")["input_ids"] == [1, 2]


def test_a_lora_artifact_is_the_adapter_alone_and_peft_loads_it(llama_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    recipe = _recipe(HuggingFace(llama_dir, lora=Lora(rank=4, alpha=8)))
    backend = TorchBackend(recipe)
    _train(backend, recipe, 1)
    model = backend.accelerator.unwrap_model(backend.model)
    ids, mask = _batch()
    trained = _logits(model, ids, mask)

    written = {}
    for dtype, tolerance in (("float32", 1e-6), ("bfloat16", 2e-2)):
        artifact = written[dtype] = write_serving_artifact(model, tmp_path / dtype, dtype=dtype)
        assert artifact.kind == "lora"
        files = set(verify_artifact(artifact.uri, artifact.sha256)["files"])
        assert files == {"adapter_config.json", "adapter_model.safetensors"}
        tensors = load_file(str(tmp_path / dtype / "adapter_model.safetensors"))
        assert len(tensors) == 16 and {t.dtype for t in tensors.values()} == {getattr(torch,
                                                                                      dtype)}
        base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir,
                                                                 dtype=torch.float32)
        served = PeftModel.from_pretrained(base, artifact.uri).eval()
        with torch.no_grad():
            got = served(input_ids=ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(got, trained, atol=tolerance, rtol=tolerance)
    # The same adapter gives the same bytes: a publication's sha256 is reproducible.
    again = write_serving_artifact(model, tmp_path / "again", dtype="float32")
    assert again.sha256 == written["float32"].sha256 != written["bfloat16"].sha256
    # Any fsspec URL (here memory://, as an object store: no rename, the manifest last).
    url = f"memory://artifacts/{tmp_path.name}"
    remote = write_serving_artifact(model, url, dtype="float32")
    assert remote.sha256 == again.sha256
    assert set(verify_artifact(url, remote.sha256)["files"]) == files


def test_verify_artifact_catches_a_flipped_byte_a_stray_file_and_a_replaced_manifest(
        llama_dir, tmp_path):
    model = HuggingFace(llama_dir, lora=Lora(rank=4))()
    artifact = write_serving_artifact(model, tmp_path / "a")
    verify_artifact(artifact.uri, artifact.sha256)
    with pytest.raises(ArtifactError, match="manifest's sha256"):
        verify_artifact(artifact.uri, "0" * 64)

    weights = tmp_path / "a" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="adapter_model.safetensors does not match"):
        verify_artifact(artifact.uri)

    rewritten = write_serving_artifact(model, tmp_path / "a")  # replaces the damaged one
    verify_artifact(rewritten.uri, rewritten.sha256)
    (tmp_path / "a" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="does not list: extra.safetensors"):
        verify_artifact(rewritten.uri)
    with pytest.raises(ArtifactError, match="no readable MANIFEST.json"):
        verify_artifact(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="takes the Hugging Face model"):
        write_serving_artifact(torch.nn.Linear(2, 2), tmp_path / "b")


# --------------------------------------------------------------------------- errors


def test_bad_inputs_are_configuration_errors_that_say_what_is_there(llama_dir, tmp_path):
    with pytest.raises(ConfigurationError, match="no such directory"):
        HuggingFace(str(tmp_path / "absent"))()
    with pytest.raises(ConfigurationError, match="not a model on a reachable hub"):
        HuggingFace("nobody-here/no-such-model")()  # a hub name, offline: never fetched
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigurationError, match=r"no config.json \(it holds: weights.bin\)"):
        HuggingFace(str(tmp_path / "empty"))()
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(tmp_path / "vit")
    with pytest.raises(ConfigurationError, match="ViTConfig.*not a causal language model"):
        HuggingFace(str(tmp_path / "vit"))()
    with pytest.raises(ConfigurationError, match=r"\['qkv'\] match no module.*q_proj, up_proj"):
        HuggingFace(llama_dir, lora=Lora(target_modules=("q_proj", "qkv")))()
    with pytest.raises(ConfigurationError) as raised:  # every problem, in one error
        Lora(rank=0, alpha=-1, dropout=1.0, target_modules=())
    for name in ("rank", "alpha", "dropout", "target_modules"):
        assert f"Lora.{name}" in str(raised.value)
    with pytest.raises(ConfigurationError, match="HuggingFace.dtype"):
        HuggingFace(llama_dir, dtype="float16")
    with pytest.raises(ConfigurationError, match="serving dtype 'int8'"):
        write_serving_artifact(HuggingFace(llama_dir)(), tmp_path / "x", dtype="int8")


def test_the_model_of_a_recipe_is_set_like_any_other_field():
    from reef_stream.api.recipe import apply_overrides

    recipe = _recipe(HuggingFace("/models/base", lora=Lora()))
    changed = apply_overrides(recipe, [
        "backend.model.dtype=bfloat16", "backend.model.gradient_checkpointing=true",
        "backend.model.lora.rank=16", "backend.model.lora.target_modules=q_proj,v_proj"])
    assert changed.backend.model == HuggingFace(
        "/models/base", dtype="bfloat16", gradient_checkpointing=True,
        lora=Lora(rank=16, target_modules=("q_proj", "v_proj")))
    with pytest.raises(ConfigurationError, match="Lora.rank must be a positive int"):
        apply_overrides(recipe, ["backend.model.lora.rank=0"])


def test_neither_the_package_nor_the_backend_module_imports_transformers_or_peft():
    """A recipe naming HuggingFace(...) is imported by every stage; only building the model
    loads transformers and peft."""
    probe = ("import importlib, pkgutil, sys, reef_stream, reef_stream.api\n"
             "for m in pkgutil.iter_modules(reef_stream.api.__path__):\n"
             "    importlib.import_module('reef_stream.api.' + m.name)\n"
             "import reef_stream.engine.hf, reef_stream.engine.artifacts\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'peft'}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
