"""Staged publication in the evaluator: the release policy, the canary's live measurement, and
the decisions it takes.

The recipe's release policy (``Release.of``: the evaluator's ``canary``, ``require_approval``
and ``publish_every_s``, ``reef_stream.api.canary.Staged``; ``reef evaluate`` options override
them) turns a candidate the offline evaluator promoted into one of (``stage``):

- ``CANARY`` with the canary's share, awaiting ``canary``, when the model has an incumbent
  and the recipe has a canary (a model's first version has nothing to be compared with);
- ``CANARY`` with share 0, awaiting ``approval``, when the recipe requires a person;
- ``PROMOTED`` otherwise.

While a model has a version waiting (``PublicationLedger.waiting``), a newer candidate is
REJECTED unmeasured (``waiting_reason``): one staged version at a time, so every canary is
decided against the incumbent it started with. With ``publish_every_s``, a candidate whose
checkpoint is younger than that after the incumbent's checkpoint is REJECTED unmeasured
(``cadence_reason``): the trainer's clock on both sides, so a restarted evaluator decides the
same.

The live measurement (``CanaryWatch``, polled by the evaluator while it is idle): for the
open canary C of a model with incumbent I, read ``<ns>.generations`` and ``<ns>.feedback``
from the canary's publication time (``offsets_for_times``, every partition), keep the
generations of C and I created since then, join each with its first feedback (of the
canary's ``source``, or any), and fold the rewards into one running ``Arm`` per version
(``Tally``). After every joined sample the canary's ``judge(candidate, incumbent)`` is asked;
the first PROMOTE or ROLL_BACK is the decision (``verdict_publication``): PROMOTED (or, when
approval is required, CANARY awaiting ``approval`` with the canary's figures) or ROLLED_BACK
to I (its replicas switch back). The state is a fold of the log from the canary's start: a
restarted evaluator reads it again from there, and once decided the decision is an event it
finds in the ledger.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from reef_stream.api.canary import Action, Arm, CanaryEvaluator, MeanDifference, Verdict
from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import Checkpoint, Decision, Feedback, Generation, Publication, now_ms
from reef_stream.core.serde import SchemaRegistry
from reef_stream.publishing.publications import PublicationLedger, written_by
from reef_stream.topics import declarations
from reef_stream.topics.connect import ask_broker, new_consumer
from reef_stream.topics.kafka import Consumer, KafkaError, TopicPartition

__all__ = ["AWAITING_APPROVAL", "AWAITING_CANARY", "CanaryWatch", "Release", "Tally",
           "cadence_reason", "judged", "stage", "verdict_publication", "waiting_reason"]

log = logging.getLogger(__name__)

AWAITING_CANARY = "canary"
AWAITING_APPROVAL = "approval"
#: Read the live topics from this long before the canary's publication (clock skew).
START_SLACK_MS = 0
#: Feedback read before its generation, kept per canary until it is joined (the oldest go first).
MAX_PENDING = 200_000


@dataclass(frozen=True)
class Release:
    """How a promoted candidate is released (see the module docstring)."""

    canary: CanaryEvaluator | None = None
    require_approval: bool = False
    publish_every_s: float | None = None

    @classmethod
    def of(cls, evaluator: object, *, canary_share: float | None = None,
           require_approval: bool | None = None,
           publish_every_s: float | None = None) -> Release:
        """The release policy of a recipe's evaluator, with the evaluator options that override
        it (None: the recipe's). ``canary_share`` changes the canary's share (0 turns the
        canary off; for a recipe without a canary, it is ``MeanDifference(share=...)`` with
        its defaults, on every feedback source)."""
        canary = getattr(evaluator, "canary", None)
        if canary_share is not None:
            if canary_share == 0:
                canary = None
            elif canary is None:
                canary = MeanDifference(share=canary_share)
            elif dataclasses.is_dataclass(canary):
                canary = dataclasses.replace(canary, share=canary_share)
            else:
                raise ConfigurationError(f"the canary {type(canary).__name__} is not a "
                                         "dataclass: its share cannot be overridden")
        approval = bool(getattr(evaluator, "require_approval", False)) \
            if require_approval is None else require_approval
        every = getattr(evaluator, "publish_every_s", None) if publish_every_s is None \
            else publish_every_s
        return cls(canary=canary, require_approval=approval, publish_every_s=every)


def cadence_reason(candidate: Checkpoint, incumbent: Publication | None,
                   every_s: float | None) -> str | None:
    """Why ``candidate`` is not published under the cadence (at most one promotion per
    ``every_s`` seconds of the trainer's clock), or None. Never for a model's first version,
    a rollback checkpoint, or an incumbent published before checkpoint times were recorded."""
    if every_s is None or incumbent is None or candidate.rolled_back_to is not None \
            or incumbent.checkpoint_created_at is None:
        return None
    since = (candidate.created_at - incumbent.checkpoint_created_at) / 1000
    if since >= every_s:
        return None
    return (f"publication cadence: version {incumbent.policy_version} was published from a "
            f"checkpoint {since:.1f} s older than this one; at most one per {every_s:g} s")


def waiting_reason(waiting: Publication) -> str:
    """The reason a candidate is REJECTED while ``waiting`` (a CANARY) is not decided."""
    what = ("its canary's measurement on live feedback" if waiting.awaiting == AWAITING_CANARY
            else "a person's approval (reef approve / reef reject)")
    return (f"version {waiting.policy_version} is staged, waiting for {what}: one staged "
            "version at a time")


def stage(publication: Publication, release: Release, has_incumbent: bool) -> Publication:
    """The publication of a candidate the offline gate PROMOTED, staged by ``release``."""
    if release.canary is not None and has_incumbent:
        return dataclasses.replace(
            publication, decision=Decision.CANARY, share=float(release.canary.share),
            awaiting=AWAITING_CANARY,
            reason=f"{publication.reason}; canary on a share of {release.canary.share:g} of "
                   f"the replicas, judged by {release.canary.name} on live feedback")
    if release.require_approval:
        return dataclasses.replace(
            publication, decision=Decision.CANARY, share=0.0, awaiting=AWAITING_APPROVAL,
            reason=f"{publication.reason}; waiting for a person's approval")
    return publication


def prune_copies(store, publication: Publication, keep: int) -> None:
    """After a decision is committed: a PROMOTED one prunes the model's copies to the newest
    ``keep`` (``PublicationStore.prune``); a canary that ended without promotion (REJECTED or
    ROLLED_BACK, ``share`` set) has its own copy deleted at once, so rolled-back canaries do
    not push the earlier promoted versions (``reef rollback`` targets) out of the retention.
    Best effort: a failure is logged (the copies are redone from the log or pruned later)."""
    model, version = publication.model, publication.policy_version
    try:
        if publication.decision is Decision.PROMOTED:
            pruned = store.prune(model, keep)
            if pruned:
                log.info("pruned published copies of %s: versions %s", model, pruned)
        elif publication.share is not None and publication.decision in (
                Decision.REJECTED, Decision.ROLLED_BACK) and store.remove(model, version):
            log.info("deleted the published copy of %s version %d: its canary ended %s", model,
                     version, publication.decision.value)
    except OSError as error:
        log.warning("could not prune old copies of %s: %s", model, error)


def verdict_publication(canary: Publication, incumbent: Publication, verdict: Verdict,
                        release: Release, name: str, *, recipe: str) -> Publication:
    """The decision a PROMOTE or ROLL_BACK ``verdict`` of the judge ``name`` on ``canary``
    publishes, written by the evaluator of ``recipe``."""
    measurement = {**canary.measurement,
                   **{key: value for key, value in verdict.figures.items()
                      if math.isfinite(value)}}
    common = dict(measurement=measurement, created_at=now_ms(), evaluator=name,
                  incumbent_version=incumbent.policy_version, decided_by=None, recipe=recipe)
    if verdict.action is Action.ROLL_BACK:
        return dataclasses.replace(
            canary, decision=Decision.ROLLED_BACK, awaiting=None,
            reason=f"canary rolled back: {verdict.reason}",
            rolled_back_to=incumbent.policy_version, uri=incumbent.uri, sha256=incumbent.sha256,
            artifact_uri=incumbent.artifact_uri, artifact_sha256=incumbent.artifact_sha256,
            artifact_kind=incumbent.artifact_kind, **common)
    if release.require_approval:
        return dataclasses.replace(
            canary, awaiting=AWAITING_APPROVAL,
            reason=f"canary passed: {verdict.reason}; waiting for a person's approval",
            **common)
    return dataclasses.replace(canary, decision=Decision.PROMOTED, share=None, awaiting=None,
                               reason=f"canary passed: {verdict.reason}", **common)


def judged(ledger: PublicationLedger, *, recipe: str, evaluator: str,
           only: str | None = None) -> list[str]:
    """The models (of ``only`` alone, when given) whose version waiting for a decision the
    evaluator of ``recipe`` (named ``evaluator``) judges: the one it wrote (``written_by``:
    by the publication's recipe; by the evaluator's name for one written before publications
    named their recipe). So of two recipes whose evaluators share a name, only the one that
    opened a canary judges it. Pure."""
    return [m for m in ledger.models() if only in (None, m)
            and (w := ledger.waiting(m)) is not None and written_by(w, recipe, evaluator)]


# --------------------------------------------------------------------------- the fold


@dataclass
class _Running:
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:  # Welford
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    def arm(self, version: int) -> Arm:
        variance = self.m2 / (self.count - 1) if self.count > 1 else 0.0
        return Arm(version, self.count, self.mean, variance)


@dataclass
class Tally:
    """The live rewards of a canary and its incumbent: a pure fold of generations and feedback
    (in any interleaving: feedback read before its generation waits for it). One reward per
    generation: its first feedback of ``source`` (any source when None)."""

    model: str
    candidate: int
    incumbent: int
    since_ms: int
    source: str | None = None
    _versions: dict[str, int] = field(default_factory=dict)
    _pending: dict[str, float] = field(default_factory=dict)
    _joined: set[str] = field(default_factory=set)
    _arms: dict[int, _Running] = field(default_factory=dict)

    def generation(self, generation: Generation) -> bool:
        """Fold one generation; True when it joined feedback already read."""
        if generation.model != self.model or generation.created_at < self.since_ms \
                or generation.policy_version not in (self.candidate, self.incumbent):
            return False
        self._versions[generation.generation_id] = generation.policy_version
        reward = self._pending.pop(generation.generation_id, None)
        return reward is not None and self._join(generation.generation_id, reward)

    def feedback(self, feedback: Feedback) -> bool:
        """Fold one feedback record; True when it made a new sample."""
        if self.source is not None and feedback.source != self.source:
            return False
        gid = feedback.generation_id
        if gid in self._joined:
            return False
        if gid in self._versions:
            return self._join(gid, feedback.reward)
        if gid not in self._pending:
            if len(self._pending) >= MAX_PENDING:
                self._pending.pop(next(iter(self._pending)))
            self._pending[gid] = feedback.reward
        return False

    def _join(self, gid: str, reward: float) -> bool:
        if not math.isfinite(reward):
            return False
        self._joined.add(gid)
        self._arms.setdefault(self._versions[gid], _Running()).add(float(reward))
        return True

    def arms(self) -> tuple[Arm, Arm]:
        """(canary, incumbent)."""
        return (self._arms.get(self.candidate, _Running()).arm(self.candidate),
                self._arms.get(self.incumbent, _Running()).arm(self.incumbent))


# --------------------------------------------------------------------------- reading the log


class CanaryWatch:
    """Reads the live topics for one open canary and asks its judge (see the module docstring).
    ``step`` never blocks for long (one consume of up to ``batch`` records); ``close`` at the
    end. One thread."""

    def __init__(self, bootstrap: str, namespace: str, canary: Publication,
                 incumbent: Publication, judge: CanaryEvaluator, *,
                 registry: SchemaRegistry | None = None, batch: int = 2000) -> None:
        self.canary, self.incumbent, self.judge = canary, incumbent, judge
        self.tally = Tally(canary.model, canary.policy_version, incumbent.policy_version,
                           canary.created_at - START_SLACK_MS, getattr(judge, "source", None))
        self.batch = batch
        self.verdict: Verdict | None = None
        self.read = 0
        self._registry = registry or SchemaRegistry.default()
        self._generations = declarations.generations(namespace)
        self._feedback = declarations.feedback(namespace)
        self._consumer: Consumer = new_consumer(
            bootstrap, f"reef-canary-{uuid.uuid4().hex}",
            {"enable.auto.offset.store": False, "enable.partition.eof": False})
        self._assign()

    def _assign(self) -> None:
        wanted = []
        for topic in (self._generations, self._feedback):
            metadata = self._consumer.list_topics(topic, timeout=30).topics.get(topic)
            if metadata is None or metadata.error is not None or not metadata.partitions:
                raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
            wanted += [TopicPartition(topic, p, self.tally.since_ms)
                       for p in sorted(metadata.partitions)]
        starts = ask_broker("finding where the canary's live feedback starts",
                            lambda: self._consumer.offsets_for_times(wanted, timeout=10))
        # No record at or after the time: the partition's end (OFFSET_END, -1) is right.
        self._consumer.assign(starts)

    def key(self) -> tuple[str, int, int]:
        return self.canary.model, self.canary.policy_version, self.incumbent.policy_version

    def step(self, timeout: float = 0.0) -> Verdict | None:
        """Fold what arrived; the first deciding verdict (PROMOTE or ROLL_BACK), or None."""
        if self.verdict is not None:
            return self.verdict
        for message in self._consumer.consume(self.batch, timeout=timeout):
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("reading %s for the canary: %s", message.topic(), error.str())
                continue
            if message.value() is None:
                continue
            self.read += 1
            event_type = Generation if message.topic() == self._generations else Feedback
            try:
                event = self._registry.decode(message.value(), message.headers(), event_type,
                                              topic=message.topic(),
                                              partition=message.partition(),
                                              offset=message.offset())
            except InvalidRecord:
                continue  # the stages that own these topics dead-letter it
            joined = self.tally.generation(event) if event_type is Generation \
                else self.tally.feedback(event)
            if joined:
                verdict = self.judge.judge(*self.tally.arms())
                if verdict.action is not Action.WAIT:
                    self.verdict = verdict
                    return verdict
        return None

    def close(self) -> None:
        self._consumer.close()


class CanaryRunner:
    """The evaluator's canary part: one ``CanaryWatch`` for the open canary of each model it
    decides on, created from the ledger, replaced when the canary changes. ``decisions``
    returns the publications to produce (at most one per model per call)."""

    def __init__(self, bootstrap: str, namespace: str, release: Release, *,
                 registry: SchemaRegistry | None = None, every_s: float = 0.2) -> None:
        self.bootstrap, self.namespace, self.release = bootstrap, namespace, release
        self._registry = registry
        self._watches: dict[str, CanaryWatch] = {}
        self._every_s, self._last = every_s, 0.0

    def decisions(self, ledger: PublicationLedger, *, recipe: str, evaluator: str,
                  model: str | None = None) -> list[Publication]:
        """The canary decisions due now (the ledger read by the caller) on the open canaries
        that the evaluator of ``recipe``, named ``evaluator``, judges (``judged``; of
        ``model`` only, if given)."""
        judge = self.release.canary
        if judge is None or time.monotonic() - self._last < self._every_s:
            return []
        self._last = time.monotonic()
        found = []
        models = judged(ledger, recipe=recipe, evaluator=evaluator, only=model)
        for model in set(models) | set(self._watches):
            canary, incumbent = ledger.waiting(model), ledger.incumbent(model)
            watch = self._watches.get(model)
            if canary is None or incumbent is None or canary.awaiting != AWAITING_CANARY:
                if watch is not None:
                    watch.close()
                    del self._watches[model]
                continue
            key = (model, canary.policy_version, incumbent.policy_version)
            if watch is None or watch.key() != key:
                if watch is not None:
                    watch.close()
                watch = self._watches[model] = CanaryWatch(
                    self.bootstrap, self.namespace, canary, incumbent, judge,
                    registry=self._registry)
                log.info("canary of %s version %d (share %g) against version %d: reading live "
                         "feedback since %d", model, canary.policy_version, canary.share or 0,
                         incumbent.policy_version, watch.tally.since_ms)
            verdict = watch.step()
            if verdict is not None:
                found.append(verdict_publication(canary, incumbent, verdict, self.release,
                                                 judge.name, recipe=recipe))
        return found

    def close(self) -> None:
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
