"""A person's decisions in the evaluator: the requests it applies in its own transactions.

``reef approve`` / ``reject`` / ``rollback`` do not publish: they put a ``DecisionRequest`` on
``<ns>.decision-requests`` (``reef_stream.publishing.decisions.ask``). The recipe's active
evaluator, the one that holds the recipe's fence, reads them in order (``DecisionRequests``,
from the recipe's committed position on that topic, ``requests_group``: whatever the
evaluator's own consumer group, as the fence is the recipe's) and, for a request on a model
it decides (``owns``: the model's latest publication names its recipe), builds the decision
against its own ledger at that moment (``outcome_of``, with
``reef_stream.publishing.decisions.applied``, which names the recipe in it). One transaction
then holds the publication (if the decision applies), the ``DecisionOutcome`` (applied, or
refused with the reason) and the request's offset (``EvaluatorWorker._apply_requests``). So a
request built on a read the log has moved past since is refused, never published as a second
decision; a zombie evaluator fails at its first write (``EvaluatorFenced``) and nothing it
wrote counts; a refused request never stops the evaluator, and one that does not decode is a
dead letter in the same transaction as its offset. A request on a model another recipe's
evaluator decides is passed over (only its offset is committed, for this recipe), even when
the two recipes' evaluators share a name.
"""

from __future__ import annotations

import logging

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import DecisionOutcome, DecisionRequest, Publication, now_ms
from reef_stream.publishing.decisions import applied, decision_line
from reef_stream.publishing.publications import PublicationLedger, written_by
from reef_stream.topics import declarations
from reef_stream.topics.connect import ask_broker, new_consumer
from reef_stream.topics.kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

__all__ = ["DecisionRequests", "outcome_of", "owns", "requests_group"]

log = logging.getLogger(__name__)

#: The most requests one ``take`` hands over.
BATCH = 100


def requests_group(namespace: str, recipe: str) -> str:
    """The group whose committed offsets on ``<ns>.decision-requests`` say how far the
    evaluators of ``recipe`` have answered; only the holder of the recipe's fence commits
    them (in its transactions), and nothing ever joins it."""
    return f"{namespace}.decide.{recipe}"


def owns(ledger: PublicationLedger, model: str, *, recipe: str, evaluator: str,
         only: str | None) -> bool:
    """Whether the evaluator of ``recipe`` (named ``evaluator``; deciding only model ``only``,
    when given) decides ``model``: it is ``only``, or else the model's version waiting for a
    decision, or its incumbent, was written by that recipe's evaluator (``written_by``: by
    the publication's recipe; by the evaluator's name for one written before publications
    named their recipe). So of two recipes whose evaluators share a name, only the one that
    published the model answers its requests. Pure."""
    if only is not None:
        return model == only
    latest = ledger.waiting(model) or ledger.incumbent(model)
    return latest is not None and written_by(latest, recipe, evaluator)


def outcome_of(ledger: PublicationLedger, request: DecisionRequest, group: str, *,
               recipe: str) -> tuple[Publication | None, DecisionOutcome]:
    """The publication ``request`` makes against ``ledger`` now when the evaluator of
    ``recipe`` applies it (None when it no longer applies) and its outcome: applied with the
    decision's line, or refused with the ``ConfigurationError``'s text. Blocks only for a
    rollback's verification of its target."""
    try:
        publication = applied(ledger, request, recipe=recipe)
    except ConfigurationError as error:
        return None, DecisionOutcome(
            request_id=request.request_id, model=request.model, applied=False,
            text=str(error), evaluator_group=group, created_at=now_ms())
    return publication, DecisionOutcome(
        request_id=request.request_id, model=request.model, applied=True,
        text=decision_line(publication), policy_version=publication.policy_version,
        evaluator_group=group, created_at=now_ms())


class DecisionRequests:
    """Reads ``<ns>.decision-requests`` for the evaluators of ``recipe``: ``start`` when one
    took the fence (assigns the topic from ``requests_group``'s committed positions, or its
    beginning), ``take`` the requests that arrived (never blocks), ``stop`` when it gave the
    fence up, ``close`` at the end. ``consumer`` never joins the group (``assign`` only) and
    commits nothing: the evaluator commits each request's offset with its group metadata in
    the transaction that answers it. One thread."""

    def __init__(self, bootstrap: str, namespace: str, recipe: str) -> None:
        self.topic = declarations.decision_requests(namespace)
        self._group = requests_group(namespace, recipe)
        self.consumer: Consumer = new_consumer(
            bootstrap, self._group, {"enable.partition.eof": False,
                               "enable.auto.offset.store": False})
        self.started = False

    def start(self) -> None:
        """Read on from where the group's last transaction left off. Blocks (up to 60 s);
        ``ConfigurationError`` when the topic does not exist."""
        metadata = self.consumer.list_topics(self.topic, timeout=30).topics.get(self.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise ConfigurationError(f"topic {self.topic} does not exist: run `reef topics "
                                     "create`")
        wanted = [TopicPartition(self.topic, p) for p in sorted(metadata.partitions)]
        committed = ask_broker(f"reading the group {self._group}'s position on {self.topic}",
                               lambda: self.consumer.committed(wanted, timeout=10))
        self.consumer.assign([
            TopicPartition(tp.topic, tp.partition,
                           tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
            for tp in committed])
        self.started = True
        log.info("reads a person's decision requests on %s from %s (group %s)", self.topic,
                 {tp.partition: tp.offset for tp in committed}, self._group)

    def take(self) -> list[Message]:
        """The requests fetched since the last call, in log order (up to ``BATCH``); []
        when not started."""
        if not self.started:
            return []
        found = []
        for message in self.consumer.consume(BATCH, timeout=0):
            error = message.error()
            if error is not None:
                log.warning("reading %s: %s", self.topic, error.str())
                continue
            found.append(message)
        return found

    def stop(self) -> None:
        """Read nothing more until ``start``."""
        if self.started:
            self.consumer.unassign()
            self.started = False

    def close(self) -> None:
        self.consumer.close()
