"""The README's five steps ("Your fleet and your recipe in five steps"), run as written.

The README marks each block with ``<!-- quickstart: NAME -->``. This test takes the blocks
from the README itself and runs them against the session's broker and Redis, in a directory
of its own (a newcomer's project): step 1's block is saved as ``my_recipes.py``; steps 2 and 3
run as bash, with ``reef`` on the PATH; step 5's stage commands each start as a process; step
4's proxy starts as a process (``VLLM_URL`` naming the fleet) in front of a stand-in for the
fleet, a small OpenAI-compatible HTTP server (aiohttp) answering ``/v1/completions`` in
vLLM's shape (``return_token_ids``: the choice's ``token_ids`` and ``prompt_token_ids``;
``logprobs.token_logprobs``) with deterministic completions, and step 4's client runs against
the proxy. It passes once the trainer acknowledged a step (a ``Checkpoint`` event in
``<ns>.checkpoints``), the evaluator published it and ``reef follow`` loaded it; then the
stages and the proxy are stopped with SIGTERM, as a person would stop them.

The stages start before the client (step 5 runs beside the fleet): a generation waits 60 s
for its feedback, and stages started late on a loaded machine could let the first ones expire.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiohttp import web

from reef_stream.core.events import Checkpoint, Decision, Publication
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import PROJECT_ROOT
from reef_stream.topics.declarations import checkpoints, publications
from tests.helpers import events_to_end, wait_until

README = (PROJECT_ROOT / "README.md").read_text()
STEPS = ("my_recipes.py", "check", "topics", "proxy", "client", "stages")
#: The stand-in model's vocabulary: step 1's TinyCausalLM(vocab_size=512).
VOCAB = 512


def quickstart_blocks() -> dict[str, str]:
    """The README's marked blocks, by name, in the README's order."""
    found = re.findall(r"<!-- quickstart: (\S+) -->\n```\w+\n(.*?)\n```", README, flags=re.DOTALL)
    return dict(found)


def test_the_readme_marks_the_five_steps_in_order():
    assert tuple(quickstart_blocks()) == STEPS


# ------------------------------------------------------------------ the stand-in fleet

def _completion(prompt: str, max_tokens: int) -> tuple[list[int], list[int], list[float], str]:
    """Deterministic: prompt ids, completion ids (4-24 tokens, cut at max_tokens), logprobs,
    finish reason."""
    prompt_ids = [ord(c) % VOCAB for c in prompt] or [0]
    digest = hashlib.sha256(prompt.encode()).digest()
    length = 4 + digest[0] % 21
    ids = [b % VOCAB for b in (digest * 2)[1:1 + length]]
    finish = "stop"
    if len(ids) > max_tokens:
        ids, finish = ids[:max_tokens], "length"
    logprobs = [-0.25 * (1 + i % 3) for i in range(len(ids))]
    return prompt_ids, ids, logprobs, finish


async def _completions(request: web.Request, served: list[int]) -> web.Response:
    body = await request.json()
    assert body.get("return_token_ids") and body.get("logprobs") is not None, body
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    choices = []
    for index, prompt in enumerate(prompts):
        prompt_ids, ids, logprobs, finish = _completion(prompt, int(body.get("max_tokens", 16)))
        choices.append({
            "index": index, "text": "".join(chr(97 + i % 26) for i in ids),
            "logprobs": {"tokens": [chr(97 + i % 26) for i in ids], "token_logprobs": logprobs,
                         "top_logprobs": None, "text_offset": list(range(len(ids)))},
            "finish_reason": finish, "stop_reason": None,
            "token_ids": ids, "prompt_token_ids": prompt_ids,
        })
    served.append(len(choices))
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": body.get("model", "stand-in"),
        "choices": choices, "usage": {"prompt_tokens": 0, "completion_tokens": 0,
                                      "total_tokens": 0}})


class StandInServer:
    """An OpenAI-compatible completions server on 127.0.0.1, on a thread of its own."""

    def __init__(self) -> None:
        #: Choices served, one entry per request.
        self.served: list[int] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._completions)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    async def _completions(self, request: web.Request) -> web.Response:
        return await _completions(request, self.served)

    def __enter__(self) -> "StandInServer":
        self.thread.start()
        self.runner = web.AppRunner(self.app)
        asyncio.run_coroutine_threadsafe(self.runner.setup(), self.loop).result(30)
        port = free_ports(1)[0]
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        asyncio.run_coroutine_threadsafe(site.start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ------------------------------------------------------------------ the five steps

def _stage_commands(block: str) -> list[str]:
    """Step 5's command lines, without their comments and trailing ``&``."""
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line.removesuffix("&").strip() for line in lines if line]


@pytest.fixture
def project(tmp_path, cli_env):
    """A newcomer's directory with ``reef`` on the PATH, and the environment to run in it."""
    directory = tmp_path / "my_project"
    bin_dir = tmp_path / "bin"
    directory.mkdir()
    bin_dir.mkdir()
    shim = bin_dir / "reef"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m reef_stream.cli "$@"\n')
    shim.chmod(0o755)
    # reef_stream from this checkout, as an installed package: nothing else of the checkout is
    # importable (no top-level ``methods``: a wheel installs reef_stream.methods alone).
    packages = tmp_path / "site"
    packages.mkdir()
    (packages / "reef_stream").symlink_to(PROJECT_ROOT / "reef_stream")
    inherited = [p for p in cli_env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and Path(p).resolve() != PROJECT_ROOT.resolve()]
    env = {**cli_env, "PATH": f"{bin_dir}{os.pathsep}{cli_env.get('PATH', '')}",
           "COLUMNS": "200", "PYTHONPATH": os.pathsep.join([str(packages), *inherited])}
    return directory, env


def _bash(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, f"{block}\n{result.stdout}\n{result.stderr}"
    return result


#: Where step 4's proxy listens (its --listen).
PROXY = "http://127.0.0.1:8001"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_five_steps_train_and_publish_a_unit(project, kafka_bootstrap, namespace):
    directory, env = project
    blocks = quickstart_blocks()

    # 1. The recipe factory bound to a model and a reward, in the project's own module.
    (directory / "my_recipes.py").write_text(blocks["my_recipes.py"] + "\n")
    # 2. reef check: the contract, with both awaited sources.
    checked = _bash(blocks["check"], directory, env).stdout
    assert "requires feedback from brevity, thumbs" in checked
    # 3. The topics, the recipe's units topic among them.
    _bash(blocks["topics"], directory, env)

    # 5. The stages, each its own process, as a person starts them.
    logs = directory / "logs"
    logs.mkdir()
    stages: dict[str, subprocess.Popen] = {}
    try:
        for command in _stage_commands(blocks["stages"]):
            name = command.split()[1]
            stages[name] = subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=directory, env=env,
                stdout=(logs / f"{name}.out").open("w"), stderr=subprocess.STDOUT,
                start_new_session=True)
        assert set(stages) == {"reward", "process", "train", "evaluate", "follow"}

        def output() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                             for p in sorted(logs.iterdir()))

        def running() -> bool:
            dead = {name: p.returncode for name, p in stages.items() if p.poll() is not None}
            assert not dead, f"stages exited: {dead}\n{output()}"
            return True

        # 4. The proxy in front of the stand-in fleet, and the clients through it.
        with StandInServer() as fleet:
            stages["proxy"] = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", blocks["proxy"].rstrip().removesuffix("&")],
                cwd=directory, env={**env, "VLLM_URL": fleet.url},
                stdout=(logs / "proxy.out").open("w"), stderr=subprocess.STDOUT,
                start_new_session=True)
            wait_until(lambda: running() and _answers(PROXY + "/reef/stats"), 60,
                       f"the proxy answering\n{output()}")
            served = subprocess.run(
                [sys.executable, "-c", blocks["client"]], cwd=directory, env=env,
                capture_output=True, text=True, timeout=180, check=False)
            assert served.returncode == 0, served.stdout + served.stderr
            assert fleet.served == [1] * 400
            # 400 generations and 400 thumbs, each handed to the producer.
            counts = json.loads(urllib.request.urlopen(PROXY + "/reef/stats", timeout=10).read())
            assert (counts["recorded"], counts["feedback"], counts["unrecorded"]) == (400, 400, {})

        # A step of SAO's 256 units, trained and acknowledged by its Checkpoint event.
        trained = wait_until(
            lambda: running() and events_to_end(kafka_bootstrap, checkpoints(namespace),
                                                Checkpoint),
            timeout=90, message=f"a Checkpoint event\n{output()}")
        assert trained[0].recipe == "mine" and trained[0].model == "my-run"
        assert trained[0].trained_unit_count == 256
        # The evaluator publishes it; reef follow loads it, verified.
        published = wait_until(
            lambda: running() and [p for p in events_to_end(
                kafka_bootstrap, publications(namespace), Publication)
                if p.decision is Decision.PROMOTED],
            timeout=60, message=f"a PROMOTED publication\n{output()}")
        assert published[0].model == "my-run"
        wait_until(lambda: running() and re.search(
            r"model my-run: loaded version \d+", (logs / "follow.out").read_text()),
            timeout=60, message=f"reef follow loading it\n{output()}")
    finally:
        for process in stages.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in stages.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
