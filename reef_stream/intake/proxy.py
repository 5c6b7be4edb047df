"""The recording proxy: an OpenAI-compatible endpoint that forwards to an upstream server and
records every choice it serves as a Generation (``reef intake proxy``; docs/proxy.md).

Routes:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (SSE) or not: forwarded
  with what training needs added to the request (``logprobs``; vLLM's ``return_token_ids``),
  answered with the upstream's response minus what the client did not ask for (``_Plan``),
  plus the header ``x-reef-generation-ids`` (``<response id>:<choice index>``, comma separated).
  Each choice that finished becomes one Generation (``reef_stream.intake.formats``); a
  choice of a batch of prompts has its own prompt and group. The tool-calling turns of a
  conversation are held and recorded as one multi-turn Generation when its answer comes
  (``reef_stream.intake.trajectories``); with a journal (``reef_stream.intake.journal``), a
  proxy killed outright and started again on it holds them again.
- ``POST /v1/feedback``: ``{"generation_ids": [...], "reward": 1.0, "source": "thumbs"}``
  (``generation_id`` for one; ``source`` defaults to the proxy's; ``components`` optional):
  one Feedback per id, answered once durable (acknowledged or spooled).
- ``GET /reef/stats``: the proxy's counts. Anything else is passed through untouched.

Serving never waits for the log: records are handed to the producer after the response is
built, the producer spools what the broker does not take, and a record the full spool has no
room for is dropped and counted (``PROXY_DROPPED``, reason ``spool_full``): the one place
reef-stream chooses to drop. Upstream errors (a status other than 200, a body that is not
JSON) pass through unchanged and are not recorded; a streamed choice without a finish reason
(a truncated stream) is not recorded either.

The conversation (the generations' ``group_id``) is the ``x-reef-conversation-id`` header,
else the body's ``metadata.conversation_id``, else its OpenAI ``user``; ``x-reef-group-size``
gives the group's size (default: the request's ``n``). The policy version is ``Versions``'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

import aiohttp
from aiohttp import web

from reef_stream.core import metric_names
from reef_stream.core.errors import ConfigurationError, InvalidRecord, ReefError
from reef_stream.core.events import (
    POLICY_VERSION_KEY,
    UNKNOWN_POLICY_VERSION,
    Generation,
)
from reef_stream.intake.aio import AsyncRecordProducer
from reef_stream.intake.formats import parse_feedback, parse_generations
from reef_stream.intake.journal import TrajectoryJournal
from reef_stream.intake.spool import SpoolFull
from reef_stream.intake.trajectories import IDLE_S, Given, Trajectories
from reef_stream.topics.metrics import MetricsWriter, PeriodicMetrics

__all__ = [
    "CONVERSATION_HEADER",
    "GENERATION_IDS_HEADER",
    "GROUP_SIZE_HEADER",
    "REDACTABLE",
    "UNKNOWN_VERSION",
    "FileReading",
    "ProxyCounts",
    "ProxyMetrics",
    "ProxyOptions",
    "RecordingProxy",
    "Versions",
]

log = logging.getLogger(__name__)

GENERATION_IDS_HEADER = "x-reef-generation-ids"
CONVERSATION_HEADER = "x-reef-conversation-id"
GROUP_SIZE_HEADER = "x-reef-group-size"
#: ``metadata["reef.policy_version"]`` of a Generation whose version the proxy could not tell
#: (``core.events.UNKNOWN_POLICY_VERSION``); its ``policy_version`` is then 0 and the recipe's
#: ``Schedule.unknown_version`` decides what training does with it.
#: ``metadata["reef.version_source"]`` says where a version came from: file, model or unknown.
UNKNOWN_VERSION = UNKNOWN_POLICY_VERSION
#: What ``--redact`` may drop before recording: the metadata ``prompt`` (the request's prompt or
#: messages), ``completion`` (the text and tool calls served), ``user`` (the OpenAI ``user``;
#: a group id taken from it is replaced by its digest). Token ids always stay.
REDACTABLE = ("prompt", "completion", "user")
#: The longest text kept in a record's metadata (prompt, completion, tool calls), in characters;
#: a longer one is cut and ``reef.truncated.<key>`` gives its length.
TEXT_MAX_CHARS = 256 * 1024
#: Generation ids remembered for the feedback's group id (so it shares the generation's key).
GROUPS_REMEMBERED = 100_000
#: Headers never forwarded either way (hop by hop, or recomputed by aiohttp).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade", "host",
                         "content-length", "accept-encoding", "content-encoding"})

Kind = Literal["chat", "completions"]


class Versions:
    """Which policy version the upstream served a request with; None when it cannot tell.

    ``file``: a file holding the version (decimal text, or JSON with ``policy_version``),
    rewritten by whatever loads new weights (``reef follow --version-file``); a request is
    stamped with it only when the file's content was the same before and after the request (a
    reload in between makes the version unknown, even one back to the same version: the
    follower's file changes with every write).
    ``model_pattern``: a regular expression whose first group is the version in the model name
    a request names (a LoRA adapter per version, e.g. ``reef-lora-v(\\d+)``); it wins over the
    file when it matches. Reading blocks on one ``stat`` (the file is re-read when it changed:
    another inode, size or time).
    """

    def __init__(self, file: Path | None = None, model_pattern: str | None = None):
        self.file = file
        self.pattern = re.compile(model_pattern) if model_pattern else None
        if self.pattern is not None and self.pattern.groups < 1:
            raise ConfigurationError(f"--version-from-model {model_pattern!r} has no group: "
                                     "put the version's digits in one, e.g. 'lora-v(\\d+)'")
        self._seen: tuple[int, ...] | None = None
        self._reading = FileReading(None, None)

    def from_file(self) -> int | None:
        """The version the file says now; None without a file or when it is unreadable."""
        return self.read_file().version

    def read_file(self) -> FileReading:
        """The file's content now and the version it says (``FileReading``)."""
        if self.file is None:
            return self._reading
        try:
            stat = os.stat(self.file)
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
            if seen != self._seen:
                text = self.file.read_text()
                self._reading = FileReading(_parse_version(text), text)
                self._seen = seen
        except OSError:
            self._seen, self._reading = None, FileReading(None, None)
        return self._reading

    def from_model(self, model: Any) -> int | None:
        """The version in the model name ``model``, or None."""
        if self.pattern is None or not isinstance(model, str):
            return None
        match = self.pattern.search(model)
        return int(match.group(1)) if match and match.group(1).isdigit() else None


class FileReading(NamedTuple):
    """What a version file held when read: the version it says (None: none, or unreadable) and
    its whole text (None: no file). Two readings are the same only if their texts are."""

    version: int | None
    text: str | None


def _parse_version(text: str) -> int | None:
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("policy_version")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


@dataclass(frozen=True)
class ProxyOptions:
    """What a ``RecordingProxy`` forwards to and how it records.

    ``model``: the model name recorded (default: the response's). ``redact``: names from
    ``REDACTABLE``. ``redactor``: a hook run on every Generation before it is recorded; it
    returns the Generation to record (e.g. with fields of ``metadata`` removed) or None to
    record nothing. ``feedback_source``: the ``source`` of feedback that names none.
    """

    upstream: str
    model: str | None = None
    replica_id: str | None = None
    versions: Versions = field(default_factory=Versions)
    redact: frozenset[str] = frozenset()
    redactor: Callable[[Generation], Generation | None] | None = None
    feedback_source: str = "user"
    #: What to do with a Generation whose version the proxy cannot tell: ``mark`` records it
    #: with ``reef.policy_version=unknown`` (version 0), ``skip`` records nothing (counted).
    unknown_version: Literal["mark", "skip"] = "mark"
    feedback_timeout_s: float = 30.0
    upstream_timeout_s: float = 600.0
    #: Seconds a conversation's tool-calling trajectory waits for its next turn before it is
    #: recorded as it is (``reef_stream.intake.trajectories``).
    trajectory_idle_s: float = IDLE_S

    def __post_init__(self) -> None:
        unknown = sorted(set(self.redact) - set(REDACTABLE))
        if unknown:
            raise ConfigurationError(f"cannot redact {', '.join(unknown)}: the choices are "
                                     f"{', '.join(REDACTABLE)}")


@dataclass
class ProxyCounts:
    """Running totals since start: choices recorded, records dropped and why, choices or
    responses not recorded and why, feedback records sent, tool-calling trajectories."""

    recorded: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    unrecorded: Counter[str] = field(default_factory=Counter)
    feedback: int = 0
    #: Tool-calling trajectories: turns ``chained``, trajectories ``split``, ``expired`` or
    #: ``restored`` (``Trajectories.counts``), journal entries ``journal_damaged`` and writes
    #: ``journal_failed``, and ``held`` now (``PROXY_TRAJECTORIES``, ``_HELD``).
    trajectories: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"recorded": self.recorded, "dropped": dict(self.dropped),
                "unrecorded": dict(self.unrecorded), "feedback": self.feedback,
                "trajectories": dict(self.trajectories)}


class ProxyMetrics:
    """Writes a proxy's counts (``PROXY_*``) to ``<ns>.metrics`` at most every ``every_s``
    seconds, through a metrics producer of its own; never blocks serving, never raises."""

    def __init__(self, bootstrap: str, namespace: str, every_s: float = 10.0,
                 instance: str | None = None):
        self.every_s = every_s
        labels = {"client": "proxy", "instance": instance or f"{os.getpid()}"}
        self._periodic = PeriodicMetrics(bootstrap, namespace, metric_names.STAGE_INTAKE,
                                         labels, every_s=every_s)

    def emit(self, counts: ProxyCounts, final: bool = False) -> None:
        self._periodic.emit(lambda: repr(counts.as_dict()), partial(_write_counts, counts),
                            final=final)


def _write_counts(counts: ProxyCounts, writer: MetricsWriter, _state: Any) -> None:
    writer.write(metric_names.PROXY_RECORDED, counts.recorded)
    writer.write_counts(metric_names.PROXY_DROPPED, counts.dropped, "reason")
    writer.write_counts(metric_names.PROXY_UNRECORDED, counts.unrecorded, "reason")
    writer.write(metric_names.PROXY_FEEDBACK, counts.feedback)
    trajectories = Counter(counts.trajectories)
    held = trajectories.pop("held", 0)
    writer.write_counts(metric_names.PROXY_TRAJECTORIES, trajectories, "outcome")
    writer.write(metric_names.PROXY_TRAJECTORIES_HELD, held)


# ------------------------------------------------------------------------- what is asked, stripped


_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class _Plan:
    """What the proxy adds to a request and so strips from its response.

    The upstream answers fields it was not asked for with null (vLLM's shape), so a stripped
    field is set to null, never removed; the rest of the body keeps its bytes."""

    kind: Kind
    body: dict[str, Any]
    add_logprobs: bool
    add_token_ids: bool

    @classmethod
    def of(cls, kind: Kind, body: dict[str, Any]) -> _Plan:
        asked = body.get("logprobs")
        # completions: an int (0 asks for the sampled token's logprob only); chat: true
        wants_logprobs = (asked is not None and asked is not False if kind == "completions"
                          else asked is True)
        wants_ids = body.get("return_token_ids") is True
        return cls(kind, body, not wants_logprobs, not wants_ids)

    @property
    def changes(self) -> bool:
        return self.add_logprobs or self.add_token_ids

    def upstream_body(self) -> dict[str, Any]:
        body = dict(self.body)
        if self.add_logprobs:
            body["logprobs"] = 0 if self.kind == "completions" else True
        if self.add_token_ids:
            body["return_token_ids"] = True
        return body

    def strip(self, raw: bytes) -> bytes:
        """``raw`` (a whole response or a stream chunk, JSON) as the client asked for it: the
        value of every key the plan added (``logprobs``, ``token_ids``,
        ``prompt_token_ids``) replaced by ``null``, every other byte as the upstream sent it.
        A key inside a JSON string is escaped, so only real keys match."""
        if self._added is None:
            return raw
        text = raw.decode("utf-8", errors="surrogateescape")
        out, done = [], 0
        for key in self._added.finditer(text):
            if key.start() < done:
                continue   # inside a value already replaced
            try:
                _, end = _DECODER.raw_decode(text, key.end())
            except ValueError:
                return raw   # not JSON after all: the client gets it as it came
            out += (text[done:key.end()], "null")
            done = end
        if not out:
            return raw
        out.append(text[done:])
        return "".join(out).encode("utf-8", errors="surrogateescape")

    @functools.cached_property
    def _added(self) -> re.Pattern[str] | None:
        names = (["logprobs"] if self.add_logprobs else []) + (
            ["token_ids", "prompt_token_ids"] if self.add_token_ids else [])
        return re.compile(rf'"(?:{"|".join(names)})"\s*:\s*') if names else None

    def unasked(self, chunk: dict[str, Any]) -> bool:
        """Whether the client would not have got the stream chunk ``chunk`` at all: vLLM sends
        a chat chunk whose delta is empty (a token that completes no text yet) only when
        logprobs or token ids were asked for, so when the plan asked for both, such a chunk
        (no finish reason either) is the proxy's doing. Its tokens are still recorded."""
        if self.kind != "chat" or not (self.add_logprobs and self.add_token_ids):
            return False
        choices = chunk.get("choices")
        return bool(choices) and all(
            isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None
            for c in choices)

    def recordable(self) -> str | None:
        """Why this request's choices cannot be recorded, or None."""
        if self.kind == "completions" and self.body.get("echo"):
            return "echo"   # its tokens and logprobs include the prompt's
        return None


# --------------------------------------------------------------------------- the proxy


class RecordingProxy:
    """The proxy's state and handlers; ``app()`` is its aiohttp application.

    The caller owns ``producer`` (build it with ``block_timeout=0``, so a full spool refuses
    at once) and closes it after the app's cleanup, which waits for the records in flight.
    ``metrics``: writes the counts while the app runs, and once more at its cleanup.
    ``journal``: where the held trajectories are written (``reef_stream.intake.journal``, in the
    producer's spool directory): the app's startup holds again what it holds, and its cleanup
    closes it. Without one, a proxy killed outright loses the trajectories it held.
    """

    def __init__(self, producer: AsyncRecordProducer, options: ProxyOptions,
                 metrics: ProxyMetrics | None = None,
                 journal: TrajectoryJournal | None = None):
        self.producer = producer
        self.options = options
        self.metrics = metrics
        self._metrics_task: asyncio.Task | None = None
        self.counts = ProxyCounts()
        self.upstream = options.upstream.rstrip("/")
        self.replica_id = options.replica_id or f"proxy@{_netloc(self.upstream)}"
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._groups: OrderedDict[str, str] = OrderedDict()
        self.trajectories = Trajectories(options.trajectory_idle_s)
        self.journal = journal
        self._sweeper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024,
                              middlewares=[self._unreachable_upstream])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/feedback", self._feedback)
        app.router.add_get("/reef/stats", self._stats)
        app.router.add_route("*", "/{tail:.*}", self._pass_through)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _unreachable_upstream(self, request: web.Request, handler) -> web.StreamResponse:
        """A 502 saying so when the upstream cannot be reached (nothing was sent to it)."""
        try:
            return await handler(request)
        except aiohttp.ClientConnectorError as error:
            self._unrecorded("upstream_unreachable")
            return web.json_response({"error": f"the upstream {self.upstream} cannot be "
                                               f"reached: {error}"}, status=502)

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.options.upstream_timeout_s),
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        if self.metrics is not None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._write_metrics())
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._restore()

    def _restore(self) -> None:
        """Hold again the trajectories the journal holds (a proxy before this one was killed
        with them), with the idle time they had; record at once those it says were given back
        to be recorded, and an older trajectory of a conversation that holds a newer one."""
        if self.journal is None:
            return
        now = time.time()
        for restored in self.journal.restored:
            if restored.ended:
                self._record([Given(restored.generation, restored.trajectory)])
                continue
            self._record(self.trajectories.restore(
                restored.conversation, restored.generation, restored.trajectory,
                idle_for=max(0.0, now - restored.held_at)))
        if self.journal.damaged:
            self.counts.trajectories["journal_damaged"] += len(self.journal.damaged)
        if self.journal.restored:
            log.info("%d held trajectories restored from %s", len(self.journal.restored),
                     self.journal.path)
        self._chained([])

    async def _stop(self, _: web.Application) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._record(self._chained(self.trajectories.close()))
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.journal is not None:
            self._journal(self.journal.close)
        if self._session is not None:
            await self._session.close()
        if self._metrics_task is not None and self.metrics is not None:
            self._metrics_task.cancel()
            await asyncio.to_thread(self.metrics.emit, self.counts, True)

    async def _sweep(self) -> None:
        """Record the trajectories that waited ``trajectory_idle_s`` for a next turn; fsync
        the journal's last entries."""
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.options.trajectory_idle_s)))
            self._record(self._chained(self.trajectories.expired()))
            if self.journal is not None:
                self._journal(self.journal.sync)

    async def _write_metrics(self) -> None:
        assert self.metrics is not None
        while True:
            self.metrics.emit(self.counts)
            await asyncio.sleep(min(1.0, self.metrics.every_s))

    # ----------------------------------------------------------------- pass-through

    async def _pass_through(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await self._forward_raw(request, body)

    async def _forward_raw(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Forward ``request`` with ``body`` as it is; stream the answer back as it comes."""
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body or None,
                                         headers=_forwarded(request.headers)) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=_forwarded(upstream.headers))
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.counts.as_dict())

    # ----------------------------------------------------------------- completions

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "completions")

    async def _forward(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):   # the upstream tells the client what is wrong
            self._unrecorded("bad_request")
            return await self._forward_raw(request, raw)
        plan = _Plan.of(kind, body)
        if (why := plan.recordable()) is not None:
            self._unrecorded(why)
            return await self._forward_raw(request, raw)
        context = _Context.of(request, plan, self.options.versions.read_file(),
                              hide_user="user" in self.options.redact)
        assert self._session is not None
        async with self._session.post(self.upstream + request.path_qs,
                                      data=json.dumps(plan.upstream_body()).encode(),
                                      headers=_forwarded(request.headers)) as upstream:
            if upstream.status == 200 and upstream.content_type == "text/event-stream":
                return await self._stream(request, upstream, plan, context)
            data = await upstream.read()
            headers = _forwarded(upstream.headers)
            if upstream.status != 200:
                self._unrecorded("upstream_error")
                return web.Response(status=upstream.status, reason=upstream.reason, body=data,
                                    headers=headers)
        try:
            response = json.loads(data)
        except ValueError:
            response = None
        if not isinstance(response, dict):
            self._unrecorded("malformed_response")
            return web.Response(status=200, body=data, headers=headers)
        served, generations = self._generations(response, plan, context)
        if plan.changes:
            data = plan.strip(data)
        if served:
            headers[GENERATION_IDS_HEADER] = ",".join(served)
        self._record(generations)
        return web.Response(status=200, body=data, headers=headers)

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse, plan: _Plan,
                      context: _Context) -> web.StreamResponse:
        """Relay an SSE stream as it arrives (the events of one read in one write; rewritten
        only when the plan strips), collecting the choices; record those that finished once
        the upstream's stream ended. A conversation's turn, which the journal may hold, is
        recorded before the client gets the stream's end (its ``[DONE]`` and whatever followed,
        held back until then, and the end of the body), so it is journalled, and its trajectory
        held or ended, before the client can send the next turn; any other stream ends for the
        client first (recording it took 0.4 ms at the end of each stream, measured)."""
        collected = _Collected(plan.kind)
        response: web.StreamResponse | None = None
        broken: BaseException | None = None
        end: list[bytes] = []   # from the [DONE] on, while it is held back
        holds_end = self.journal is not None and _may_chain(plan, context)
        try:
            async for events in _sse_events(upstream.content):
                out = [_relay(event, plan, collected) for event in events]
                if end:
                    out, end = [], end + out
                elif holds_end:
                    done = next((i for i, event in enumerate(events) if _is_done(event)), None)
                    if done is not None:
                        out, end = out[:done], out[done:]
                if response is None:
                    response = await self._start_stream(request, upstream, plan,
                                                        collected, context)
                if out:
                    await response.write(b"".join(out))
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as error:
            broken = error
        if response is None:
            response = await self._start_stream(request, upstream, plan, collected,
                                                context)
        if broken is not None:
            self._unrecorded("upstream_broke_stream")
            if end:
                await response.write(b"".join(end))
            # The client sees the stream end as abruptly as the upstream's did.
            raise ConnectionResetError(f"the upstream broke the stream: {broken}")
        if not holds_end:
            await response.write_eof()
        try:
            _, generations = self._generations(collected.response(), plan, context,
                                               streamed=collected)
            self._record(generations)
        except Exception:   # noqa: BLE001 - the client is served whatever recording does
            log.exception("a stream of %s was not recorded", self.upstream)
            self._unrecorded("recording_error")
        if holds_end:
            if end:
                await response.write(b"".join(end))
            await response.write_eof()
        return response

    async def _start_stream(self, request: web.Request, upstream: aiohttp.ClientResponse,
                            plan: _Plan, collected: _Collected,
                            context: _Context) -> web.StreamResponse:
        headers = _forwarded(upstream.headers)
        if collected.id is not None:
            choices = context.n * len(context.prompts or "_")
            headers[GENERATION_IDS_HEADER] = ",".join(f"{collected.id}:{i}"
                                                      for i in range(choices))
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=headers)
        await response.prepare(request)
        return response

    # ----------------------------------------------------------------- recording

    def _generations(self, response: dict[str, Any], plan: _Plan, context: _Context,
                     streamed: _Collected | None = None) -> tuple[list[str], list[Given]]:
        """The ids of a complete (or collected) response's choices, and the Generations to
        record now (a tool-calling turn of a conversation is held: ``_chain``); none when
        none can be made."""
        if streamed is not None:
            unfinished = streamed.unfinished()
            if unfinished:
                self._unrecorded("unfinished_choice", unfinished)
            if not response.get("choices"):
                return [], []
        version, source = context.version(self.options.versions, response.get("model"))
        if version is None and self.options.unknown_version == "skip":
            self._unrecorded("version_unknown", len(response.get("choices") or ()))
            return [], []
        envelope: dict[str, Any] = {
            "policy_version": version if version is not None else 0,
            "replica_id": self.replica_id, "sampling": _sampling(plan),
        }
        if self.options.model:
            envelope["model"] = self.options.model
        if context.group_id is not None:
            envelope["group_id"] = context.group_id
            envelope["group_size"] = context.group_size
        try:
            generations = parse_generations({"reef": envelope, "response": response})
        except InvalidRecord as error:
            log.warning("a response of %s was not recorded: %s", self.upstream, error)
            self._unrecorded("invalid")
            return [], []
        texts = streamed.texts() if streamed is not None else _texts(response)
        recorded = []
        calls_tools = any("tool_calls" in texts.get(int(g.generation_id.rsplit(":", 1)[1]), {})
                          for g in generations)
        for generation in generations:
            index = int(generation.generation_id.rsplit(":", 1)[1])
            metadata = dict(context.metadata)
            metadata["reef.version_source"] = source
            if version is None:
                metadata[POLICY_VERSION_KEY] = UNKNOWN_VERSION
            metadata.update(texts.get(index, {}))
            generation = context.batched(dataclasses.replace(generation, metadata=metadata))
            metadata = dict(generation.metadata)
            _cap_texts(metadata)
            for name in self.options.redact:
                for key in _REDACTED_KEYS[name]:
                    metadata.pop(key, None)
            generation = dataclasses.replace(generation, metadata=metadata)
            if self.options.redactor is not None:
                generation = self.options.redactor(generation)
                if generation is None:
                    self._unrecorded("redactor")
                    continue
            recorded.append(generation)
            if generation.group_id is not None:
                self._remember_group(generation.generation_id, generation.group_id)
        served = [g.generation_id for g in recorded]
        if _may_chain(plan, context) and len(generations) == 1:
            return served, self._chain(context, recorded, calls_tools)
        return served, [Given(g, None) for g in recorded]

    def _chain(self, context: _Context, recorded: list[Generation],
               calls_tools: bool) -> list[Given]:
        """A conversation's turn through ``trajectories``: what to record now."""
        generations: list[Given] = []
        try:
            if recorded:
                generations = self.trajectories.turn(
                    context.group_id or "", recorded[0], calls_tools=calls_tools,
                    environment_role=context.environment_role)
        except InvalidRecord as error:
            log.warning("a trajectory of conversation %s was not recorded: %s",
                        context.group_id, error)
            self._unrecorded("invalid")
            generations = []
        except Exception:   # noqa: BLE001 - the client is served whatever recording does
            log.exception("a turn of conversation %s was not recorded", context.group_id)
            self._unrecorded("trajectory_error")
            generations = []
        else:
            if recorded and self.journal is not None:
                self._journal(self._hold, context.group_id or "")
        return self._chained(generations)

    def _hold(self, conversation: str) -> None:
        """Write the trajectory ``conversation`` holds now, if any, to the journal."""
        assert self.journal is not None
        held = self.trajectories.held(conversation)
        if held is not None:
            self.journal.hold(conversation, held.trajectory, held.generation)

    def _journal(self, write: Callable[..., None], *args: Any) -> None:
        """``write(*args)`` on the journal; a failure is logged and counted, and serving and
        recording go on (the trajectory is then held in memory only)."""
        try:
            write(*args)
        except Exception:   # noqa: BLE001 - the client is served whatever the disk does
            self.counts.trajectories["journal_failed"] += 1
            log.exception("the trajectory journal %s could not be written",
                          self.journal.path if self.journal is not None else None)

    def _chained(self, generations: list[Given]) -> list[Given]:
        self.counts.trajectories.update(self.trajectories.counts)
        self.trajectories.counts.clear()
        self.counts.trajectories["held"] = len(self.trajectories)
        return generations

    def _record(self, generations: list[Given]) -> None:
        """Hand ``generations`` to the producer in a task of their own: never awaited here.
        A trajectory among them is first written to the journal as ended (``_send`` writes it
        done once handed over): a kill in between records it again, never loses it."""
        if not generations:
            return
        if self.journal is not None:
            for generation, trajectory in generations:
                if trajectory is not None:
                    self._journal(self.journal.end, trajectory, generation)
        task = asyncio.get_running_loop().create_task(self._send(generations))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, generations: list[Given]) -> None:
        """Each Generation to the producer; a trajectory handed over (or dropped for a full
        spool, or invalid: never to be recorded) is done in the journal."""
        for generation, trajectory in generations:
            try:
                await self.producer.send(generation)
                self.counts.recorded += 1
            except SpoolFull:
                self.counts.dropped["spool_full"] += 1
                if self.counts.dropped["spool_full"] in (1, 10, 100) \
                        or self.counts.dropped["spool_full"] % 1000 == 0:
                    log.warning("the spool is full: generation %s dropped (%d so far); serving "
                                "goes on", generation.generation_id,
                                self.counts.dropped["spool_full"])
            except InvalidRecord as error:
                log.warning("generation %s not recorded: %s", generation.generation_id, error)
                self._unrecorded("invalid")
            except ReefError as error:   # the producer is closed: the journal keeps it
                log.error("generation %s not recorded: %s", generation.generation_id, error)
                self._unrecorded("producer_closed")
                continue
            if trajectory is not None and self.journal is not None:
                self._journal(self.journal.done, trajectory)

    def _unrecorded(self, reason: str, count: int = 1) -> None:
        self.counts.unrecorded[reason] += count

    def _remember_group(self, generation_id: str, group_id: str) -> None:
        self._groups[generation_id] = group_id
        if len(self._groups) > GROUPS_REMEMBERED:
            self._groups.popitem(last=False)

    # ----------------------------------------------------------------- feedback

    async def _feedback(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")  # noqa: TRY004 - a 400
            ids = body.get("generation_ids", [body.get("generation_id")])
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
                raise ValueError("give generation_ids (a list of the ids of the header "
                                 f"{GENERATION_IDS_HEADER}) or generation_id")
            group = body.get("group_id") or request.headers.get(CONVERSATION_HEADER)
            events = [parse_feedback({
                "generation_id": gid, "reward": body.get("reward"),
                "source": body.get("source", self.options.feedback_source),
                "components": body.get("components", {}),
                "group_id": group or self._groups.get(gid)}) for gid in ids]
        except (ValueError, InvalidRecord) as error:
            return web.json_response({"error": str(error)}, status=400)
        results = []
        for event in events:
            try:
                handle = await self.producer.send(event)
                await self.producer.durable(handle, timeout=self.options.feedback_timeout_s)
            except SpoolFull:
                return web.json_response({"error": "the proxy's spool is full: retry later"},
                                         status=503, headers={"Retry-After": "5"})
            except ReefError as error:
                return web.json_response({"error": str(error)}, status=500)
            self.counts.feedback += 1
            results.append({"id": event.feedback_id, "status": handle.state.value})
        return web.json_response({"results": results})


def _cap_texts(metadata: dict[str, str]) -> None:
    """Cut each text of ``metadata`` to ``TEXT_MAX_CHARS``, saying so: a record is never lost
    to its text (token ids are what training needs)."""
    for key in ("prompt", "completion", "tool_calls"):
        text = metadata.get(key)
        if text is not None and len(text) > TEXT_MAX_CHARS:
            metadata[key] = text[:TEXT_MAX_CHARS]
            metadata[f"reef.truncated.{key}"] = str(len(text))


_REDACTED_KEYS = {"prompt": ("prompt",), "completion": ("completion", "tool_calls"),
                  "user": ("user",)}


@dataclass(frozen=True)
class _Context:
    """What a request contributes to its Generations beyond the response."""

    model: Any
    before: FileReading
    group_id: str | None
    group_size: int
    metadata: dict[str, str]
    #: The roles of a chat's messages after its last assistant message (``tool:<function>``
    #: for a tool's result), joined by ``+``: what a chained turn's ENVIRONMENT segment is.
    environment_role: str = ""
    #: A completions request's prompts when it sends several (a batch), as text each; choice
    #: ``i`` answers prompt ``i // n``.
    prompts: list[str] | None = None
    n: int = 1

    def batched(self, generation: Generation) -> Generation:
        """``generation`` of a choice of a batch: its own prompt's text, and, without a
        conversation, the group of its prompt's ``n`` choices (none when ``n`` is 1), not the
        response's (the formats' default for several choices)."""
        if self.prompts is None:
            return generation
        index = int(generation.generation_id.rsplit(":", 1)[1])
        metadata = {**generation.metadata, "prompt": self.prompts[index // self.n]} \
            if index // self.n < len(self.prompts) else generation.metadata
        if self.group_id is not None:
            return dataclasses.replace(generation, metadata=metadata)
        group = (f"{generation.request_id}:p{index // self.n}" if self.n > 1 else None)
        return dataclasses.replace(generation, metadata=metadata, group_id=group,
                                   group_size=self.n)

    @classmethod
    def of(cls, request: web.Request, plan: _Plan, before: FileReading, *,
           hide_user: bool) -> _Context:
        """``hide_user``: a group id taken from the OpenAI ``user`` is its digest."""
        body = plan.body
        metadata: dict[str, str] = {"proxy.endpoint": plan.kind}
        prompt = body.get("messages") if plan.kind == "chat" else body.get("prompt")
        prompts = _batch(prompt) if plan.kind == "completions" else None
        if prompt is not None and prompts is None:
            metadata["prompt"] = prompt if isinstance(prompt, str) else json.dumps(prompt)
        user = body.get("user") if isinstance(body.get("user"), str) else None
        if user:
            metadata["user"] = user
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        group = request.headers.get(CONVERSATION_HEADER) or meta.get("conversation_id")
        if (not isinstance(group, str) or not group) and user:
            group = (f"user:sha256:{hashlib.sha256(user.encode()).hexdigest()[:16]}"
                     if hide_user else f"user:{user}")
        elif not isinstance(group, str) or not group:
            group = None
        n = _int(body.get("n"), 1)
        size = _int(request.headers.get(GROUP_SIZE_HEADER), n)
        role = _environment_role(body.get("messages")) if plan.kind == "chat" else ""
        return cls(body.get("model"), before, group, max(size, 1), metadata, role,
                   prompts, max(n, 1))

    def version(self, versions: Versions, served_model: Any) -> tuple[int | None, str]:
        """(version, where it came from); None when the proxy cannot tell."""
        for model in (self.model, served_model):
            version = versions.from_model(model)
            if version is not None:
                return version, "model"
        after = versions.read_file()
        if self.before.version is not None and after == self.before:
            return after.version, "file"
        return None, UNKNOWN_VERSION


def _batch(prompt: Any) -> list[str] | None:
    """The prompts of a completions request that sends several (a list of texts, or of token
    id lists), each as text (a token id list as JSON); None for one prompt."""
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(
            isinstance(p, (str, list)) for p in prompt):
        return None
    return [p if isinstance(p, str) else json.dumps(p) for p in prompt]


def _environment_role(messages: Any) -> str:
    """The roles of the messages after the last assistant message, each once, in order, joined
    by ``+``; a tool's result is ``tool:<function>`` (the function of the call it answers)."""
    if not isinstance(messages, list):
        return ""
    messages = [m for m in messages if isinstance(m, dict)]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    functions = {}
    if last >= 0:
        for call in messages[last].get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                functions[call.get("id")] = call["function"].get("name")
    roles = []
    for message in messages[last + 1:]:
        role = str(message.get("role", ""))
        name = message.get("name") or functions.get(message.get("tool_call_id"))
        roles.append(f"tool:{name}" if role == "tool" and isinstance(name, str) else role)
    return "+".join(dict.fromkeys(roles))


def _sampling(plan: _Plan) -> dict[str, Any]:
    """The request's sampling parameters; ``max_tokens`` 0 when it set none (the server's)."""
    body = plan.body
    limit = body.get("max_completion_tokens") if plan.kind == "chat" else None
    limit = limit if limit is not None else body.get("max_tokens")
    if limit is None and plan.kind == "completions":
        limit = 16   # the OpenAI and vLLM default for completions
    sampling: dict[str, Any] = {"max_tokens": _int(limit, 0)}
    for name, default in (("temperature", 1.0), ("top_p", 1.0)):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            sampling[name] = float(value)
    for name in ("top_k", "seed"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            sampling[name] = value
    return sampling


def _texts(response: dict[str, Any]) -> dict[int, dict[str, str]]:
    """Per choice index, the metadata of what was served: its text and its tool calls."""
    texts: dict[int, dict[str, str]] = {}
    for choice in response.get("choices") or ():
        if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
            continue
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = choice.get("text", message.get("content"))
        entry = {"completion": text} if isinstance(text, str) else {}
        if message.get("tool_calls"):
            entry["tool_calls"] = json.dumps(message["tool_calls"])
        texts[choice["index"]] = entry
    return texts


def _int(value: Any, default: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _netloc(url: str) -> str:
    from urllib.parse import urlsplit
    return urlsplit(url).netloc or url


def _forwarded(headers: Any) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in _HOP_BY_HOP}


# --------------------------------------------------------------------------- server-sent events


_EVENT_END = re.compile(rb"\r?\n\r?\n")


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[list[bytes]]:
    """The events of an SSE body as they arrive, those of one read together, each with its
    terminating blank line; a last event without one (a truncated stream) as it came."""
    rest = b""
    async for data in content.iter_any():
        rest += data
        events, start = [], 0
        for end in _EVENT_END.finditer(rest):
            events.append(rest[start:end.end()])
            start = end.end()
        rest = rest[start:]
        if events:
            yield events
    if rest:
        yield [rest]


def _may_chain(plan: _Plan, context: _Context) -> bool:
    """Whether a response may be a conversation's turn: a chat request that names its
    conversation (``Trajectories`` chains it when it has one choice)."""
    return plan.kind == "chat" and context.group_id is not None


def _is_done(event: bytes) -> bool:
    """Whether ``event`` is the stream's ``data: [DONE]``."""
    body = event.strip()
    return body.startswith(b"data:") and body[5:].strip() == b"[DONE]"


def _relay(event: bytes, plan: _Plan, collected: _Collected) -> bytes:
    """``event`` as the client gets it (its JSON ``data:`` lines stripped by ``plan``); each
    data line is parsed once and added to ``collected``."""
    if not event.startswith(b"data:") or event.count(b"\n") > 2:
        lines = event.splitlines(keepends=True)   # several lines: each on its own
        if len(lines) > 1:
            return b"".join([_relay(line, plan, collected) if line.startswith(b"data:")
                             else line for line in lines])
        return event
    body = event.rstrip(b"\r\n")
    payload = body[5:].strip()
    if payload == b"[DONE]":
        return event
    try:
        value = json.loads(payload)
    except ValueError:
        value = None
    collected.add(value)
    if not plan.changes or not isinstance(value, dict):
        return event
    return b"" if plan.unasked(value) else plan.strip(event)


class _Collected:
    """The choices of a stream, collected chunk by chunk into one complete response."""

    def __init__(self, kind: Kind):
        self.kind = kind
        self.id: str | None = None
        self.model: Any = None
        self.created: Any = None
        self.prompt_token_ids: list[int] | None = None
        self.choices: dict[int, dict[str, Any]] = {}
        self.malformed = False

    def add(self, chunk: Any) -> None:
        """Add one parsed ``data:`` payload (None: it was not JSON)."""
        if not isinstance(chunk, dict) or "error" in chunk:
            self.malformed = True
            return
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("index"), int):
                self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        into = self.choices.setdefault(choice["index"], {
            "token_ids": [], "logprobs": [], "finish_reason": None, "text": [],
            "prompt_token_ids": None, "tool_calls": {}})
        if choice.get("prompt_token_ids"):
            into["prompt_token_ids"] = choice["prompt_token_ids"]
        into["token_ids"] += choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        if self.kind == "chat":
            into["logprobs"] += [entry.get("logprob") for entry in logprobs.get("content") or ()
                                 if isinstance(entry, dict)]
            delta = choice.get("delta") or {}
            text = delta.get("content")
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    _add_tool_call(into["tool_calls"], call)
        else:
            into["logprobs"] += logprobs.get("token_logprobs") or []
            text = choice.get("text")
        if isinstance(text, str):
            into["text"].append(text)
        if choice.get("finish_reason") is not None:
            into["finish_reason"] = choice["finish_reason"]

    def unfinished(self) -> int:
        """Choices seen without a finish reason (or all of them after a malformed chunk)."""
        if self.malformed:
            return max(len(self.choices), 1)
        return sum(1 for c in self.choices.values() if c["finish_reason"] is None)

    def response(self) -> dict[str, Any]:
        """The finished choices as one complete response (``formats``' OpenAI shape)."""
        finished = [] if self.malformed else [
            (index, c) for index, c in sorted(self.choices.items())
            if c["finish_reason"] is not None]
        choices = []
        for index, c in finished:
            logprobs = ({"content": [{"logprob": v} for v in c["logprobs"]]}
                        if self.kind == "chat" else {"token_logprobs": c["logprobs"]})
            choices.append({"index": index, "token_ids": c["token_ids"], "logprobs": logprobs,
                            "finish_reason": c["finish_reason"],
                            "prompt_token_ids": c["prompt_token_ids"]})
        response: dict[str, Any] = {
            "id": self.id, "model": self.model, "choices": choices,
            "object": "chat.completion" if self.kind == "chat" else "text_completion"}
        if isinstance(self.created, int):
            response["created"] = self.created
        if self.prompt_token_ids is not None:
            response["prompt_token_ids"] = self.prompt_token_ids
        return response

    def texts(self) -> dict[int, dict[str, str]]:
        """Per choice index, the text streamed and the tool calls its deltas assembled."""
        texts = {}
        for index, c in self.choices.items():
            texts[index] = {"completion": "".join(c["text"])}
            if c["tool_calls"]:
                texts[index]["tool_calls"] = json.dumps(
                    [c["tool_calls"][i] for i in sorted(c["tool_calls"])])
        return texts


def _add_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Add one streamed tool-call delta (OpenAI's shape: ``index``, then ``id``, ``type`` and
    the function's ``name`` once, its ``arguments`` in pieces) to ``calls`` by index."""
    call = calls.setdefault(_int(delta.get("index"), len(calls)),
                            {"id": None, "type": "function",
                             "function": {"name": None, "arguments": ""}})
    for name in ("id", "type"):
        if delta.get(name):
            call[name] = delta[name]
    function = delta.get("function") if isinstance(delta.get("function"), dict) else {}
    if function.get("name"):
        call["function"]["name"] = function["name"]
    if isinstance(function.get("arguments"), str):
        call["function"]["arguments"] += function["arguments"]
