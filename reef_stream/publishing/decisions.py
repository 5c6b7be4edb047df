"""A person's decisions, as events: approve or reject a staged version, roll a model back.

    reef approve MODEL VERSION [--reason ...]
    reef reject MODEL VERSION --reason ...
    reef rollback MODEL [--to VERSION] [--reason ...]

Each reads ``<ns>.publications`` to its end (``PublicationLedger``), builds one Publication
(``approval``, ``rejection``, ``rollback``: pure, a ``ConfigurationError`` saying what is wrong
when the decision does not apply), produces it acknowledged (``record``) and updates the Redis
projection when there is one. The person is ``decided_by``, the time ``created_at``, the why
``reason``.

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

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Decision, Publication, now_ms
from reef_stream.core.serde import SchemaRegistry
from reef_stream.engine.checkpoints import CheckpointError, verify
from reef_stream.publishing.publications import PublicationLedger, publication_key
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_producer
from reef_stream.topics.delivery import DELIVERY_TIMEOUT_S, deliver

__all__ = ["approval", "record", "rejection", "rollback"]

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


def record(bootstrap: str, namespace: str, publication: Publication, *,
           ledger: PublicationLedger | None = None, fleet: object | None = None) -> None:
    """Produce ``publication`` to ``<ns>.publications`` and wait for the broker's
    acknowledgement (``FatalError`` otherwise); then update the Redis projection (best
    effort: ``reef fleet --rebuild`` restores it)."""
    producer = new_producer(bootstrap, {
        "acks": "all", "enable.idempotence": True, "linger.ms": 0,
        "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000) - 5000})
    value, headers = SchemaRegistry.default().encode(publication)
    deliver(producer, declarations.publications(namespace), publication_key(publication), value,
            headers, f"the {publication.decision.value} decision on {publication.model} "
                     f"version {publication.policy_version}")
    incumbent = None
    if ledger is not None:
        ledger.record(publication)
        incumbent = ledger.incumbent(publication.model)
    if fleet is not None:
        try:
            fleet.record_publication(publication, incumbent)
        except Exception as error:  # noqa: BLE001 - Redis is a projection
            log.warning("could not update the fleet projection in Redis (%s); `reef fleet "
                        "--rebuild` restores it", error)
