"""The recording proxy's cost: streamed completions through ``reef intake proxy`` against direct.

    python bench/proxy.py [--concurrency 1,16,64] [--seconds 5] [--tokens 32] [--repeat 1]
                          [--upstream URL --model NAME] [--token-ms T] [--think-ms M] [--pin]

Against the same upstream, at each concurrency (that many clients, each sending streamed
``/v1/completions`` requests back to back), it measures requests/s and the latency of whole
streams, directly and through the proxy; and the proxy's CPU time per request (its process's
user + system time, read from the OS). ``--repeat N`` measures N rounds of ``--seconds`` each,
direct and proxied in ABBA order (every other round the proxy first, so that a drift of the
machine falls on both sides alike), and pools every request of each side. The proxy records
to a real broker (REEF_BOOTSTRAP_SERVERS, or a throw-away one it starts).

The default upstream is a fast local OpenAI-compatible server (a process of its own) that
streams ``--tokens`` tokens per request in vLLM's shape at once, so what is measured is the
proxy's own cost. ``--upstream URL`` measures against another server, e.g. vLLM
(``--model`` names its model). Client, upstream, proxy and broker share this machine's CPUs:
the figures, never assertions, are only as steady as the machine.

``--token-ms T`` makes the fast upstream stream a token every T ms, waited off the CPU, as a
GPU-bound engine's decoding is for the host: what is measured then is what a streaming client
of such an engine sees the proxy add. At 0 (the default) the upstream does no more work per
token than the proxy (a JSON chunk written), so the proxy, which also parses, strips and
records each one, cannot keep its pace on an equal core: that run measures the proxy's
capacity, not what serving through it costs.

``--think-ms M`` makes each client wait an exponential think time of mean M ms before each
request (client i's draws from seed i, the same direct and proxied). Back to back (the
default), paced streams of equal length keep the clients in step, so their requests reach
the proxy in waves; live traffic does not arrive in step.

``--pin`` gives the proxy a core of its own, as it has beside a GPU-bound server whose host
CPUs are mostly idle: the clients and the upstream run on CPU 0 in both the direct and the
proxied runs, the proxy and the broker on CPU 1 (the other CPUs unused). Without it, on two
cores, the proxied run has three busy processes where the direct run has two, and the ratio
measures the machine's cores as much as the proxy. The last line, for the first upstream at
16 streams (or the largest concurrency measured below 16), is::

    PROXY throughput_ratio=X added_p50_ms=X added_p99_ms=X cpu_ms_per_request=X pinned=yes|no token_ms=X think_ms=X
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web

from reef_stream.core.processes import free_ports
from reef_stream.core.settings import load_settings
from reef_stream.demo.run import local_broker_pids
from reef_stream.servers.kafka_local import configured_or_throwaway
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import new_admin
from reef_stream.topics.declarations import declare_topics

# --------------------------------------------------------------------------- the fast upstream


def _fast_upstream(port: int, tokens: int, token_ms: float = 0.0) -> None:
    """Serve streamed (and whole) completions in vLLM's shape, as fast as it can, or with
    token j at ``j * token_ms`` milliseconds after the first, waited off the CPU as an
    engine's GPU decodes: the pace does not depend on how long a chunk took to write (asked
    for logprobs and token ids, as the proxy asks, the chunks are larger)."""
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        with_ids = body.get("return_token_ids") is True
        logprobs = body.get("logprobs") is not None
        prompt = [1 + (ord(c) % 1000) for c in str(body.get("prompt"))]
        if not body.get("stream"):
            return web.json_response({
                "id": rid, "object": "text_completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "text": " x" * tokens, "finish_reason": "length",
                             "logprobs": {"token_logprobs": [-0.5] * tokens,
                                          "tokens": [" x"] * tokens} if logprobs else None,
                             "prompt_token_ids": prompt if with_ids else None,
                             "token_ids": [7] * tokens if with_ids else None}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        started = loop.time()
        for j in range(tokens):
            choice = {"index": 0, "text": " x",
                      "logprobs": {"text_offset": [j], "token_logprobs": [-0.5],
                                   "tokens": [" x"], "top_logprobs": [None]}
                      if logprobs else None,
                      "finish_reason": "length" if j == tokens - 1 else None,
                      "stop_reason": None,
                      "prompt_token_ids": prompt if with_ids and j == 0 else None,
                      "token_ids": [7 + j] if with_ids else None}
            chunk = {"id": rid, "object": "text_completion", "created": 1,
                     "model": body["model"], "choices": [choice], "usage": None}
            if token_ms and j:   # token j at its time, whatever writing the others took
                await asyncio.sleep(max(0.0, started + j * token_ms / 1000 - loop.time()))
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _proxy(port: int, upstream: str, bootstrap: str, namespace: str, home: str,
           cpus: set[int] | None) -> None:
    from reef_stream.intake.aio import AsyncRecordProducer

    if cpus:
        os.sched_setaffinity(0, cpus)   # before any thread starts: they inherit it
    from reef_stream.intake.proxy import ProxyOptions, RecordingProxy

    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": bootstrap, "REEF_NAMESPACE": namespace,
                              "REEF_HOME": home})

    async def app() -> web.Application:
        producer = AsyncRecordProducer(settings=settings, spool_dir=Path(home) / "spool",
                                       block_timeout=0, metrics_every_s=None, client="proxy")
        recording = RecordingProxy(producer, ProxyOptions(upstream=upstream))
        application = recording.app()

        async def close(_: web.Application) -> None:
            await producer.close(5)

        application.on_cleanup.append(close)
        return application

    web.run_app(app(), host="127.0.0.1", port=port, print=None, access_log=None)


def _wait_answering(url: str, timeout: float = 60) -> None:
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return   # it answers
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --------------------------------------------------------------------------- the clients


@dataclass(frozen=True)
class Run:
    requests: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @classmethod
    def pooled(cls, runs: list[Run]) -> Run:
        """One run of every request of ``runs``: their requests, seconds and latencies."""
        return cls(sum(r.requests for r in runs), sum(r.seconds for r in runs),
                   [latency for r in runs for latency in r.latencies_ms])

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _load(url: str, model: str, concurrency: int, seconds: float, tokens: int,
                asks_all: bool = False, think_ms: float = 0.0) -> Run:
    """``concurrency`` clients sending streamed completions for ``seconds`` (with
    ``asks_all``, asking for logprobs and token ids as the proxy does): back to back, or each
    after a think time drawn from an exponential of mean ``think_ms`` (client i's draws from
    seed i, the same on either side)."""
    request = {"model": model, "prompt": "The quick brown fox", "max_tokens": tokens,
               "stream": True, "temperature": 1.0}
    if asks_all:
        request.update(logprobs=0, return_token_ids=True)
    body = json.dumps(request).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        end = time.monotonic() + seconds

        async def client(rng: random.Random) -> None:
            while time.monotonic() < end:
                if think_ms:
                    await asyncio.sleep(rng.expovariate(1000 / think_ms))
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=body,
                                        headers=headers) as response:
                    assert response.status == 200, await response.text()
                    async for _ in response.content.iter_any():
                        pass
                latencies.append((time.perf_counter() - started) * 1000)

        started = time.monotonic()
        await asyncio.gather(*(client(random.Random(i)) for i in range(concurrency)))
        return Run(len(latencies), time.monotonic() - started, latencies)


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (a JVM's too, whose threads run already) on ``cpus``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass   # a thread that ended meanwhile


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of --seconds each, direct and proxied in ABBA order, "
                             "pooled (default 1)")
    parser.add_argument("--upstream", default=None, help="another upstream, e.g. vLLM's URL")
    parser.add_argument("--model", default="fast")
    parser.add_argument("--token-ms", type=float, default=0.0,
                        help="the fast upstream streams a token every this many ms, waited "
                             "off the CPU as a GPU engine's decoding is (0: at once)")
    parser.add_argument("--asks-all", action="store_true",
                        help="the clients ask for logprobs and token ids themselves, as the "
                             "proxy asks the upstream: the upstream does the same work "
                             "direct and proxied, and the proxy strips nothing")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="each client waits an exponential think time of this mean "
                             "before each request (0: back to back)")
    parser.add_argument("--pin", action="store_true",
                        help="clients and upstream on CPU 0, proxy and broker on CPU 1")
    args = parser.parse_args()
    if args.pin and not {0, 1} <= os.sched_getaffinity(0):
        parser.error("--pin needs CPUs 0 and 1")
    levels = [int(c) for c in args.concurrency.split(",")]
    context = multiprocessing.get_context("spawn")
    settings = load_settings()
    with tempfile.TemporaryDirectory() as workdir, \
            configured_or_throwaway(settings, Path(workdir)) as bootstrap:
        if args.pin:
            for pid in local_broker_pids(bootstrap):
                _pin_process(pid, {1})
            os.sched_setaffinity(0, {0})   # the clients, and the upstream it starts
        namespace = f"bench{uuid.uuid4().hex[:8]}"
        ensure_topics(new_admin(bootstrap), declare_topics(namespace))
        upstream_port, proxy_port = free_ports(2)
        children = []
        upstream = args.upstream
        if upstream is None:
            children.append(context.Process(target=_fast_upstream,
                                            args=(upstream_port, args.tokens, args.token_ms),
                                            daemon=True))
            upstream = f"http://127.0.0.1:{upstream_port}"
        proxy = context.Process(target=_proxy, daemon=True, args=(
            proxy_port, upstream, bootstrap, namespace, str(Path(workdir) / "home"),
            {1} if args.pin else None))
        children.append(proxy)
        for child in children:
            child.start()
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        _wait_answering(upstream + "/v1/models")
        _wait_answering(proxy_url + "/reef/stats")
        proxy_process = psutil.Process(proxy.pid)
        results: dict[int, tuple[Run, Run, float]] = {}
        try:
            for level in levels:
                directs, throughs, cpu = [], [], 0.0
                for round_ in range(args.repeat):
                    # ABBA: every other round measures the proxy first, so that a drift of
                    # the machine over the rounds falls on both sides alike.
                    for proxied in (False, True) if round_ % 2 == 0 else (True, False):
                        if not proxied:
                            directs.append(asyncio.run(_load(
                                upstream, args.model, level, args.seconds, args.tokens,
                                args.asks_all, args.think_ms)))
                            continue
                        before = _cpu_seconds(proxy_process)
                        throughs.append(asyncio.run(_load(
                            proxy_url, args.model, level, args.seconds, args.tokens,
                            args.asks_all, args.think_ms)))
                        cpu += _cpu_seconds(proxy_process) - before
                direct, through = Run.pooled(directs), Run.pooled(throughs)
                cpu_ms = cpu * 1000 / max(through.requests, 1)
                results[level] = direct, through, cpu_ms
                print(f"{level:3d} streams: direct {direct.rate:7.1f} req/s p50 "
                      f"{direct.quantile(0.5):6.2f} ms p99 {direct.quantile(0.99):6.2f} ms | "
                      f"proxy {through.rate:7.1f} req/s p50 {through.quantile(0.5):6.2f} ms "
                      f"p99 {through.quantile(0.99):6.2f} ms | ratio "
                      f"{through.rate / direct.rate:.3f}, proxy CPU {cpu_ms:.2f} ms/request",
                      flush=True)
        finally:
            for child in children:
                child.terminate()
                child.join(10)
    headline = 16 if 16 in results else max(level for level in results if level <= 16)
    direct, through, cpu_ms = results[headline]
    print(f"PROXY throughput_ratio={through.rate / direct.rate:.3f} "
          f"added_p50_ms={through.quantile(0.5) - direct.quantile(0.5):.2f} "
          f"added_p99_ms={through.quantile(0.99) - direct.quantile(0.99):.2f} "
          f"cpu_ms_per_request={cpu_ms:.2f} pinned={'yes' if args.pin else 'no'} "
          f"token_ms={args.token_ms:g} think_ms={args.think_ms:g}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
