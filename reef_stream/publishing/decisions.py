"""A person's decisions, as requests the recipe's fenced evaluator applies: approve or reject a
staged version, roll a model back.

    reef approve MODEL VERSION [--reason ...]
    reef reject MODEL VERSION --reason ...
    reef rollback MODEL [--to VERSION] [--reason ...]

A decision is built by one of the pure functions here (``approval``, ``rejection``,
``rollback``: a ``ConfigurationError`` saying what is wrong when it does not apply) against a
``PublicationLedger`` read to its end, twice: by the command, against its own read, so that a
mistake is refused at once; then as a ``DecisionRequest`` (``request_for``) on
``<ns>.decision-requests``, by the recipe's active evaluator against its own ledger at the
moment it applies it (``applied``), in its transaction under the recipe's transactional id
(``reef_stream.consumers.evaluator.requests``). So every decision in ``<ns>.publications`` is
written by one fenced writer, in order: a request built on a read the log has moved past since
(the evaluator's canary decided the version meanwhile, another person decided it) is refused
with the reason, never published as a second decision. ``ask`` sends a request and waits for
its ``DecisionOutcome`` (applied, with the decision's line, or refused, with why); none comes
while no evaluator runs, and the request stays queued until one does. The person is
``decided_by``, the time ``created_at``, the why ``reason``.

- approve: the version waiting for a decision (CANARY, awaiting the canary or a person) is
  PROMOTED: every replica serves it.
- reject: the version waiting is REJECTED; the replicas that took it go back to the incumbent.
- rollback: with a version waiting, the canary is ROLLED_BACK (its replicas go back to the
  incumbent). Otherwise the incumbent X is ROLLED_BACK to an earlier promoted version V
  (``--to``; default the newest one before X still in the log), whose published copy must
  still verify (``--keep-published`` retains the last copies): every replica serves V again,
  and the ledger's incumbent is V. Versions stay monotonic for the trainer: a trainer more
  than ``max_staleness`` past V has stalled and rolls back to V's weights as its next version
  (``reef_stream.publishing.rollback``), which the evaluator promotes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import (
    Decision, DecisionKind, DecisionOutcome, DecisionRequest, Publication, now_ms,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.checkpoints import CheckpointError, verify
from reef_stream.publishing.publications import PublicationLedger
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer, new_producer, watermarks
from reef_stream.topics.delivery import DELIVERY_TIMEOUT_S, deliver
from reef_stream.topics.kafka import TopicPartition

__all__ = ["applied", "approval", "ask", "decision_line", "rejection", "request_for",
           "rollback"]

log = logging.getLogger(__name__)


def _waiting(ledger: PublicationLedger, model: str, version: int) -> Publication:
    waiting = ledger.waiting(model)
    if waiting is None or waiting.policy_version != version:
        now = "nothing" if waiting is None else f"version {waiting.policy_version}"
        incumbent = ledger.incumbent(model)
        served = "" if incumbent is None else f"; it serves version {incumbent.policy_version}"
        raise ConfigurationError(f"version {version} of model {model!r} is not waiting for a "
                                 f"decision ({now} is{served})")
    return waiting


def approval(ledger: PublicationLedger, model: str, version: int, *, by: str,
             reason: str | None = None) -> Publication:
    """The PROMOTED publication of the staged ``version`` approved by ``by``."""
    waiting = _waiting(ledger, model, version)
    return dataclasses.replace(
        waiting, decision=Decision.PROMOTED, share=None, awaiting=None, decided_by=by,
        created_at=now_ms(), reason=f"approved by {by}" + (f": {reason}" if reason else ""))


def rejection(ledger: PublicationLedger, model: str, version: int, *, by: str,
              reason: str) -> Publication:
    """The REJECTED publication of the staged ``version`` rejected by ``by``, because
    ``reason``; keeps its ``share`` (it ends a canary)."""
    if not reason.strip():
        raise ConfigurationError("a rejection must say why (--reason)")
    waiting = _waiting(ledger, model, version)
    incumbent = ledger.incumbent(model)
    return dataclasses.replace(
        waiting, decision=Decision.REJECTED, awaiting=None, decided_by=by, created_at=now_ms(),
        share=waiting.share or 0.0, reason=f"rejected by {by}: {reason}",
        incumbent_version=None if incumbent is None else incumbent.policy_version)


def rollback(ledger: PublicationLedger, model: str, *, by: str, to: int | None = None,
             reason: str | None = None) -> Publication:
    """The ROLLED_BACK publication (see the module docstring). Verifies the target's published
    copy (blocks for the read); ``ConfigurationError`` when there is nothing to roll back, no
    such earlier promoted version in the log, or its copy no longer verifies."""
    why = f"rolled back by {by}" + (f": {reason}" if reason else "")
    incumbent, waiting = ledger.incumbent(model), ledger.waiting(model)
    if incumbent is None:
        raise ConfigurationError(f"model {model!r} has no promoted version: nothing to roll back")
    if waiting is not None and to in (None, incumbent.policy_version):
        return _to(waiting, incumbent, share=waiting.share or 0.0, by=by, reason=why)
    if waiting is not None:
        raise ConfigurationError(
            f"version {waiting.policy_version} of {model!r} is staged: decide it first (reef "
            f"reject, or reef rollback {model} without --to to roll the canary back)")
    current = incumbent.policy_version
    earlier = [v for v in ledger.promoted_versions(model) if v < current]
    if to is None:
        if not earlier:
            raise ConfigurationError(f"no promoted version of {model!r} before version "
                                     f"{current} is left in the log: give --to VERSION")
        to = earlier[-1]
    if to >= current:
        raise ConfigurationError(f"version {to} is not earlier than version {current}, which "
                                 f"{model!r} serves: a rollback goes back")
    target = ledger.promotion(model, to)
    if target is None:
        raise ConfigurationError(f"version {to} of {model!r} has no PROMOTED publication in the "
                                 f"log (promoted ones left: {earlier or 'none'})")
    try:
        verify(target.uri, target.sha256)
    except CheckpointError as error:
        raise ConfigurationError(f"the published copy of version {to} no longer verifies "
                                 f"({error}): it cannot be served again") from error
    return _to(incumbent, target, share=None, by=by, reason=why)


def _to(withdrawn: Publication, target: Publication, *, share: float | None, by: str,
        reason: str) -> Publication:
    return dataclasses.replace(
        withdrawn, decision=Decision.ROLLED_BACK, awaiting=None, share=share, decided_by=by,
        created_at=now_ms(), reason=reason, rolled_back_to=target.policy_version,
        incumbent_version=target.policy_version, uri=target.uri, sha256=target.sha256,
        artifact_uri=target.artifact_uri, artifact_sha256=target.artifact_sha256,
        artifact_kind=target.artifact_kind)


def decision_line(publication: Publication) -> str:
    """The decision in one line, as ``reef approve`` / ``reject`` / ``rollback`` print it."""
    target = "" if publication.rolled_back_to is None else \
        f"; replicas serve version {publication.rolled_back_to} again"
    return (f"{publication.decision.value} {publication.model} version "
            f"{publication.policy_version} by {publication.decided_by}: "
            f"{publication.reason}{target}")


def request_for(kind: DecisionKind, publication: Publication, *, reason: str | None,
                request_id: str | None = None) -> DecisionRequest:
    """The request of ``publication``, the decision a person's command built against its own
    read of the ledger: the version it decides on (and for a rollback, the version served
    again), so the evaluator refuses it when its ledger no longer agrees. ``reason``: the
    person's own words (the publication's reason says more)."""
    return DecisionRequest(
        request_id=request_id or uuid.uuid4().hex, kind=kind, model=publication.model,
        version=publication.policy_version, rolled_back_to=publication.rolled_back_to,
        decided_by=publication.decided_by or "", reason=reason, created_at=now_ms())


def applied(ledger: PublicationLedger, request: DecisionRequest, *,
            recipe: str) -> Publication:
    """The publication ``request`` makes against ``ledger`` now (the evaluator's, read to its
    end), written by the evaluator of ``recipe`` (its ``recipe``); ``ConfigurationError``
    saying why when it no longer applies (as ``approval``, ``rejection`` and ``rollback`` do;
    and a rollback that would now take another version out of service than the one the
    person saw). Pure but for a rollback's verification of the target's published copy
    (blocks for the read)."""
    model, by = request.model, request.decided_by
    if request.kind is DecisionKind.APPROVE:
        publication = approval(ledger, model, request.version, by=by, reason=request.reason)
    elif request.kind is DecisionKind.REJECT:
        publication = rejection(ledger, model, request.version, by=by,
                                reason=request.reason or "")
    else:
        publication = rollback(ledger, model, by=by, to=request.rolled_back_to,
                               reason=request.reason)
        if publication.policy_version != request.version:
            raise ConfigurationError(
                f"a rollback of {model!r} now takes version {publication.policy_version} out "
                f"of service, not version {request.version} as asked: the log moved on since")
    return dataclasses.replace(publication, recipe=recipe)


def ask(bootstrap: str, namespace: str, request: DecisionRequest,
        wait_s: float) -> DecisionOutcome | None:
    """Produce ``request`` to ``<ns>.decision-requests`` (acknowledged, ``FatalError``
    otherwise), then wait up to ``wait_s`` seconds for its outcome on
    ``<ns>.decision-outcomes`` (read_committed, from the end as of before the request was
    sent). Returns the outcome, or None when no evaluator decided in time (the request stays
    queued). Blocks. ``ConfigurationError`` when a topic does not exist."""
    registry = SchemaRegistry.default()
    topic = declarations.decision_outcomes(namespace)
    consumer = new_consumer(bootstrap, f"reef-decide-{uuid.uuid4().hex}",
                            {"enable.partition.eof": False})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
        # Any outcome of this request is written after it is sent, so after these ends.
        consumer.assign([TopicPartition(topic, p, watermarks(consumer, topic, p)[1])
                         for p in sorted(metadata.partitions)])
        producer = new_producer(bootstrap, {
            "acks": "all", "enable.idempotence": True, "linger.ms": 0,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000) - 5000})
        value, headers = registry.encode(request)
        deliver(producer, declarations.decision_requests(namespace), request.model.encode(),
                value, headers, f"the request to {request.kind.value.lower()} "
                                f"{request.model} version {request.version}")
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            for message in consumer.consume(100, timeout=min(left, 0.5)):
                if message.error() is not None or message.value() is None:
                    continue
                try:
                    outcome = registry.decode(message.value(), message.headers(),
                                              DecisionOutcome)
                except InvalidRecord as error:
                    log.warning("skipping an outcome that does not decode: %s", error)
                    continue
                if outcome.request_id == request.request_id:
                    return outcome
        return None
    finally:
        consumer.close()
