"""The HTTP intake against the real broker: a real aiohttp server, a real HTTP client (urllib).

Most tests run the app of ``reef_stream.intake.http.make_app`` in a thread of
this process, on a free port; the last one runs ``reef intake serve`` as a
subprocess and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from reef_stream.core.events import Feedback, Generation
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import load_settings
from reef_stream.intake.aio import AsyncRecordProducer
from reef_stream.intake.http import make_app
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, feedback, generations
from tests.helpers import consume_events, wait_until

MAX_REQUEST_BYTES = 64 * 1024


def native_generation(generation_id: str) -> dict:
    return {
        "generation_id": generation_id, "request_id": "r-1", "prompt_id": "p-1", "model": "tiny",
        "policy_version": 3, "replica_id": "replica-a", "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5], "completion_logprobs": [-0.5, -1.25],
        "finish_reason": "stop", "sampling": {"max_tokens": 16},
    }


def enveloped_completion(response_id: str, n: int) -> dict:
    return {
        "reef": {"policy_version": 5, "replica_id": "replica-go", "sampling": {"max_tokens": 8}},
        "response": {
            "id": response_id, "object": "text_completion", "created": 1_795_000_000,
            "model": "Qwen",
            "choices": [{"index": i, "text": "x", "finish_reason": "stop",
                         "prompt_token_ids": [7, 8], "token_ids": [9, 10 + i],
                         "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}}
                        for i in range(n)],
        },
    }


# --------------------------------------------------------------------------- server and client


@dataclass
class Server:
    """An intake app served by its own event loop in a thread."""

    url: str
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner
    producer: AsyncRecordProducer
    thread: threading.Thread
    close_timeout: float

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.producer.close(self.close_timeout)


@pytest.fixture
def serve(kafka_bootstrap, namespace, tmp_path) -> Iterator:
    """``serve(token=None, bootstrap=None, close_timeout=30, **producer_options)``: start an
    intake on a free port, on the session's broker unless ``bootstrap`` names another;
    stopped after the test."""
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                              "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})
    servers: list[Server] = []

    def start(token: str | None = None, bootstrap: str | None = None, close_timeout: float = 30,
              **producer_options) -> Server:
        port = free_ports(1)[0]
        loop = asyncio.new_event_loop()
        cluster = bootstrap or kafka_bootstrap

        async def setup() -> tuple[web.AppRunner, AsyncRecordProducer]:
            producer = AsyncRecordProducer(bootstrap=cluster, settings=settings,
                                           spool_dir=tmp_path / "spool", **producer_options)
            runner = web.AppRunner(make_app(producer, bootstrap=cluster, token=token,
                                            max_request_bytes=MAX_REQUEST_BYTES))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner, producer

        runner, producer = loop.run_until_complete(setup())
        thread = threading.Thread(target=loop.run_forever, name="intake-test", daemon=True)
        thread.start()
        server = Server(f"http://127.0.0.1:{port}", loop, runner, producer, thread,
                        close_timeout)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


def request(url: str, body: bytes | Iterator[bytes] | None = None, *,
            token: str | None = None) -> Reply:
    """POST ``body`` (GET when None) and read the JSON answer, whatever its status."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return Reply(response.status, dict(response.headers), json.loads(response.read()))
    except urllib.error.HTTPError as error:
        return Reply(error.code, dict(error.headers), json.loads(error.read()))


def post_json(url: str, value: Any, token: str | None = None) -> Reply:
    return request(url, json.dumps(value).encode(), token=token)


# --------------------------------------------------------------------------- the tests


def test_a_valid_batch_is_answered_once_acknowledged_and_is_in_the_topic(
        serve, kafka_bootstrap, namespace):
    server = serve()
    batch = [native_generation("g-1"), enveloped_completion("cmpl-7", n=2),
             native_generation("g-2")]

    reply = post_json(f"{server.url}/v1/generations", batch)

    assert reply.status == 200, reply.body
    results = reply.body["results"]
    assert [(r["index"], r["id"], r["status"]) for r in results] == [
        (0, "g-1", "acknowledged"), (1, "cmpl-7:0", "acknowledged"),
        (1, "cmpl-7:1", "acknowledged"), (2, "g-2", "acknowledged")]
    assert all(isinstance(r["partition"], int) and r["offset"] >= 0 for r in results)
    stored = {g.generation_id: g for g in consume_events(kafka_bootstrap, generations(namespace), 4,
                                                  Generation)}
    assert set(stored) == {"g-1", "cmpl-7:0", "cmpl-7:1", "g-2"}
    assert (stored["cmpl-7:1"].replica_id, stored["cmpl-7:1"].group_size) == ("replica-go", 2)

    single = post_json(f"{server.url}/v1/generations", native_generation("g-3"))
    assert single.status == 200
    assert [(r["index"], r["id"], r["status"]) for r in single.body["results"]] == [
        (0, "g-3", "acknowledged")]


def test_an_invalid_record_is_rejected_with_its_reason_and_the_valid_ones_acknowledged(
        serve, kafka_bootstrap, namespace):
    server = serve()
    batch = [
        {"generation_id": "g-1", "source": "judge", "reward": 1.0},
        {"generation_id": "g-2", "reward": 0.5},
        {"generation_id": "g-3", "source": "judge", "reward": math.nan},
        {"generation_id": "g-4", "group_id": "grp", "source": "judge", "reward": -1.0},
    ]

    reply = post_json(f"{server.url}/v1/feedback", batch)  # json.dumps writes NaN as NaN

    assert reply.status == 200, reply.body
    by_index = {r["index"]: r for r in reply.body["results"]}
    assert [by_index[i]["status"] for i in range(4)] == [
        "acknowledged", "rejected", "rejected", "acknowledged"]
    assert by_index[1]["field"] == "source" and "is missing" in by_index[1]["error"]
    assert by_index[2]["field"] == "reward" and "finite" in by_index[2]["error"]
    assert by_index[3]["id"] == "g-4:judge"
    stored = consume_events(kafka_bootstrap, feedback(namespace), 2, Feedback)
    assert {f.feedback_id for f in stored} == {"g-1:judge", "g-4:judge"}

    every_one_invalid = post_json(f"{server.url}/v1/feedback", batch[1:3])
    assert every_one_invalid.status == 400
    assert [r["field"] for r in every_one_invalid.body["results"]] == ["source", "reward"]

    not_json = request(f"{server.url}/v1/feedback", b'{"generation_id": ')
    assert not_json.status == 400 and "not JSON" in not_json.body["error"]
    empty = post_json(f"{server.url}/v1/feedback", [])
    assert empty.status == 400 and "empty" in empty.body["error"]


def test_with_a_token_a_missing_or_wrong_one_is_refused(serve):
    server = serve(token="s3cret")
    url = f"{server.url}/v1/generations"

    missing = post_json(url, native_generation("g-1"))
    wrong = post_json(url, native_generation("g-1"), token="guess")
    right = post_json(url, native_generation("g-1"), token="s3cret")

    assert (missing.status, wrong.status, right.status) == (401, 401, 200)
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert "bearer token" in wrong.body["error"]
    assert request(f"{server.url}/healthz").status == 200  # probes need no token


def test_an_oversized_body_is_refused_with_413(serve):
    server = serve()
    url = f"{server.url}/v1/generations"
    big = native_generation("g-big")
    big["prompt_token_ids"] = list(range(MAX_REQUEST_BYTES // 4))
    body = json.dumps(big).encode()
    assert len(body) > MAX_REQUEST_BYTES

    declared = request(url, body)
    chunked = request(url, iter([body[i:i + 8192] for i in range(0, len(body), 8192)]))

    assert declared.status == 413 and "over 65536 bytes" in declared.body["error"]
    assert chunked.status == 413


def test_healthz_reports_the_broker_and_the_spool(serve):
    server = serve()
    post_json(f"{server.url}/v1/generations", native_generation("g-1"))

    reply = request(f"{server.url}/healthz")

    assert reply.status == 200
    assert reply.body["broker_reachable"] is True
    assert (reply.body["spooled"], reply.body["pending"], reply.body["failed"]) == (0, 0, 0)
    assert reply.body["acknowledged"] == 1


def test_with_the_broker_unreachable_records_are_spooled_and_a_full_spool_answers_503(serve):
    nobody = f"127.0.0.1:{free_ports(1)[0]}"  # no broker listens there
    server = serve(bootstrap=nobody, spool_max_bytes=4096, block_timeout=0.5, close_timeout=1)
    url = f"{server.url}/v1/generations"

    health = request(f"{server.url}/healthz")  # meanwhile the producer finds the broker down
    spooled = post_json(url, native_generation("g-1"))
    full = post_json(url, [native_generation(f"g-{i}") for i in range(2, 60)])

    assert health.status == 200 and health.body["broker_reachable"] is False
    assert spooled.status == 200
    assert [(r["id"], r["status"]) for r in spooled.body["results"]] == [("g-1", "spooled")]
    assert full.status == 503 and full.headers["Retry-After"] == "5"
    assert "spool is full" in full.body["error"]
    assert request(f"{server.url}/healthz").body["spooled"] > 1


def test_reef_intake_serve_runs_the_server_with_the_token_from_the_environment(
        kafka_bootstrap, namespace, tmp_path):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))
    port, metrics_port = free_ports(2)
    env = {**os.environ, "REEF_BOOTSTRAP_SERVERS": kafka_bootstrap, "REEF_NAMESPACE": namespace,
           "REEF_HOME": str(tmp_path / "home"), "REEF_INTAKE_TOKEN": "s3cret", "COLUMNS": "200"}
    server = subprocess.Popen(_serve_command(port, "--metrics-port", str(metrics_port)), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_answering(f"{url}/healthz", server)
        assert post_json(f"{url}/v1/generations", native_generation("g-1")).status == 401
        reply = post_json(f"{url}/v1/generations", native_generation("g-1"), token="s3cret")
        assert reply.status == 200 and reply.body["results"][0]["status"] == "acknowledged"
        # Its producer's counts reach Prometheus (written every 10 s): one record, acknowledged.
        samples: dict[str, float] = {}

        def acknowledged() -> bool:
            nonlocal samples
            samples = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            return samples.get("reef_intake_acknowledged") == 1.0

        wait_until(acknowledged, 30, lambda: f"one acknowledged record on /metrics: {samples}",
                   poll_s=0.5)
        assert samples["reef_intake_sent"] == 1.0 and samples["reef_intake_failed"] == 0.0
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=60)
    assert server.returncode == 0, output
    assert "bearer token required" in output
    assert "producer closed: 1 acknowledged, 0 left in the spool" in output
    assert (tmp_path / "home" / "spool" / f"{namespace}-intake").is_dir()


def _serve_command(port: int, *extra: str) -> list[str]:
    """`reef intake serve` on ``port``."""
    return [sys.executable, "-m", "reef_stream.cli", "intake", "serve", "--port", str(port), *extra]


def _scrape(url: str) -> dict[str, float]:
    """The intake's samples (``reef_intake_*``, client http) at a Prometheus ``/metrics``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            if family.name.startswith("reef_intake_") for sample in family.samples
            if sample.labels.get("client") == "http"}


def _wait_until_answering(url: str, server: subprocess.Popen, timeout: float = 30) -> None:
    def answering() -> bool:
        if server.poll() is not None:
            raise AssertionError(f"the server exited {server.returncode}: "
                                 f"{server.communicate()[0]}")
        try:
            return request(url).status == 200
        except OSError:
            return False

    wait_until(answering, timeout, f"{url} to answer", poll_s=0.2)
