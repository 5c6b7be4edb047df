"""Candidate evaluation: every checkpoint of a recipe gets exactly one decision, as a Publication.

    worker = EvaluatorWorker(recipe, bootstrap=..., namespace="reef", options=EvaluateOptions())
    summary = worker.run()        # blocks until stop(), --max-candidates, --idle-exit or a signal
    print(summary.line())

One worker is one member of a consumer group (default ``<ns>.evaluate.<recipe name>``) on
``<ns>.checkpoints``, on the stage loop (strategy ``_Decisions``). Each waiting Checkpoint
event, in log order: another recipe's is skipped and an undecodable one dead-lettered; one
the ``PublicationLedger`` has decided already gets no second decision (``duplicates``); with
``supersede``, an older candidate while a newer one waits is REJECTED unmeasured; the files
are verified against the sha256 (nothing unverified is promoted); ``measure`` (``1 +
retries`` tries) and ``select`` against the incumbent decide, a failure being a REJECTED with
the reason; a PROMOTED candidate is copied and verified into the ``PublicationStore`` (with a
serving artifact for a Hugging Face model). A rollback checkpoint is promoted unmeasured when
its weights are the incumbent's (``reef_stream.publishing.rollback.check_rollback``).

Durability order (``_write``, the one place it is written down): one Kafka transaction holds
the Publication and the checkpoint's offset for the group (``send_offsets_to_transaction``)
-> the ledger, counters, Redis projection and pruned copies follow its commit
(``_after_commit``). A store or copy failure is a ``FatalError``. Undecodable publications are
dead-lettered, keyed by ``coordinates_key``.

Fencing. Every transaction is under ``evaluator_transactional_id(ns, recipe)``: the member
the group assigns the checkpoints initialises it (``_fence``, at each assignment), which
fences every other evaluator of the recipe and aborts its open transaction, and gives it up
when they are revoked (``_unfence``); a standby fences nothing and decides nothing, canaries
included. A paused or partitioned zombie that wakes up and writes before it learns it lost
them fails at that write (``EvaluatorFenced``, one line, the process exits); nothing it wrote
counts for a read_committed reader, and it writes nothing to Redis (that follows a commit).

A person's decisions (``reef approve`` / ``reject`` / ``rollback``) are requests the member
that holds the fence applies while it polls, each in a transaction of its own with its outcome
and the request's offset (``_apply_requests``, ``reef_stream.consumers.evaluator.requests``):
every decision in ``<ns>.publications`` is this fenced writer's, in order.
``run`` is called from one thread, which runs ``measure`` and ``select``; ``stop`` from any
thread. The long form: ``docs/stages.md`` ("The evaluator").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.api.recipe import Recipe
from reef_stream.consumers.evaluator.canary import (
    CanaryRunner, Release, cadence_reason, prune_copies, stage, waiting_reason,
)
from reef_stream.consumers.evaluator.requests import DecisionRequests, outcome_of, owns
from reef_stream.consumers.evaluator.superseding import superseded_reason, superseding
from reef_stream.consumers.stage import (
    SPARSE_FETCH, CommitsItself, DeadLetters, FetchEnd, Group, Positions, Rebalancing, StageLoop,
    StageOptions, kafka_consumers,
)
from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import Checkpoint, Decision, DecisionRequest, Publication, now_ms
from reef_stream.core.metric_names import (
    EVALUATOR_CANDIDATE_VERSION, EVALUATOR_CANDIDATES_SKIPPED, EVALUATOR_CANDIDATES_SUPERSEDED,
    EVALUATOR_DECISIONS, EVALUATOR_MEASURE_SECONDS, EVALUATOR_MEASUREMENT, STAGE_EVALUATOR,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings, load_settings
from reef_stream.engine.checkpoints import (
    CheckpointError, load_weights, store_unreachable, verify,
)
from reef_stream.publishing.publications import (
    PublicationLedger, PublicationStore, default_publication_url, publication_key,
)
from reef_stream.publishing.rollback import check_rollback
from reef_stream.topics import declarations
from reef_stream.topics.connect import bootstrap_servers, new_producer
from reef_stream.topics.dead_letters import dead_letter
from reef_stream.topics.delivery import DELIVERY_TIMEOUT_S, deliver
from reef_stream.topics.fencing import FENCED_CODES, CommitWatchdog, TransactionalIdentity
from reef_stream.topics.kafka import Consumer, KafkaException, Message, Producer, TopicPartition
from reef_stream.topics.metrics import MetricsWriter

if TYPE_CHECKING:
    from reef_stream.engine.artifacts import ServingArtifact
    from reef_stream.publishing.fleet import Fleet

__all__ = ["EvaluateOptions", "EvaluateSummary", "EvaluatorFenced", "EvaluatorWorker",
           "PublicationLedger", "PublicationStore", "coordinates_key", "default_group",
           "default_publication_url", "evaluator_transactional_id", "publication_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")

STAGE = STAGE_EVALUATOR
#: The longest wait between two tries of ``measure``.
MAX_BACKOFF_S = 60.0
#: The first wait before reading a checkpoint again whose store could not be reached; each
#: next wait doubles, up to ``MAX_BACKOFF_S``.
STORE_BACKOFF_S = 1.0
#: With ``idle_exit``: how much longer a worker waits that the group has not assigned yet.
JOIN_GRACE_S = 30.0
#: With ``supersede``: the most checkpoint events that wait before they are decided, even when
#: the consumer holds more (a bound on what one newest candidate can supersede at once).
MAX_WAITING = 1000
#: The decision transaction's timeout: the broker aborts one left open this long (an evaluator
#: that died inside it), and a newer evaluator's ``init_transactions`` aborts it at once.
TRANSACTION_TIMEOUT_MS = 60_000


class EvaluatorFenced(FatalError):
    """A newer evaluator of this recipe took over (same transactional id): this process must
    not publish anything more. Fatal: the process exits."""


def evaluator_transactional_id(namespace: str, recipe: str) -> str:
    """The transactional id every evaluator of ``recipe`` decides under, whatever its group:
    stable across restarts and hosts, so the newest active one fences every older one (one
    active evaluator per recipe)."""
    return f"reef-evaluate.{namespace}.{recipe}"


def default_group(recipe: Recipe, namespace: str) -> str:
    """The consumer group of a recipe's evaluator unless one is given (under the namespace)."""
    return f"{namespace}.evaluate.{recipe.name}"


def coordinates_key(topic: str, partition: int, offset: int) -> bytes:
    """``<topic>/<partition>/<offset>``: the key of the dead letter of a publication that does
    not decode; the same at every reading of that record (topic names hold no ``/``)."""
    return f"{topic}/{partition}/{offset}".encode()


# --------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class EvaluateOptions:
    """How an evaluator runs; validated by ``problems()``.

    ``model``: decide only on checkpoints of this model. ``publish_to``: the
    ``PublicationStore`` URL [default: ``$REEF_HOME/published/<ns>``]. ``keep_published``:
    copies kept per model (0: all). ``retries``: tries of ``measure`` after a failed one.
    ``max_candidates``: stop after deciding this many. ``idle_exit``: stop after this many
    seconds without a new checkpoint event (counted from the group's assignment; a member
    still joining waits up to ``JOIN_GRACE_S`` longer). ``supersede``: of the candidates of a
    model waiting at once, measure only the newest and reject the older ones unmeasured (with
    an evaluator that ``evaluates``; see the module docstring); False measures every candidate.
    ``serving_dtype``: the dtype of a Hugging Face model's serving artifact (None: the
    model's own).
    """

    group: str | None = None
    model: str | None = None
    publish_to: str | None = None
    keep_published: int = 3
    retries: int = 1
    backoff: float = 1.0
    max_candidates: int | None = None
    idle_exit: float | None = None
    supersede: bool = True
    serving_dtype: str | None = None
    #: Release overrides (None: the recipe's evaluator says; ``reef_stream.consumers.evaluator.canary``).
    publish_every_s: float | None = None
    canary_share: float | None = None
    require_approval: bool | None = None

    def problems(self) -> list[str]:
        found = []
        if self.keep_published < 0:
            found.append(f"keep published must be 0 (all) or more, not {self.keep_published}")
        if self.retries < 0:
            found.append(f"retries must be 0 or more, not {self.retries}")
        if self.backoff < 0:
            found.append(f"backoff must be 0 or more seconds, not {self.backoff}")
        if self.max_candidates is not None and self.max_candidates < 1:
            found.append(f"max candidates must be at least 1, not {self.max_candidates}")
        if self.idle_exit is not None and not self.idle_exit > 0:
            found.append(f"idle exit must be more than 0 seconds, not {self.idle_exit}")
        if self.model is not None and not self.model.strip():
            found.append("model must not be empty")
        if self.publish_every_s is not None and not self.publish_every_s > 0:
            found.append(f"publish every must be more than 0 s, not {self.publish_every_s}")
        if self.canary_share is not None and not 0 <= self.canary_share <= 1:
            found.append(f"canary share must be in [0, 1], not {self.canary_share}")
        if self.serving_dtype not in (None, "float32", "bfloat16", "float16"):
            found.append(f"serving dtype must be float32, bfloat16 or float16, not "
                         f"{self.serving_dtype!r}")
        return found


@dataclass
class EvaluateSummary:
    """The worker's counters. ``checkpoints``: events read; ``promoted`` / ``rejected`` /
    ``canaries`` / ``rolled_back``: decisions published; ``superseded``: of the rejected, those decided unmeasured because a
    newer candidate of their model was waiting (``supersede``); ``duplicates``: candidates
    already decided (same checkpoint id, or a version not newer than one decided);
    ``skipped``: checkpoints of another recipe or model; ``undecodable``: checkpoint events
    dead-lettered; ``failed_measures``: tries of ``measure`` that raised;
    ``undecodable_publications``: records of ``<ns>.publications`` dead-lettered (see the
    module docstring); ``requests_applied`` / ``requests_refused``: a person's decision
    requests published / refused (``reef_stream.consumers.evaluator.requests``), not counted
    in the decisions above."""

    group: str = ""
    checkpoints: int = 0
    promoted: int = 0
    rejected: int = 0
    canaries: int = 0
    rolled_back: int = 0
    superseded: int = 0
    duplicates: int = 0
    skipped: int = 0
    undecodable: int = 0
    failed_measures: int = 0
    undecodable_publications: int = 0
    requests_applied: int = 0
    requests_refused: int = 0
    elapsed_s: float = 0.0

    @property
    def decided(self) -> int:
        return self.promoted + self.rejected + self.canaries

    def line(self) -> str:
        """One line for the log: ``evaluator <group>: checkpoints=... promoted=... ...``."""
        names = ("checkpoints", "promoted", "rejected", "superseded", "duplicates", "skipped",
                 "undecodable", "failed_measures", "undecodable_publications", "canaries",
                 "rolled_back", "requests_applied", "requests_refused")
        counts = " ".join(f"{name}={getattr(self, name)}" for name in names)
        return f"evaluator {self.group}: {counts} elapsed_s={self.elapsed_s:.1f}"


class _Stopped(Exception):
    """``stop`` was called while a candidate was being measured: leave it undecided."""


class EvaluatorWorker:
    """The candidate evaluator of one recipe; see the module docstring.

    ``fleet``: the Redis projection to tell about publications (``reef_stream.publishing.fleet.Fleet``);
    None leaves Redis alone (``reef fleet --rebuild`` catches up). ``announce(text)``: how the
    evaluator's ``warning`` is shown at start [default: logged at WARNING]. ``on_decision(pub)``:
    called after each publication is acknowledged and committed (on ``run``'s thread).
    ``on_stuck(why)``: called when a decision's transaction stays stuck inside librdkafka
    (``fencing.CommitWatchdog``) [default: logged only]. Raises ``ConfigurationError`` for bad
    options.
    """

    def __init__(self, recipe: Recipe, *, bootstrap: str | None = None,
                 settings: Settings | None = None, namespace: str | None = None,
                 options: EvaluateOptions = EvaluateOptions(), fleet: Fleet | None = None,
                 consumer_config: dict | None = None,
                 announce: Callable[[str], None] | None = None,
                 on_decision: Callable[[Publication], None] | None = None,
                 on_stuck: Callable[[str], None] | None = None) -> None:
        problems = options.problems()
        if problems:
            raise ConfigurationError(problems)
        settings = settings or load_settings()
        self.recipe = recipe
        self.evaluator = recipe.evaluator
        self.options = options
        self.namespace = namespace or settings.namespace
        self.bootstrap = bootstrap or bootstrap_servers(settings)
        self.group = options.group or default_group(recipe, self.namespace)
        self.topic = declarations.checkpoints(self.namespace)
        self.publications_topic = declarations.publications(self.namespace)
        self.store = PublicationStore(options.publish_to
                                      or default_publication_url(settings, self.namespace))
        self.summary = EvaluateSummary(group=self.group)
        self.release = Release.of(self.evaluator, canary_share=options.canary_share,
                                  require_approval=options.require_approval,
                                  publish_every_s=options.publish_every_s)
        self.fleet = fleet
        self._registry = SchemaRegistry.default()
        self._consumer_config = consumer_config or {}
        self._announce = announce or log.warning
        self._on_decision = on_decision
        self._stop = threading.Event()
        self._last_assigned: float | None = None
        #: The transactional producer of decisions (``_fence``), once this member was assigned.
        self._fence_producer: Producer | None = None
        #: Calls ``on_stuck(why)`` when a decision's transaction is stuck inside librdkafka
        #: (``fencing.CommitWatchdog``; `reef evaluate` exits for its supervisor to restart it).
        self._watchdog = CommitWatchdog(f"evaluator {self.group}", on_stuck,
                                        stuck_after_s=settings.stuck_commit_s)
        #: A person's decision requests (``run``), read while this member holds the fence;
        #: the fence (producer) they were started under.
        self._requests: DecisionRequests | None = None
        self._requests_fence: Producer | None = None
        #: Whether candidates are superseded: nothing to save without measuring.
        self._supersedes = options.supersede and bool(self.evaluator.evaluates)

    @property
    def warning(self) -> str | None:
        """The evaluator's warning, if any (AcceptEverything: every checkpoint is published
        unevaluated)."""
        return getattr(self.evaluator, "warning", None)

    def stop(self) -> None:
        """Ask ``run`` to stop after the current candidate (a candidate still being measured
        is left undecided and uncommitted). Safe from any thread and from a signal handler."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def active(self) -> bool:
        """Whether this member holds the recipe's fence now (it is assigned the checkpoints):
        the one evaluator of the recipe that decides. Safe from any thread."""
        return self._fence_producer is not None

    def run(self) -> EvaluateSummary:
        """Decide on checkpoints until stopped; return the counters. Blocks.

        Announces the evaluator's warning first, then reads ``<ns>.publications`` to its end
        (the incumbents; a record there that does not decode is dead-lettered) before the first
        decision. Runs on the stage loop (``reef_stream.consumers.stage``); each checkpoint's
        offset is committed in the transaction of its decision (``_write``). Raises
        ``ConfigurationError`` for a missing topic, ``EvaluatorFenced`` when a newer evaluator
        of the recipe took over, and ``FatalError`` when a decision or a dead letter cannot be
        stored (its offset stays uncommitted, so a restart decides it again).
        """
        started = time.monotonic()
        if self.warning:
            self._announce(self.warning)
        self._watchdog.start(self._stop)
        producer = new_producer(self.bootstrap, {
            "acks": "all", "enable.idempotence": True, "linger.ms": 0,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000) - 5000,
        })
        ledger = PublicationLedger(
            self.bootstrap, self.namespace, registry=self._registry,
            on_undecodable=lambda message, error: self._undecodable_publication(
                producer, message, error))
        metrics = MetricsWriter(producer, self.namespace, STAGE,
                                {"group": self.group, "recipe": self.recipe.name})
        self._canary = CanaryRunner(self.bootstrap, self.namespace, self.release,
                                    registry=self._registry)
        self._requests = DecisionRequests(self.bootstrap, self.namespace, self.recipe.name)
        try:
            ledger.open()
            ledger.catch_up()
            log.info("evaluator %s: %d publications read; incumbents: %s", self.group,
                     ledger.read, {m: ledger.incumbent(m).policy_version for m in ledger.models()
                                   if ledger.incumbent(m) is not None} or "none")
            StageLoop(
                _Decisions(self, ledger, metrics), StageOptions(
                    stage=STAGE, topics=(self.topic,), namespace=self.namespace,
                    reads="checkpoint event", membership=Group(self.group),
                    # checkpoints are sparse: a fetch is answered as one arrives (SPARSE_FETCH)
                    consumer_config={"max.poll.interval.ms": 3_600_000, **SPARSE_FETCH,
                                     **self._consumer_config}),
                consumers=kafka_consumers(self.bootstrap), producer=producer,
                registry=self._registry, metrics=metrics, stop_event=self._stop, logger=log,
            ).run()
        finally:
            self._canary.close()
            self._requests.close()
            ledger.close()
            self.summary.elapsed_s = time.monotonic() - started
        return self.summary

    def _publish(self, publication: Publication, offsets: Positions, consumer: Consumer,
                 ledger: PublicationLedger, metrics: MetricsWriter,
                 superseded_by: int | None = None) -> None:
        """Write the decision on a checkpoint with ``offsets`` (the group's positions, its
        checkpoint's included) in one transaction (``_write``), then fold it into the ledger,
        count it and write its metrics. ``superseded_by``: the newer waiting version that
        superseded it (``superseding``), if any. ``_after_commit`` is the rest."""
        self._write(publication, offsets, consumer,
                    f"the decision on checkpoint {publication.checkpoint_id}")
        ledger.record(publication)
        if publication.decision is Decision.PROMOTED:
            self.summary.promoted += 1
        elif publication.decision is Decision.CANARY:
            self.summary.canaries += 1
        else:
            self.summary.rejected += 1
        metrics.write(EVALUATOR_DECISIONS, self.summary.promoted, decision="PROMOTED")
        metrics.write(EVALUATOR_DECISIONS, self.summary.rejected, decision="REJECTED")
        metrics.write(EVALUATOR_CANDIDATE_VERSION, publication.policy_version,
                      model=publication.model, decision=publication.decision.value)
        if superseded_by is not None and publication.reason == superseded_reason(superseded_by):
            self.summary.superseded += 1
            metrics.write(EVALUATOR_CANDIDATES_SUPERSEDED, self.summary.superseded)
        for measure, value in sorted(publication.measurement.items()):
            metrics.write(EVALUATOR_MEASUREMENT, value, model=publication.model,
                          measure=measure)

    def _judge_canaries(self, ledger: PublicationLedger) -> None:
        """Publish the canary decisions due (``CanaryRunner``) on the canaries this recipe's
        evaluator opened (``judged``), each in a transaction of its own (``_write``; no offset
        goes with them). Only the member that holds the fence judges: a standby decides
        nothing."""
        if self._fence_producer is None:
            return
        for publication in self._canary.decisions(ledger, recipe=self.recipe.name,
                                                  evaluator=self.evaluator.name,
                                                  model=self.options.model):
            self._write(publication, {}, None, f"the canary decision on {publication.model} "
                                               f"version {publication.policy_version}")
            ledger.record(publication)
            self.summary.promoted += publication.decision is Decision.PROMOTED
            self.summary.rolled_back += publication.decision is Decision.ROLLED_BACK
            self._after_commit(publication)

    def _apply_requests(self, ledger: PublicationLedger) -> int:
        """Apply or refuse the decision requests that arrived (``requests``), each in one
        transaction with its outcome and its offset (``_write``, for ``requests_group``),
        against the ledger read to its end; then the post-commit steps of an applied one. Only
        the member that holds the fence reads them (from the recipe's committed position, at
        each fence). A request that does not decode is dead-lettered in its offset's
        transaction; one on a model this evaluator does not decide (``owns``) gets only its
        offset committed. Returns how many were read. Blocks for the broker (and a rollback's
        verification); raises as ``_write``."""
        requests = self._requests
        if self._fence_producer is None:
            requests.stop()
            return 0
        if self._requests_fence is not self._fence_producer:
            requests.start()
            self._requests_fence = self._fence_producer
        consumer, messages = requests.consumer, requests.take()
        if messages:
            ledger.catch_up()
        outcomes = declarations.decision_outcomes(self.namespace)
        for message in messages:
            offsets = {(message.topic(), message.partition()): message.offset() + 1}
            where = f"{message.topic()}[{message.partition()}]@{message.offset()}"
            try:
                request = self._registry.decode(
                    message.value(), message.headers(), DecisionRequest, topic=message.topic(),
                    partition=message.partition(), offset=message.offset())
            except InvalidRecord as error:
                letter = dead_letter(f"undecodable decision request: {error}",
                                     type(error).__name__, stage=STAGE, message=message)
                self._write(None, offsets, consumer, f"the dead letter of request {where}",
                            also=[(declarations.dead_letters(self.namespace), message.key(),
                                   letter)])
                log.warning("dead-lettered %s: undecodable decision request: %s", where, error)
                continue
            if not owns(ledger, request.model, recipe=self.recipe.name,
                        evaluator=self.evaluator.name, only=self.options.model):
                self._write(None, offsets, consumer, f"the offset of request {where}")
                continue
            publication, outcome = outcome_of(ledger, request, self.group,
                                              recipe=self.recipe.name)
            self._write(publication, offsets, consumer,
                        f"the {request.kind.value.lower()} request {request.request_id} on "
                        f"{request.model} version {request.version}",
                        also=[(outcomes, request.request_id.encode(), outcome)])
            if publication is None:
                self.summary.requests_refused += 1
                log.info("refused the %s request %s by %s on %s version %d: %s",
                         request.kind.value.lower(), request.request_id, request.decided_by,
                         request.model, request.version, outcome.text)
                continue
            ledger.record(publication)
            self.summary.requests_applied += 1
            self._after_commit(publication, ledger.incumbent(publication.model))
        return len(messages)

    def _after_commit(self, publication: Publication,
                      incumbent: Publication | None = None) -> None:
        """After the decision's transaction committed: log, update the Redis projection
        (``incumbent``: what the ledger serves after it, for a rollback), prune old copies
        (best effort: both can be redone from the log), ``on_decision``."""
        log.info("%s version %d of model %s (checkpoint %s): %s", publication.decision.value,
                 publication.policy_version, publication.model, publication.checkpoint_id,
                 publication.reason)
        self._project(publication, incumbent)
        prune_copies(self.store, publication, self.options.keep_published)
        if self._on_decision is not None:
            self._on_decision(publication)

    def _decide(self, candidate: Checkpoint, ledger: PublicationLedger, metrics: MetricsWriter,
                superseded_by: int | None = None) -> Publication | None:
        """The publication for ``candidate``, or None when it gets none (another recipe or model,
        or already decided, by the ledger read to its end before the candidates that waited
        together); REJECTED unmeasured when ``superseded_by`` a newer waiting version and the
        model has an incumbent (see the module docstring). Blocks while ``measure`` runs."""
        if candidate.recipe != self.recipe.name or (
                self.options.model is not None and candidate.model != self.options.model):
            self.summary.skipped += 1
            metrics.write(EVALUATOR_CANDIDATES_SKIPPED, self.summary.skipped, why="other")
            return None
        earlier = ledger.decision(candidate.checkpoint_id)
        decided = ledger.decided_version(candidate.model)
        if earlier is not None or (decided is not None and candidate.policy_version <= decided):
            self.summary.duplicates += 1
            metrics.write(EVALUATOR_CANDIDATES_SKIPPED, self.summary.duplicates, why="decided")
            if earlier is not None:
                log.info("checkpoint %s (version %d) was already decided: %s; no second decision",
                         candidate.checkpoint_id, candidate.policy_version, earlier.decision.value)
            else:
                log.info("checkpoint %s: version %d of model %s is not newer than version %d, "
                         "already decided; no decision", candidate.checkpoint_id,
                         candidate.policy_version, candidate.model, decided)
            return None
        current = ledger.incumbent(candidate.model)
        incumbent = Incumbent.from_publication(current) if current is not None else None
        waiting = ledger.waiting(candidate.model)
        unmeasured = (superseded_reason(superseded_by)
                      if superseded_by is not None and current is not None else
                      waiting_reason(waiting) if waiting is not None else
                      cadence_reason(candidate, current, self.release.publish_every_s))
        if unmeasured is not None:  # never promoted, so neither verified nor measured
            return self._publication(candidate, Measurement(), incumbent, Selection(
                Decision.REJECTED, unmeasured), candidate.uri)
        if candidate.rolled_back_to is not None:  # verified as its weights load
            return self._decide_rollback(candidate, current, incumbent)
        try:
            self._reaching_store(f"verifying checkpoint {candidate.checkpoint_id}",
                                 lambda: verify(candidate.uri, candidate.sha256))
        except CheckpointError as error:
            return self._publication(candidate, Measurement(), incumbent, Selection(
                Decision.REJECTED, f"the candidate failed verification: {error}"), candidate.uri)
        measurement, problem = self._measure(candidate, metrics)
        if problem is not None:
            return self._publication(candidate, Measurement(), incumbent,
                                     Selection(Decision.REJECTED, problem), candidate.uri)
        try:
            selection = self.evaluator.select(measurement, incumbent)
            if not isinstance(selection, Selection):
                raise TypeError(f"select returned {type(selection).__name__}, not a Selection")
        except Exception as error:  # noqa: BLE001 - the evaluator's bug is this candidate's outcome
            return self._publication(candidate, measurement, incumbent, Selection(
                Decision.REJECTED, f"the evaluator's select raised {type(error).__name__}: "
                                   f"{error}"), candidate.uri)
        uri, artifact = candidate.uri, None
        if selection.promoted:
            try:
                uri, artifact = self._reaching_store(
                    f"publishing checkpoint {candidate.checkpoint_id}",
                    lambda: self._copy(candidate))
            except CheckpointError as error:  # changed between verification and copy
                return self._publication(candidate, measurement, incumbent, Selection(
                    Decision.REJECTED, f"the candidate failed verification while it was "
                                       f"copied for publication: {error}"), candidate.uri)
        publication = self._publication(candidate, measurement, incumbent, selection, uri,
                                        artifact)
        return stage(publication, self.release, current is not None) if selection.promoted \
            else publication

    def _reaching_store(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, tried again while it fails because a store cannot be reached (an
        object store down, a partition: ``store_unreachable``), after ``STORE_BACKOFF_S``,
        doubling up to ``MAX_BACKOFF_S``, until it succeeds or the worker is asked to stop
        (``_Stopped``). An outage is waited out: a candidate is never rejected, nor a rollback
        refused, for a store it could not reach. Any other ``CheckpointError`` (missing,
        corrupt) raises at once. Blocks."""
        wait = STORE_BACKOFF_S
        while True:
            try:
                return call()
            except CheckpointError as error:
                if not store_unreachable(error):
                    raise
                log.warning("%s: the store cannot be reached (%s); trying again in %g s",
                            what, error, wait)
            if self._stop.wait(wait):
                raise _Stopped
            wait = min(wait * 2, MAX_BACKOFF_S)

    def _copy(self, candidate: Checkpoint) -> tuple[str, ServingArtifact | None]:
        """Publish a promoted candidate's copy (its URI) and, when the recipe's model is a
        Hugging Face one (``reef_stream.engine.hf.HuggingFace``), its serving artifact (else
        None), in ``options.serving_dtype``. Blocks; ``CheckpointError`` when it does not
        verify."""
        from reef_stream.engine.hf import HuggingFace

        uri = self.store.publish(candidate)
        model = self.recipe.backend.model
        if not isinstance(model, HuggingFace):
            return uri, None
        return uri, self.store.publish_artifact(candidate, model, self.options.serving_dtype)

    def _decide_rollback(self, candidate: Checkpoint, current: Publication | None,
                         incumbent: Incumbent | None) -> Publication:
        """The decision on a trainer's rollback checkpoint (``reef_stream.publishing.rollback``):
        promoted, without measuring, when its weights are exactly the incumbent's; the
        incumbent's measurement goes with it. Its files are verified once before the decision,
        here: ``load_weights`` checks every file of the checkpoint (step 4 of the module
        docstring) before it hands over the weights (a promoted one's copy for publication
        reads them again); one that does not verify is REJECTED as any candidate is."""
        try:
            mine = self._reaching_store(f"reading rollback {candidate.checkpoint_id}",
                                        lambda: load_weights(candidate.uri, candidate.sha256))
        except CheckpointError as error:
            return self._publication(candidate, Measurement(), incumbent, Selection(
                Decision.REJECTED, f"the candidate failed verification: {error}"), candidate.uri)
        try:
            theirs = None if current is None else self._reaching_store(
                f"reading the incumbent, version {current.policy_version}",
                lambda: load_weights(current.uri, current.sha256))
        except CheckpointError as error:
            log.warning("the incumbent's weights do not load (%s): the rollback %s is rejected",
                        error, candidate.checkpoint_id)
            theirs = None
        decision, reason = check_rollback(candidate.rolled_back_to, current, mine, theirs)
        measurement = Measurement(dict(current.measurement)) if current is not None \
            else Measurement()
        uri, artifact = candidate.uri, None
        if decision is Decision.PROMOTED:
            try:
                uri, artifact = self._reaching_store(
                    f"publishing rollback {candidate.checkpoint_id}",
                    lambda: self._copy(candidate))
            except CheckpointError as error:
                decision, reason = Decision.REJECTED, (
                    f"the rollback failed verification while it was copied for publication: "
                    f"{error}")
        return self._publication(candidate, measurement, incumbent,
                                 Selection(decision, reason), uri, artifact)

    def _measure(self, candidate: Checkpoint,
                 metrics: MetricsWriter) -> tuple[Measurement, str | None]:
        """``measure`` with retries: (measurement, None), or (empty, why it failed)."""
        tries, last_error = self.options.retries + 1, None
        for attempt in range(tries):
            if attempt:
                if self._stop.wait(min(self.options.backoff * 2 ** (attempt - 1), MAX_BACKOFF_S)):
                    raise _Stopped
            started = time.monotonic()
            try:
                measurement = self.evaluator.measure(candidate)
                if not isinstance(measurement, Measurement):
                    raise TypeError(f"measure returned {type(measurement).__name__}, "
                                    "not a Measurement")
            except Exception as error:  # noqa: BLE001 - retried, then the candidate's outcome
                self.summary.failed_measures += 1
                last_error = error
                log.warning("measuring checkpoint %s failed (try %d of %d): %s: %s",
                            candidate.checkpoint_id, attempt + 1, tries, type(error).__name__,
                            error)
                continue
            finally:
                metrics.write(EVALUATOR_MEASURE_SECONDS, time.monotonic() - started)
            return measurement, None
        if self._stop.is_set():
            raise _Stopped
        return Measurement(), (f"the evaluator's measure failed on every one of {tries} tries; "
                               f"last error: {type(last_error).__name__}: {last_error}")

    def _publication(self, candidate: Checkpoint, measurement: Measurement,
                     incumbent: Incumbent | None, selection: Selection, uri: str,
                     artifact: ServingArtifact | None = None) -> Publication:
        return Publication(
            model=candidate.model, policy_version=candidate.policy_version,
            checkpoint_id=candidate.checkpoint_id, uri=uri, sha256=candidate.sha256,
            decision=selection.decision, reason=selection.reason,
            evaluator=self.evaluator.name, evaluated=bool(self.evaluator.evaluates),
            recipe=self.recipe.name,
            measurement=dict(measurement.values),
            incumbent_version=None if incumbent is None else incumbent.policy_version,
            created_at=now_ms(), checkpoint_created_at=candidate.created_at,
            artifact_uri=None if artifact is None else artifact.uri,
            artifact_sha256=None if artifact is None else artifact.sha256,
            artifact_kind=None if artifact is None else artifact.kind)

    # ----------------------------------------------------------------- Kafka and Redis

    def _fence(self) -> None:
        """When this member is assigned the checkpoints (and holds no fence): the decisions'
        transactional producer, initialised, which fences every other evaluator of the recipe
        and aborts its open transaction. Blocks (up to 60 s)."""
        if self._fence_producer is not None:
            return
        identity = TransactionalIdentity(
            self.bootstrap, evaluator_transactional_id(self.namespace, self.recipe.name),
            timeout_ms=TRANSACTION_TIMEOUT_MS, probe_topic=self.publications_topic,
            instance=self.group)
        self._fence_producer = identity.new_producer()
        log.info("evaluator %s: decides for recipe %s; any older evaluator of the recipe is "
                 "fenced", self.group, self.recipe.name)

    def _unfence(self) -> None:
        """This member's checkpoints were revoked: drop the producer, so that it writes nothing
        more until it is assigned them again and fences whoever holds them then."""
        if self._fence_producer is not None:
            self._fence_producer = None
            log.info("evaluator %s: no longer assigned the checkpoints, so it gave up the "
                     "fence", self.group)

    def _write(self, publication: Publication | None, offsets: Positions,
               consumer: Consumer | None, what: str, *,
               also: Sequence[tuple[str, bytes | None, object]] = ()) -> None:
        """Write a decision, in this order, in one Kafka transaction; any failure aborts it.

        1. Begin a transaction (``_fence``'s producer).
        2. Produce ``publication`` (if any) to ``<ns>.publications``, then each event of
           ``also`` as (topic, key, event): a decision request's outcome or dead letter.
        3. Add ``offsets`` for the group of ``consumer`` (``send_offsets_to_transaction``;
           none for a canary's decision; a decision request's own offset for a request).
        4. Commit. From here the decision exists for every read_committed reader, and the
           group reads its checkpoint no more.

        Nothing else (ledger, Redis, pruning) happens before 4. Blocks for up to
        ``DELIVERY_TIMEOUT_S`` per broker call. Raises ``EvaluatorFenced`` when a newer
        evaluator of the recipe holds the transactional id, ``FatalError`` for any other
        failure (aborted: a restart decides the checkpoint again), or when this member holds
        no fence (assigned nothing: it never writes).
        """
        producer = self._fence_producer
        if producer is None:
            raise FatalError(f"{what}: this evaluator is not assigned the checkpoints, so it "
                             "holds no fence and writes nothing")
        self._watchdog.begin()
        try:
            producer.begin_transaction()
            if publication is not None:
                value, headers = self._registry.encode(publication)
                producer.produce(self.publications_topic, key=publication_key(publication),
                                 value=value, headers=headers)
            for topic, key, event in also:
                value, headers = self._registry.encode(event)
                producer.produce(topic, key=key, value=value, headers=headers)
            if offsets:
                producer.send_offsets_to_transaction(
                    [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())],
                    consumer.consumer_group_metadata(), DELIVERY_TIMEOUT_S)
            producer.commit_transaction(DELIVERY_TIMEOUT_S)
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in FENCED_CODES:
                raise EvaluatorFenced(
                    f"evaluator {self.group} was fenced at {what}: a newer evaluator of recipe "
                    f"{self.recipe.name} took over, so this one stops; nothing it wrote counts "
                    f"({error.str()})") from exc
            if error.fatal():
                # A fatal state of this producer's own, not a newer evaluator's fence (that
                # bumps the epoch: FENCED_CODES), e.g. INVALID_TXN_STATE when the answer to a
                # commit was lost while the coordinator's host was paused (the trainer's
                # case, found by the seeded nemesis). Drop it: the next fence takes the id.
                self._fence_producer = None
                raise FatalError(
                    f"{what} was not committed: the decisions' producer is in a fatal state "
                    f"({error.str()}), though no newer evaluator fenced it; nothing of it "
                    "counts, and a restart decides the checkpoint again") from exc
            if error.txn_requires_abort():
                try:
                    producer.abort_transaction(DELIVERY_TIMEOUT_S)
                except KafkaException as abort:
                    log.warning("aborting the failed transaction: %s", abort.args[0])
            raise FatalError(f"{what} was not committed ({error.str()}); nothing of it counts, "
                             "and a restart decides the checkpoint again") from exc
        except BufferError as exc:
            producer.abort_transaction(DELIVERY_TIMEOUT_S)
            raise FatalError(f"{what} could not be sent ({exc}); nothing of it counts, and a "
                             "restart decides the checkpoint again") from exc
        finally:
            self._watchdog.end()

    def _undecodable_publication(self, producer: Producer, message: Message,
                                 error: InvalidRecord) -> None:
        """The ledger's ``on_undecodable``: dead-letter a record of ``<ns>.publications`` that
        does not decode, keyed by its coordinates (``coordinates_key``), and block until the
        broker acknowledged the letter (``FatalError`` otherwise). At least once with a stable
        key: a restarted worker reads the topic from its beginning and letters the record again
        under the same key."""
        self._dead_letter(producer, message, f"undecodable publication: {error}",
                          type(error).__name__, key=coordinates_key(
                              message.topic(), message.partition(), message.offset()))
        self.summary.undecodable_publications += 1

    def _dead_letter(self, producer: Producer, message: Message, reason: str,
                     error_type: str, *, key: bytes | None = None) -> None:
        """Produce the ``DeadLetter`` of ``message`` (kept whole, with ``reason``) to
        ``<ns>.dead-letters`` and block until it is acknowledged (``stage.deliver``). Its Kafka key is
        ``key``, or else the message's own key."""
        letter = dead_letter(reason, error_type, stage=STAGE, message=message)
        value, headers = self._registry.encode(letter)
        deliver(producer, declarations.dead_letters(self.namespace),
                      message.key() if key is None else key, value, headers,
                      f"the dead letter for {message.topic()}[{message.partition()}]@"
                      f"{message.offset()}")
        log.warning("dead-lettered %s[%d]@%d: %s", message.topic(), message.partition(),
                    message.offset(), reason)

    def _project(self, publication: Publication, incumbent: Publication | None = None) -> None:
        if self.fleet is None:
            return
        try:
            self.fleet.record_publication(publication, incumbent)
        except Exception as error:  # noqa: BLE001 - Redis is a projection; `reef fleet --rebuild`
            log.warning("could not update the fleet projection in Redis (%s); "
                        "`reef fleet --rebuild` restores it", error)


class _Decisions:
    """The evaluator's strategy on the stage loop. ``submit`` decodes a checkpoint event and
    adds it to the waiting ones; ``fetched`` decides every waiting one, in log order, once the
    loop's consumer holds nothing more (``_holds_more``; at once when nothing is superseded),
    so that the newest waiting candidate supersedes the older ones. It commits itself: each
    decision goes in one transaction with its checkpoint's offset (``EvaluatorWorker._write``),
    then the post-commit steps run; the offsets of events that got no decision (skipped,
    already decided, dead-lettered) go in a transaction of their own after the batch. The
    first assignment fences older evaluators of the recipe (``EvaluatorWorker._fence``).
    ``poll`` follows the publications topic while idle and stops the worker at
    ``--max-candidates`` or ``--idle-exit``."""

    capabilities = frozenset({CommitsItself, Rebalancing, DeadLetters, FetchEnd})

    def __init__(self, worker: EvaluatorWorker, ledger: PublicationLedger,
                 metrics: MetricsWriter) -> None:
        self.worker, self.ledger, self.metrics = worker, ledger, metrics
        self._consumer: Consumer | None = None
        self._positions: dict[tuple[str, int], int] = {}
        #: The positions committed (in a transaction) so far.
        self._sent: dict[tuple[str, int], int] = {}
        #: The partitions assigned to this member now.
        self._owned: list[tuple[str, int]] = []
        #: Handed over, not decided yet, in log order; None: dead-lettered already.
        self._waiting: list[tuple[Message, Checkpoint | None]] = []
        self._last_activity = time.monotonic()

    def on_start(self, consumer: Consumer) -> None:
        """The loop's consumer: asked whether it holds more records (``_holds_more``) and for
        its group's metadata (the decisions' transactions)."""
        self._consumer = consumer

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        """Take the fence when assigned the checkpoints (``EvaluatorWorker._fence``: blocks
        the rebalance while ``init_transactions`` runs)."""
        self._owned += [(tp.topic, tp.partition) for tp in partitions]
        if partitions:
            self.worker._fence()
        self.worker._last_assigned = time.monotonic()

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Forget the partitions' positions, which their next owner moves on, and drop their
        waiting events (undecided, uncommitted: their next owner reads them again). With none
        left, give up the fence (``EvaluatorWorker._unfence``): the next owner takes it."""
        gone = {(tp.topic, tp.partition) for tp in partitions}
        for where in gone:
            self._positions.pop(where, None)
            self._sent.pop(where, None)
        self._waiting = [(message, checkpoint) for message, checkpoint in self._waiting
                         if (message.topic(), message.partition()) not in gone]
        if not set(self._owned) - gone:
            self.worker._unfence()
        self._owned = [where for where in self._owned if where not in gone]

    def submit(self, message: Message) -> None:
        """Decode the event and let it wait (``fetched`` decides); ``InvalidRecord`` for one
        that does not decode."""
        worker = self.worker
        self._last_activity = time.monotonic()
        worker.summary.checkpoints += 1
        try:
            checkpoint = worker._registry.decode(
                message.value(), message.headers(), Checkpoint, topic=message.topic(),
                partition=message.partition(), offset=message.offset())
        except InvalidRecord:
            worker.summary.undecodable += 1
            raise  # the loop dead-letters it, then dead_lettered()
        self._waiting.append((message, checkpoint))

    def dead_lettered(self, message: Message) -> None:
        self._waiting.append((message, None))  # committable in its turn, after those before it

    def fetched(self, drained_at_ms: int | None) -> None:
        """Decide the waiting events unless the consumer holds more to hand over first (with
        ``supersede``; up to ``MAX_WAITING``; a fetch that came back empty ends the wait)."""
        if not self._waiting or (
                self.worker._supersedes and drained_at_ms is None
                and len(self._waiting) < MAX_WAITING and self._holds_more()):
            return
        self._decide_waiting()

    def poll(self) -> None:
        worker, options = self.worker, self.worker.options
        if self._enough():
            worker.stop()
            return
        self.ledger.poll(0)  # meanwhile: what others publish, and letters for what is bad
        worker._judge_canaries(self.ledger)
        if worker._apply_requests(self.ledger):
            self._last_activity = time.monotonic()
        idle = options.idle_exit
        if idle is not None:
            if worker._last_assigned is None:  # still joining the group: allow for it
                idle, since = idle + JOIN_GRACE_S, self._last_activity
            else:
                since = max(self._last_activity, worker._last_assigned)
            if time.monotonic() - since >= idle:
                log.info("no new checkpoint for %.1f s: stopping", idle)
                worker.stop()

    def join(self, timeout: float | None) -> None:
        """Decide nothing more: the events still waiting stay undecided and uncommitted (read
        again at the next start)."""
        if self._waiting:
            log.info("%d checkpoint events left undecided at the stop; read again at the next "
                     "start", len(self._waiting))
            self._waiting = []

    def close(self) -> None:
        """The ledger and the producer are the worker's."""

    def _holds_more(self) -> bool:
        """Whether the loop's consumer has more records of the waiting events' partitions to
        hand over: the log's end at its last fetch (cached, no request) is past its position.
        False when it cannot say."""
        wanted = sorted({(message.topic(), message.partition()) for message, _ in self._waiting})
        try:
            for position in self._consumer.position([TopicPartition(t, p) for t, p in wanted]):
                _, end = self._consumer.get_watermark_offsets(position, cached=True)
                if 0 <= position.offset < end:
                    return True
        except KafkaException as error:
            log.warning("could not read the consumer's position (%s): deciding what waits", error)
        return False

    def _decide_waiting(self) -> None:
        """Decide the waiting events in log order, each with the version that supersedes it
        (``superseding``, with ``supersede`` and an evaluator that measures), each decision
        committed with its offset before the next is made; then commit the offsets of those
        that got none. At a stop, or at ``--max-candidates``, the rest stay undecided and
        uncommitted."""
        worker = self.worker
        waiting, self._waiting = self._waiting, []
        checkpoints = [checkpoint for _, checkpoint in waiting if checkpoint is not None]
        # What was decided since (by this group's previous member, say): read once for all of
        # them (a few ms when little is new; this worker's own decisions are folded in as made).
        if any(checkpoint.recipe == worker.recipe.name for checkpoint in checkpoints):
            self.ledger.catch_up()
        newer = iter(superseding(checkpoints) if worker._supersedes
                     else [None] * len(checkpoints))
        for done, (message, checkpoint) in enumerate(waiting):
            publication = superseded_by = None
            if checkpoint is not None:
                if worker.stopping or self._enough():
                    self._waiting = waiting[done:]  # dropped by join()
                    worker.stop()
                    break
                superseded_by = next(newer)
                try:
                    publication = worker._decide(checkpoint, self.ledger, self.metrics,
                                                 superseded_by)
                except _Stopped:  # stopped while measuring: undecided, uncommitted
                    self._waiting = waiting[done:]
                    worker.stop()
                    break
                self._last_activity = time.monotonic()
            self._done(message)
            if publication is not None:
                worker._publish(publication, self._positions, self._consumer, self.ledger,
                                self.metrics, superseded_by)
                self._sent.update(self._positions)
                worker._after_commit(publication)
        self._commit_rest()

    def _commit_rest(self) -> None:
        """Commit the positions not committed yet (events that got no decision) in a
        transaction of their own; nothing when there are none."""
        rest = {where: offset for where, offset in self._positions.items()
                if self._sent.get(where) != offset}
        if rest:
            self.worker._write(None, rest, self._consumer, f"the offsets {rest}")
            self._sent.update(rest)

    def _enough(self) -> bool:
        """``--max-candidates`` decisions made."""
        limit = self.worker.options.max_candidates
        return limit is not None and self.worker.summary.decided >= limit

    def _done(self, message: Message) -> None:
        self._positions[(message.topic(), message.partition())] = message.offset() + 1
