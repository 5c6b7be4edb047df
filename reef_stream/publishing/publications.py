"""Where promoted checkpoints go: the publication ledger and the publication store.

``PublicationLedger`` is the fold of ``<ns>.publications`` (read with ``assign()`` from the
beginning): per model, the incumbent (newest PROMOTED publication), the newest decided
version, and the decision on each checkpoint id. The evaluator asks it before deciding;
replicas' ``Follower`` and the fleet's ``reef fleet --rebuild`` read it to follow.

``PublicationStore`` holds byte-for-byte copies of promoted checkpoints at
``<url>/<model>/v<version>``, out of reach of the trainer's retention; the evaluator copies
a candidate in before it publishes the copy's URI.

Publications are keyed by stage (``publication_key``), so that compaction keeps the latest
of each stage per model and never the wrong one: PROMOTED by ``<model>`` (the incumbent
survives anything later); CANARY by ``<model>#canary``, and so is the REJECTED or ROLLED_BACK
decision that ends a canary (its ``share`` is set): once compacted, a decided canary cannot
look open again; another REJECTED by ``<model>#rejected``; the rollback of a promoted version
(``reef rollback``) by ``<model>#rolled_back``.

Staged publication (``reef_stream.consumers.evaluator.canary``): the ledger's fold, in log order, per
model: the incumbent (``incumbent``) is the newest PROMOTED version, or after a ROLLED_BACK of
the incumbent the version it rolled back to; the open canary (``waiting``) is the newest
CANARY version newer than the incumbent that no later decision ended. A replica serves the
canary when ``takes_canary(canary, slot)``, with its ``canary_slot`` (from its replica id),
else the incumbent (``serving``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

import fsspec

from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord, RetryableError
from reef_stream.core.events import Checkpoint, Decision, Publication
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings
from reef_stream.engine.checkpoints import (
    MANIFEST, CheckpointError, fsync_dir, remove_tree, storage_errors, verify, write_durably,
)
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer, watermarks
from reef_stream.topics.kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

__all__ = ["CANARY_KEY_SUFFIX", "READ_TIMEOUT_S", "REJECTED_KEY_SUFFIX", "ROLLED_BACK_KEY_SUFFIX",
           "PublicationLedger", "PublicationStore", "canary_slot", "default_publication_url",
           "publication_key", "takes_canary", "written_by"]

log = logging.getLogger(__name__)

#: Appended to the model in the key of a REJECTED publication (see the module docstring).
REJECTED_KEY_SUFFIX = "#rejected"
#: Appended to the model in the key of a CANARY publication and of the decision ending one.
CANARY_KEY_SUFFIX = "#canary"
#: Appended to the model in the key of the rollback of a promoted version.
ROLLED_BACK_KEY_SUFFIX = "#rolled_back"
#: How long reading a topic up to its end may take before it is given up (RetryableError).
READ_TIMEOUT_S = 60.0


def default_publication_url(settings: Settings, namespace: str) -> str:
    """``$REEF_HOME/published/<ns>``: where promoted checkpoints are copied unless told."""
    return str(settings.home / "published" / namespace)



def publication_key(publication: Publication) -> bytes:
    """The Kafka key of a publication, by its stage (see the module docstring): the model for
    PROMOTED, ``<model>#canary`` for CANARY and for the REJECTED / ROLLED_BACK ending a canary
    (``share`` set), ``<model>#rolled_back`` for another rollback, else ``<model>#rejected``."""
    decision = publication.decision
    if decision is Decision.PROMOTED:
        return publication.model.encode()
    if decision is Decision.CANARY or publication.share is not None:
        return (publication.model + CANARY_KEY_SUFFIX).encode()
    if decision is Decision.ROLLED_BACK:
        return (publication.model + ROLLED_BACK_KEY_SUFFIX).encode()
    return (publication.model + REJECTED_KEY_SUFFIX).encode()


def written_by(publication: Publication, recipe: str, evaluator: str) -> bool:
    """Whether the evaluator of ``recipe`` (named ``evaluator``) wrote ``publication``: it names
    that recipe, or, written before publications named their recipe (``recipe`` None), that
    evaluator. Two recipes whose evaluators share a name are told apart by the first rule
    only. Pure."""
    if publication.recipe is not None:
        return publication.recipe == recipe
    return publication.evaluator == evaluator


def canary_slot(replica_id: str) -> float:
    """A replica's place in [0, 1) for canary cohorts, from its id alone (sha256): stable
    across restarts. A deployment that numbers its replicas may give replica i of n the slot
    i / n instead (``Follower(canary_slot=...)``): then a share s takes s * n of them, exactly."""
    digest = hashlib.sha256(replica_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def takes_canary(canary: Publication, slot: float) -> bool:
    """Whether the replica at ``slot`` serves the CANARY ``canary``: its slot falls in the
    arc ``[offset, offset + share)`` (mod 1), where the offset comes from the model and the
    version, so each canary takes another cohort of about ``share`` of the fleet. A pure
    function of the publication and the slot: every replica decides alone, the same way
    after a restart."""
    share = canary.share or 0.0
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    digest = hashlib.sha256(f"{canary.model}/{canary.policy_version}".encode()).digest()
    offset = int.from_bytes(digest[:8], "big") / 2 ** 64
    return (slot - offset) % 1.0 < share


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
        self._group = f"reef-ledger-{uuid.uuid4().hex}"
        self._consumer_config = {
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            **(consumer_config or {}),
        }
        self._bootstrap = bootstrap
        self._consumer: Consumer | None = None  # created by open(); a fold-only ledger has none
        #: Asks for the topic's ends on a connection of its own: the reading consumer's has a
        #: fetch waiting there (up to fetch.wait.max.ms, 500 ms), and the broker answers a
        #: connection's requests in order, so each catch_up waited for it.
        self._ends: Consumer | None = None
        self._positions: dict[int, int] = {}
        self._promoted: dict[str, Publication] = {}
        #: model -> version -> its PROMOTED publication, while in the log (rollback targets).
        self._promotions: dict[str, dict[int, Publication]] = {}
        #: model -> the open CANARY publication (newer than the incumbent, not decided since).
        self._canary: dict[str, Publication] = {}
        #: model -> the newest version whose canary ended (or that was promoted): a CANARY
        #: read back after its own end (``record`` first) does not open again.
        self._ended: dict[str, int] = {}
        self._decided: dict[str, int] = {}
        self._by_checkpoint: dict[str, Publication] = {}
        self._on_undecodable = on_undecodable
        #: Publications read from the log (not counting ``record``).
        self.read = 0
        #: Records read from the log that did not decode.
        self.undecodable = 0

    def open(self) -> PublicationLedger:
        """Assign every partition of the topic from its beginning. Blocks for metadata (up to
        30 s). Raises ``ConfigurationError`` when the topic does not exist. Without ``open``
        the ledger only folds what it is given (``take``), read by someone else (the
        ``Follower``'s stage loop)."""
        self._consumer = new_consumer(self._bootstrap, self._group, self._consumer_config)
        self._ends = new_consumer(self._bootstrap, f"{self._group}-ends")
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
            # As many as the offsets say are left: consume returns once they are here, not
            # after its whole timeout (compaction's gaps can make fewer come: then it waits).
            left = sum(max(0, end - self._positions[p]) for p, end in ends.items())
            read += self.take(self._consumer.consume(min(500, left), timeout=0.2))
        return read

    def poll(self, timeout: float) -> list[Publication]:
        """The publications that arrived since the last call, folded in; waits up to
        ``timeout`` seconds for the first one. Blocks; returns [] when none came."""
        return self.take(self._consumer.consume(500, timeout=timeout))

    def record(self, publication: Publication) -> None:
        """Fold in a publication this process just produced, before it is read back. Idempotent."""
        self._fold(publication)

    def incumbent(self, model: str) -> Publication | None:
        """What every replica of ``model`` outside a canary serves: the newest PROMOTED
        publication, or after the rollback of that one, the rolled-back-to version's (its
        PROMOTED publication while in the log, else the rollback with ``uri`` and ``sha256`` of
        that version and ``policy_version`` set to it). None before any promotion."""
        return self._promoted.get(model)

    def waiting(self, model: str) -> Publication | None:
        """The open CANARY publication of ``model`` (waiting for a decision: ``awaiting``),
        or None."""
        return self._canary.get(model)

    def serving(self, model: str, slot: float) -> Publication | None:
        """What the replica at canary ``slot`` serves: the open canary if it takes it
        (``takes_canary``), else the incumbent."""
        canary = self._canary.get(model)
        if canary is not None and takes_canary(canary, slot):
            return canary
        return self._promoted.get(model)

    def promoted_versions(self, model: str) -> list[int]:
        """The versions of ``model`` with a PROMOTED publication still in the log, sorted
        (a rolled-back one excluded)."""
        return sorted(self._promotions.get(model, {}))

    def promotion(self, model: str, version: int) -> Publication | None:
        """The PROMOTED publication of ``version``, if it is still in the log."""
        return self._promotions.get(model, {}).get(version)

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
        for consumer in (self._consumer, self._ends):
            if consumer is not None:
                consumer.close()

    def __enter__(self) -> PublicationLedger:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _watermarks(self, partition: int) -> tuple[int, int]:
        return watermarks(self._ends, self.topic, partition)

    def take(self, messages: list[Message]) -> list[Publication]:
        """Fold in ``messages`` read from the topic (records, end-of-partition events); the
        publications among them, in order. Records that do not decode go to
        ``on_undecodable`` (see the class docstring)."""
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
        """One publication, in log order (see the module docstring)."""
        model, version, decision = publication.model, publication.policy_version, \
            publication.decision
        current = self._promoted.get(model)
        canary = self._canary.get(model)
        if decision is Decision.PROMOTED:
            self._promotions.setdefault(model, {})[version] = publication
            if current is None or version >= current.policy_version:
                self._promoted[model] = publication
            if canary is not None and canary.policy_version <= version:
                del self._canary[model]
            self._ended[model] = max(self._ended.get(model, -1), version)
        elif decision is Decision.CANARY:
            if (current is None or version > current.policy_version) \
                    and version > self._ended.get(model, -1):
                self._canary[model] = publication
        elif canary is not None and canary.policy_version == version:
            del self._canary[model]  # a REJECTED or ROLLED_BACK canary: its replicas go back
            self._ended[model] = max(self._ended.get(model, -1), version)
        elif publication.share is not None:  # ends a canary not open here (read back)
            self._ended[model] = max(self._ended.get(model, -1), version)
        elif decision is Decision.ROLLED_BACK and current is not None \
                and current.policy_version == version and publication.rolled_back_to is not None:
            target = self._promotions.get(model, {}).get(publication.rolled_back_to)
            self._promoted[model] = target if target is not None else dataclasses.replace(
                publication, policy_version=publication.rolled_back_to,
                decision=Decision.PROMOTED, measurement={})
            self._promotions.get(model, {}).pop(version, None)
        if version > self._decided.get(model, -1):
            self._decided[model] = version
        self._by_checkpoint[publication.checkpoint_id] = publication


# --------------------------------------------------------------------------- the store


class PublicationStore:
    """Copies of promoted checkpoints, at ``<url>/<model>/v<version>``, out of reach of the
    trainer's retention, and for a Hugging Face model its serving artifact beside each, at
    ``<url>/<model>/v<version>-serving``. ``url`` is a local path or any fsspec URL.

    A copy holds every file of the checkpoint, byte for byte (manifest included), so it has
    the checkpoint's sha256 and ``checkpoints.load_weights(copy_uri, sha256)`` verifies it (a
    rollback restores its optimizer state too); the artifact is what an engine loads.
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
        except storage_errors() as error:
            raise CheckpointError(f"checkpoint {candidate.uri}: {MANIFEST} cannot be read: "
                                  f"{error}") from error
        if hashlib.sha256(manifest).hexdigest() != candidate.sha256:
            raise CheckpointError(f"checkpoint {candidate.uri} changed while it was copied")
        staging = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            target = staging if self.local else final
            if self.fs.exists(final):
                remove_tree(self.fs, final)
            self.fs.makedirs(target, exist_ok=True)
            for name, data in files.items():
                self._write(f"{target}/{name}", data)
            self._write(f"{target}/{MANIFEST}", manifest)  # last: the copy exists from here on
            if self.local:
                os.rename(staging, final)
                fsync_dir(os.path.dirname(final))
        except storage_errors() as error:
            raise FatalError(f"could not copy checkpoint {candidate.checkpoint_id} to the "
                             f"publication store {self.url}: {error}; nothing was published, "
                             "fix the store and start the evaluator again") from error
        verify(uri, candidate.sha256)
        return uri

    def publish_artifact(self, candidate: Checkpoint, model: Callable[[], Any],
                         dtype: str | None = None) -> Any:
        """Write the candidate's serving artifact (``reef_stream.engine.artifacts``) beside its
        copy, at ``<url>/<model>/v<version>-serving``: ``model()`` builds the recipe's Hugging
        Face model (its base from its path), the candidate's verified weights are loaded into
        it, and ``write_serving_artifact`` writes the directory in ``dtype`` (None: the model's
        own). Returns the ``ServingArtifact``. Blocks (building the model, writing the files).
        One already there (an evaluator that stopped before it published) is replaced whole.
        ``CheckpointError`` when the candidate does not verify, ``FatalError`` when the store
        cannot be written."""
        from reef_stream.engine.artifacts import ArtifactError, write_serving_artifact
        from reef_stream.engine.checkpoints import load_weights

        uri = self._uri(f"{self._path(candidate.model, candidate.policy_version)}-serving")
        weights = load_weights(candidate.uri, candidate.sha256)
        built = model()
        built.load_state_dict(weights)
        try:
            return write_serving_artifact(built, uri, dtype, metadata={
                "model": candidate.model, "policy_version": candidate.policy_version,
                "checkpoint_id": candidate.checkpoint_id, "checkpoint_sha256": candidate.sha256})
        except ArtifactError as error:
            raise FatalError(f"could not write the serving artifact of {candidate.checkpoint_id}"
                             f" to the publication store {self.url}: {error}; nothing was "
                             "published, fix the store and start the evaluator again") from error

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

    def remove(self, model: str, version: int) -> bool:
        """Delete the copy of ``version`` (and its serving artifact); False when there was
        none. Idempotent."""
        path = self._path(model, version)
        found = self.fs.exists(path)
        for doomed in (path, f"{path}-serving"):
            if self.fs.exists(doomed):
                remove_tree(self.fs, doomed)
        return found

    def prune(self, model: str, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` copies of ``model`` (0 keeps all) and leftover
        staging directories; returns the versions deleted. Idempotent."""
        if keep <= 0:
            return []
        doomed = self.versions(model)[:-keep]
        for version in doomed:
            remove_tree(self.fs, self._path(model, version))
            if self.fs.exists(f"{self._path(model, version)}-serving"):
                remove_tree(self.fs, f"{self._path(model, version)}-serving")
        directory = f"{self.root}/{_model_dir(model)}"
        if self.fs.exists(directory):
            for path in self.fs.ls(directory, detail=False):
                if ".tmp-" in path.rstrip("/").rsplit("/", 1)[-1]:
                    remove_tree(self.fs, path)
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
