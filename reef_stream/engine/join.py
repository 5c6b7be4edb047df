"""The processor: recorded generations and feedback in, typed units and explicit outcomes out.

A ``Processor`` (what a method author writes) composes ``Grouping``, ``FeedbackPolicy`` and
``UnitBuilder`` (built-in parts: ``reef_stream.api.parts``). ``ProcessorState`` is the
join/group state machine that drives one, in the processor runtime and in
``reef_stream.engine.testing.run_processor`` alike; every time is one the caller passes in,
never the wall clock. Its promises:

- a generation seen before (within ``retention_ms``) is a duplicate, dropped and counted;
  every other one gets exactly one ``Outcome`` (UNIT, EXPIRED after ``timeout_ms``,
  TOO_STALE beyond ``max_staleness``, SHED past ``max_backlog``, INVALID, UNKNOWN_VERSION),
  with a reason; a generation whose version its producer could not tell is handled by
  ``unknown_version`` (``reef_stream.api.schedule``: rejected, or taken as the stalest);
- feedback joins its generation by id in either order and gets exactly one
  ``FeedbackFate`` (USED, IGNORED, DUPLICATE, LATE, UNUSED, ORPHANED);
- a group becomes one unit once its ``group_size`` members are scored (or a smaller one
  at its deadline if ``Grouping.accept_incomplete``); a unit's id, member order and
  ``created_at`` depend only on its members, so a re-emitted unit is the same unit;
- a multi-turn generation's environment tokens are masked (``policy_mask()``), never trained.

State is kept per key; concluded generations and closed groups are remembered in a
``reef_stream.engine.ledger.Ledger``. ``Step`` names the keys it changed; ``snapshot`` and
``restore`` move a key's state. Every rule in full: ``docs/design-notes.md`` ("The join").
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from reef_stream.api.processor import (
    DEFAULT_RETENTION_MS, MissingFeedback, Origin, Processor, Score, Scored, processor_problems,
    unit_id,
)
from reef_stream.api.schedule import REJECT, STALEST, UNKNOWN_VERSION_RULES
from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import EpochMillis, Feedback, Generation, RolloutUnit
from reef_stream.engine.ledger import Ledger, segment_of
from reef_stream.engine.snapshots import (
    Encoded, Member, Received, dumps_snapshot, member_from, member_record, received_from,
    received_records,
)

UnitT = TypeVar("UnitT")
EventT = TypeVar("EventT")
UnitT_co = TypeVar("UnitT_co", covariant=True)

#: Why a shed group closed (the same words for every one: the ledger stores a group of one
#: that was shed without an entry of its own).
SHED_CLOSURE = "shed: the trainer's backlog was full"


from reef_stream.engine.outcomes import (  # noqa: F401 - re-exported: the join's vocabulary
    DroppedGeneration,
    EmittedUnit,
    FeedbackFate,
    FeedbackOutcome,
    GenerationOutcome,
    Outcome,
    Step,
)


@dataclass(slots=True, eq=False)
class _StepBuilder:
    units: list[EmittedUnit[Any]] = field(default_factory=list)
    generations: list[GenerationOutcome] = field(default_factory=list)
    feedback: list[FeedbackOutcome] = field(default_factory=list)
    duplicates: list[DroppedGeneration] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)

    def fate(self, entry: Received, fate: FeedbackFate, reason: str, at: int,
             generation: Generation | None = None) -> None:
        self.feedback.append(FeedbackOutcome(
            entry.feedback, fate, reason, entry.origin, at,
            None if generation is None else generation.policy_version,
            generation is None or generation.policy_version_known))

    def build(self) -> Step:
        return Step(tuple(self.units), tuple(self.generations), tuple(self.feedback),
                    tuple(self.duplicates), tuple(sorted(self.touched)))


# =========================================================================== the state machine


@dataclass(slots=True, eq=False)
class _Bucket:
    """The pending state of one key: an open group (declared size, members admitted, deadline,
    the first member's id, its pending members) and feedback ahead of its generation. What
    concluded or closed is in the ledger."""

    size: int | None = None
    admitted: int = 0
    deadline: int = 0
    first: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    orphans: dict[str, dict[str, Received]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.members or self.orphans or self.size is not None)


class ProcessorState(Generic[UnitT]):
    """The join/group state machine of one processor over one stream (or one partition of it).

    Not thread-safe: one caller at a time. Every method is non-blocking (no
    I/O) and returns what it decided as a ``Step``. Times are integers of the
    caller's clock in ms (use the log's record timestamps, so a replay decides
    as the live run did): ``at`` is when a record arrived; ``tick(now)``
    advances the clock and is the only call that expires anything.

    Order of calls: after a restart, ``restore`` every saved key and
    ``observe_checkpoint`` the newest checkpoint version first; then any
    interleaving of ``offer_generation``, ``offer_feedback`` (or ``offer_all``,
    several at once), ``observe_checkpoint`` and ``tick``. Offering a record twice is safe (the
    second is a duplicate); ``tick`` and ``observe_checkpoint`` are idempotent.
    ``retention_ms`` (None: the processor's, else ``DEFAULT_RETENTION_MS``): how
    long concluded generations and closed groups are remembered, by ledger
    entries without their records (``reef_stream.engine.ledger``).
    ``max_backlog`` (None: no bound): see ``observe_backlog``. ``unknown_version``: what
    becomes of a generation whose version is unknown (``Generation.policy_version_known``):
    ``reject`` ends it UNKNOWN_VERSION, ``stalest`` takes its version as 0, the oldest it can
    be, for ``max_staleness`` (``reef_stream.api.schedule``).
    """

    def __init__(self, processor: Processor[UnitT], *, recipe: str,
                 max_staleness: int | None = None, retention_ms: int | None = None,
                 max_backlog: int | None = None, unknown_version: str = REJECT):
        problems = processor_problems(processor)
        timeout = getattr(getattr(processor, "feedback", None), "timeout_ms", 0)
        if retention_ms is None:
            retention_ms = getattr(processor, "retention_ms", DEFAULT_RETENTION_MS)
        elif isinstance(timeout, int) and retention_ms <= timeout:
            problems.append(f"retention_ms ({retention_ms}) must exceed the feedback timeout "
                            f"({timeout} ms)")
        if max_staleness is not None and max_staleness < 0:
            problems.append(f"max_staleness must be at least 0, got {max_staleness}")
        if max_backlog is not None and max_backlog < 1:
            problems.append(f"max_backlog must be at least 1 unit, got {max_backlog}")
        if unknown_version not in UNKNOWN_VERSION_RULES:
            problems.append(f"unknown_version must be one of {list(UNKNOWN_VERSION_RULES)}, got "
                            f"{unknown_version!r}")
        if problems:
            raise ConfigurationError(problems)
        self.processor, self.recipe = processor, recipe
        self.max_staleness, self.retention_ms = max_staleness, retention_ms
        self.max_backlog, self.unknown_version = max_backlog, unknown_version
        self._backlog = 0       # units waiting for the trainer, as last observed (+ emitted since)
        self._timeout: int = processor.feedback.timeout_ms
        self._clock = 0
        self._newest: int | None = None
        self._buckets: dict[str, _Bucket] = {}
        self._ledger = Ledger(retention_ms, functools.partial(_implied_closure, recipe))
        self._where: dict[str, str] = {}  # pending generation id -> its key
        self._orphan_at: dict[str, str] = {}  # generation id -> key holding its early feedback
        self._active: set[str] = set()  # keys with pending members
        self._timers: list[tuple[int, str]] = []  # heap; an entry is live iff _wake[key] == time
        self._wake: dict[str, int] = {}
        self._rewrite: set[str] = set()  # keys restored from version-1 snapshots (see restore)

    @classmethod
    def for_recipe(cls, recipe: Any, *, retention_ms: int | None = None) -> ProcessorState:
        """The state machine of ``recipe``'s processor, with its name, its schedule's
        ``max_staleness``, backlog bound and ``unknown_version`` rule, and (unless given) its
        processor's retention."""
        return cls(recipe.processor, recipe=recipe.name,
                   max_staleness=recipe.schedule.max_staleness, retention_ms=retention_ms,
                   max_backlog=recipe.schedule.max_backlog_units,
                   unknown_version=recipe.schedule.unknown_version)

    # ------------------------------------------------------------------- reading (pure)

    @property
    def clock(self) -> int:
        """The latest time passed in."""
        return self._clock

    @property
    def newest_checkpoint_version(self) -> int | None:
        return self._newest

    def keys(self) -> list[str]:
        """Every key holding state, sorted (the ledger's segment keys among them)."""
        return sorted([*self._buckets, *self._ledger.keys()])

    def pending_generations(self) -> list[str]:
        """Ids of the generations without an outcome yet, sorted."""
        return sorted(g for key in self._active for g in self._buckets[key].members)

    def waiting_feedback(self) -> int:
        """How many feedback records are held without a fate yet."""
        orphans = sum(len(self._buckets[key].orphans[g]) for g, key in self._orphan_at.items())
        return orphans + sum(len(m.received) for key in self._active
                             for m in self._buckets[key].members.values())

    def next_deadline(self) -> int | None:
        """The earliest time at which ``tick`` may decide something; None if nothing waits."""
        while self._timers and self._wake.get(self._timers[0][1]) != self._timers[0][0]:
            heapq.heappop(self._timers)
        due = [t for t in (self._timers[0][0] if self._timers else None,
                           self._ledger.next_expiry()) if t is not None]
        return min(due, default=None)

    # ------------------------------------------------------------------- input

    def offer(self, record: Generation | Feedback, *, at: int, origin: Origin | None = None,
              encoded: Encoded | None = None) -> Step:
        """``offer_generation`` or ``offer_feedback``, by the record's type."""
        step = _StepBuilder()
        self._offer(record, at, origin, encoded, step)
        return self._done(step)

    def offer_all(self, records: Iterable[tuple[Generation | Feedback, int, Origin | None,
                                                Encoded | None]]) -> Step:
        """Offer each ``(record, at, origin, encoded)`` in turn, as ``offer`` would, and return
        what they decided together as one ``Step`` (outcomes in the same order as the ``Step``s
        of one ``offer`` per record would list them, one after another). The same state
        results as from one ``offer`` per record; it saves the per-record bookkeeping (one
        ``Step``, one rescheduling of each key touched) for a caller that handles a batch
        of records at once, as the runtime does per fetch. Non-blocking."""
        step = _StepBuilder()
        for record, at, origin, encoded in records:
            self._offer(record, at, origin, encoded, step)
        return self._done(step)

    def _offer(self, record: Generation | Feedback, at: int, origin: Origin | None,
               encoded: Encoded | None, step: _StepBuilder) -> None:
        if isinstance(record, Generation):
            self._offer_generation(record, at, origin, encoded, step)
        elif isinstance(record, Feedback):
            self._offer_feedback(record, at, origin, encoded, step)
        else:
            raise TypeError(f"a processor takes Generation and Feedback, not "
                            f"{type(record).__name__}")

    def offer_generation(self, generation: Generation, *, at: int,
                         origin: Origin | None = None, encoded: Encoded | None = None) -> Step:
        """Take one generation that arrived at ``at``. Non-blocking; a duplicate is dropped.
        ``encoded``: the generation as it was read (Avro bytes and writer-schema fingerprint),
        kept for its snapshots instead of encoding it again (see ``snapshots.Encoded``)."""
        step = _StepBuilder()
        self._offer_generation(generation, at, origin, encoded, step)
        return self._done(step)

    def _offer_generation(self, generation: Generation, at: int, origin: Origin | None,
                          encoded: Encoded | None, step: _StepBuilder) -> None:
        gid = generation.generation_id
        self._clock = max(self._clock, at)
        if gid in self._where or self._ledger.concluded(gid) is not None:
            reason = f"generation {gid} was already received"
            step.duplicates.append(DroppedGeneration(generation, reason, origin, at))
            return
        member = Member(generation, at, at + self._timeout, origin, encoded=encoded)
        try:
            key, size = self._group_of(generation)
            rejection = self._admission(key, self._bucket(key, step), gid, size)
        except InvalidRecord as error:
            key, size = generation.group_id or gid, 0
            rejection = Outcome.INVALID, f"cannot be grouped: {error}"
        if rejection is None and generation.segments:
            try:
                generation.policy_mask()
            except InvalidRecord as error:
                rejection = Outcome.INVALID, f"its segments do not fit its completion: {error}"
        bucket = self._bucket(key, step)
        self._where[gid] = key
        self._adopt_orphans(member, step)
        if rejection is not None:
            outcome, reason = rejection
            if outcome is Outcome.INVALID and size and self._ledger.closure(key) is None:
                self._invalidate(key, bucket, reason, at, step)
            self._conclude(key, bucket, member, outcome, reason, at, step)
            return
        bucket.size, bucket.admitted = size, bucket.admitted + 1
        bucket.first = bucket.first or gid
        bucket.deadline = max(bucket.deadline, member.deadline)
        if too_old := self._too_old(generation):
            self._conclude(key, bucket, member, *too_old, at, step)
        else:
            bucket.members[gid] = member
            self._active.add(key)
            self._try_score(key, bucket, member, at, step, final=False)
        self._check_group(key, bucket, at, step)

    def offer_feedback(self, feedback: Feedback, *, at: int, origin: Origin | None = None,
                       encoded: Encoded | None = None) -> Step:
        """Take one feedback record that arrived at ``at``. Non-blocking; a duplicate (same
        generation id and source) is dropped. ``encoded``: as for ``offer_generation``."""
        step = _StepBuilder()
        self._offer_feedback(feedback, at, origin, encoded, step)
        return self._done(step)

    def _offer_feedback(self, feedback: Feedback, at: int, origin: Origin | None,
                        encoded: Encoded | None, step: _StepBuilder) -> None:
        entry = Received(feedback, at, origin, encoded=encoded)
        gid, source = feedback.generation_id, feedback.source
        self._clock = max(self._clock, at)
        if not self.processor.feedback.wants(source):
            step.fate(entry, FeedbackFate.IGNORED, f"the processor does not use {source!r}", at)
            return
        if (key := self._where.get(gid)) is not None:
            bucket = self._bucket(key, step)
            member = bucket.members[gid]
            if source in member.seen:
                step.fate(entry, FeedbackFate.DUPLICATE, _duplicate(source, gid), at)
            elif member.score is not None:
                member.seen.add(source)
                step.fate(entry, FeedbackFate.LATE, f"arrived after generation {gid} was "
                          f"scored from {list(member.score.sources)}", at)
            else:
                member.seen.add(source)
                member.received[source] = entry
                self._try_score(key, bucket, member, at, step, final=False)
                self._check_group(key, bucket, at, step)
            return
        if (concluded := self._ledger.concluded(gid)) is not None:
            if source in concluded.sources:
                step.fate(entry, FeedbackFate.DUPLICATE, _duplicate(source, gid), at)
            else:
                sources = tuple(sorted((*concluded.sources, source)))
                step.touched.add(self._ledger.update(gid, concluded._replace(sources=sources)))
                step.fate(entry, FeedbackFate.LATE, f"arrived after generation {gid} "
                          f"concluded as {concluded.outcome}", at)
            return
        key = self._orphan_at.get(gid) or feedback.group_id or gid
        waiting = self._bucket(key, step).orphans.setdefault(gid, {})
        if source in waiting:
            step.fate(entry, FeedbackFate.DUPLICATE, _duplicate(source, gid), at)
        else:
            waiting[source] = entry
            self._orphan_at[gid] = key

    def observe_backlog(self, units: int) -> None:
        """Learn how many units wait for the trainer: emitted, and not yet behind the offsets of
        its newest checkpoint. Non-blocking. Until the next call, each unit emitted counts one
        more. While they are ``max_backlog`` or more (and a checkpoint was observed: a trainer
        exists), a unit that completes is not emitted: its generations end SHED, so the queue
        in front of the trainer stays short and what it trains stays fresh (see
        ``reef_stream.api.schedule``)."""
        self._backlog = max(int(units), 0)

    def backlog_room(self) -> int | None:
        """How many more units may be emitted before what completes is shed (``observe_backlog``,
        and each unit emitted since): 0 when full; None while nothing is shed (no bound, or no
        checkpoint observed yet)."""
        if self.max_backlog is None or self._newest is None:
            return None
        return max(self.max_backlog - self._backlog, 0)

    def observe_checkpoint(self, policy_version: int) -> Step:
        """Learn that a checkpoint of ``policy_version`` exists. Non-blocking, idempotent.
        When it is the newest yet, every pending generation now more than
        ``max_staleness`` versions behind it ends TOO_STALE (one of unknown version counts as
        version 0 here: only ``stalest`` lets one be pending)."""
        step = _StepBuilder()
        if self._newest is not None and policy_version <= self._newest:
            return self._done(step)
        self._newest = policy_version
        for key in sorted(self._active) if self.max_staleness is not None else ():
            bucket = self._buckets[key]
            for gid in sorted(bucket.members):
                if too_old := self._too_old(bucket.members[gid].generation):
                    self._conclude(key, bucket, bucket.members[gid], *too_old, self._clock, step)
            self._check_group(key, bucket, self._clock, step)
        return self._done(step)

    def tick(self, now: int) -> Step:
        """Advance the clock to ``now`` and decide everything due by then: feedback and group
        deadlines, feedback waiting in vain, forgetting what concluded ``retention_ms`` ago.
        Non-blocking, idempotent; call it regularly (e.g. after each batch of records, with
        the newest record timestamp)."""
        step = _StepBuilder()
        self._clock = now = max(self._clock, now)
        due = set()
        while self._timers and self._timers[0][0] <= now:
            time, key = heapq.heappop(self._timers)
            if self._wake.get(key) == time:
                del self._wake[key]
                due.add(key)
        for key in sorted(due & self._buckets.keys()):
            self._sweep(key, self._buckets[key], now, step)
        step.touched.update(self._ledger.expire(now))
        return self._done(step)

    # ------------------------------------------------------------------- snapshot / restore

    def snapshot(self, key: str) -> dict[str, Any] | None:
        """The state of ``key`` as JSON-ready data (dicts, lists, str, int, float, bool, None;
        events as Avro bytes in base64 with their schema fingerprint), or None when the key
        holds nothing (delete it from the table). Call it for each key in ``Step.touched``;
        it changes nothing (it caches each event's encoding)."""
        if segment_of(key) is not None:
            return self._ledger.snapshot(key)
        bucket = self._buckets.get(key)
        if bucket is None or bucket.empty():
            return None
        return {
            "version": 2, "size": bucket.size, "admitted": bucket.admitted,
            "deadline": bucket.deadline, "first": bucket.first,
            "members": [member_record(bucket.members[g]) for g in sorted(bucket.members)],
            "orphans": [{"generation_id": g, "received": received_records(bucket.orphans[g])}
                        for g in sorted(bucket.orphans)],
        }

    def snapshot_bytes(self, key: str) -> bytes | None:
        """``dumps_snapshot(snapshot(key))`` (the changelog record of ``key``), the same bytes;
        a ledger segment's from its entries' kept JSON text (``Ledger.snapshot_bytes``)."""
        if segment_of(key) is not None:
            return self._ledger.snapshot_bytes(key)
        snapshot = self.snapshot(key)
        return None if snapshot is None else dumps_snapshot(snapshot)

    def restore(self, key: str, snapshot: Mapping[str, Any]) -> None:
        """Load ``key``'s state from ``snapshot``, replacing what the key held (a ledger
        segment's entries are added). Idempotent; call it for every saved key before offering
        records after a restart. A version-1 snapshot (before the ledger) loads too: the next
        ``Step`` names its key and the segments it went to, for the caller to rewrite them."""
        version = snapshot.get("version")
        if version not in (1, 2) or (version == 1 and segment_of(key) is not None):
            raise FatalError(f"snapshot of {key!r} has unknown version {version!r}")
        if segment_of(key) is not None:
            self._ledger.restore(key, snapshot)
            return
        self._forget(key)
        bucket = self._buckets[key] = _Bucket(
            size=snapshot["size"], admitted=snapshot["admitted"], deadline=snapshot["deadline"],
            first=snapshot.get("first"))
        if version == 1:  # its concluded generations and closed group go to the ledger
            self._rewrite |= {key, *self._ledger.migrate(key, snapshot)}
            if snapshot["closed"] is not None:
                bucket.size, bucket.admitted, bucket.deadline = None, 0, 0
        for record in snapshot["members"]:
            member = member_from(record)
            bucket.members[member.generation.generation_id] = member
        for record in snapshot["orphans"]:
            bucket.orphans[record["generation_id"]] = received_from(record["received"])
            self._orphan_at[record["generation_id"]] = key
        self._where.update(dict.fromkeys(bucket.members, key))
        if bucket.members:
            self._active.add(key)
        if bucket.empty():
            del self._buckets[key]
        else:
            self._schedule(key, bucket)

    # ------------------------------------------------------------------- the rules

    def _group_of(self, generation: Generation) -> tuple[str, int]:
        key = self.processor.grouping.key(generation)
        size = self.processor.grouping.size(generation)
        if not isinstance(key, str) or not key:
            raise InvalidRecord(f"the grouping gave the key {key!r}, not a non-empty string")
        try:
            key.isascii() or key.encode()
        except UnicodeEncodeError as error:
            raise InvalidRecord(f"the grouping gave the key {key!r}, not UTF-8: {error}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidRecord(f"the grouping gave the size {size!r}, not a positive integer")
        return key, size

    def _admission(self, key: str, bucket: _Bucket, gid: str,
                   size: int) -> tuple[Outcome, str] | None:
        """Why generation ``gid`` of declared ``size`` cannot join group ``key`` (None if it can).
        An open group (its size known) is not closed: only a bucket without one can be (``_close``
        clears the size as the ledger records the closure), so only then is the ledger asked."""
        if bucket.size is None and (closed := self._ledger.closure(key)) is not None:
            how, detail = closed
            if how == "resolved":
                return Outcome.EXPIRED, f"arrived after its group {key!r} closed: {detail}"
            if how == "shed":
                return Outcome.SHED, f"arrived after its group {key!r} was shed"
            return Outcome.INVALID, f"its group {key!r} is closed: {detail}"
        if bucket.size is not None and size != bucket.size:
            return Outcome.INVALID, (f"group_size disagreement in group {key!r}: {gid} declares "
                                     f"{size}, earlier members {bucket.size}")
        if bucket.admitted >= size:
            return Outcome.INVALID, f"group {key!r} has more generations than its group_size {size}"
        return None

    def _too_old(self, generation: Generation) -> tuple[Outcome, str] | None:
        """Why ``generation`` cannot be trained for its version: UNKNOWN_VERSION (``reject``)
        or TOO_STALE, with the reason; None if it can."""
        known = generation.policy_version_known
        if not known and self.unknown_version == REJECT:
            return Outcome.UNKNOWN_VERSION, (
                "its policy version is unknown (metadata reef.policy_version=unknown: its "
                "producer could not tell which version sampled it, e.g. a proxy during a "
                "reload) and the schedule's unknown_version is 'reject'")
        if self.max_staleness is None or self._newest is None:
            return None
        version = generation.policy_version if known else 0
        behind = self._newest - version
        if behind <= self.max_staleness:
            return None
        if not known:
            return Outcome.TOO_STALE, (
                f"its policy version is unknown, taken as the stalest (version 0, "
                f"unknown_version '{STALEST}'): {behind} versions behind the newest checkpoint "
                f"{self._newest} (max staleness {self.max_staleness})")
        return Outcome.TOO_STALE, (
            f"policy_version {generation.policy_version} is {behind} versions behind the "
            f"newest checkpoint {self._newest} (max staleness {self.max_staleness})")

    def _adopt_orphans(self, member: Member, step: _StepBuilder) -> None:
        """Move feedback that arrived before ``member`` into it."""
        if (key := self._orphan_at.pop(member.generation.generation_id, None)) is not None:
            step.touched.add(key)
            member.received = self._buckets[key].orphans.pop(member.generation.generation_id)
            member.seen = set(member.received)

    def _try_score(self, key: str, bucket: _Bucket, member: Member, now: int,
                   step: _StepBuilder, *, final: bool) -> None:
        """Score ``member`` if its feedback is ready; when ``final`` (its deadline), as its
        policy says for missing feedback."""
        policy = self.processor.feedback
        received = {source: r.feedback for source, r in sorted(member.received.items())}
        if not final and not policy.ready(received):
            return
        if final and (policy.missing is MissingFeedback.EXPIRE or not received):
            reason = (f"no complete feedback within {self._timeout} ms (received "
                      f"{sorted(received) or 'none'}; {policy.description})")
            return self._conclude(key, bucket, member, Outcome.EXPIRED, reason, now, step)
        try:
            score = policy.combine(member.generation, types.MappingProxyType(received))
            problem = _score_problem(score, received)
        except InvalidRecord as error:
            problem = f"its feedback does not combine: {error}"
        if problem:
            return self._conclude(key, bucket, member, Outcome.INVALID, problem, now, step)
        member.score = score
        member.scored_time = max([member.generation.created_at,
                                  *(received[s].created_at for s in score.sources)])
        for source, entry in sorted(member.received.items()):
            if source in score.sources:
                step.fate(entry, FeedbackFate.USED, "in its generation's score", now,
                          member.generation)
            else:
                step.fate(entry, FeedbackFate.UNUSED, "its generation's score did not use it", now,
                          member.generation)
        member.received = {}

    def _check_group(self, key: str, bucket: _Bucket, now: int, step: _StepBuilder) -> None:
        """Emit the group if complete; resolve it if it can no longer complete."""
        if bucket.size is None or any(m.score is None for m in bucket.members.values()):
            return
        if len(bucket.members) == bucket.size:
            self._emit(key, bucket, now, step, how="emitted")
        elif bucket.admitted == bucket.size:
            self._resolve(key, bucket, now, step, why="it can no longer complete")

    def _resolve(self, key: str, bucket: _Bucket, now: int, step: _StepBuilder, *, why: str) -> None:
        """Close a group that will not complete: a smaller unit if allowed, else expire it."""
        scored, size = sum(m.score is not None for m in bucket.members.values()), bucket.size
        if scored and self.processor.grouping.accept_incomplete(scored, size):
            return self._emit(key, bucket, now, step, how="resolved")
        detail = _incomplete(why, scored, size)
        for gid in sorted(bucket.members):
            self._conclude(key, bucket, bucket.members[gid], Outcome.EXPIRED,
                           f"its group {key!r} is {detail}", now, step)
        self._close(key, bucket, "resolved", detail, now, step)

    def _emit(self, key: str, bucket: _Bucket, now: int, step: _StepBuilder, *, how: str) -> None:
        members = [bucket.members[g] for g in sorted(bucket.members)]
        if self.max_backlog is not None and self._newest is not None \
                and self._backlog >= self.max_backlog:
            reason = (f"{self._backlog} units wait for the trainer (max_backlog "
                      f"{self.max_backlog}), so this unit would be trained stale")
            for member in members:
                self._conclude(key, bucket, member, Outcome.SHED, reason, now, step)
            self._close(key, bucket, "shed", SHED_CLOSURE, now, step)
            return
        self._backlog += 1
        ids = tuple(m.generation.generation_id for m in members)
        uid, builder = unit_id(self.recipe, ids), self.processor.units
        unit = builder.build(
            unit_id=uid, recipe=self.recipe, group_key=key,
            members=tuple(Scored(m.generation, m.score) for m in members),  # type: ignore[arg-type]
            created_at=EpochMillis(max(m.scored_time for m in members)))
        if not isinstance(unit, builder.unit_type):
            raise FatalError(f"the processor's unit builder returned a {type(unit).__name__}, "
                             f"not its unit_type {builder.unit_type.__name__}")
        if isinstance(unit, RolloutUnit):
            unit = _with_policy_masks(unit, {m.generation.generation_id: m.generation
                                             for m in members})
        step.units.append(EmittedUnit(uid, key, unit, ids))
        for member in members:
            self._conclude(key, bucket, member, Outcome.UNIT, f"in unit {uid}", now, step, unit=uid)
        self._close(key, bucket, how, _emitted(uid, len(ids), bucket.size, how), now, step)

    def _invalidate(self, key: str, bucket: _Bucket, reason: str, now: int,
                    step: _StepBuilder) -> None:
        for gid in sorted(bucket.members):
            self._conclude(key, bucket, bucket.members[gid], Outcome.INVALID, reason, now, step)
        self._close(key, bucket, "invalid", reason, now, step)

    def _conclude(self, key: str, bucket: _Bucket, member: Member, outcome: Outcome,
                  reason: str, now: int, step: _StepBuilder, *, unit: str | None = None) -> None:
        """Give ``member`` its one outcome; feedback it held without using it is UNUSED. From
        here on only its ledger entry is kept (none of its records)."""
        gid = member.generation.generation_id
        bucket.members.pop(gid, None)
        self._where.pop(gid, None)
        for _, entry in sorted(member.received.items()):
            step.fate(entry, FeedbackFate.UNUSED,
                      f"generation {gid} ended {outcome.value} without using it", now,
                      member.generation)
        member.received = {}
        step.touched.add(self._ledger.conclude(gid, outcome.name, tuple(member.seen), now))
        step.generations.append(GenerationOutcome(member.generation, outcome, reason, key, unit,
                                                  member.origin, now))
        step.touched.add(key)

    def _close(self, key: str, bucket: _Bucket, how: str, detail: str, now: int,
               step: _StepBuilder) -> None:
        """Close group ``key`` (its members have concluded): the ledger remembers it, and the
        bucket holds no group any more."""
        only = bucket.first if bucket.admitted == 1 else None
        step.touched.add(self._ledger.close(key, how, detail, now, only_member=only))
        bucket.size, bucket.admitted, bucket.deadline, bucket.first = None, 0, 0, None
        step.touched.add(key)

    def _sweep(self, key: str, bucket: _Bucket, now: int, step: _StepBuilder) -> None:
        """Everything due in ``key`` by ``now``, then its next wake-up."""
        step.touched.add(key)
        for gid, waiting in sorted(bucket.orphans.items()):
            for source, entry in sorted(waiting.items()):
                if entry.arrived + self._timeout <= now:
                    del waiting[source]
                    step.fate(entry, FeedbackFate.ORPHANED, f"no generation {gid} arrived "
                              f"within {self._timeout} ms of this feedback", now)
            if not waiting:
                del bucket.orphans[gid]
                self._orphan_at.pop(gid, None)
        for gid in sorted(bucket.members):
            member = bucket.members[gid]
            if member.score is None and member.deadline <= now:
                self._try_score(key, bucket, member, now, step, final=True)
        self._check_group(key, bucket, now, step)
        if bucket.size is not None and bucket.deadline <= now:
            self._resolve(key, bucket, now, step, why="its deadline passed")

    # ------------------------------------------------------------------- bookkeeping

    def _bucket(self, key: str, step: _StepBuilder) -> _Bucket:
        step.touched.add(key)
        if (bucket := self._buckets.get(key)) is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def _done(self, step: _StepBuilder) -> Step:
        """Drop emptied keys and reschedule the touched ones; the step, frozen."""
        step.touched |= self._rewrite
        self._rewrite = set()
        for key in step.touched & self._buckets.keys():
            bucket = self._buckets[key]
            if not bucket.members:
                self._active.discard(key)
            if bucket.empty():
                del self._buckets[key]
                self._wake.pop(key, None)
            else:
                self._schedule(key, bucket)
        return step.build()

    def _schedule(self, key: str, bucket: _Bucket) -> None:
        """Set ``key``'s wake-up to the earliest time anything in it is due."""
        times = [m.deadline for m in bucket.members.values() if m.score is None]
        times += [r.arrived + self._timeout for w in bucket.orphans.values() for r in w.values()]
        if bucket.size is not None:
            times.append(bucket.deadline)
        wake = min(times, default=None)
        if wake is None:
            self._wake.pop(key, None)
        elif self._wake.get(key) != wake:
            self._wake[key] = wake
            heapq.heappush(self._timers, (wake, key))

    def _forget(self, key: str) -> None:
        bucket = self._buckets.pop(key, None) or _Bucket()
        self._active.discard(key)
        self._wake.pop(key, None)
        for index, gids in ((self._where, list(bucket.members)),
                            (self._orphan_at, list(bucket.orphans))):
            for gid in gids:
                if index.get(gid) == key:
                    del index[gid]


def _with_policy_masks(unit: RolloutUnit, generations: Mapping[str, Generation]) -> RolloutUnit:
    """``unit`` with each sample of a multi-turn generation carrying the generation's
    ``policy_mask()`` (rule 7); ``unit`` itself when none lacks one."""
    members, changed = [], False
    for sample in unit.members:
        generation = generations.get(sample.generation_id)
        if (generation is not None and generation.segments and not sample.policy_mask.size
                and len(sample.completion_token_ids) == len(generation.completion_token_ids)):
            mask = generation.policy_mask()
            if mask.size:
                sample, changed = dataclasses.replace(sample, policy_mask=mask), True
        members.append(sample)
    return dataclasses.replace(unit, members=tuple(members)) if changed else unit


def _duplicate(source: str, gid: str) -> str:
    return f"feedback from {source!r} for {gid} was already received"


def _emitted(uid: str, members: int, size: int | None, how: str) -> str:
    of = f" of {size}" if how == "resolved" else ""
    return f"emitted as unit {uid} with {members}{of} members"


def _incomplete(why: str, scored: int, size: int | None) -> str:
    return f"incomplete ({why}: {scored} of {size} members scored)"


def _implied_closure(recipe: str, key: str, outcome: str) -> tuple[str, str]:
    """How and why a group of one closed whose only member, generation ``key``, concluded as
    ``outcome`` (``Ledger`` remembers such a group with its member)."""
    if outcome == Outcome.UNIT.name:
        return "emitted", _emitted(unit_id(recipe, [key]), 1, 1, "emitted")
    if outcome == Outcome.SHED.name:
        return "shed", SHED_CLOSURE
    return "resolved", _incomplete("it can no longer complete", 0, 1)


def _score_problem(score: Any, received: Mapping[str, Feedback]) -> str:
    """Why a combined score cannot be used ("" if it can); a processor bug is fatal."""
    if not isinstance(score, Score):
        raise FatalError(f"the feedback policy's combine returned {type(score).__name__}, "
                         "not a Score")
    if not score.sources or not set(score.sources) <= set(received):
        raise FatalError(f"the feedback policy's score names sources {list(score.sources)}; "
                         f"they must be a non-empty subset of those received {sorted(received)}")
    if _finite_number(score.reward) and all(map(_finite_number, score.components.values())):
        return ""
    values = {"reward": score.reward, **{f"components.{k}": v for k, v in score.components.items()}}
    bad = [name for name, value in values.items() if isinstance(value, bool)
           or not isinstance(value, (int, float)) or not math.isfinite(value)]
    return f"its combined score is not finite: {bad}" if bad else ""


def _finite_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a score's reward and components must be."""
    return type(value) in (float, int) and math.isfinite(value)
