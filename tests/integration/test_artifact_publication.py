"""A promoted Hugging Face model is published with its serving artifact, and a follower that
loads artifacts hands an engine the verified directory -- against the real broker.

The test plays the trainer: it writes a checkpoint of a tiny Llama-style model (built from a
config, saved with ``save_pretrained``: no hub) and produces its Checkpoint event; an in-process
evaluator promotes it. The artifact is checked with transformers' and peft's own loaders.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from reef_stream.api.evaluator import AcceptEverything
from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
from reef_stream.core.events import Checkpoint, Decision, now_ms
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore
from reef_stream.engine.hf import HuggingFace, Lora
from reef_stream.serving.follower import ARTIFACT, Follower
from tests.integration.publishing import (
    Loads, create_topics, produce_checkpoints, read_publications, settings_for, write_checkpoint,
)
from tests.recipes.trainable import recipe as trainable


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _trained_checkpoint(store, spec: HuggingFace, step: int) -> tuple[Checkpoint, dict]:
    """A checkpoint of ``spec``'s model with every trained tensor moved a little (as a step
    would), and its Checkpoint event."""
    torch.manual_seed(step)
    weights = {name: tensor + 0.01 * torch.randn_like(tensor)
               for name, tensor in spec().state_dict().items()}
    stored = CheckpointStore(store).write(CheckpointContents(
        step=step, policy_version=step, model="llm", recipe=trainable.name, trainer_group="t",
        weights=weights, optimizer={}, rng={}, algorithm_state={}, offsets=(),
        trained_units=np.array([], dtype=np.uint64), created_at=now_ms()))
    return Checkpoint(checkpoint_id=stored.checkpoint_id, recipe=trainable.name,
                      trainer_group="t", step=step, model="llm", policy_version=step,
                      uri=stored.uri, sha256=stored.sha256, offsets=(), trained_unit_count=0,
                      metrics={}, created_at=now_ms()), weights


def _evaluate(spec: HuggingFace, settings, **options) -> None:
    recipe = dataclasses.replace(trainable, evaluator=AcceptEverything(), backend=dataclasses.replace(
        trainable.backend, model=spec, model_name="llm"))
    EvaluatorWorker(recipe, settings=settings,
                    options=EvaluateOptions(idle_exit=3.0, **options), fleet=None).run()


@pytest.mark.parametrize("lora", [None, Lora(rank=4)], ids=["full", "lora"])
def test_a_promoted_hugging_face_model_is_published_with_what_an_engine_loads(
        base_dir, lora, kafka_bootstrap, redis_url, namespace, tmp_path):
    from peft import PeftModel

    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    create_topics(kafka_bootstrap, namespace)
    spec = HuggingFace(base_dir, lora=lora)
    candidate, weights = _trained_checkpoint(tmp_path / "ckpt", spec, step=1)
    produce_checkpoints(kafka_bootstrap, namespace, candidate)

    _evaluate(spec, settings, serving_dtype="bfloat16")

    (publication,) = read_publications(kafka_bootstrap, namespace, 1)
    assert publication.decision is Decision.PROMOTED
    assert publication.artifact_kind == ("lora" if lora else "full")
    assert publication.artifact_uri.endswith("/llm/v1-serving")
    # What serving loads is the candidate's weights, in the serving dtype, through the
    # libraries' own loaders; the checkpoint copy (with its optimizer state) stays beside it.
    if lora is None:
        served = transformers.AutoModelForCausalLM.from_pretrained(publication.artifact_uri)
        assert next(served.parameters()).dtype == torch.bfloat16
        state = served.state_dict()
        for name, tensor in weights.items():   # the wrapper holds the model as .hf
            assert torch.equal(state[name.removeprefix("hf.")], tensor.to(torch.bfloat16)), name
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        served = PeftModel.from_pretrained(base, publication.artifact_uri)
        adapters = {n: t for n, t in served.state_dict().items() if "lora_" in n}
        assert len(adapters) == len(weights)
        for tensor in adapters.values():   # every adapter tensor is one the checkpoint held
            assert any(torch.equal(tensor, w.to(torch.bfloat16)) for w in weights.values())
    assert publication.uri.endswith("/llm/v1")

    # A follower that loads artifacts hands over the verified directory, not weights.
    loads = Loads()
    artifacts = []
    with Follower("llm", on_version=lambda v: (loads(v), artifacts.append(v.artifact)),
                  settings=settings, fleet=None, loads=ARTIFACT) as replica:
        assert replica.wait_ready(30) == 1
    assert artifacts == [publication.artifact_uri] and loads.weights[1] == {}


def test_a_follower_of_artifacts_refuses_a_version_without_one_or_a_tampered_one(
        base_dir, kafka_bootstrap, redis_url, namespace, tmp_path):
    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    create_topics(kafka_bootstrap, namespace)
    # A model that is not a Hugging Face one is published without an artifact.
    produce_checkpoints(kafka_bootstrap, namespace, write_checkpoint(
        tmp_path / "toy", 1, 0.5, model="llm", recipe=trainable.name))
    _evaluate(trainable.backend.model, settings)
    (toy,) = read_publications(kafka_bootstrap, namespace, 1)
    assert toy.decision is Decision.PROMOTED and toy.artifact_uri is None

    refused = []
    with Follower("llm", on_version=Loads(), settings=settings, fleet=None, loads=ARTIFACT,
                  on_refused=lambda p, e: refused.append(str(e))) as replica:
        assert replica.wait_ready(30) is None
    assert "published without a serving artifact" in refused[0]

    # A Hugging Face version whose artifact changed after publication is refused too.
    spec = HuggingFace(base_dir)
    candidate, _ = _trained_checkpoint(tmp_path / "ckpt", spec, step=2)
    produce_checkpoints(kafka_bootstrap, namespace, candidate)
    _evaluate(spec, settings)
    publication = read_publications(kafka_bootstrap, namespace, 2)[-1]
    tensors = next(p for p in Path(publication.artifact_uri).iterdir()
                   if p.suffix == ".safetensors")
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    refused.clear()
    with Follower("llm", on_version=Loads(), settings=settings, fleet=None, loads=ARTIFACT,
                  on_refused=lambda p, e: refused.append(str(e))) as replica:
        assert replica.wait_ready(30) is None
    assert refused and "sha256" in refused[0], refused


def test_reef_follow_hands_each_artifact_to_an_engine_command(
        base_dir, kafka_bootstrap, redis_url, namespace, tmp_path, cli_env):
    import sys

    from tests.helpers import reef

    settings = settings_for(kafka_bootstrap, redis_url, namespace, tmp_path / "home")
    create_topics(kafka_bootstrap, namespace)
    spec = HuggingFace(base_dir)
    candidate, _ = _trained_checkpoint(tmp_path / "ckpt", spec, step=1)
    produce_checkpoints(kafka_bootstrap, namespace, candidate)
    _evaluate(spec, settings)
    (publication,) = read_publications(kafka_bootstrap, namespace, 1)

    told = tmp_path / "told"
    engine = (f"{sys.executable} -c 'import sys; open(sys.argv[1], \"w\").write(\" \".join("
              f"sys.argv[2:]))' {told} {{path}} {{version}} {{kind}}")
    result = reef("follow", "--model", "llm", "--once", "--engine", "command", "--exec", engine,
                  env=cli_env)
    assert told.read_text() == f"{publication.artifact_uri} 1 full"
    assert "command serves version 1 (full artifact" in result.stdout, result.stdout

    # An engine that fails refuses the version: exit status 1, the engine's words in the log.
    failing = reef("follow", "--model", "llm", "--once", "--engine", "command", "--exec",
                   f"{sys.executable} -c 'import sys; sys.exit(\"no room for weights\")'",
                   env=cli_env, check=False)
    assert failing.returncode == 1
    assert "no room for weights" in failing.stderr

    usage = reef("follow", "--model", "llm", "--engine", "vllm", env=cli_env, check=False)
    assert usage.returncode == 2 and "--engine vllm needs --url" in usage.stderr
