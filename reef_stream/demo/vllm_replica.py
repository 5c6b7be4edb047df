"""The replica of ``reef demo --engine vllm``: sample the toy task from a real vLLM server.

    python -m reef_stream.demo.vllm_replica --model policy --url http://127.0.0.1:18000 \\
        --recipe reef_stream.demo.vllm_recipes:sao --replica-id vllm-0 --rate 300

One replica process drives one vLLM server (``reef_stream.servers.inference.LocalEngine``, which
the demo starts on the demo's Hugging Face model, ``reef_stream.demo.vllm_model``):

1. its ``Follower(loads=ARTIFACT)`` reads the model's publications; for each newer promoted
   version it verifies the serving artifact the evaluator wrote and hands it to
   ``EngineGate.on_version``, which makes the engine load it (``VllmEngine``: pause, reload
   the weights, resume, set the engine's weight version). The server starts on the weights
   the trainer starts from, so it serves version 0 before any load;
2. it samples continuously: each round sends ``prompts`` prompts of the task as token ids to
   ``/v1/completions`` in one request (one completion token each, temperature 1, no top-p /
   top-k, EOS not special, ``logprobs`` and ``return_token_ids``), and each completion becomes
   a ``Generation`` carrying the token id and logprob vLLM returned, stamped with the version
   the engine served for that request, sent through ``RecordProducer(guard=follower)``.

Which version a completion came from: ``EngineGate`` is a lock between requests and reloads.
A request runs only while no reload does, and a reload waits for the request in flight (and
vLLM's own ``/pause?mode=wait`` for anything else); the version read under the lock is the one
whose weights serve the whole request. A request is sent only once the follower serves that
version too (it counts a version as served after ``on_version`` returned), so the producer's
guard never refuses a generation: no generation carries a version the engine did not serve.

One server, one follower driving it: the engine is one replica in the fleet (its id, its
version, its heartbeats); requests from other processes could not be ordered against a reload
by this lock, so ``reef demo --engine vllm`` runs this one replica process per server. vLLM
batches the prompts of a request; one request stream gives more completions than the
pipeline trains (``docs/history.md``, "One request stream per vLLM server").

Through the recording proxy (``--via URL --version-file PATH``, ``reef demo --engine vllm
--via-proxy``): the follower keeps PATH naming the version the engine serves
(``reef_stream.serving.version_file``), the requests go to the proxy at URL (``reef intake
proxy --upstream <the server> --version-file PATH``), and the proxy, not this process, records
each completion as a Generation, stamped with the version the file named before and after the
request (the gate keeps reloads out of a request; one that began before the follower marked
the file ``reloading`` is unknown, and the demo's proxy records nothing for it). The replica
only counts what it was served.

The process prints one JSON line last (``ReplicaReport``'s fields, plus ``engine_reloads``:
the seconds each reload took in the engine, and ``url``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np

from reef_stream.core.errors import FatalError
from reef_stream.core.processes import stop_on_signals
from reef_stream.core.settings import Settings, load_settings
from reef_stream.demo.replica import Pacer, ReplicaReport, RoundSender, replica_spool_dir
from reef_stream.demo.task import ProblemStream, make_generation
from reef_stream.intake.producer import RecordProducer
from reef_stream.serving.adapters import VllmEngine
from reef_stream.serving.follower import ARTIFACT, AUTO, Follower, LoadedVersion

__all__ = ["EngineGate", "complete", "run_vllm_replica"]

log = logging.getLogger("reef_stream.demo.vllm_replica")  # its module name under python -m too

#: Seconds one completions request may take.
REQUEST_TIMEOUT_S = 120.0


class EngineGate:
    """The version an engine serves, and a lock that orders requests against reloads.

    ``on_version`` (the follower's callback, on its thread) waits until no request is in
    flight, holds new requests back, reloads the engine, and on success records the version.
    ``request()`` (the sampling thread) is a context manager that waits while a reload runs
    and yields the version served for as long as the block runs. A reload that fails raises
    (the follower refuses the version) and leaves the version as it was.
    """

    def __init__(self, engine: VllmEngine, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        #: Seconds each completed reload took in the engine (``VllmEngine.reload``).
        self.reloads: list[float] = []
        self._condition = threading.Condition()
        self._requests = 0
        self._reloading = False

    def on_version(self, loaded: LoadedVersion) -> None:
        with self._condition:
            self._reloading = True
            self._condition.wait_for(lambda: self._requests == 0)
        try:
            self.engine(loaded)
            with self._condition:
                self.version = loaded.policy_version
                if self.engine.last is not None:
                    self.reloads.append(self.engine.last.seconds)
        finally:
            with self._condition:
                self._reloading = False
                self._condition.notify_all()

    @contextlib.contextmanager
    def request(self) -> Iterator[int]:
        with self._condition:
            self._condition.wait_for(lambda: not self._reloading)
            self._requests += 1
            version = self.version
        try:
            yield version
        finally:
            with self._condition:
                self._requests -= 1
                self._condition.notify_all()


def served_model(url: str) -> str:
    """The name vLLM at ``url`` serves its base model under (``/v1/models``)."""
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as response:
        models = json.loads(response.read())["data"]
    return next(m["id"] for m in models if not m.get("parent"))


def complete(url: str, model: str, prompts: list[list[int]], *,
             temperature: float = 1.0) -> list[tuple[int, float]]:
    """One completion token for each of ``prompts`` (token ids) from vLLM at ``url``: (token
    id, its logprob) each, in order. Plain sampling at ``temperature`` (top-p 1, top-k off,
    EOS an ordinary token). Blocks; ``FatalError`` with vLLM's answer when it fails."""
    body: dict[str, Any] = {"model": model, "prompt": prompts, "max_tokens": 1,
                            "temperature": temperature, "top_p": 1.0, "top_k": -1,
                            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            choices = json.loads(response.read())["choices"]
    except urllib.error.HTTPError as error:
        raise FatalError(f"vLLM at {url} answered /v1/completions with HTTP {error.code}: "
                         f"{error.read().decode(errors='replace')[:2000]}") from None
    except (urllib.error.URLError, OSError) as error:
        raise FatalError(f"vLLM at {url} did not answer /v1/completions: {error}") from None
    choices.sort(key=lambda choice: choice["index"])
    return [(int(c["token_ids"][0]), float(c["logprobs"]["token_logprobs"][0])) for c in choices]


def run_vllm_replica(model_name: str, url: str, *, prompts: int = 32, rate: float | None = None,
                     sampling_seed: int = 1000, settings: Settings | None = None,
                     namespace: str | None = None, replica_id: str = "vllm-0",
                     stop_event: threading.Event | None = None,
                     max_generations: int | None = None, ready_timeout: float = 60.0,
                     heartbeat_s: float = 2.0, fleet: Any = AUTO,
                     flush_timeout: float = 30.0, via: str | None = None,
                     version_file: Path | None = None) -> tuple[ReplicaReport, list[float]]:
    """Drive and sample the vLLM server at ``url`` until ``stop_event`` is set or
    ``max_generations`` were sent (see the module docstring). ``via``: a recording proxy in
    front of the server, which the requests go to and which records them (``version_file``:
    the file the follower keeps for it). Returns the report and the engine's reload seconds.
    Blocks; raises what stopped the follower or a request."""
    settings = settings or load_settings()
    namespace = namespace or settings.namespace
    stop_event = stop_event or threading.Event()
    gate = EngineGate(VllmEngine(url))
    follower = Follower(model_name, on_version=gate.on_version, settings=settings,
                        namespace=namespace, replica_id=replica_id, initial_version=0,
                        fleet=fleet, heartbeat_s=heartbeat_s, loads=ARTIFACT,
                        version_file=version_file)
    engine_model = served_model(url)
    stream = ProblemStream(sampling_seed)
    producer: RecordProducer | None = None
    follower.start()
    try:
        follower.wait_ready(ready_timeout)
        if via is None:
            producer = RecordProducer(follower.bootstrap, settings=settings,
                                      namespace=namespace, guard=follower, client="replica",
                                      spool_dir=replica_spool_dir(settings, namespace,
                                                                  replica_id))
        log.info("replica %s drives vLLM at %s (%s), serving version %s, %d prompts a request%s"
                 "%s", replica_id, url, engine_model, gate.version, prompts,
                 f", at most {rate:g} generations/s" if rate else "",
                 f"; requests through the recording proxy at {via}" if via else "")
        sender = RoundSender(producer, replica_id, stop_event,
                             Pacer(rate) if rate is not None else None)
        while not stop_event.is_set() and (max_generations is None
                                           or sender.sent < max_generations):
            if follower.error is not None:
                raise follower.error
            batch = stream.take(prompts)
            with gate.request() as version:
                if follower.policy_version != version:   # it registers the load just after
                    batch = []
                else:
                    completions = complete(via or url, engine_model,
                                           [p.token_ids.tolist() for p in batch])
            if not batch:
                stop_event.wait(0.01)
                continue
            if via is not None:
                sender.count_round(version, len(completions))
                continue
            sender.send_round(version, (
                make_generation(model=model_name, policy_version=version, replica_id=replica_id,
                                problem=problem, token_ids=np.array([token], dtype=np.int32),
                                logprobs=np.array([logprob], dtype=np.float32), temperature=1.0)
                for problem, (token, logprob) in zip(batch, completions)), len(batch))
    finally:
        flushed = producer.close(flush_timeout) if producer is not None else None
        follower.stop()
    report = sender.report(model_name, gate.version, flushed)
    log.info("replica %s stopped: %d generations sent over %d versions; %d engine reloads",
             replica_id, report.sent, len(report.by_version), len(gate.reloads))
    return report, gate.reloads


@click.command()
@click.option("--model", "-m", "model_name", required=True,
              help="The model to follow (what its trainer's Checkpoint events call it).")
@click.option("--url", required=True, help="The vLLM server to drive and sample.")
@click.option("--prompts", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts per request.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="PER_SECOND", help="Generations per second at most [default: no cap].")
@click.option("--sample-seed", "sampling_seed", type=click.IntRange(min=0), default=1000,
              show_default=True, help="Seeds the prompts (vLLM's sampling is its own).")
@click.option("--replica-id", default="vllm-0", show_default=True)
@click.option("--max-generations", type=click.IntRange(min=1), default=None)
@click.option("--heartbeat", type=click.FloatRange(min=0, min_open=True), default=2.0,
              show_default=True, metavar="SECONDS")
@click.option("--via", default=None, metavar="URL",
              help="A recording proxy in front of --url (reef intake proxy --upstream URL): "
                   "requests go there and it records them; this process produces nothing.")
@click.option("--version-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="PATH", help="Keep PATH naming the version the engine serves, for the "
                                   "proxy's --version-file.")
def main(model_name: str, url: str, prompts: int, rate: float | None, sampling_seed: int,
         replica_id: str, max_generations: int | None, heartbeat: float, via: str | None,
         version_file: Path | None) -> None:
    """The vLLM replica of `reef demo --engine vllm` (REEF_* variables name the cluster and
    namespace). Stops on SIGTERM or Ctrl-C; prints a JSON summary line last."""
    stop = threading.Event()
    with stop_on_signals(stop.set):
        report, reloads = run_vllm_replica(model_name, url, prompts=prompts, rate=rate,
                                           sampling_seed=sampling_seed, replica_id=replica_id,
                                           stop_event=stop, max_generations=max_generations,
                                           heartbeat_s=heartbeat, via=via,
                                           version_file=version_file)
    record = json.loads(report.to_json())
    click.echo(json.dumps({**record, "url": url, "engine_reloads": [round(s, 4)
                                                                    for s in reloads]},
                          sort_keys=True))


if __name__ == "__main__":
    from reef_stream.cli.common import run_standalone

    run_standalone(main, "python -m reef_stream.demo.vllm_replica", "reef_stream")

