"""The recording proxy against the real broker, in front of a real local HTTP server that
answers as vLLM's OpenAI server does (token ids and logprobs in vLLM's shape).

The stand-in upstream is deterministic: a response's id is ``cmpl-<X-Request-Id>`` (vLLM takes
the request id from that header too) and ``created`` is fixed, so a direct call and a call
through the proxy with the same request id must answer the same JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import IncompleteRead
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from reef_stream.core.events import Feedback, Generation, Metric
from reef_stream.core.metric_names import (
    PROXY_DROPPED,
    PROXY_TRAJECTORIES,
    PROXY_TRAJECTORIES_HELD,
    STAGE_INTAKE,
)
from reef_stream.core.prometheus import exposition
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import load_settings
from reef_stream.intake.aio import AsyncRecordProducer
from reef_stream.intake.journal import TrajectoryJournal
from reef_stream.intake.producer import RecordProducer
from reef_stream.intake.proxy import (
    GENERATION_IDS_HEADER,
    ProxyMetrics,
    ProxyOptions,
    RecordingProxy,
    Versions,
)
from reef_stream.serving.follower import Follower
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, feedback, generations
from reef_stream.topics.declarations import metrics as metrics_topic
from tests import factories
from tests.helpers import events_to_end, reef, wait_until
from tests.integration.publishing import (
    produce_publications,
    promoted,
    write_checkpoint,
)

CREATED = 1_795_000_000


# --------------------------------------------------------------------------- the stand-in upstream


def prompt_ids(text: str) -> list[int]:
    return [ord(c) % 1000 + 1 for c in text]


def chat_ids(messages: list[dict]) -> list[int]:
    """A chat's prompt token ids as the stand-in renders them: each message's text, but an
    assistant message's, which is the tokens it names (``token_text``'s): a template that
    gives back what was sampled."""
    ids: list[int] = []
    for message in messages:
        text = message.get("content") or ""
        ids += ([int(t) for t in re.findall(r" t(\d+)", text)]
                if message.get("role") == "assistant" else prompt_ids(text))
    return ids


def completion_of(choice: int, max_tokens: int) -> tuple[list[int], list[float]]:
    tokens = [100 + choice, 200 + choice, 300 + choice, 400 + choice][:max_tokens]
    logprobs = [-0.5, -0.25 - choice / 8, -1.0, -0.0625][:max_tokens]
    return tokens, logprobs


def token_text(token: int) -> str:
    return f" t{token}"


def _completion_logprobs(tokens: list[int], logprobs: list[float], top: int) -> dict:
    texts = [token_text(t) for t in tokens]
    return {"text_offset": [4 * j for j in range(len(tokens))], "token_logprobs": logprobs,
            "tokens": texts, "top_logprobs": [{s: v} if top else None
                                              for s, v in zip(texts, logprobs)]}


def _chat_logprobs(tokens: list[int], logprobs: list[float]) -> dict:
    return {"content": [{"token": token_text(t), "logprob": v,
                         "bytes": list(token_text(t).encode()), "top_logprobs": []}
                        for t, v in zip(tokens, logprobs)]}


class Upstream:
    """The vLLM-shaped server's handlers. Model ``fail`` answers 500; ``garbled`` answers 200
    with a body that is not JSON; streamed, ``truncate`` sends one chunk and drops the
    connection, ``midfail`` sends one chunk, an error event and the end."""

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "created": CREATED, "owned_by": "vllm",
             "root": "/models/tiny", "parent": None, "max_model_len": 2048}]})

    async def other(self, request: web.Request) -> web.Response:
        return web.Response(status=418, text=f"teapot at {request.path_qs}",
                            headers={"x-upstream": "yes"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "chat")

    async def _answer(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") == "garbled":
            return web.Response(body=b'{"id": "cmpl-x", "choices": [',
                                content_type="application/json")
        if body.get("model") == "fail":
            return web.json_response({"object": "error", "message": "engine dead",
                                      "type": "InternalServerError", "code": 500}, status=500)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request.headers['X-Request-Id']}"
        # a batch of prompts (not streamed here): choice i answers prompt i // n
        batch = body.get("prompt") if isinstance(body.get("prompt"), list) else None
        ids = (prompt_ids(batch[0] if batch else body["prompt"]) if kind == "completions"
               else chat_ids(body["messages"]))
        n, max_tokens = body.get("n", 1), body.get("max_tokens", 16)
        with_ids = body.get("return_token_ids") is True
        logprobs = body.get("logprobs")
        wants_logprobs = logprobs is not None if kind == "completions" else logprobs is True
        tools = bool(body.get("tools"))
        if body.get("stream"):
            return await self._stream(request, kind, body, rid, ids, n, max_tokens, with_ids,
                                      wants_logprobs, tools)
        choices = []
        for i in range(n * len(batch or "_")):
            ids = prompt_ids(batch[i // n]) if batch else ids
            tokens, values = completion_of(i % n, max_tokens)
            finish = "tool_calls" if tools else ("length" if max_tokens <= len(tokens) else "stop")
            text = "".join(token_text(t) for t in tokens)
            if kind == "completions":
                choices.append({
                    "index": i, "text": text,
                    "logprobs": _completion_logprobs(tokens, values, logprobs)
                    if wants_logprobs else None,
                    "finish_reason": finish, "stop_reason": None, "prompt_logprobs": None,
                    "prompt_token_ids": ids if with_ids else None,
                    "token_ids": tokens if with_ids else None})
            else:
                calls = [{"id": f"call-{i}", "type": "function", "function": {
                    "name": "add", "arguments": "{\"a\": 17, \"b\": 25}"}}] if tools else []
                choices.append({
                    "index": i, "message": {"role": "assistant", "content": text,
                                            "tool_calls": calls, "reasoning_content": None},
                    "logprobs": _chat_logprobs(tokens, values) if wants_logprobs else None,
                    "finish_reason": finish, "stop_reason": None,
                    "token_ids": tokens if with_ids else None})
        completion_tokens = sum(len(completion_of(i % n, max_tokens)[0])
                                for i in range(n * len(batch or "_")))
        response = {
            "id": rid, "object": "text_completion" if kind == "completions" else "chat.completion",
            "created": CREATED, "model": body["model"], "choices": choices,
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + completion_tokens,
                      "completion_tokens": completion_tokens, "prompt_tokens_details": None},
            "service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}
        if kind == "chat":
            response.update(prompt_logprobs=None, prompt_token_ids=ids if with_ids else None)
        return web.json_response(response)

    async def _stream(self, request, kind, body, rid, ids, n, max_tokens, with_ids,
                      wants_logprobs, tools) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        obj = "text_completion" if kind == "completions" else "chat.completion.chunk"

        async def send(chunk: dict) -> None:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if kind == "chat":
            for i in range(n):
                await send({"id": rid, "object": obj, "created": CREATED,
                            "model": body["model"],
                            "choices": [{"index": i, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": ids if with_ids else None})
        for i in range(n):
            tokens, values = completion_of(i, max_tokens)
            for j, (token, value) in enumerate(zip(tokens, values)):
                last = j == len(tokens) - 1
                finish = ("length" if max_tokens <= len(tokens) else "stop") if last else None
                if kind == "completions":
                    choice = {"index": i, "text": token_text(token),
                              "logprobs": _completion_logprobs([token], [value], 0)
                              if wants_logprobs else None,
                              "finish_reason": finish, "stop_reason": None,
                              "prompt_token_ids": ids if with_ids and j == 0 else None,
                              "token_ids": [token] if with_ids else None}
                elif tools:   # a tool call, its arguments in pieces as vLLM streams them
                    call = {"index": 0, "function": {"arguments": "{\"a\": 1" if j == 0
                                                      else "" if not last else "}"}}
                    if j == 0:
                        call.update(id=f"call-{i}", type="function")
                        call["function"]["name"] = "add"
                    choice = {"index": i, "delta": {"tool_calls": [call]},
                              "logprobs": _chat_logprobs([token], [value])
                              if wants_logprobs else None,
                              "finish_reason": finish, "token_ids": [token] if with_ids else None}
                else:
                    choice = {"index": i, "delta": {"content": token_text(token)},
                              "logprobs": _chat_logprobs([token], [value])
                              if wants_logprobs else None,
                              "finish_reason": finish, "token_ids": [token] if with_ids else None}
                await send({"id": rid, "object": obj, "created": CREATED,
                            "model": body["model"], "choices": [choice]})
                if body["model"] == "midfail":   # vLLM's error event, then the end
                    await response.write(b'data: {"error": {"object": "error", "message": '
                                         b'"engine died", "code": 500}}\n\n')
                    await response.write(b"data: [DONE]\n\n")
                    await response.write_eof()
                    return response
                if body["model"] == "truncate":
                    assert request.transport is not None
                    request.transport.close()   # the connection drops mid-stream
                    return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


# --------------------------------------------------------------------------- servers in threads


@dataclass
class Running:
    url: str
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner
    thread: threading.Thread

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def run_app(make) -> Running:
    """Serve the app ``make()`` builds (called on the server's loop) on a free port."""
    port = free_ports(1)[0]
    loop = asyncio.new_event_loop()

    async def setup() -> web.AppRunner:
        runner = web.AppRunner(await make())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run_until_complete(setup())
    thread = threading.Thread(target=loop.run_forever, name="proxy-test", daemon=True)
    thread.start()
    return Running(f"http://127.0.0.1:{port}", loop, runner, thread)


@pytest.fixture
def upstream() -> Iterator[str]:
    handlers = Upstream()

    async def make() -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", handlers.models)
        app.router.add_post("/v1/completions", handlers.completions)
        app.router.add_post("/v1/chat/completions", handlers.chat)
        app.router.add_route("*", "/{tail:.*}", handlers.other)
        return app

    running = run_app(make)
    yield running.url
    running.stop()


@dataclass
class Proxy:
    url: str
    recording: RecordingProxy
    producer: AsyncRecordProducer
    running: Running
    stopped: bool = False

    def flush(self) -> None:
        report = asyncio.run_coroutine_threadsafe(self.producer.flush(30),
                                                  self.running.loop).result(60)
        assert report.complete, report

    def stop(self, close_timeout: float = 30) -> None:
        """Stop serving, then close the producer (what is not acknowledged stays spooled)."""
        if not self.stopped:
            self.stopped = True
            asyncio.run_coroutine_threadsafe(self.running.runner.cleanup(),
                                             self.running.loop).result(60)
            asyncio.run_coroutine_threadsafe(self.producer.close(close_timeout),
                                             self.running.loop).result(close_timeout + 60)
            self.running.loop.call_soon_threadsafe(self.running.loop.stop)
            self.running.thread.join(10)


@pytest.fixture
def proxy(kafka_bootstrap, namespace, tmp_path, upstream) -> Iterator:
    """``proxy(bootstrap=None, spool_max_bytes=1 GiB, metrics=None, journal=None,
    **options)``: a proxy in front of ``upstream`` recording to the session's broker (or
    ``bootstrap``), spooling in ``tmp_path / "spool"``, with ``ProxyOptions`` ``options``;
    stopped after the test."""
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                              "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})
    started: list[Proxy] = []

    def start(bootstrap: str | None = None, spool_max_bytes: int = 1 << 30,
              metrics: ProxyMetrics | None = None, journal: TrajectoryJournal | None = None,
              **options) -> Proxy:
        holder: dict[str, Any] = {}

        async def make() -> web.Application:
            producer = AsyncRecordProducer(bootstrap=bootstrap or kafka_bootstrap,
                                           settings=settings, spool_dir=tmp_path / "spool",
                                           spool_max_bytes=spool_max_bytes, block_timeout=0,
                                           metrics_every_s=None, client="proxy")
            recording = RecordingProxy(producer, ProxyOptions(**{"upstream": upstream,
                                                                 **options}),
                                       metrics=metrics, journal=journal)
            holder.update(producer=producer, recording=recording)
            return recording.app()

        running = run_app(make)
        started.append(Proxy(running.url, holder["recording"], holder["producer"], running))
        return started[-1]

    yield start
    for server in started:
        server.stop(close_timeout=1)


# --------------------------------------------------------------------------- a client


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of an SSE body, JSON decoded (``[DONE]`` as it is)."""
        payloads = [line[5:].strip() for line in self.body.splitlines()
                    if line.startswith(b"data:")]
        return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def call(url: str, body: Any = None, *, request_id: str | None = None,
         headers: dict[str, str] | None = None, method: str | None = None) -> Reply:
    """One HTTP request; a truncated body is returned as far as it came."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    if request_id is not None:
        sent["X-Request-Id"] = request_id
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=sent,
                                 method=method or ("GET" if body is None else "POST"))
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            try:
                content = response.read()
            except IncompleteRead as partial:
                content = partial.partial
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()},
                         content)
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())


def both(upstream: str, proxy: Proxy, path: str, body: dict) -> tuple[Reply, Reply]:
    """The same request sent directly and through the proxy (one request id)."""
    rid = uuid.uuid4().hex[:12]
    return (call(upstream + path, body, request_id=rid),
            call(proxy.url + path, body, request_id=rid))


def read_all(bootstrap: str, topic: str, reader: type) -> list:
    """``events_to_end``, once every partition of the new topic has a leader (right after
    creation a partition may have none yet, and reading its end fails)."""
    def attempt() -> list | None:
        try:
            return [events_to_end(bootstrap, topic, reader)]
        except KafkaException as error:
            if error.args[0].code() != KafkaError.NOT_LEADER_FOR_PARTITION:
                raise
            return None

    return wait_until(attempt, 30, f"every partition of {topic} to have a leader")[0]


def recorded(kafka_bootstrap: str, namespace: str, proxy: Proxy) -> dict[str, Generation]:
    proxy.flush()
    return {g.generation_id: g for g in read_all(kafka_bootstrap, generations(namespace),
                                                 Generation)}


def wait_recorded(proxy: Proxy, count: int) -> None:
    wait_until(lambda: proxy.recording.counts.recorded >= count, 30,
               f"{count} choices handed to the producer")


def full(upstream: str, path: str, body: dict) -> dict:
    """What the upstream returns with token ids and logprobs asked for."""
    extra = {"logprobs": 0 if path.endswith("/v1/completions") else True,
             "return_token_ids": True}
    return call(upstream + path, {**body, **extra}, request_id=uuid.uuid4().hex).json()


# --------------------------------------------------------------------------- the tests


def test_non_streamed_completions_and_chat_are_unchanged_and_each_choice_is_recorded(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    completion = {"model": "tiny", "prompt": "17+25=", "max_tokens": 3, "n": 2,
                  "temperature": 0.7, "top_p": 0.9, "seed": 5}
    chat = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "add 17 and 25"}],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]}

    direct_c, proxied_c = both(upstream, server, "/v1/completions", completion)
    direct_h, proxied_h = both(upstream, server, "/v1/chat/completions", chat)

    assert proxied_c.status == direct_c.status == 200
    assert proxied_c.json() == direct_c.json(), "the client sees what it asked for, no more"
    assert proxied_c.body == direct_c.body, "byte for byte"
    assert proxied_c.json()["choices"][0]["logprobs"] is None
    assert proxied_h.json() == direct_h.json()
    assert proxied_h.headers["content-type"].startswith("application/json")
    c_ids = proxied_c.headers[GENERATION_IDS_HEADER].split(",")
    h_ids = proxied_h.headers[GENERATION_IDS_HEADER].split(",")
    assert c_ids == [f"{direct_c.json()['id']}:0", f"{direct_c.json()['id']}:1"]
    assert h_ids == [f"{direct_h.json()['id']}:0"]
    assert GENERATION_IDS_HEADER not in direct_c.headers

    wait_recorded(server, 3)
    stored = recorded(kafka_bootstrap, namespace, server)
    served = full(upstream, "/v1/completions", completion)
    for i, gid in enumerate(c_ids):
        g = stored[gid]
        assert g.prompt_token_ids.tolist() == served["choices"][i]["prompt_token_ids"]
        assert g.completion_token_ids.tolist() == served["choices"][i]["token_ids"]
        assert np.array_equal(g.completion_logprobs, np.array(
            served["choices"][i]["logprobs"]["token_logprobs"], dtype=np.float32))
        assert (g.group_id, g.group_size) == (direct_c.json()["id"], 2)
        assert (g.sampling.temperature, g.sampling.top_p, g.sampling.max_tokens,
                g.sampling.seed) == (pytest.approx(0.7), pytest.approx(0.9), 3, 5)
        assert g.metadata["prompt"] == "17+25="
        assert g.metadata["reef.policy_version"] == "unknown" and g.policy_version == 0
    chat_served = full(upstream, "/v1/chat/completions", chat)
    g = stored[h_ids[0]]
    assert g.prompt_token_ids.tolist() == chat_served["prompt_token_ids"]
    assert g.completion_token_ids.tolist() == chat_served["choices"][0]["token_ids"]
    assert g.completion_logprobs.tolist() == [
        e["logprob"] for e in chat_served["choices"][0]["logprobs"]["content"]]
    assert json.loads(g.metadata["tool_calls"])[0]["function"]["name"] == "add"
    assert g.sampling.max_tokens == 4 and g.finish_reason.name == "STOP"


def test_each_choice_of_a_batch_of_prompts_is_recorded_with_its_own_prompt_and_group(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    body = {"model": "tiny", "prompt": ["1+2=", "3+4=", "5+6="], "max_tokens": 1}
    direct, proxied = both(upstream, server, "/v1/completions", body)
    assert proxied.body == direct.body
    ids = proxied.headers[GENERATION_IDS_HEADER].split(",")
    grouped = call(server.url + "/v1/completions", {**body, "n": 2},
                   request_id="batch-2").headers[GENERATION_IDS_HEADER].split(",")
    wait_recorded(server, 9)
    stored = recorded(kafka_bootstrap, namespace, server)
    assert [(stored[i].prompt_token_ids.tolist(), stored[i].metadata["prompt"],
             stored[i].group_id, stored[i].group_size) for i in ids] == [
        (prompt_ids(p), p, None, 1) for p in body["prompt"]], "three prompts, not a group"
    assert [(stored[i].metadata["prompt"], stored[i].group_id, stored[i].group_size)
            for i in grouped] == [(p, f"cmpl-batch-2:p{k}", 2) for k, p in
                                  enumerate(body["prompt"]) for _ in range(2)]


def test_what_the_client_asked_for_it_still_gets(upstream, proxy):
    server = proxy()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 1,
            "return_token_ids": True}
    direct, proxied = both(upstream, server, "/v1/completions", body)
    assert proxied.json() == direct.json()
    assert proxied.json()["choices"][0]["token_ids"] == [100, 200]
    assert proxied.json()["choices"][0]["logprobs"]["top_logprobs"] is not None
    # logprobs=0 asks for the sampled tokens' logprobs (0 is not false here)
    direct, proxied = both(upstream, server, "/v1/completions", {**body, "logprobs": 0})
    assert proxied.json() == direct.json()
    assert proxied.json()["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_is_relayed_unchanged_and_its_choices_recorded(
        upstream, proxy, kafka_bootstrap, namespace, path):
    server = proxy()
    body = {"model": "tiny", "max_tokens": 4, "n": 2, "stream": True}
    body.update({"prompt": "stream me"} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "stream me"}]})

    direct, proxied = both(upstream, server, path, body)

    assert proxied.status == 200 and proxied.headers["content-type"].startswith(
        "text/event-stream")
    assert proxied.events() == direct.events()
    assert proxied.body == direct.body, "byte for byte"
    assert proxied.events()[-1] == "[DONE]"
    rid = direct.events()[0]["id"]
    assert proxied.headers[GENERATION_IDS_HEADER] == f"{rid}:0,{rid}:1"
    wait_recorded(server, 2)
    stored = recorded(kafka_bootstrap, namespace, server)
    served = full(upstream, path, {k: v for k, v in body.items() if k != "stream"})
    for i in range(2):
        g = stored[f"{rid}:{i}"]
        choice = served["choices"][i]
        assert g.completion_token_ids.tolist() == choice["token_ids"]
        values = (choice["logprobs"]["token_logprobs"] if path == "/v1/completions"
                  else [e["logprob"] for e in choice["logprobs"]["content"]])
        assert np.array_equal(g.completion_logprobs, np.array(values, dtype=np.float32))
        assert g.prompt_token_ids.tolist() == prompt_ids("stream me")
        assert g.finish_reason.name == choice["finish_reason"].upper() == "LENGTH"
        assert g.metadata["completion"] == "".join(token_text(t) for t in choice["token_ids"])


def test_a_streamed_tool_call_is_relayed_and_recorded_whole(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    body = {"model": "tiny", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "add"}],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]}
    direct, proxied = both(upstream, server, "/v1/chat/completions", body)
    assert proxied.body == direct.body
    wait_recorded(server, 1)
    (g,) = recorded(kafka_bootstrap, namespace, server).values()
    assert json.loads(g.metadata["tool_calls"]) == [{"id": "call-0", "type": "function",
                                                     "function": {"name": "add",
                                                                  "arguments": "{\"a\": 1}"}}]
    assert g.completion_token_ids.tolist() == [100, 200, 300]


def test_models_and_other_paths_pass_through_untouched(upstream, proxy):
    server = proxy()
    direct, proxied = call(upstream + "/v1/models"), call(server.url + "/v1/models")
    assert (proxied.status, proxied.json()) == (200, direct.json())
    other = call(server.url + "/v1/whatever?x=1", {"a": 1})
    assert (other.status, other.body, other.headers["x-upstream"]) == (
        418, b"teapot at /v1/whatever?x=1", "yes")
    assert server.recording.counts.recorded == 0


def test_an_upstream_error_passes_through_and_nothing_is_recorded(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    body = {"model": "fail", "prompt": "x", "max_tokens": 2}
    direct, proxied = both(upstream, server, "/v1/completions", body)
    assert (proxied.status, proxied.json()) == (500, direct.json())
    assert GENERATION_IDS_HEADER not in proxied.headers
    assert server.recording.counts.unrecorded["upstream_error"] == 1
    ok = call(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
              request_id="after")
    wait_recorded(server, 1)
    assert set(recorded(kafka_bootstrap, namespace, server)) == {f"{ok.json()['id']}:0"}


def test_with_unknown_version_skip_a_record_whose_version_is_unknown_is_not_made(
        upstream, proxy, kafka_bootstrap, namespace, tmp_path):
    version_file = tmp_path / "served-version"
    server = proxy(versions=Versions(version_file), unknown_version="skip")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 2}
    unknown = call(server.url + "/v1/completions", body, request_id="unknown")
    version_file.write_text('{"policy_version": 4}')
    known = call(server.url + "/v1/completions", body, request_id="known")
    assert unknown.status == known.status == 200
    assert GENERATION_IDS_HEADER not in unknown.headers
    wait_recorded(server, 2)
    stored = recorded(kafka_bootstrap, namespace, server)
    assert set(stored) == set(known.headers[GENERATION_IDS_HEADER].split(","))
    assert {g.policy_version for g in stored.values()} == {4}
    assert server.recording.counts.unrecorded["version_unknown"] == 2


def test_a_garbled_body_or_an_error_mid_stream_passes_through_and_nothing_is_recorded(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    garbled = {"model": "garbled", "prompt": "x", "max_tokens": 2}
    direct, proxied = both(upstream, server, "/v1/completions", garbled)
    assert (proxied.status, proxied.body) == (200, direct.body)
    midfail = {"model": "midfail", "prompt": "x", "max_tokens": 4, "stream": True}
    direct, proxied = both(upstream, server, "/v1/completions", midfail)
    assert proxied.events() == direct.events() and "error" in proxied.events()[1]
    unrecorded = server.recording.counts.unrecorded   # counted once the stream ended
    wait_until(lambda: unrecorded["unfinished_choice"] == 1, 10, "the unfinished choice counted")
    assert unrecorded["malformed_response"] == 1
    ok = call(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
              request_id="after")
    wait_recorded(server, 1)
    assert set(recorded(kafka_bootstrap, namespace, server)) == {f"{ok.json()['id']}:0"}


def test_an_upstream_that_cannot_be_reached_is_a_502(proxy):
    server = proxy(upstream=f"http://127.0.0.1:{free_ports(1)[0]}")   # nobody listens
    reply = call(server.url + "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert reply.status == 502 and "cannot be reached" in reply.json()["error"]
    assert server.recording.counts.unrecorded["upstream_unreachable"] == 1


def test_a_truncated_stream_passes_through_and_records_nothing(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy()
    body = {"model": "truncate", "prompt": "x", "max_tokens": 4, "stream": True}
    direct, proxied = both(upstream, server, "/v1/completions", body)
    assert direct.events() and "[DONE]" not in direct.events()
    assert proxied.events() == direct.events()
    # a whole request after it is recorded, and is the only one
    ok = call(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
              request_id="after")
    wait_recorded(server, 1)
    assert set(recorded(kafka_bootstrap, namespace, server)) == {f"{ok.json()['id']}:0"}
    assert server.recording.counts.unrecorded["upstream_broke_stream"] == 1


def test_feedback_for_the_header_ids_becomes_feedback_with_the_conversation_as_group(
        upstream, proxy, kafka_bootstrap, namespace):
    server = proxy(feedback_source="thumbs")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    turns = [call(server.url + "/v1/chat/completions", body, request_id=f"turn-{i}",
                  headers={"x-reef-conversation-id": "conv-9", "x-reef-group-size": "2"})
             for i in range(2)]
    ids = [t.headers[GENERATION_IDS_HEADER] for t in turns]

    reply = call(server.url + "/v1/feedback", {"generation_ids": ids, "reward": 1.0})

    assert reply.status == 200, reply.body
    assert [r["status"] for r in reply.json()["results"]] == ["acknowledged"] * 2
    wait_recorded(server, 2)
    stored = recorded(kafka_bootstrap, namespace, server)
    assert {(stored[i].group_id, stored[i].group_size) for i in ids} == {("conv-9", 2)}
    scores = {f.generation_id: f for f in read_all(kafka_bootstrap, feedback(namespace),
                                                     Feedback)}
    assert set(scores) == set(ids)
    assert {(f.source, f.reward, f.group_id) for f in scores.values()} == {
        ("thumbs", 1.0, "conv-9")}
    bad = call(server.url + "/v1/feedback", {"generation_ids": ids})
    assert bad.status == 400 and "reward" in bad.json()["error"]


def test_a_conversations_tool_calling_turns_are_recorded_as_one_masked_trajectory(
        upstream, proxy, kafka_bootstrap, namespace):
    """An agent's turns (a tool call, its result, another call, its result, the answer), each a
    request of its own in one conversation, are recorded as one Generation when the answer
    comes: the first prompt, then every token as sampled or as the prompts carried it, the
    tool results masked. A turn that does not continue the trajectory's tokens ends it; one
    still held when the proxy stops is recorded as it is."""
    server = proxy()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    messages = [{"role": "user", "content": "add 17 and 25"}]
    served = []
    for i, (max_tokens, result) in enumerate([(3, "42"), (2, "ok"), (4, None)]):
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                **({"tools": tools} if result else {"stream": True})}
        reply = call(server.url + "/v1/chat/completions", body, request_id=f"agent-{i}",
                     headers={"x-reef-conversation-id": "conv-1"})
        assert reply.status == 200
        served.append(reply.headers[GENERATION_IDS_HEADER])
        if result is not None:
            message = reply.json()["choices"][0]["message"]
            assert message["tool_calls"] and server.recording.counts.recorded == 0, "held"
            messages = [*messages, message, {"role": "tool", "tool_call_id": "call-0",
                                             "content": result}]
    assert served == [f"chatcmpl-agent-{i}:0" for i in range(3)]

    # Another conversation: a tool call, then a turn whose history was edited (it does not
    # begin with the tokens sampled), then a tool call the proxy still holds when it stops.
    def turn(rid: str, history: list[dict], tools_on: bool = True) -> Reply:
        return call(server.url + "/v1/chat/completions",
                    {"model": "tiny", "messages": history, "max_tokens": 2,
                     **({"tools": tools} if tools_on else {})},
                    request_id=rid, headers={"x-reef-conversation-id": "conv-2"})

    first = turn("edit-0", [{"role": "user", "content": "hi"}]).json()["choices"][0]["message"]
    turn("edit-1", [{"role": "user", "content": "hi"}, {**first, "content": " t7"},
                    {"role": "tool", "content": "x"}])
    wait_recorded(server, 2)   # the trajectory of conv-1, and edit-0's, split off
    assert server.recording.counts.as_dict()["trajectories"] == {"chained": 2, "split": 1,
                                                                 "held": 1}
    server.stop()
    stored = {g.generation_id: g for g in read_all(kafka_bootstrap, generations(namespace),
                                                   Generation)}
    assert set(stored) == {"chatcmpl-agent-2:0", "chatcmpl-edit-0:0", "chatcmpl-edit-1:0"}

    g = stored["chatcmpl-agent-2:0"]
    tokens = [(completion_of(0, 3), "assistant"), (prompt_ids("42"), "tool:add"),
              (completion_of(0, 2), "assistant"), (prompt_ids("ok"), "tool:add"),
              (completion_of(0, 4), "assistant")]
    assert g.prompt_token_ids.tolist() == prompt_ids("add 17 and 25")
    expected_ids = [t for part, _ in tokens for t in (part[0] if isinstance(part, tuple)
                                                       else part)]
    assert g.completion_token_ids.tolist() == expected_ids
    assert g.completion_logprobs.tolist() == [
        v for part, _ in tokens for v in (part[1] if isinstance(part, tuple) else [0.0] * len(part))]
    assert [(turn.role, turn.token_ids.size) for turn in g.turns()] == [
        (role, len(part[0] if isinstance(part, tuple) else part)) for part, role in tokens]
    assert g.policy_mask().tolist() == [1] * 3 + [0] * 2 + [1] * 2 + [0] * 2 + [1] * 4
    assert (g.group_id, g.request_id, g.finish_reason.name) == ("conv-1", "chatcmpl-agent-2",
                                                                "LENGTH")
    assert g.metadata["proxy.turns"] == "3" and g.metadata["completion"] == " t100 t200 t300 t400"
    assert json.loads(g.metadata["prompt"]) == [{"role": "user", "content": "add 17 and 25"}]
    assert stored["chatcmpl-edit-0:0"].segments == stored["chatcmpl-edit-1:0"].segments == ()


def test_at_start_a_journalled_trajectory_is_held_again_and_an_ended_one_recorded(
        proxy, kafka_bootstrap, namespace, tmp_path):
    """What a proxy killed outright left in its journal: a trajectory given back but not yet
    handed to the producer is recorded at start; a held one is held again, and recorded as it
    is when the proxy stops. Then nothing is left in the journal. The counts are metrics, in
    the topic and for Prometheus."""
    left = TrajectoryJournal(tmp_path / "spool")   # never closed: killed
    left.hold("conv-h", "chatcmpl-h:0", factories.generation("chatcmpl-h:0", group_id="conv-h"))
    left.hold("conv-e", "chatcmpl-e0:0",
              factories.generation("chatcmpl-e0:0", group_id="conv-e"))
    left.end("chatcmpl-e0:0", factories.generation("chatcmpl-e2:0", group_id="conv-e",
                                                   metadata={"proxy.turns": "3"}))
    server = proxy(journal=TrajectoryJournal(tmp_path / "spool"),
                   metrics=ProxyMetrics(kafka_bootstrap, namespace, every_s=0.2,
                                        instance="restarted"))
    wait_recorded(server, 1)
    assert server.recording.counts.as_dict()["trajectories"] == {"restored": 1, "held": 1}
    labels = {"client": "proxy", "instance": "restarted"}
    wait_until(lambda: exposition().value(STAGE_INTAKE, PROXY_TRAJECTORIES, outcome="restored",
                                          **labels) == 1, 30, "the restored metric")
    assert exposition().value(STAGE_INTAKE, PROXY_TRAJECTORIES_HELD, **labels) == 1
    server.stop()

    def written() -> set[tuple[str, str, float]] | None:
        seen = {(m.name, m.labels.get("outcome", ""), m.value)
                for m in read_all(kafka_bootstrap, metrics_topic(namespace), Metric)
                if m.stage == STAGE_INTAKE and m.labels.get("instance") == "restarted"}
        return seen if {(PROXY_TRAJECTORIES, "restored", 1.0),
                        (PROXY_TRAJECTORIES_HELD, "", 0.0)} <= seen else None

    wait_until(written, 30, "the trajectories' metrics in the topic, held 0 once stopped")
    stored = {g.generation_id: g for g in read_all(kafka_bootstrap, generations(namespace),
                                                   Generation)}
    assert set(stored) == {"chatcmpl-e2:0", "chatcmpl-h:0"}
    assert stored["chatcmpl-e2:0"].metadata["proxy.turns"] == "3"
    assert TrajectoryJournal(tmp_path / "spool").restored == []


class BrokenJournal:
    """A journal on a disk that fails: every write raises ``OSError`` (``sync`` does nothing)."""

    path = Path("/full-disk/trajectories.journal")
    restored: list = []
    damaged: list = []

    def hold(self, *_: Any) -> None:
        raise OSError(28, "No space left on device")

    end = done = close = hold

    def sync(self) -> None:
        pass


def test_a_journal_that_cannot_be_written_is_counted_and_serving_and_recording_go_on(
        proxy, kafka_bootstrap, namespace):
    server = proxy(journal=BrokenJournal())
    messages = [{"role": "user", "content": "add 1 and 2"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    first = call(server.url + "/v1/chat/completions",
                 {"model": "tiny", "messages": messages, "max_tokens": 2, "tools": tools},
                 request_id="broken-0", headers={"x-reef-conversation-id": "conv-broken"})
    assert first.status == 200
    messages = [*messages, first.json()["choices"][0]["message"],
                {"role": "tool", "tool_call_id": "call-0", "content": "3"}]
    last = call(server.url + "/v1/chat/completions",
                {"model": "tiny", "messages": messages, "max_tokens": 2, "stream": True},
                request_id="broken-1", headers={"x-reef-conversation-id": "conv-broken"})
    assert last.status == 200
    wait_until(lambda: server.recording.counts.trajectories["journal_failed"] == 3, 30,
               "the held, ended and done writes counted as failed")
    (g,) = [g for g in recorded(kafka_bootstrap, namespace, server).values()
            if g.group_id == "conv-broken"]
    assert (g.generation_id, g.metadata["proxy.turns"]) == ("chatcmpl-broken-1:0", "2")


class WatchedJournal:
    """A real journal that notes, at each write, whether the client already had the end of
    the stream being served (``at_end``, set by the client): it waits up to half a second for
    the client to get there first, as a proxy killed right after the end would let it."""

    def __init__(self, journal: TrajectoryJournal):
        self.journal, self.path = journal, journal.path
        self.restored, self.damaged = journal.restored, journal.damaged
        self.at_end = threading.Event()
        self.writes: list[tuple[str, bool]] = []

    def _watched(self, name: str, *args: Any) -> None:
        self.writes.append((name, self.at_end.wait(0.5)))
        getattr(self.journal, name)(*args)

    def hold(self, *args: Any) -> None:
        self._watched("hold", *args)

    def end(self, *args: Any) -> None:
        self._watched("end", *args)

    def done(self, *args: Any) -> None:
        self.journal.done(*args)

    def sync(self) -> None:
        self.journal.sync()

    def close(self) -> None:
        self.journal.close()


def stream_watching_end(url: str, body: dict, request_id: str, conversation: str,
                        at_end: threading.Event) -> list[bytes]:
    """A streamed chat turn, read line by line as it arrives; ``at_end`` is set once its
    ``data: [DONE]`` (or the end of the body) came. Returns its lines."""
    at_end.clear()
    request = urllib.request.Request(url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={
                                         "Content-Type": "application/json",
                                         "X-Request-Id": request_id,
                                         "x-reef-conversation-id": conversation})
    lines = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            lines.append(line)
            if line.strip() == b"data: [DONE]":
                at_end.set()
    at_end.set()
    return lines


def test_a_streamed_turn_is_journalled_before_the_client_gets_its_end(
        proxy, kafka_bootstrap, namespace, tmp_path):
    """A streamed turn that leaves a trajectory held, and one that ends it, are written to the
    journal before the client gets the stream's ``[DONE]``: a proxy killed the moment the
    client has it (who may send the next turn at once) has journalled the turn. Before, the
    stream's end went out first and the journal was written after."""
    journal = WatchedJournal(TrajectoryJournal(tmp_path / "spool"))
    server = proxy(journal=journal)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    question = [{"role": "user", "content": "add 2 and 3"}]
    called = stream_watching_end(server.url, {"model": "tiny", "messages": question,
                                              "max_tokens": 2, "stream": True,
                                              "tools": tools},
                                 "watched-0", "conv-watched-0", journal.at_end)
    assert b"data: [DONE]\n" in called
    wait_until(lambda: journal.writes, 10, "the turn journalled")
    assert journal.writes == [("hold", False)], "the held turn journalled first"

    first = call(server.url + "/v1/chat/completions",
                 {"model": "tiny", "messages": question, "max_tokens": 2, "tools": tools},
                 request_id="watched-1", headers={"x-reef-conversation-id": "conv-watched-1"})
    history = [*question, first.json()["choices"][0]["message"],
               {"role": "tool", "tool_call_id": "call-0", "content": "5"}]
    answer = stream_watching_end(server.url, {"model": "tiny", "messages": history,
                                              "max_tokens": 2, "stream": True},
                                 "watched-2", "conv-watched-1", journal.at_end)
    assert b"data: [DONE]\n" in answer
    wait_until(lambda: len(journal.writes) == 3, 10, "the ended trajectory journalled")
    assert [name for name, _ in journal.writes] == ["hold", "hold", "end"]
    assert journal.writes[2] == ("end", False), "the ended trajectory journalled first"
    wait_recorded(server, 1)
    (g,) = [g for g in recorded(kafka_bootstrap, namespace, server).values()
            if g.group_id == "conv-watched-1"]
    assert (g.generation_id, g.metadata["proxy.turns"]) == ("chatcmpl-watched-2:0", "2")


def test_the_version_is_what_the_upstream_served_and_redaction_drops_text(
        upstream, proxy, kafka_bootstrap, namespace, tmp_path):
    version_file = tmp_path / "served-version"
    version_file.write_text("12\n")
    server = proxy(versions=Versions(version_file, r"-lora-v(\d+)$"),
                   redact=frozenset({"prompt", "user", "completion"}))
    body = {"prompt": "secret", "max_tokens": 2, "user": "alice@example.com"}

    from_file = call(server.url + "/v1/completions", {**body, "model": "tiny"}, request_id="f")
    from_name = call(server.url + "/v1/completions", {**body, "model": "reef-lora-v3"},
                     request_id="n")
    version_file.write_text("not a version")
    unknown = call(server.url + "/v1/completions", {**body, "model": "tiny"}, request_id="u")

    wait_recorded(server, 3)
    stored = recorded(kafka_bootstrap, namespace, server)
    g_file, g_name, g_unknown = (stored[r.headers[GENERATION_IDS_HEADER]]
                                 for r in (from_file, from_name, unknown))
    assert (g_file.policy_version, g_file.metadata["reef.version_source"]) == (12, "file")
    assert (g_name.policy_version, g_name.metadata["reef.version_source"]) == (3, "model")
    assert "reef.policy_version" not in g_file.metadata
    assert (g_unknown.policy_version, g_unknown.metadata["reef.policy_version"]) == (
        0, "unknown")
    for g in (g_file, g_name, g_unknown):
        assert not {"prompt", "user", "completion"} & set(g.metadata)
        assert g.prompt_token_ids.tolist() == prompt_ids("secret")
        assert g.group_id.startswith("user:sha256:") and "alice" not in g.group_id


def test_the_version_file_of_a_real_follower_stamps_what_the_proxy_records(
        upstream, proxy, kafka_bootstrap, namespace, tmp_path):
    """`reef follow --version-file` names the version it loaded and the proxy records it; while
    a follower's engine loads the next one, what the proxy records is unknown; then the new
    version. The tests play the evaluator (tests/integration/publishing.py)."""
    version_file = tmp_path / "served-version"
    server = proxy(versions=Versions(version_file))
    v1, v2 = (write_checkpoint(tmp_path / "published", step, 0.1 * step) for step in (1, 2))
    produce_publications(kafka_bootstrap, namespace, promoted(v1))
    env = {**os.environ, "REEF_BOOTSTRAP_SERVERS": kafka_bootstrap, "REEF_NAMESPACE": namespace,
           "REEF_HOME": str(tmp_path / "home")}
    reef("follow", "--model", "tiny", "--until-version", "1", "--timeout", "60",
         "--version-file", str(version_file), env=env)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    on_v1 = call(server.url + "/v1/completions", body, request_id="v1")

    loading, release = threading.Event(), threading.Event()

    def engine(loaded) -> None:   # holds the reload of version 2 until the test releases it
        if loaded.policy_version == 2:
            loading.set()
            assert release.wait(30)

    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                              "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})
    with Follower("tiny", on_version=engine, settings=settings, fleet=None,
                  version_file=version_file) as replica:
        assert replica.wait_ready(30) == 1
        produce_publications(kafka_bootstrap, namespace, promoted(v2))
        assert loading.wait(30), "the follower never began loading version 2"
        during = call(server.url + "/v1/completions", body, request_id="during")
        release.set()
        assert replica.wait_for_version(2, 30) == 2
    on_v2 = call(server.url + "/v1/completions", body, request_id="v2")

    wait_recorded(server, 3)
    stored = recorded(kafka_bootstrap, namespace, server)
    g1, g_during, g2 = (stored[r.headers[GENERATION_IDS_HEADER]] for r in (on_v1, during, on_v2))
    assert (g1.policy_version, g1.metadata["reef.version_source"]) == (1, "file")
    assert (g_during.policy_version, g_during.metadata["reef.policy_version"]) == (0, "unknown")
    assert not g_during.policy_version_known
    assert (g2.policy_version, g2.metadata["reef.version_source"]) == (2, "file")
    assert json.loads(version_file.read_text())["checkpoint_id"] == v2.checkpoint_id


def test_with_the_broker_down_clients_are_served_records_spooled_then_delivered(
        upstream, proxy, kafka_bootstrap, namespace, tmp_path):
    nobody = f"127.0.0.1:{free_ports(1)[0]}"   # no broker listens there
    server = proxy(bootstrap=nobody)
    body = {"model": "tiny", "prompt": "offline", "max_tokens": 2}
    replies = [call(server.url + "/v1/completions", body, request_id=f"off-{i}")
               for i in range(3)]
    assert [r.status for r in replies] == [200] * 3
    ids = {r.headers[GENERATION_IDS_HEADER] for r in replies}
    wait_recorded(server, 3)
    wait_until(lambda: server.producer.sync.report().spooled == 3, 60,
               "the three records in the spool")
    server.stop(close_timeout=1)

    # the next producer on the same spool, with the broker back, delivers every one
    with RecordProducer(kafka_bootstrap, namespace=namespace, spool_dir=tmp_path / "spool",
                        settings=load_settings({"REEF_HOME": str(tmp_path / "home")}),
                        metrics_every_s=None) as later:
        assert later.flush(60).complete
    assert ids <= {g.generation_id for g in read_all(
        kafka_bootstrap, generations(namespace), Generation)}


def test_with_the_spool_full_the_client_is_served_and_the_record_dropped_and_counted(
        upstream, proxy, kafka_bootstrap, namespace):
    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    # records go nowhere and no record fits the spool; the metrics reach the real broker
    server = proxy(bootstrap=nobody, spool_max_bytes=1,
                   metrics=ProxyMetrics(kafka_bootstrap, namespace, every_s=0.2))
    body = {"model": "tiny", "prompt": "full", "max_tokens": 2}

    def served_one_dropped() -> bool:
        reply = call(server.url + "/v1/completions", body, request_id=uuid.uuid4().hex)
        assert reply.status == 200 and reply.headers[GENERATION_IDS_HEADER]
        return server.recording.counts.dropped["spool_full"] >= 1

    wait_until(served_one_dropped, 60, "a record dropped for a full spool", poll_s=0.2)
    assert call(server.url + "/reef/stats").json()["dropped"]["spool_full"] >= 1

    def dropped_metric() -> list[Metric]:
        return [m for m in read_all(kafka_bootstrap, metrics_topic(namespace), Metric)
                if (m.stage, m.name) == (STAGE_INTAKE, PROXY_DROPPED)
                and m.labels.get("reason") == "spool_full" and m.value >= 1]

    assert wait_until(dropped_metric, 30, "the proxy_dropped metric")[0].labels["client"] == \
        "proxy"


@dataclass
class CliProxy:
    """A running `reef intake proxy`: its URL; ``output`` and ``returncode`` once stopped."""

    url: str
    process: subprocess.Popen
    output: str = ""
    returncode: int | None = None


def spawn_reef_intake_proxy(upstream: str, bootstrap: str, namespace: str, home: Path,
                            *args: str) -> CliProxy:
    """`reef intake proxy --upstream UPSTREAM ARGS...` on a free port, recording to
    ``namespace`` (its topics declared here), once it answers; the caller stops it."""
    ensure_topics(AdminClient(client_config(bootstrap)), declare_topics(namespace))
    port = free_ports(1)[0]
    env = {**os.environ, "REEF_BOOTSTRAP_SERVERS": bootstrap, "REEF_NAMESPACE": namespace,
           "REEF_HOME": str(home), "COLUMNS": "200"}
    command = [sys.executable, "-m", "reef_stream.cli", "intake", "proxy", "--upstream",
               upstream, "--listen", f"127.0.0.1:{port}", *args]
    running = CliProxy(f"http://127.0.0.1:{port}",
                       subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))

    def answers() -> Reply | None:
        assert running.process.poll() is None, running.process.communicate()[0]
        try:
            return call(running.url + "/reef/stats")
        except OSError:
            return None

    try:
        wait_until(answers, 60, "the proxy to answer")
    except BaseException:
        running.process.kill()
        running.process.communicate(timeout=60)
        raise
    return running


@contextlib.contextmanager
def reef_intake_proxy(upstream: str, bootstrap: str, namespace: str, home: Path,
                      *args: str) -> Iterator[CliProxy]:
    """``spawn_reef_intake_proxy``, answering when entered; SIGTERM on exit, which the proxy
    must survive with status 0 (its closing report is then in ``output``)."""
    running = spawn_reef_intake_proxy(upstream, bootstrap, namespace, home, *args)
    try:
        yield running
    finally:
        running.process.send_signal(signal.SIGTERM)
        running.output, _ = running.process.communicate(timeout=60)
        running.returncode = running.process.returncode
    assert running.returncode == 0, running.output


def test_reef_intake_proxy_serves_records_and_reports_at_sigterm(
        upstream, kafka_bootstrap, namespace, tmp_path):
    (tmp_path / "version").write_text("7")
    with reef_intake_proxy(upstream, kafka_bootstrap, namespace, tmp_path / "home",
                           "--model", "my-model", "--policy-version-file",
                           str(tmp_path / "version"), "--redact", "prompt") as server:
        reply = call(server.url + "/v1/completions",
                     {"model": "tiny", "prompt": "hi", "max_tokens": 2}, request_id="cli")
        assert reply.status == 200
        gid = reply.headers[GENERATION_IDS_HEADER]
    assert "proxy closed: 1 recorded, 0 dropped" in server.output
    assert "1 acknowledged" in server.output
    (g,) = [g for g in read_all(kafka_bootstrap, generations(namespace), Generation)
            if g.generation_id == gid]
    assert (g.model, g.policy_version, g.replica_id) == ("my-model", 7,
                                                         f"proxy@{upstream[len('http://'):]}")
    assert "prompt" not in g.metadata


def test_a_proxy_killed_outright_holding_a_trajectory_records_it_whole_once_restarted(
        upstream, kafka_bootstrap, namespace, tmp_path):
    """The tool-calling turns a proxy holds are journalled in its spool directory: killed with
    SIGKILL mid-conversation and started again on the same directory, it holds the trajectory
    again, the next turn chains onto it, and exactly one Generation holds every turn."""
    home = tmp_path / "home"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    messages = [{"role": "user", "content": "add 17 and 25"}]
    conversation = {"x-reef-conversation-id": "conv-kill"}

    def agent_turn(url: str, i: int, max_tokens: int, result: str | None) -> Reply:
        nonlocal messages
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                **({"tools": tools} if result else {"stream": True})}
        reply = call(url + "/v1/chat/completions", body, request_id=f"kill-{i}",
                     headers=conversation)
        assert reply.status == 200
        if result is not None:
            message = reply.json()["choices"][0]["message"]
            assert message["tool_calls"]
            messages = [*messages, message, {"role": "tool", "tool_call_id": "call-0",
                                             "content": result}]
        return reply

    killed = spawn_reef_intake_proxy(upstream, kafka_bootstrap, namespace, home)
    try:
        agent_turn(killed.url, 0, 3, "42")
        agent_turn(killed.url, 1, 2, "ok")
        assert call(killed.url + "/reef/stats").json()["trajectories"] == {"chained": 1,
                                                                          "held": 1}
    finally:
        killed.process.kill()
        killed.process.communicate(timeout=60)
    assert killed.process.returncode == -signal.SIGKILL

    with reef_intake_proxy(upstream, kafka_bootstrap, namespace, home) as server:
        restarted = call(server.url + "/reef/stats").json()["trajectories"]
        assert agent_turn(server.url, 2, 4, None).headers[GENERATION_IDS_HEADER] == \
            "chatcmpl-kill-2:0"
    assert "proxy closed: 1 recorded, 0 dropped" in server.output

    stored = [g for g in read_all(kafka_bootstrap, generations(namespace), Generation)
              if g.group_id == "conv-kill"]
    assert [g.generation_id for g in stored] == ["chatcmpl-kill-2:0"], "exactly one"
    (g,) = stored
    assert g.metadata.get("proxy.turns") == "3", "the turns before the kill are in it"
    tokens = [(completion_of(0, 3), "assistant"), (prompt_ids("42"), "tool:add"),
              (completion_of(0, 2), "assistant"), (prompt_ids("ok"), "tool:add"),
              (completion_of(0, 4), "assistant")]
    assert g.prompt_token_ids.tolist() == prompt_ids("add 17 and 25")
    assert g.completion_token_ids.tolist() == [
        t for part, _ in tokens for t in (part[0] if isinstance(part, tuple) else part)]
    assert g.completion_logprobs.tolist() == [
        v for part, _ in tokens
        for v in (part[1] if isinstance(part, tuple) else [0.0] * len(part))]
    assert [(t.role, t.token_ids.size) for t in g.turns()] == [
        (role, len(part[0] if isinstance(part, tuple) else part)) for part, role in tokens]
    assert restarted == {"restored": 1, "held": 1}
    journal = home / "spool" / f"{namespace}-proxy" / "trajectories.journal"
    assert journal.stat().st_size == 0, "handed to the producer: nothing left in the journal"


def test_stripping_nulls_only_the_added_keys_never_text_that_looks_like_them():
    from reef_stream.intake.proxy import _Plan

    plan = _Plan.of("chat", {"model": "m", "messages": []})
    text = 'he said "logprobs": [1] and "token_ids":[2]'
    raw = json.dumps({"id": "c", "prompt_token_ids": [1, 2], "choices": [{
        "index": 0, "message": {"content": text, "tool_calls": [{"function": {
            "arguments": json.dumps({"logprobs": {"x": 1}})}}]},
        "logprobs": {"content": [{"token": "}", "logprob": -1e-05, "top_logprobs": []}]},
        "token_ids": [5, 6]}]}, separators=(",", ":")).encode()

    stripped = plan.strip(raw)

    expected = {"id": "c", "prompt_token_ids": None, "choices": [{
        "index": 0, "message": json.loads(raw)["choices"][0]["message"], "logprobs": None,
        "token_ids": None}]}
    assert stripped == json.dumps(expected, separators=(",", ":")).encode()  # byte for byte
    asked = _Plan.of("chat", {"logprobs": True, "return_token_ids": True})
    assert asked.strip(raw) is raw
