"""Candidate evaluation: every checkpoint of a recipe gets exactly one decision, as a Publication.

    worker = EvaluatorWorker(recipe, bootstrap=..., namespace="reef", options=EvaluateOptions())
    summary = worker.run()        # blocks until stop(), --max-candidates, --idle-exit or a signal
    print(summary.line())

One worker is one member of a Kafka consumer group (default
``<ns>.evaluate.<recipe name>``) on ``<ns>.checkpoints`` (one partition: one
worker of the group is active, the others stand by). For each Checkpoint
event, in log order:

1. a Checkpoint of another recipe (or, with ``--model``, of another model) is
   skipped; an undecodable record becomes a ``DeadLetter`` (stage
   ``evaluator``);
2. the ``PublicationLedger`` (the fold of ``<ns>.publications``, read to its
   end) is asked whether this checkpoint id was decided already, or a version
   not older than this one was: then there is no second decision
   (``duplicates``). A trainer that re-emits its Checkpoint event after a
   crash, or an evaluator restarted between its publication and its commit,
   therefore never publishes twice;
3. the candidate's files are verified against its sha256; a candidate that
   fails is REJECTED with the reason (nothing unverified is ever promoted);
4. ``evaluator.measure(candidate)`` runs (tried ``1 + retries`` times), then
   ``evaluator.select(measurement, incumbent)`` with the incumbent (the
   model's newest PROMOTED publication). A measure that fails on every try,
   or a select that raises, is REJECTED with the error as the reason: a bad
   candidate never stops the pipeline and never disappears;
5. a PROMOTED candidate is copied into the ``PublicationStore``
   (``$REEF_HOME/published/<ns>/<model>/v<version>`` by default) and the copy
   verified; the Publication names the copy, so the trainer's retention of
   its last K checkpoints cannot delete what replicas serve;
6. the Publication is produced (idempotent producer, ``acks=all``) and
   waited for.

The durability order (``_decide_and_commit``): publication acknowledged by
the broker → the checkpoint's offset committed → the Redis projection
updated and old published copies pruned. A crash before the commit re-reads
the checkpoint on restart; step 2 then finds its decision in the ledger. A
publication that cannot be stored, or a copy that cannot be written, stops
the worker with a ``FatalError`` and leaves the offset uncommitted.

Undecodable publications. The evaluator owns ``<ns>.publications``, so a
record there that does not decode (raw bytes, another schema, an unknown
fingerprint, no headers: written by something else) is dead-lettered by the
evaluator (stage ``evaluator``, reason ``undecodable publication: ...``) when
its ledger reads it: at start, before each decision, and while idle. The
letter is keyed ``coordinates_key`` (``<topic>/<partition>/<offset>`` of the
bad record) and acknowledged before the worker goes on. That is at least
once with a stable key: every reading of the topic from its beginning (a
restarted worker, a standby member of the group, another recipe's evaluator)
letters the record again under the same key, so a reader of the dead letters
deduplicates by key. Other readers (replicas' ``Follower``) only count them.

Publications are keyed by model, so compaction keeps each model's latest
decision. A REJECTED publication is keyed ``<model>#rejected`` so that it
cannot compact away the model's last PROMOTED one (which late replicas and a
restarted evaluator need); readers use the event's ``model`` field, never the
key.

Threads: ``run`` owns the clients and must be called from one thread; it
calls ``measure`` and ``select`` on that thread (``max.poll.interval.ms`` is
an hour by default, so a long evaluation keeps the group membership).
``stop`` may be called from any thread or a signal handler.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
from confluent_kafka import (
    OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition,
)

from reef_stream.engine.checkpoints import MANIFEST, CheckpointError, verify, write_durably
from reef_stream.config import Settings, load_settings
from reef_stream.topics.connect import ask_broker, bootstrap_servers, client_config
from reef_stream.errors import ConfigurationError, FatalError, InvalidRecord, RetryableError
from reef_stream.api.evaluator import Incumbent, Measurement, Selection
from reef_stream.topics.dead_letters import dead_letter
from reef_stream.topics.events import Checkpoint, Decision, Publication, now_ms
from reef_stream.ops.metrics import (
    EVALUATOR_CANDIDATE_VERSION, EVALUATOR_CANDIDATES_SKIPPED, EVALUATOR_DECISIONS,
    EVALUATOR_MEASURE_SECONDS, EVALUATOR_MEASUREMENT, STAGE_EVALUATOR, MetricsWriter,
)
from reef_stream.api.recipe import Recipe
from reef_stream.topics import declarations
from reef_stream.topics.serde import SchemaRegistry

if TYPE_CHECKING:
    from reef_stream.consumers.fleet import Fleet

__all__ = ["EvaluateOptions", "EvaluateSummary", "EvaluatorWorker", "PublicationLedger",
           "PublicationStore", "coordinates_key", "default_group", "default_publication_url",
           "publication_key"]

log = logging.getLogger(__name__)

STAGE = STAGE_EVALUATOR
#: Appended to the model in the key of a REJECTED publication (see the module docstring).
REJECTED_KEY_SUFFIX = "#rejected"
#: How long a publication or dead letter may take to be acknowledged before the worker stops.
DELIVERY_TIMEOUT_S = 60.0
#: How long reading a topic up to its end may take before it is given up (RetryableError).
READ_TIMEOUT_S = 60.0
#: The longest wait between two tries of ``measure``.
MAX_BACKOFF_S = 60.0
#: With ``idle_exit``: how much longer a worker waits that the group has not assigned yet.
JOIN_GRACE_S = 30.0


def default_group(recipe: Recipe, namespace: str) -> str:
    """The consumer group of a recipe's evaluator unless one is given (under the namespace)."""
    return f"{namespace}.evaluate.{recipe.name}"


def default_publication_url(settings: Settings, namespace: str) -> str:
    """``$REEF_HOME/published/<ns>``: where promoted checkpoints are copied unless told."""
    return str(settings.home / "published" / namespace)




def publication_key(publication: Publication) -> bytes:
    """The Kafka key of a publication: the model, or ``<model>#rejected`` for a rejection."""
    if publication.decision is Decision.PROMOTED:
        return publication.model.encode()
    return (publication.model + REJECTED_KEY_SUFFIX).encode()


def coordinates_key(topic: str, partition: int, offset: int) -> bytes:
    """``<topic>/<partition>/<offset>``: the key of the dead letter of a publication that does
    not decode; the same at every reading of that record (topic names hold no ``/``)."""
    return f"{topic}/{partition}/{offset}".encode()


# --------------------------------------------------------------------------- the ledger


class PublicationLedger:
    """What ``<ns>.publications`` says so far, per model: the newest PROMOTED publication
    (the incumbent, what replicas serve), the newest decided version, and the decision on
    each checkpoint id still in the log.

    Reads with ``assign()`` from the beginning and a throwaway group id; commits nothing.
    ``open`` then ``catch_up`` (and ``poll`` to follow); ``close`` at the end. Not
    thread-safe: one thread uses it.

    A record that does not decode (``InvalidRecord``: not Avro, another schema, an unknown
    fingerprint, no headers) is left out of the fold, counted in ``undecodable`` and handed
    to ``on_undecodable(message, error)``, once per record this ledger reads, on the thread
    that called ``catch_up`` or ``poll``; what it raises propagates from there. Without
    ``on_undecodable`` it is logged as a warning naming its topic, partition and offset. The
    evaluator, the topic's owner, dead-letters it (``EvaluatorWorker``); every other reader
    counts it. Tombstones (a compaction delete, no value) are skipped silently.
    """

    def __init__(self, bootstrap: str, namespace: str, *,
                 registry: SchemaRegistry | None = None,
                 consumer_config: dict | None = None,
                 on_undecodable: Callable[[Message, InvalidRecord], None] | None = None) -> None:
        self.topic = declarations.publications(namespace)
        self._registry = registry or SchemaRegistry.default()
        self._consumer = Consumer(client_config(bootstrap, {
            "group.id": f"reef-ledger-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            **(consumer_config or {}),
        }))
        self._positions: dict[int, int] = {}
        self._promoted: dict[str, Publication] = {}
        self._decided: dict[str, int] = {}
        self._by_checkpoint: dict[str, Publication] = {}
        self._on_undecodable = on_undecodable
        #: Publications read from the log (not counting ``record``).
        self.read = 0
        #: Records read from the log that did not decode.
        self.undecodable = 0

    def open(self) -> PublicationLedger:
        """Assign every partition of the topic from its beginning. Blocks for metadata (up to
        30 s). Raises ``ConfigurationError`` when the topic does not exist."""
        metadata = self._consumer.list_topics(self.topic, timeout=30)
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise ConfigurationError(f"topic {self.topic} does not exist: run `reef topics create`")
        partitions = sorted(topic.partitions)
        for p in partitions:
            low, _ = self._watermarks(p)
            self._positions[p] = max(low, 0)
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in partitions])
        return self

    def catch_up(self, timeout: float = READ_TIMEOUT_S) -> list[Publication]:
        """Read every publication up to the end of the log as of this call; returns them in
        log order (already folded in). Blocks until then; raises ``RetryableError`` if the
        end is not reached within ``timeout`` seconds. Idempotent."""
        ends = {p: self._watermarks(p)[1] for p in self._positions}
        read: list[Publication] = []
        deadline = time.monotonic() + timeout
        while any(self._positions[p] < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                behind = {p: (self._positions[p], end) for p, end in ends.items()
                          if self._positions[p] < end}
                raise RetryableError(f"could not read {self.topic} to its end within "
                                     f"{timeout:.0f} s (at/end per partition: {behind}); check "
                                     "that the cluster is reachable, then start again")
            read += self._take(self._consumer.consume(500, timeout=0.2))
        return read

    def poll(self, timeout: float) -> list[Publication]:
        """The publications that arrived since the last call, folded in; waits up to
        ``timeout`` seconds for the first one. Blocks; returns [] when none came."""
        return self._take(self._consumer.consume(500, timeout=timeout))

    def record(self, publication: Publication) -> None:
        """Fold in a publication this process just produced, before it is read back. Idempotent."""
        self._fold(publication)

    def incumbent(self, model: str) -> Publication | None:
        """The newest PROMOTED publication of ``model``, or None."""
        return self._promoted.get(model)

    def decided_version(self, model: str) -> int | None:
        """The newest policy version of ``model`` with a decision (promoted or rejected)."""
        return self._decided.get(model)

    def decision(self, checkpoint_id: str) -> Publication | None:
        """The decision on ``checkpoint_id``, if it is still in the log (compaction keeps the
        latest per key; ``decided_version`` covers what it removed)."""
        return self._by_checkpoint.get(checkpoint_id)

    def models(self) -> list[str]:
        """Every model with at least one decision, sorted."""
        return sorted(self._decided)

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> PublicationLedger:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _watermarks(self, partition: int) -> tuple[int, int]:
        return ask_broker(f"reading the offsets of {self.topic}[{partition}]",
                          lambda: self._consumer.get_watermark_offsets(
                              TopicPartition(self.topic, partition), timeout=10))

    def _take(self, messages: list[Message]) -> list[Publication]:
        taken = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self._positions[message.partition()] = message.offset()
                elif error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                    raise ConfigurationError(f"topic {self.topic} does not exist: run "
                                             "`reef topics create`")
                else:
                    log.warning("reading %s: %s", self.topic, error.str())
                continue
            self._positions[message.partition()] = message.offset() + 1
            if message.value() is None:
                continue
            try:
                publication = self._registry.decode(
                    message.value(), message.headers(), Publication, topic=message.topic(),
                    partition=message.partition(), offset=message.offset())
            except InvalidRecord as error:
                self.undecodable += 1
                if self._on_undecodable is None:
                    log.warning("skipping a publication that does not decode: %s", error)
                else:
                    self._on_undecodable(message, error)
                continue
            self.read += 1
            self._fold(publication)
            taken.append(publication)
        return taken

    def _fold(self, publication: Publication) -> None:
        model, version = publication.model, publication.policy_version
        if publication.decision is Decision.PROMOTED:
            current = self._promoted.get(model)
            if current is None or version >= current.policy_version:
                self._promoted[model] = publication
        if version > self._decided.get(model, -1):
            self._decided[model] = version
        self._by_checkpoint[publication.checkpoint_id] = publication


# --------------------------------------------------------------------------- the store


class PublicationStore:
    """Copies of promoted checkpoints, at ``<url>/<model>/v<version>``, out of reach of the
    trainer's retention. ``url`` is a local path or any fsspec URL.

    A copy holds every file of the checkpoint, byte for byte (manifest included), so it has
    the checkpoint's sha256 and ``checkpoints.load_weights(copy_uri, sha256)`` verifies it.
    """

    def __init__(self, url: str | os.PathLike[str]) -> None:
        url = os.fspath(url)
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self._protocol = protocol
        self.local = protocol in ("file", "local")
        self.url = url

    def uri_of(self, model: str, version: int) -> str:
        """Where version ``version`` of ``model`` is (or would be) kept."""
        return self._uri(self._path(model, version))

    def publish(self, candidate: Checkpoint) -> str:
        """Copy the candidate's checkpoint into the store and verify the copy against
        ``candidate.sha256``; returns the copy's URI.

        Blocks for the copy (the whole checkpoint is read into memory once). Idempotent: a
        copy already there that verifies is kept; one that does not is replaced. Raises
        ``CheckpointError`` when the source does not verify, ``FatalError`` when the store
        cannot be written.
        """
        final = self._path(candidate.model, candidate.policy_version)
        uri = self._uri(final)
        try:
            if self.fs.exists(f"{final}/{MANIFEST}"):
                verify(uri, candidate.sha256)
                return uri
        except CheckpointError:
            log.warning("replacing %s: it does not match checkpoint %s", uri,
                        candidate.checkpoint_id)
        files = verify(candidate.uri, candidate.sha256)
        src_fs, src_path = fsspec.core.url_to_fs(candidate.uri)
        try:
            manifest = src_fs.cat_file(f"{src_path}/{MANIFEST}")
        except OSError as error:
            raise CheckpointError(f"checkpoint {candidate.uri}: {MANIFEST} cannot be read: "
                                  f"{error}") from error
        if hashlib.sha256(manifest).hexdigest() != candidate.sha256:
            raise CheckpointError(f"checkpoint {candidate.uri} changed while it was copied")
        staging = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            target = staging if self.local else final
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            self.fs.makedirs(target, exist_ok=True)
            for name, data in files.items():
                self._write(f"{target}/{name}", data)
            self._write(f"{target}/{MANIFEST}", manifest)  # last: the copy exists from here on
            if self.local:
                os.rename(staging, final)
                _fsync_dir(os.path.dirname(final))
        except OSError as error:
            raise FatalError(f"could not copy checkpoint {candidate.checkpoint_id} to the "
                             f"publication store {self.url}: {error}; nothing was published, "
                             "fix the store and start the evaluator again") from error
        verify(uri, candidate.sha256)
        return uri

    def versions(self, model: str) -> list[int]:
        """The versions of ``model`` with a complete copy, oldest first."""
        directory = f"{self.root}/{_model_dir(model)}"
        if not self.fs.exists(directory):
            return []
        found = []
        for path in self.fs.ls(directory, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("v") and name[1:].isdigit() and self.fs.exists(f"{path}/{MANIFEST}"):
                found.append(int(name[1:]))
        return sorted(found)

    def prune(self, model: str, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` copies of ``model`` (0 keeps all) and leftover
        staging directories; returns the versions deleted. Idempotent."""
        if keep <= 0:
            return []
        doomed = self.versions(model)[:-keep]
        for version in doomed:
            self.fs.rm(self._path(model, version), recursive=True)
        directory = f"{self.root}/{_model_dir(model)}"
        if self.fs.exists(directory):
            for path in self.fs.ls(directory, detail=False):
                if ".tmp-" in path.rstrip("/").rsplit("/", 1)[-1]:
                    self.fs.rm(path, recursive=True)
        return doomed

    def _path(self, model: str, version: int) -> str:
        return f"{self.root}/{_model_dir(model)}/v{version}"

    def _uri(self, path: str) -> str:
        return path if self.local else f"{self._protocol}://{path}"

    def _write(self, path: str, data: bytes) -> None:
        write_durably(self.fs, path, data, local=self.local)


def _model_dir(model: str) -> str:
    """A model name as one path segment (``/`` and other specials percent-encoded)."""
    return urllib.parse.quote(model, safe="")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class EvaluateOptions:
    """How an evaluator runs; validated by ``problems()``.

    ``model``: decide only on checkpoints of this model. ``publish_to``: the
    ``PublicationStore`` URL [default: ``$REEF_HOME/published/<ns>``]. ``keep_published``:
    copies kept per model (0: all). ``retries``: tries of ``measure`` after a failed one.
    ``max_candidates``: stop after deciding this many. ``idle_exit``: stop after this many
    seconds without a new checkpoint event (counted from the group's assignment; a member
    still joining waits up to ``JOIN_GRACE_S`` longer).
    """

    group: str | None = None
    model: str | None = None
    publish_to: str | None = None
    keep_published: int = 3
    retries: int = 1
    backoff: float = 1.0
    max_candidates: int | None = None
    idle_exit: float | None = None

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
        return found


@dataclass
class EvaluateSummary:
    """The worker's counters. ``checkpoints``: events read; ``promoted`` / ``rejected``:
    decisions published; ``duplicates``: candidates already decided (same checkpoint id, or a
    version not newer than one decided); ``skipped``: checkpoints of another recipe or model;
    ``undecodable``: checkpoint events dead-lettered; ``failed_measures``: tries of ``measure``
    that raised; ``undecodable_publications``: records of ``<ns>.publications`` dead-lettered
    (see the module docstring)."""

    group: str = ""
    checkpoints: int = 0
    promoted: int = 0
    rejected: int = 0
    duplicates: int = 0
    skipped: int = 0
    undecodable: int = 0
    failed_measures: int = 0
    undecodable_publications: int = 0
    elapsed_s: float = 0.0

    @property
    def decided(self) -> int:
        return self.promoted + self.rejected

    def line(self) -> str:
        """One line for the log: ``evaluator <group>: checkpoints=... promoted=... ...``."""
        names = ("checkpoints", "promoted", "rejected", "duplicates", "skipped", "undecodable",
                 "failed_measures", "undecodable_publications")
        counts = " ".join(f"{name}={getattr(self, name)}" for name in names)
        return f"evaluator {self.group}: {counts} elapsed_s={self.elapsed_s:.1f}"


class _Stopped(Exception):
    """``stop`` was called while a candidate was being measured: leave it undecided."""


class EvaluatorWorker:
    """The candidate evaluator of one recipe; see the module docstring.

    ``fleet``: the Redis projection to tell about publications (``reef_stream.consumers.fleet.Fleet``);
    None leaves Redis alone (``reef fleet --rebuild`` catches up). ``announce(text)``: how the
    evaluator's ``warning`` is shown at start [default: logged at WARNING]. ``on_decision(pub)``:
    called after each publication is acknowledged and committed (on ``run``'s thread).
    Raises ``ConfigurationError`` for bad options.
    """

    def __init__(self, recipe: Recipe, *, bootstrap: str | None = None,
                 settings: Settings | None = None, namespace: str | None = None,
                 options: EvaluateOptions = EvaluateOptions(), fleet: Fleet | None = None,
                 consumer_config: dict | None = None,
                 announce: Callable[[str], None] | None = None,
                 on_decision: Callable[[Publication], None] | None = None) -> None:
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
        self.fleet = fleet
        self._registry = SchemaRegistry.default()
        self._consumer_config = consumer_config or {}
        self._announce = announce or log.warning
        self._on_decision = on_decision
        self._stop = threading.Event()
        self._last_assigned: float | None = None

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

    def run(self) -> EvaluateSummary:
        """Decide on checkpoints until stopped; return the counters. Blocks.

        Announces the evaluator's warning first, then reads ``<ns>.publications`` to its end
        (the incumbents; a record there that does not decode is dead-lettered) before the first
        decision. Raises ``ConfigurationError`` for a missing topic and ``FatalError`` when a
        decision or a dead letter cannot be stored (its offset stays uncommitted, so a restart
        decides it again).
        """
        started = time.monotonic()
        if self.warning:
            self._announce(self.warning)
        producer = Producer(client_config(self.bootstrap, {
            "acks": "all", "enable.idempotence": True, "linger.ms": 0,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000) - 5000,
        }))
        ledger = PublicationLedger(
            self.bootstrap, self.namespace, registry=self._registry,
            on_undecodable=lambda message, error: self._undecodable_publication(
                producer, message, error))
        metrics = MetricsWriter(producer, self.namespace, STAGE,
                                {"group": self.group, "recipe": self.recipe.name})
        consumer = Consumer(client_config(self.bootstrap, {
            "group.id": self.group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "max.poll.interval.ms": 3_600_000,
            **self._consumer_config,
        }))
        try:
            ledger.open()
            ledger.catch_up()
            log.info("evaluator %s: %d publications read; incumbents: %s", self.group,
                     ledger.read, {m: ledger.incumbent(m).policy_version for m in ledger.models()
                                   if ledger.incumbent(m) is not None} or "none")
            self._check_topic(consumer)
            consumer.subscribe([self.topic], on_assign=self._assigned)
            self._consume(consumer, producer, ledger, metrics)
        finally:
            try:
                producer.flush(10)
                consumer.close()
            finally:
                ledger.close()
                self.summary.elapsed_s = time.monotonic() - started
        return self.summary

    # ----------------------------------------------------------------- the loop

    def _consume(self, consumer: Consumer, producer: Producer, ledger: PublicationLedger,
                 metrics: MetricsWriter) -> None:
        last_activity = time.monotonic()
        while not self._stop.is_set():
            message = consumer.poll(0.2)
            producer.poll(0)
            if message is None:
                ledger.poll(0)  # meanwhile: what others publish, and letters for what is bad
                idle = self.options.idle_exit
                if idle is not None:
                    if self._last_assigned is None:  # still joining the group: allow for it
                        idle, since = idle + JOIN_GRACE_S, last_activity
                    else:
                        since = max(last_activity, self._last_assigned)
                    if time.monotonic() - since >= idle:
                        log.info("no new checkpoint for %.1f s: stopping", idle)
                        return
                continue
            last_activity = time.monotonic()
            error = message.error()
            if error is not None:
                if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                    raise ConfigurationError(f"topic {self.topic} does not exist: run "
                                             "`reef topics create`")
                if error.fatal():
                    raise FatalError(f"the Kafka consumer failed: {error.str()}")
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("Kafka consumer: %s", error.str())
                continue
            try:
                self._decide_and_commit(message, consumer, producer, ledger, metrics)
            except _Stopped:
                return
            if self.options.max_candidates is not None \
                    and self.summary.decided >= self.options.max_candidates:
                return
            last_activity = time.monotonic()

    def _decide_and_commit(self, message: Message, consumer: Consumer, producer: Producer,
                           ledger: PublicationLedger, metrics: MetricsWriter) -> None:
        """The durability order for one checkpoint event, all of it here:

        decide (or find it decided) → produce the Publication → wait for the broker's
        acknowledgement (``FatalError`` otherwise; nothing committed) → commit the offset past
        the event → update the Redis projection and prune old copies (best effort: both can
        be redone from the log).
        """
        self.summary.checkpoints += 1
        where = dict(topic=message.topic(), partition=message.partition(), offset=message.offset())
        try:
            checkpoint = self._registry.decode(message.value(), message.headers(), Checkpoint,
                                               **where)
        except InvalidRecord as error:
            self.summary.undecodable += 1
            self._dead_letter(producer, message, f"undecodable checkpoint event: {error}",
                              type(error).__name__)
            self._commit(consumer, message)
            return
        publication = self._decide(checkpoint, ledger, metrics)
        if publication is not None:
            value, headers = self._registry.encode(publication)
            self._deliver(producer, self.publications_topic, publication_key(publication), value,
                          headers, f"the publication of {checkpoint.checkpoint_id}")
            ledger.record(publication)
            if publication.decision is Decision.PROMOTED:
                self.summary.promoted += 1
            else:
                self.summary.rejected += 1
            metrics.write(EVALUATOR_DECISIONS, self.summary.promoted, decision="PROMOTED")
            metrics.write(EVALUATOR_DECISIONS, self.summary.rejected, decision="REJECTED")
            metrics.write(EVALUATOR_CANDIDATE_VERSION, publication.policy_version,
                          model=publication.model, decision=publication.decision.value)
            for measure, value in sorted(publication.measurement.items()):
                metrics.write(EVALUATOR_MEASUREMENT, value, model=publication.model,
                              measure=measure)
        self._commit(consumer, message)
        metrics.write_lag(consumer)
        if publication is None:
            return
        log.info("%s version %d of model %s (checkpoint %s): %s", publication.decision.value,
                 publication.policy_version, publication.model, publication.checkpoint_id,
                 publication.reason)
        self._project(publication)
        if publication.decision is Decision.PROMOTED:
            try:
                pruned = self.store.prune(publication.model, self.options.keep_published)
            except OSError as error:
                log.warning("could not prune old copies of %s: %s", publication.model, error)
            else:
                if pruned:
                    log.info("pruned published copies of %s: versions %s", publication.model,
                             pruned)
        if self._on_decision is not None:
            self._on_decision(publication)

    def _decide(self, candidate: Checkpoint, ledger: PublicationLedger,
                metrics: MetricsWriter) -> Publication | None:
        """The publication for ``candidate``, or None when it gets none (another recipe or model,
        or already decided). Blocks while ``measure`` runs."""
        if candidate.recipe != self.recipe.name or (
                self.options.model is not None and candidate.model != self.options.model):
            self.summary.skipped += 1
            metrics.write(EVALUATOR_CANDIDATES_SKIPPED, self.summary.skipped, why="other")
            return None
        ledger.catch_up()  # decisions made since (by this group's previous member, say)
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
        try:
            verify(candidate.uri, candidate.sha256)
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
        uri = candidate.uri
        if selection.promoted:
            try:
                uri = self.store.publish(candidate)
            except CheckpointError as error:  # changed between verification and copy
                return self._publication(candidate, measurement, incumbent, Selection(
                    Decision.REJECTED, f"the candidate failed verification while it was "
                                       f"copied for publication: {error}"), candidate.uri)
        return self._publication(candidate, measurement, incumbent, selection, uri)

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
                     incumbent: Incumbent | None, selection: Selection, uri: str) -> Publication:
        return Publication(
            model=candidate.model, policy_version=candidate.policy_version,
            checkpoint_id=candidate.checkpoint_id, uri=uri, sha256=candidate.sha256,
            decision=selection.decision, reason=selection.reason,
            evaluator=self.evaluator.name, evaluated=bool(self.evaluator.evaluates),
            measurement=dict(measurement.values),
            incumbent_version=None if incumbent is None else incumbent.policy_version,
            created_at=now_ms(), checkpoint_created_at=candidate.created_at)

    # ----------------------------------------------------------------- Kafka and Redis

    def _deliver(self, producer: Producer, topic: str, key: bytes | None, value: bytes,
                 headers: list, what: str) -> None:
        """Produce one record and block until the broker acknowledged it (``acks=all``).
        Raises ``FatalError`` if it did not: nothing after it may be committed."""
        outcome: list[KafkaError | None] = []
        try:
            producer.produce(topic, key=key, value=value, headers=headers,
                             on_delivery=lambda error, _: outcome.append(error))
        except Exception as error:  # noqa: BLE001 - BufferError, a record too large, ...
            raise FatalError(f"{what} could not be sent: {error}; its offset stays "
                             "uncommitted") from error
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        while not outcome:
            producer.poll(0.1)
            if time.monotonic() > deadline:
                raise FatalError(f"{what} was not acknowledged within {DELIVERY_TIMEOUT_S:.0f} s; "
                                 "its offset stays uncommitted")
        if outcome[0] is not None:
            error = outcome[0]
            if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
            raise FatalError(f"{what} was refused by the broker: {error.str()}; its offset stays "
                             "uncommitted")

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
        ``<ns>.dead-letters`` and block until it is acknowledged (``_deliver``). Its Kafka key is
        ``key``, or else the message's own key."""
        letter = dead_letter(reason, error_type, stage=STAGE, message=message)
        value, headers = self._registry.encode(letter)
        self._deliver(producer, declarations.dead_letters(self.namespace),
                      message.key() if key is None else key, value, headers,
                      f"the dead letter for {message.topic()}[{message.partition()}]@"
                      f"{message.offset()}")
        log.warning("dead-lettered %s[%d]@%d: %s", message.topic(), message.partition(),
                    message.offset(), reason)

    def _commit(self, consumer: Consumer, message: Message) -> None:
        """Commit past ``message``, synchronously. A failed commit is logged: the event is read
        again after a restart and the ledger finds its decision."""
        position = TopicPartition(message.topic(), message.partition(), message.offset() + 1)
        try:
            consumer.commit(offsets=[position], asynchronous=False)
        except Exception as error:  # noqa: BLE001 - harmless, see the docstring
            log.warning("committing %s failed: %s", position, error)

    def _project(self, publication: Publication) -> None:
        if self.fleet is None:
            return
        try:
            self.fleet.record_publication(publication)
        except Exception as error:  # noqa: BLE001 - Redis is a projection; `reef fleet --rebuild`
            log.warning("could not update the fleet projection in Redis (%s); "
                        "`reef fleet --rebuild` restores it", error)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._last_assigned = time.monotonic()
        log.info("assigned %s", [f"{tp.topic}[{tp.partition}]" for tp in partitions])

    def _check_topic(self, consumer: Consumer) -> None:
        metadata = consumer.list_topics(self.topic, timeout=10)
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None:
            raise ConfigurationError(f"topic {self.topic} does not exist: run `reef topics create`")


if __name__ == "__main__":
    from reef_stream.cli.evaluate import main

    main()
