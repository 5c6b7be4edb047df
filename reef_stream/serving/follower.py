"""Serving replicas: follow a model's publications, load the newest promoted version, verified.

    def swap(loaded: LoadedVersion) -> None:          # your serving code
        model.load_state_dict(loaded.weights)

    follower = Follower("my-model", on_version=swap).start()   # a background thread
    follower.wait_ready(60)                          # publications read, newest version tried
    producer = RecordProducer(guard=follower)        # generations must carry a served version
    generation = Generation(..., model="my-model", policy_version=follower.policy_version, ...)

A follower reads ``<ns>.publications`` from its beginning (no group: every replica reads
everything) and folds its model's (``PublicationLedger``). Whenever ``ledger.serving`` (the
open canary for this replica's ``canary_slot``, else the incumbent) differs from what it
serves, it loads and verifies the weights (``checkpoints.load_weights``, or the serving
artifact for an engine: ``reef_stream.serving.adapters``), calls ``on_version`` on its
thread, and only then changes ``policy_version``. A failed load is refused, reported to
``on_refused``, and retried every ``retry_s`` (``DEFAULT_RETRY_S``) while newest; the
previous version keeps serving. Intermediate versions are never loaded. An undecodable
publication is counted (``FOLLOWER_PUBLICATIONS_UNDECODABLE``), never dead-lettered here.
Every ``heartbeat_s`` the replica reports to the Redis projection and ``<ns>.metrics``;
their failures never stop serving. With ``version_file``, the follower keeps a file saying
which version the engine serves, for a recording proxy beside it
(``reef_stream.serving.version_file``: unknown from before ``on_version`` is called until it
returned). As a ``GenerationGuard``, ``check`` refuses a generation
of another model or of a version never served. ``policy_version``, ``check``, ``wait_*`` and
``stop`` may be called from any thread. The long form: ``docs/stages.md`` ("The follower").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from reef_stream.consumers.stage import (
    SPARSE_FETCH, PartitionEnd, Reader, Rebalancing, StageLoop, StageOptions, kafka_consumers,
)
from reef_stream.core.errors import (
    ConfigurationError, FatalError, InvalidRecord, ReefError, RetryableError,
)
from reef_stream.core.events import Generation, Publication, now_ms
from reef_stream.core.metric_names import (
    FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, FOLLOWER_LOAD_SECONDS, FOLLOWER_POLICY_VERSION,
    FOLLOWER_PUBLICATION_TO_SERVING_SECONDS, FOLLOWER_PUBLICATIONS_UNDECODABLE,
    FOLLOWER_VERSIONS_LOADED, FOLLOWER_VERSIONS_REFUSED, STAGE_FOLLOWER,
)
from reef_stream.core.settings import Settings, load_settings
from reef_stream.engine.checkpoints import CheckpointError, load_weights
from reef_stream.publishing.fleet import (
    DEFAULT_HEARTBEAT_S, DEFAULT_TTL_S, Fleet, ReplicaStatus, heartbeat_metric_labels,
)
from reef_stream.publishing.publications import READ_TIMEOUT_S, PublicationLedger
from reef_stream.publishing.publications import canary_slot as canary_slot_of
from reef_stream.serving.version_file import ServedVersionFile
from reef_stream.topics.connect import bootstrap_servers, new_producer, watermarks
from reef_stream.topics.kafka import Message, Producer, TopicPartition
from reef_stream.topics.metrics import MetricsWriter

__all__ = ["AUTO", "Follower", "LoadedVersion", "default_replica_id"]

log = logging.getLogger(__name__)

#: ``Follower(fleet=AUTO)``: the Redis that the settings name, or none (logged) if they name none.
AUTO = "auto"
#: The environment variable that gives a replica's canary slot (``Follower``).
CANARY_SLOT_ENV = "REEF_CANARY_SLOT"
#: Seconds between two tries of a refused version that is still the newest.
DEFAULT_RETRY_S = 30.0


def default_replica_id() -> str:
    """``<host>-<pid>-<random>``: unique per process; give a stable one (a pod name) if you
    have it."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


#: ``Follower(loads=...)``: the checkpoint's weights, loaded into memory (``LoadedVersion.weights``),
#: or the serving artifact, verified where it is (``LoadedVersion.artifact``: an engine loads it).
WEIGHTS, ARTIFACT = "weights", "artifact"


@dataclass(frozen=True, slots=True, eq=False)
class LoadedVersion:
    """A verified version, handed to ``on_version``: the model's state dict (name → tensor, on
    the CPU; empty when the follower ``loads`` the artifact), the publication that promoted it
    and, for a follower that loads artifacts, the URI of its verified serving artifact
    (``reef_stream.engine.artifacts``: a Hugging Face directory or a LoRA adapter, as
    ``publication.artifact_kind`` says)."""

    policy_version: int
    weights: Mapping[str, torch.Tensor]
    publication: Publication
    artifact: str | None = None


class Follower:
    """One serving replica's view of a model's publications; see the module docstring.

    ``initial_version``: the version the replica serves before anything is loaded (its base
    weights), or None when it serves nothing until the first load. ``fleet``: a
    ``reef_stream.publishing.fleet.Fleet``, ``AUTO`` (the Redis the settings name, if any) or None (no
    Redis projection). ``on_refused(publication, error)``: told about each refusal.
    ``loads``: ``WEIGHTS`` (the checkpoint's state dict, for serving code that swaps it into
    its model) or ``ARTIFACT`` (the publication's serving artifact verified against its
    sha256 and handed over by URI, for an engine adapter, ``reef_stream.serving.adapters``; a
    version published without one is refused). ``canary_slot``: the replica's place in [0, 1)
    for canary cohorts (replica i of n: i / n, so a share takes exactly its part; default
    ``$REEF_CANARY_SLOT``, else derived from the replica id). ``version_file``: a file kept
    naming the version the engine serves (``reef_stream.serving.version_file``), rewritten
    atomically around each load; ``run`` raises ``ConfigurationError`` when it cannot write it
    at the start. Constructing connects to nothing; raises ``ConfigurationError`` for bad
    arguments.
    """

    def __init__(self, model: str, on_version: Callable[[LoadedVersion], None], *,
                 bootstrap: str | None = None, settings: Settings | None = None,
                 namespace: str | None = None, replica_id: str | None = None,
                 initial_version: int | None = None, fleet: Fleet | str | None = AUTO,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, ttl_s: float | None = None,
                 retry_s: float = DEFAULT_RETRY_S,
                 on_refused: Callable[[Publication, Exception], None] | None = None,
                 consumer_config: dict | None = None, loads: str = WEIGHTS,
                 canary_slot: float | None = None, version_file: Path | None = None) -> None:
        problems = []
        if loads not in (WEIGHTS, ARTIFACT):
            problems.append(f"loads must be {WEIGHTS!r} or {ARTIFACT!r}, not {loads!r}")
        if not isinstance(model, str) or not model.strip():
            problems.append("model must be a non-empty name")
        if not callable(on_version):
            problems.append("on_version must be callable (it receives a LoadedVersion)")
        if not heartbeat_s > 0:
            problems.append(f"heartbeat interval must be more than 0 seconds, not {heartbeat_s}")
        if ttl_s is not None and not ttl_s > heartbeat_s:
            problems.append(f"the heartbeat TTL ({ttl_s} s) must be longer than the heartbeat "
                            f"interval ({heartbeat_s} s)")
        if not retry_s > 0:
            problems.append(f"retry interval must be more than 0 seconds, not {retry_s}")
        if canary_slot is not None and not 0 <= canary_slot < 1:
            problems.append(f"canary slot must be in [0, 1), not {canary_slot}")
        if initial_version is not None and initial_version < 0:
            problems.append(f"initial version must be 0 or more, not {initial_version}")
        if problems:
            raise ConfigurationError(problems)
        self._settings = settings or load_settings()
        self.model = model
        self.namespace = namespace or self._settings.namespace
        self.bootstrap = bootstrap or bootstrap_servers(self._settings)
        self.replica_id = replica_id or default_replica_id()
        #: Where this replica stands for canary cohorts (``publications.takes_canary``): the
        #: argument, else ``$REEF_CANARY_SLOT`` (replica i of n: i / n), else from the id.
        self.canary_slot = canary_slot if canary_slot is not None else _slot_from_env() \
            if os.environ.get(CANARY_SLOT_ENV) else canary_slot_of(self.replica_id)
        self.host = socket.gethostname()
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s if ttl_s is not None else max(DEFAULT_TTL_S, 3 * heartbeat_s)
        self.retry_s = retry_s
        self.loads = loads
        self._fleet_arg = fleet
        self.fleet: Fleet | None = None
        self._on_version = on_version
        self._on_refused = on_refused
        self._consumer_config = consumer_config
        self._lock = threading.Condition()
        self._version = initial_version
        self._served: set[int] = set() if initial_version is None else {initial_version}
        self._publication: Publication | None = None
        self._canary: Publication | None = None  # the model's open canary, if any
        #: version -> (the error, monotonic time of the next try)
        self._refused: dict[int, tuple[Exception, float]] = {}
        self._loads = 0
        self._refusals = 0
        self._undecodable = 0
        self._ready = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics: MetricsWriter | None = None
        self._producer: Producer | None = None
        self._redis_warned = 0.0
        self._version_file = None if version_file is None else ServedVersionFile(
            Path(version_file), model=model, replica_id=self.replica_id)
        #: The version file lags what is served (a write failed); rewritten on the next poll.
        self._version_file_behind = False

    # ----------------------------------------------------------------- state

    @property
    def policy_version(self) -> int | None:
        """The version served now (None before the first load without ``initial_version``)."""
        with self._lock:
            return self._version

    @property
    def publication(self) -> Publication | None:
        """The publication of the version served now (None for ``initial_version``)."""
        with self._lock:
            return self._publication

    @property
    def refused(self) -> dict[int, str]:
        """Versions refused and not superseded since: version → why."""
        with self._lock:
            return {version: str(error) for version, (error, _) in self._refused.items()}

    @property
    def undecodable(self) -> int:
        """Records of the publications topic that did not decode, read since ``run`` began."""
        with self._lock:
            return self._undecodable

    @property
    def error(self) -> BaseException | None:
        """What stopped ``run``, if anything did."""
        return self._error

    def check(self, generation: Generation) -> None:
        """``GenerationGuard`` for ``RecordProducer``: raise ``InvalidRecord`` unless
        ``generation`` is of this model and carries a version this replica served. Does not
        block; safe from any thread."""
        if generation.model != self.model:
            raise InvalidRecord(f"replica {self.replica_id} serves model {self.model!r}, not "
                                f"{generation.model!r}", field="model")
        with self._lock:
            current, served = self._version, generation.policy_version in self._served
        if current is None:
            raise InvalidRecord(f"replica {self.replica_id} has loaded no version of "
                                f"{self.model!r} yet, so it cannot have sampled this "
                                "generation (wait_ready, or give initial_version)",
                                field="policy_version")
        if not served:
            raise InvalidRecord(f"replica {self.replica_id} never served version "
                                f"{generation.policy_version} of {self.model!r} (it serves "
                                f"{current}); set policy_version from follower.policy_version "
                                "when sampling starts", field="policy_version")

    # ----------------------------------------------------------------- waiting

    def wait_ready(self, timeout: float | None = None) -> int | None:
        """Block until publications were read to their end and the newest promoted version was
        tried (loaded or refused); returns ``policy_version``. Raises what stopped ``run``, or
        ``TimeoutError``."""
        self._wait(lambda: self._ready, timeout, "to read the publications")
        return self.policy_version

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Block until the replica serves ``version`` or newer; returns the version served.
        Raises what stopped ``run``, or ``TimeoutError`` (naming any refusal)."""
        self._wait(lambda: self._version is not None and self._version >= version, timeout,
                   f"to serve version {version}")
        return self.policy_version  # type: ignore[return-value]

    def _wait(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not predicate():
                if self._error is not None:
                    raise self._error
                if self._thread is not None and not self._thread.is_alive() and not self._ready:
                    raise FatalError(f"follower {self.replica_id} stopped before it was ready")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    refused = "; ".join(f"version {v} refused: {e}"
                                        for v, (e, _) in self._refused.items())
                    raise TimeoutError(f"replica {self.replica_id} waited {timeout} s {what}; it "
                                       f"serves {self._version}"
                                       + (f"; {refused}" if refused else ""))
                self._lock.wait(0.1 if remaining is None else min(remaining, 0.1))

    # ----------------------------------------------------------------- running

    def start(self) -> Follower:
        """Run ``run`` on a daemon thread; returns self. Call once."""
        if self._thread is not None:
            raise FatalError("this Follower was started already")
        self._thread = threading.Thread(target=self._run_catching, daemon=True,
                                        name=f"reef-follower-{self.model}")
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop following (after a load in progress), leave the fleet projection, flush the
        metrics. With ``start``, blocks until the background thread ended, at most ``timeout``
        seconds (0: do not wait, as in a signal handler). Idempotent; safe from any thread."""
        self._stop.set()
        self._beat_now.set()
        thread = self._thread
        if timeout > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called or ``run`` ended."""
        return self._stop.is_set()

    def __enter__(self) -> Follower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run_catching(self) -> None:
        try:
            self.run()
        except BaseException as error:  # noqa: BLE001 - handed to the waiters
            log.error("follower %s stopped: %s", self.replica_id, error)

    def run(self) -> None:
        """Follow publications until ``stop``. Blocks. Raises ``ConfigurationError`` when the
        publications topic does not exist, ``RetryableError`` when it cannot be read."""
        ledger = PublicationLedger(self.bootstrap, self.namespace,
                                   on_undecodable=self._undecodable_publication)
        self._producer = new_producer(self.bootstrap, {"linger.ms": 50})
        self._metrics = MetricsWriter(self._producer, self.namespace, STAGE_FOLLOWER,
                                      {"replica": self.replica_id, "model": self.model})
        self.fleet = self._connect_fleet()
        beating = threading.Thread(target=self._heartbeats, daemon=True,
                                   name=f"reef-heartbeat-{self.model}")
        try:
            self._start_version_file()
            following = _Following(self, ledger, beating)
            following.loop = StageLoop(following, StageOptions(
                stage=STAGE_FOLLOWER, topics=(ledger.topic,), namespace=self.namespace,
                reads="publication", membership=Reader(), poll_timeout=0.5,
                # publications are sparse: a fetch is answered as one arrives (SPARSE_FETCH)
                consumer_config={"enable.partition.eof": True, **SPARSE_FETCH,
                                 **(self._consumer_config or {})}),
                consumers=kafka_consumers(self.bootstrap), stop_event=self._stop, logger=log)
            following.loop.run()
        except BaseException as error:
            with self._lock:
                self._error = error
                self._lock.notify_all()
            raise
        finally:
            self._stop.set()
            self._beat_now.set()
            if beating.is_alive():
                beating.join(10)
            self._leave()
            ledger.close()
            self._producer.flush(5)

    def _caught_up(self, ledger: PublicationLedger, beating: threading.Thread) -> None:
        """The publications as of the start are read: heartbeats start, the newest promoted
        version is tried, and the replica is ready (``wait_ready``)."""
        beating.start()
        self._converge(ledger)
        with self._lock:
            self._ready = True
            self._lock.notify_all()

    def _converge(self, ledger: PublicationLedger) -> None:
        """Load what this replica should serve (``ledger.serving``) if it is another version
        than the one served and not waiting for its retry."""
        newest = ledger.serving(self.model, self.canary_slot)
        with self._lock:
            self._canary = ledger.waiting(self.model)
        if newest is None:
            return
        version = newest.policy_version
        with self._lock:
            if self._version is not None and version == self._version:
                return
            for old in [v for v in self._refused if v != version]:
                del self._refused[old]  # superseded
            refused = self._refused.get(version)
        if refused is not None and time.monotonic() < refused[1]:
            return
        self._load(newest)

    def _load(self, publication: Publication) -> None:
        """Verify, load and hand over one version; on any failure refuse it (see the module
        docstring). Blocks for the load and for ``on_version``."""
        version = publication.policy_version
        started = time.monotonic()
        try:
            if self.loads == ARTIFACT:
                weights, artifact = {}, _verified_artifact(publication)
            else:
                weights, artifact = load_weights(publication.uri, publication.sha256), None
        except CheckpointError as error:
            self._refuse(publication, error)
            return
        if self._version_file is not None:
            # Unknown before the engine is asked to load, so the file never names a version it
            # does not serve (reef_stream.serving.version_file).
            try:
                self._version_file.reloading(publication, self.policy_version)
            except OSError as error:
                self._refuse(publication, ReefError(
                    f"the version file {self._version_file.path} could not be marked reloading "
                    f"({error}), so the engine was not asked to load this version"))
                return
        try:
            self._on_version(LoadedVersion(policy_version=version, weights=weights,
                                           publication=publication, artifact=artifact))
        except Exception as error:  # noqa: BLE001 - the serving code's failure refuses this version
            self._refuse(publication, ReefError(f"on_version raised {type(error).__name__}: "
                                                f"{error}"))
            self._write_version_file()  # the version served before, again
            return
        with self._lock:
            previous = self._version
            self._version = version
            self._served.add(version)
            self._publication = publication
            self._refused.pop(version, None)
            self._loads += 1
            self._lock.notify_all()
        self._write_version_file()
        seconds = time.monotonic() - started
        log.info("replica %s serves version %d of model %s (checkpoint %s, evaluator %s%s; "
                 "was %s; loaded in %.2f s)", self.replica_id, version, self.model,
                 publication.checkpoint_id, publication.evaluator,
                 "" if publication.evaluated else ", UNEVALUATED", previous, seconds)
        self._metric(FOLLOWER_VERSIONS_LOADED, self._loads)
        self._metric(FOLLOWER_LOAD_SECONDS, seconds)
        serving_at = now_ms()
        self._metric(FOLLOWER_PUBLICATION_TO_SERVING_SECONDS,
                     (serving_at - publication.created_at) / 1000)
        if publication.checkpoint_created_at is not None:
            self._metric(FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS,
                         (serving_at - publication.checkpoint_created_at) / 1000)
        self._beat_now.set()

    def _start_version_file(self) -> None:
        """The version file's first content: the initial version, else unknown;
        ``ConfigurationError`` naming the file when it cannot be written."""
        if self._version_file is None:
            return
        try:
            self._version_file.starting(self.policy_version)
        except OSError as error:
            raise ConfigurationError(f"cannot write the version file {self._version_file.path}: "
                                     f"{error}") from None

    def _write_version_file(self) -> None:
        """Make the version file name the version served now. A failure is logged and leaves
        the file saying less than is served (unknown, or the reload in progress), never more;
        the next ``_Following.poll`` tries again. On the follower's thread only."""
        if self._version_file is None:
            return
        with self._lock:
            version, publication = self._version, self._publication
        try:
            self._version_file.serving(version, publication)
        except OSError as error:
            if not self._version_file_behind:
                log.error("replica %s could not write the version file %s (%s): it says the "
                          "version is unknown until a write succeeds", self.replica_id,
                          self._version_file.path, error)
            self._version_file_behind = True
            return
        self._version_file_behind = False

    def _refuse(self, publication: Publication, error: Exception) -> None:
        version = publication.policy_version
        with self._lock:
            first = version not in self._refused
            self._refused[version] = (error, time.monotonic() + self.retry_s)
            self._refusals += 1
            serving = self._version
            self._lock.notify_all()
        (log.error if first else log.warning)(
            "replica %s refused version %d of model %s: %s; it keeps serving %s (retrying every "
            "%.0f s while it is the newest)", self.replica_id, version, self.model, error,
            "nothing" if serving is None else f"version {serving}", self.retry_s)
        self._metric(FOLLOWER_VERSIONS_REFUSED, self._refusals)
        if self._on_refused is not None:
            try:
                self._on_refused(publication, error)
            except Exception as callback_error:  # noqa: BLE001 - a reporting hook
                log.warning("on_refused raised %s", callback_error)

    def _undecodable_publication(self, message: Message, error: InvalidRecord) -> None:
        """The ledger's ``on_undecodable``: log and count, never a dead letter (see the module
        docstring). Called once per record, on the follower's thread."""
        with self._lock:
            self._undecodable += 1
            count = self._undecodable
        log.warning("replica %s ignores a record of %s[%d]@%d that does not decode (%s: %s); "
                    "the evaluator dead-letters it, serving goes on", self.replica_id,
                    message.topic(), message.partition(), message.offset(),
                    type(error).__name__, error.reason)
        self._metric(FOLLOWER_PUBLICATIONS_UNDECODABLE, count)

    def _retry_due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(due <= now for _, due in self._refused.values())

    # ----------------------------------------------------------------- reporting

    def status(self, state: str | None = None) -> ReplicaStatus:
        """This replica as a heartbeat describes it, now."""
        with self._lock:
            version, canary = self._version, self._canary
        on_canary = canary is not None and version == canary.policy_version
        return ReplicaStatus(replica_id=self.replica_id, model=self.model, version=version,
                             host=self.host, last_seen=now_ms(),
                             state=state or ("waiting" if version is None else
                                             "canary" if on_canary else "serving"))

    def _heartbeats(self) -> None:
        """The heartbeat thread: one at once, then every ``heartbeat_s`` or after a load."""
        while True:
            self._beat()
            self._beat_now.wait(self.heartbeat_s)
            self._beat_now.clear()
            if self._stop.is_set():
                return

    def _beat(self, state: str | None = None) -> None:
        status = self.status(state)
        if self._metrics is not None:
            self._metrics.write(FOLLOWER_POLICY_VERSION,
                                -1 if status.version is None else status.version,
                                created_at=status.last_seen,  # the rebuild reads it back
                                **heartbeat_metric_labels(status))
            self._producer.poll(0)
        if self.fleet is not None and status.state != "stopped":
            try:
                self.fleet.heartbeat(status)
            except Exception as error:  # noqa: BLE001 - Redis is a projection; serving goes on
                self._redis_trouble(error)

    def _leave(self) -> None:
        self._beat("stopped")
        if self.fleet is not None:
            try:
                self.fleet.leave(self.replica_id, self.model)
            except Exception as error:  # noqa: BLE001
                self._redis_trouble(error)

    def _redis_trouble(self, error: Exception) -> None:
        if time.monotonic() - self._redis_warned > 60:
            self._redis_warned = time.monotonic()
            log.warning("replica %s could not update the fleet projection in Redis: %s (serving "
                        "goes on; `reef fleet --rebuild` restores the projection)",
                        self.replica_id, error)

    def _metric(self, name: str, value: float) -> None:
        if self._metrics is not None:
            self._metrics.write(name, value)

    def _connect_fleet(self) -> Fleet | None:
        if isinstance(self._fleet_arg, Fleet) or self._fleet_arg is None:
            return self._fleet_arg
        if self._fleet_arg != AUTO:
            raise ConfigurationError(f"fleet must be a reef_stream.publishing.fleet.Fleet, {AUTO!r} or None, "
                                     f"not {self._fleet_arg!r}")
        try:
            return Fleet.from_settings(self._settings, namespace=self.namespace, ttl_s=self.ttl_s)
        except ConfigurationError as error:
            log.info("replica %s: no Redis, so no fleet projection (%s)", self.replica_id, error)
            return None


class _Following:
    """The follower's strategy on the stage loop, a reader (every partition of the
    publications topic from its beginning, nothing committed): records are folded into the
    ledger (``submit``); once the topic is read to where it ended at the start (``at_end``
    or positions), the replica catches up (``Follower._caught_up``); afterwards ``poll``
    converges whenever publications arrived or a refused version's retry is due. Raises
    ``RetryableError`` from ``poll`` when the start's end is not reached within
    ``READ_TIMEOUT_S``."""

    capabilities = frozenset({Rebalancing, PartitionEnd})

    def __init__(self, follower: Follower, ledger: PublicationLedger,
                 beating: threading.Thread) -> None:
        self.follower, self.ledger, self.beating = follower, ledger, beating
        self._ends: dict[int, int] = {}  # partition -> end offset at the start
        self._positions: dict[int, int] = {}
        self._ready = False
        self._arrived = False
        self._deadline = time.monotonic() + READ_TIMEOUT_S
        self.loop: StageLoop | None = None

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            low, high = watermarks(self.loop.consumer, tp.topic, tp.partition)
            self._positions[tp.partition] = max(low, 0)
            self._ends[tp.partition] = high

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """A reader is never revoked."""

    def submit(self, message: Message) -> None:
        self._positions[message.partition()] = message.offset() + 1
        if self.ledger.take([message]):
            self._arrived = True

    def at_end(self, topic: str, partition: int, offset: int) -> None:
        self._positions[partition] = offset

    def poll(self) -> None:
        follower = self.follower
        if not self._ready:
            if all(self._positions.get(p, 0) >= end for p, end in self._ends.items()):
                self._ready = True
                follower._caught_up(self.ledger, self.beating)
            elif time.monotonic() > self._deadline:
                behind = {p: (self._positions.get(p), end) for p, end in self._ends.items()
                          if self._positions.get(p, 0) < end}
                raise RetryableError(f"could not read {self.ledger.topic} to its end within "
                                     f"{READ_TIMEOUT_S:.0f} s (at/end per partition: {behind}); "
                                     "check that the cluster is reachable, then start again")
            return
        arrived, self._arrived = self._arrived, False
        if follower._version_file_behind:
            follower._write_version_file()
        if arrived or follower._retry_due():
            follower._converge(self.ledger)

    def join(self, timeout: float | None) -> None:
        """Nothing held."""

    def close(self) -> None:
        """The ledger and the producer are the follower's."""


def _slot_from_env() -> float:
    """``$REEF_CANARY_SLOT`` as a slot in [0, 1); ``ConfigurationError`` naming it otherwise."""
    text = os.environ[CANARY_SLOT_ENV]
    try:
        slot = float(text)
    except ValueError:
        slot = -1.0
    if not 0 <= slot < 1:
        raise ConfigurationError(f"{CANARY_SLOT_ENV} must be a number in [0, 1) (replica i of n: "
                                 f"i / n), not {text!r}")
    return slot


def _verified_artifact(publication: Publication) -> str:
    """The URI of ``publication``'s serving artifact once every file matches its sha256;
    ``CheckpointError`` (a refusal) when it has none or it does not verify."""
    from reef_stream.engine.artifacts import verify_artifact

    if publication.artifact_uri is None:
        raise CheckpointError(
            f"version {publication.policy_version} of model {publication.model} was published "
            "without a serving artifact (its recipe's model is not a Hugging Face one, or it "
            "was published before artifacts existed): an engine has nothing to load")
    verify_artifact(publication.artifact_uri, publication.artifact_sha256)
    return publication.artifact_uri
