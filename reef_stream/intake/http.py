"""The HTTP intake, for inference fleets not written in Python (``reef intake serve``).

- ``POST /v1/generations`` and ``POST /v1/feedback``: one JSON object or an array of them,
  each in a form of ``reef_stream.intake.formats``. The answer is sent only once every valid
  record is durable (acknowledged with ``acks=all``, or in this server's spool):
  ``{"results": [...]}``, one per record in body order. Invalid records are ``rejected``
  to the sender with the field at fault, never dead-lettered.
- ``GET /healthz``: 200 while the server runs, with ``broker_reachable`` (a metadata request
  answered within ``PROBE_TIMEOUT_S``) and the producer's counts; needs no token.

Statuses: 200 (valid records durable), 400 (not JSON, or every record rejected), 401
(``REEF_INTAKE_TOKEN`` set and not sent), 413 (body over ``max_request_bytes``, default
``DEFAULT_MAX_REQUEST_BYTES``), 500 (the broker refused a record for good), 503 (spool full
or not durable within ``durable_timeout``; ``Retry-After: RETRY_AFTER_S``). A request sent
again after a 500 or 503 may store records twice; readers drop duplicates. The table of
statuses and what to do: ``docs/intake.md`` ("The HTTP intake").
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from reef_stream.core.errors import InvalidRecord, ReefError
from reef_stream.core.events import Feedback, Generation
from reef_stream.intake.aio import AsyncRecordProducer
from reef_stream.intake.formats import Kind, parse_record
from reef_stream.intake.producer import DeliveryState, SendHandle
from reef_stream.intake.spool import SpoolFull
from reef_stream.topics.connect import new_admin
from reef_stream.topics.kafka import AdminClient

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "make_app"]

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: Seconds a client should wait before retrying after a 503.
RETRY_AFTER_S = 5
#: Seconds ``/healthz`` waits for the broker's answer.
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class _Item:
    """One element of a request body: its events, or why it was rejected."""

    index: int
    events: tuple[Generation | Feedback, ...] = ()
    error: InvalidRecord | None = None


def make_app(producer: AsyncRecordProducer, *, bootstrap: str, token: str | None = None,
             max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
             durable_timeout: float = 30.0) -> web.Application:
    """The intake's aiohttp application, sending through ``producer``.

    ``bootstrap`` is the cluster ``/healthz`` probes. ``token``: when given,
    POSTs need ``Authorization: Bearer <token>``. ``durable_timeout``: how
    long a request waits for its records to be durable before a 503; keep it
    above the producer's delivery timeout (15 s), after which an
    unacknowledged record is spooled. The caller owns ``producer`` and
    closes it.
    """
    app = web.Application(client_max_size=max_request_bytes)
    intake = _Intake(producer, token, max_request_bytes, durable_timeout)
    app.router.add_post("/v1/generations", partial(intake.handle, kind="generations"))
    app.router.add_post("/v1/feedback", partial(intake.handle, kind="feedback"))
    app.router.add_get("/healthz", partial(_healthz, producer=producer,
                                           admin=new_admin(bootstrap)))
    return app


class _Intake:
    """The POST handlers' state and steps: authorise, read, parse, send, wait, answer."""

    def __init__(self, producer: AsyncRecordProducer, token: str | None, max_request_bytes: int,
                 durable_timeout: float):
        self._producer = producer
        self._token = token.encode() if token else None
        self._max_request_bytes = max_request_bytes
        self._durable_timeout = durable_timeout

    async def handle(self, request: web.Request, kind: Kind) -> web.Response:
        if not self._authorised(request):
            return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer "
                               "<REEF_INTAKE_TOKEN>'", headers={"WWW-Authenticate": "Bearer"})
        body = await self._read(request)
        if isinstance(body, web.Response):
            return body
        try:
            items = await asyncio.to_thread(_parse_body, body, kind)
        except ValueError as error:
            return _error(400, str(error))
        return await self._send(items)

    def _authorised(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(),
                                                                  self._token)

    async def _read(self, request: web.Request) -> bytes | web.Response:
        """The body, or the 413 answer when it is over the limit."""
        if (request.content_length or 0) <= self._max_request_bytes:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
                pass
        return _error(413, f"the body is over {self._max_request_bytes} bytes: send smaller "
                           "batches")

    async def _send(self, items: list[_Item]) -> web.Response:
        """Send the valid records, wait until they are durable, answer with every result."""
        sent: list[tuple[int, Generation | Feedback, SendHandle]] = []
        results: list[dict[str, Any]] = []
        for item in items:
            if item.error is not None:
                results.append(_rejected(item.index, item.error))
                continue
            for event in item.events:
                try:
                    sent.append((item.index, event, await self._producer.send(event)))
                except InvalidRecord as error:  # over the topic's size limit
                    results.append(_rejected(item.index, error))
                except SpoolFull:
                    return _error(503, "the intake's spool is full (the broker has been "
                                       f"unreachable for a while): retry in {RETRY_AFTER_S} s",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        results += await asyncio.gather(*(self._outcome(index, event, handle)
                                          for index, event, handle in sent))
        results.sort(key=lambda result: result["index"])
        return _answer(results)

    async def _outcome(self, index: int, event: Generation | Feedback,
                       handle: SendHandle) -> dict[str, Any]:
        """The result of one sent record, once durable or after the timeout."""
        result: dict[str, Any] = {"index": index, "id": _event_id(event)}
        try:
            await self._producer.durable(handle, timeout=self._durable_timeout)
        except ReefError as error:  # the record FAILED: its error goes to the sender
            return {**result, "status": "failed", "error": str(error)}
        result["status"] = handle.state.value
        if handle.state is DeliveryState.ACKNOWLEDGED:
            result.update(partition=handle.partition, offset=handle.offset)
        return result


def _parse_body(body: bytes, kind: Kind) -> list[_Item]:
    """The items of a request body; ValueError with a message for a body that is not one."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"the body is not JSON: {error}") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise ValueError("the body must be a JSON object (one record) or a JSON array (a batch)")
    if not value:
        raise ValueError("the body is an empty array: send at least one record")
    return [_parse_item(index, element, kind) for index, element in enumerate(value)]


def _parse_item(index: int, value: Any, kind: Kind) -> _Item:
    try:
        return _Item(index, events=tuple(parse_record(kind, value)))
    except InvalidRecord as error:
        return _Item(index, error=error)


def _answer(results: list[dict[str, Any]]) -> web.Response:
    """The response to a POST whose records were all handled, by the worst outcome."""
    statuses = [result["status"] for result in results]
    failed = statuses.count(DeliveryState.FAILED.value)
    pending = statuses.count(DeliveryState.PENDING.value)
    if failed:
        return _error(500, f"the broker refused {failed} record(s) for good (see results): "
                           "fix the cluster and send them again", results=results)
    if pending:
        return _error(503, f"{pending} record(s) were not durable in time (the broker is slow "
                           f"or unreachable): send the request again in {RETRY_AFTER_S} s",
                      results=results, headers={"Retry-After": str(RETRY_AFTER_S)})
    if all(status == "rejected" for status in statuses):
        return _error(400, "every record was rejected (see results): fix them", results=results)
    return web.json_response({"results": results})


def _rejected(index: int, error: InvalidRecord) -> dict[str, Any]:
    return {"index": index, "status": "rejected", "error": str(error), "field": error.field}


def _event_id(event: Generation | Feedback) -> str:
    return event.generation_id if isinstance(event, Generation) else event.feedback_id


def _error(status: int, message: str, *, results: list[dict[str, Any]] | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if results is not None:
        body["results"] = results
    return web.json_response(body, status=status, headers=headers)


async def _healthz(request: web.Request, *, producer: AsyncRecordProducer,
                   admin: AdminClient) -> web.Response:
    report = producer.sync.report()
    return web.json_response({
        "status": "ok",
        "broker_reachable": await asyncio.to_thread(_broker_answers, admin),
        "pending": report.pending,
        "spooled": report.spooled,
        "acknowledged": report.acknowledged,
        "failed": report.failed,
    })


def _broker_answers(admin: AdminClient) -> bool:
    try:
        admin.list_topics(timeout=PROBE_TIMEOUT_S)
        return True
    except Exception:  # noqa: BLE001 - any failure means: not reachable now
        return False
