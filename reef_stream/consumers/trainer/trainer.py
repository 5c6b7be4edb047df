"""The trainer: a consumer group over ``<ns>.units.<recipe>`` whose acknowledgements are checkpoints.

    trainer = Trainer(recipe, bootstrap=..., namespace="reef", group="run-1")
    summary = trainer.run()      # blocks until stop(), max_steps, idle_exit or a signal

A step's units are a pure function of the log and the trainer's state: every partition is
assigned manually and merged into one order (``reef_stream.engine.log_merge.LogMerge``);
units that do not decode, that the backend cannot train (``engine.training.untrainable``) or
that are more than ``schedule.max_staleness`` versions behind are dead-lettered, already
trained unit ids are skipped, and the rest fill ``schedule.units_per_step``. A non-finite
step raises ``NonFiniteStep`` before it reaches the weights.

Acknowledgement (``_acknowledge``, the one place the order is written): (1) the checkpoint
(weights, optimizer and RNG state, algorithm state, next offsets, trained unit ids) is
written durably in a directory of this process's own (``CheckpointStore``'s writer id);
(2) one Kafka transaction holds its ``Checkpoint`` event and the group's offsets
(``send_offsets_to_transaction``): the checkpoint exists once it commits. It happens every
``schedule.checkpoint_every`` steps (and ``checkpoint_every_s``, at ``max_steps``, before a
rollback, at stop); any failure sends the trainer back to the group's newest committed
checkpoint (``_resume``, ``committed_checkpoint``), and it retrains from the log to the same
weights. The stage loop runs it with a manual assignment and ``CommitsItself`` (strategy
``_Steps``, ``CONSUME_BATCH`` records a fetch). Rank 0 checks ``<ns>.publications`` for a
stall every ``CHECK_EVERY_S`` and rolls back (``reef_stream.publishing.rollback``).

Fencing: the transactional id is ``trainer_transactional_id(ns, recipe, group)``, so a
trainer that starts (rank 0, before it reads where to resume) fences every older one of its
group; a paused or partitioned zombie fails at its first acknowledgement (``TrainerFenced``,
one line, the process exits) and its files are garbage ``prune`` removes. The long form:
``docs/stages.md`` ("The trainer").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import safetensors.torch

from reef_stream.api.objective import state_from_record, state_record
from reef_stream.api.recipe import Recipe
from reef_stream.consumers.stage import (
    CommitsItself, FetchEnd, Group, ManualAssignment, PartitionEnd, StageLoop, StageOptions,
    kafka_consumers,
)
from reef_stream.consumers.trainer.ranks import Ranks
from reef_stream.core.errors import (
    ConfigurationError, FatalError, InvalidRecord, ReefError, RetryableError,
)
from reef_stream.core.events import Checkpoint, Publication, TopicOffset, now_ms
from reef_stream.core.failpoints import failpoint
from reef_stream.core.histograms import AGE_LABELS, age_buckets
from reef_stream.core.metric_names import (
    STAGE_TRAINER, TRAINER_DATA_SECONDS, TRAINER_ROLLBACKS, TRAINER_SAMPLE_AGE_MEAN,
    TRAINER_SAMPLE_AGE_SAMPLES, TRAINER_SAMPLE_TO_UNIT_SAMPLES, TRAINER_STALENESS_MAX,
    TRAINER_STALENESS_MEAN, TRAINER_STALENESS_SAMPLES, TRAINER_STEP_SECONDS, TRAINER_STEPS,
    TRAINER_UNIT_TO_TRAIN_SAMPLES, TRAINER_UNITS_DUPLICATE, TRAINER_UNITS_INVALID,
    TRAINER_UNITS_STALE, TRAINER_UNITS_TRAINED, UNKNOWN_STALENESS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings, load_settings
from reef_stream.engine.checkpoints import (
    CheckpointContents, CheckpointError, CheckpointStore, StoredCheckpoint, default_store_url, load,
    store_unreachable, unit_hash,
)
from reef_stream.engine.log_merge import LogMerge, Ordered
from reef_stream.engine.training import TorchBackend, select_rows, unit_members, untrainable
from reef_stream.publishing.rollback import CHECK_EVERY_S, Agreed, StallWatch, Verdict, Vote, agree
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics, namespace_topics
from reef_stream.topics.connect import ask_broker, new_admin, new_producer
from reef_stream.topics.dead_letters import dead_letter
from reef_stream.topics.fencing import FENCED_CODES, CommitWatchdog, TransactionalIdentity
from reef_stream.topics.kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition
from reef_stream.topics.metrics import MetricsWriter
from reef_stream.topics.reading import NewestFirst

log = logging.getLogger(__name__)

#: Most messages taken from the client per poll.
CONSUME_BATCH = 1_000
#: Seconds the broker has to acknowledge a Checkpoint event before the step is aborted.
ACK_TIMEOUT_S = 30.0
#: Seconds between attempts to resume after a failed step.
RETRY_BACKOFF_S = 2.0
#: The acknowledgement transaction's timeout: the broker aborts one left open this long (a
#: trainer that died inside it), and a newer trainer's ``init_transactions`` aborts it at once.
TRANSACTION_TIMEOUT_MS = 60_000


class TrainerFenced(FatalError):
    """A newer trainer of this group took over (same transactional id): this process must not
    acknowledge anything more. Fatal: the process exits."""


def trainer_transactional_id(namespace: str, recipe: str, group: str) -> str:
    """The transactional id every trainer of ``group`` acknowledges under: stable across
    restarts and hosts, so the newest instance fences every older one."""
    return f"reef-train.{namespace}.{recipe}.{group}"


def committed_checkpoint(bootstrap: str, namespace: str, recipe: str, group: str, *,
                         registry: SchemaRegistry | None = None,
                         reader: NewestFirst | None = None) -> Checkpoint | None:
    """The newest ``Checkpoint`` event of ``recipe``'s ``group`` committed to
    ``<ns>.checkpoints`` (read_committed: an aborted or open transaction's event is not seen),
    or None. The tip of the group's lineage: the last such event in the log, the same one a
    read from the beginning ends with. It reads back from the topic's end in windows
    (``NewestFirst``) and stops at the first window that holds one, so its cost depends on
    the events written after the group's newest (other groups'), not on how many the topic
    holds; a group with none reads the whole topic. ``reader``: one to read with (closed
    here), to count what was read. Blocks; raises ``TimeoutError`` past
    ``reading.READ_TIMEOUT_S`` per window."""
    registry = registry or SchemaRegistry.default()
    key = group.encode()
    with reader or NewestFirst(bootstrap, declarations.checkpoints(namespace)) as windows:
        for records in windows:
            for message in reversed(records):
                if message.key() != key:
                    continue
                try:
                    event = registry.decode(message.value(), message.headers(), Checkpoint,
                                            topic=message.topic(),
                                            partition=message.partition(),
                                            offset=message.offset())
                except ReefError as error:
                    log.warning("skipping an undecodable checkpoint event: %s", error)
                    continue
                if event.recipe == recipe and event.trainer_group == group:
                    return event
    return None


@dataclass
class TrainerSummary:
    """What one run did. ``resumed_from``: the checkpoint step it started from (0: none)."""

    resumed_from: int = 0
    steps: int = 0
    last_step: int = 0
    units_trained: int = 0
    duplicates: int = 0
    stale: int = 0
    #: Units that do not decode or cannot be trained (``untrainable``), dead-lettered.
    invalid: int = 0
    #: Rollback checkpoints written (``reef_stream.publishing.rollback``).
    rollbacks: int = 0
    resume_seconds: float = 0.0
    first_step_seconds: float | None = None
    data_seconds: float = 0.0
    step_seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    #: Trained samples by staleness (versions behind the trainer), over the run; those of
    #: unknown version (``Sample.policy_version_known``) under ``UNKNOWN_STALENESS``.
    staleness: Counter[int | str] = field(default_factory=Counter)
    #: Trained samples with a known created_at by age bucket (``le``, seconds), over the run:
    #: generation -> step, generation -> unit, unit -> step (``reef_stream.core.histograms``).
    sample_age: Counter[str] = field(default_factory=Counter)
    sample_to_unit: Counter[str] = field(default_factory=Counter)
    unit_to_train: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        first = ("" if self.first_step_seconds is None
                 else f", first step {self.first_step_seconds:.2f} s after start")
        return (f"trained {self.steps} steps (now at step {self.last_step}, resumed from "
                f"{self.resumed_from}), {self.units_trained} units; skipped {self.duplicates} "
                f"duplicates, dropped {self.stale} stale and {self.invalid} invalid units; "
                + (f"rolled back {self.rollbacks} times; " if self.rollbacks else "")
                + f"resumed in {self.resume_seconds:.2f} s{first}")


class StepAges(NamedTuple):
    """Seconds, per trained sample with a known ``created_at`` (0: unknown, not counted): from
    its generation to the step that trained it, to its unit, and from its unit to the step."""

    sample_age: list[float]
    sample_to_unit: list[float]
    unit_to_train: list[float]

    @classmethod
    def of(cls, units: Sequence[Any], trained_at: int) -> StepAges:
        """``trained_at``: the step's wall-clock time (epoch ms), one for all its samples."""
        ages = cls([], [], [])
        for unit in units:
            unit_at = getattr(unit, "created_at", 0)
            for member in unit_members(unit):
                created_at = getattr(member, "created_at", 0)
                if not created_at:
                    continue
                ages.sample_age.append((trained_at - created_at) / 1000)
                if unit_at:
                    ages.sample_to_unit.append((unit_at - created_at) / 1000)
                    ages.unit_to_train.append((trained_at - unit_at) / 1000)
        return ages


class Trainer:
    """One trainer process of group ``group`` (see the module docstring).

    ``checkpoints``: the store URL. ``keep``: checkpoints retained (0: all).
    ``model_name``: what Checkpoint events call the model (default: the
    backend's ``model_name``, else the group). ``max_steps``: stop once the
    trainer is at this step. ``idle_exit``: stop after this many seconds
    without a new unit (units of an unfinished step stay unacknowledged).
    ``on_stuck(why)``: called when an acknowledgement's transaction stays stuck inside
    librdkafka (``fencing.CommitWatchdog``) [default: logged only].
    """

    def __init__(self, recipe: Recipe, *, bootstrap: str, namespace: str, group: str,
                 checkpoints: str | None = None, keep: int = 5, model_name: str | None = None,
                 max_steps: int | None = None, idle_exit: float | None = None,
                 checkpoint_every_s: float | None = None,
                 settings: Settings | None = None, ranks_timeout_s: float | None = None,
                 on_stuck: Callable[[str], None] | None = None) -> None:
        settings = settings or load_settings()
        self.recipe, self.bootstrap, self.ns, self.group = recipe, bootstrap, namespace, group
        self.topic = declarations.units(namespace, recipe.name)
        self.store = CheckpointStore(checkpoints or default_store_url(
            settings.home, namespace, recipe.name, group))
        self.keep, self.max_steps, self.idle_exit = keep, max_steps, idle_exit
        self.checkpoint_every_s = checkpoint_every_s
        #: How long an exchange between data-parallel ranks waits (``Ranks.join``).
        self.ranks_timeout_s = ranks_timeout_s
        #: Calls ``on_stuck(why)`` when an acknowledgement's transaction is stuck inside
        #: librdkafka (``fencing.CommitWatchdog``; `reef train` exits for a restart).
        self._watchdog = CommitWatchdog(f"trainer {group}", on_stuck,
                                        stuck_after_s=settings.stuck_commit_s)
        self.model_name = model_name or recipe.backend.model_name or group
        self.registry = SchemaRegistry.default()
        self.summary = TrainerSummary()
        self._stop = threading.Event()
        self._stop_asked = threading.Event()   # data parallelism: stop at the next meeting
        self._started = time.monotonic()
        # Set by _resume:
        self.backend: TorchBackend | None = None
        self.step = 0
        self.algorithm_state: Any = None
        self.trained: set[int] = set()
        self.offsets: dict[int, int] = {}
        #: The newest checkpoint's offsets and, for a rollback checkpoint, the version it
        #: went back to.
        self.acknowledged: tuple[TopicOffset, ...] = ()
        self.rolled_back_to: int | None = None
        #: The newest checkpoint's step and when it was written (monotonic), and what the steps
        #: trained since hold: their unit ids in order, the offsets and metrics of the last.
        self.durable_step, self.durable_at = 0, time.monotonic()
        self.unacknowledged: list[str] = []
        self.step_offsets: dict[int, int] = {}
        self.step_metrics: dict[str, float] = {}
        #: Rank 0's fold of <ns>.publications, opened after _resume.
        self.watch: StallWatch | None = None
        self.pending: list[Any] = []
        self.pending_ids: set[str] = set()
        #: Rank 0's transactional producer of acknowledgements (``_fence``).
        self.fence_producer: Any = None
        #: A failed acknowledgement left its transaction open and aborting it failed too: the
        #: next acknowledgement aborts it first (``_acknowledge``).
        self._abort_pending = False
        #: This process among the data-parallel ranks (joined in _Steps.assignment).
        self.world = Ranks()
        self.rank, self.ranks = 0, 1
        self.owned: list[int] = []

    def stop(self) -> None:
        """Stop after the step in progress (if any) is acknowledged; data-parallel ranks all stop
        at their next meeting (``_meet``). Any thread; a signal handler."""
        (self._stop_asked if self.ranks > 1 else self._stop).set()

    def _stopping(self) -> bool:
        """Whether a stop was asked, on one rank (``_stop``) or many (``_stop_asked``): the
        waits for a broker or a store to come back end on it."""
        return self._stop.is_set() or self._stop_asked.is_set()

    # ----------------------------------------------------------------- the loop

    def run(self) -> TrainerSummary:
        """Train until stopped; returns the summary. Blocks. Call once."""
        self._ensure_topics()
        self.producer = new_producer(self.bootstrap, {
            "acks": "all", "enable.idempotence": True, "linger.ms": 5})
        self.metrics = MetricsWriter(self.producer, self.ns, STAGE_TRAINER,
                                     {"recipe": self.recipe.name, "group": self.group})
        self._watchdog.start(self._stop)
        if self.recipe.evaluator is not None and getattr(self.recipe.evaluator, "warning", None):
            log.info("candidate evaluator %s decides what is published (reef evaluate)",
                     self.recipe.evaluator.name)
        StageLoop(
            _Steps(self), StageOptions(
                stage=STAGE_TRAINER, topics=(self.topic,), namespace=self.ns, reads="unit",
                membership=Group(self.group), batch=CONSUME_BATCH, poll_timeout=0.2,
                # Units become readable a processor transaction at a time, so the broker
                # answers as each commits (1 byte) instead of holding the fetch up to 100 ms
                # for 64 KB: a step's last units reach the trainer that much sooner, for a
                # quarter more fetches (docs/benchmarks.md, "The trainer's fetch").
                consumer_config={"isolation.level": "read_committed",
                                 "enable.partition.eof": True, "fetch.min.bytes": 1,
                                 "fetch.wait.max.ms": 100}),
            consumers=kafka_consumers(self.bootstrap), producer=self.producer,
            registry=self.registry, metrics=self.metrics, stop_event=self._stop, logger=log,
        ).run()
        self.summary.last_step = self.step
        self.world.leave()
        return self.summary

    def _done(self) -> bool:
        return self._stop.is_set() or (self.max_steps is not None and self.step >= self.max_steps)

    def _take(self, record: Ordered) -> None:
        """One unit, in log order: skip, drop or keep it; a full step is trained and acknowledged."""
        failpoint("trainer.fetching", step=self.step + 1)
        started = time.monotonic()
        message = record.item
        self.offsets[record.source] = record.offset + 1
        try:
            unit = self.registry.decode(message.value(), message.headers(),
                                        self.recipe.objective.unit_type, topic=message.topic(),
                                        partition=message.partition(), offset=message.offset())
            unit_members(unit)
        except (InvalidRecord, ConfigurationError) as error:
            self.summary.invalid += 1
            self._dead_letter(message, f"unit cannot be trained: {error}", type(error).__name__)
            return
        finally:
            self.summary.data_seconds += time.monotonic() - started
        if unit_hash(unit.unit_id) in self.trained or unit.unit_id in self.pending_ids:
            self.summary.duplicates += 1
            return
        checked = time.monotonic()
        problem = untrainable(unit, self.backend.limits)
        self.summary.data_seconds += time.monotonic() - checked
        if problem is not None:
            self.summary.invalid += 1
            self._dead_letter(message, problem, "UntrainableUnit")
            return
        # An unknown version is 0 in the unit (the stalest: schedule.unknown_version).
        oldest = min((m.policy_version for m in unit_members(unit)), default=self.step)
        if self.step - oldest > self.recipe.schedule.max_staleness:
            self.summary.stale += 1
            unknown = any(not m.policy_version_known for m in unit_members(unit))
            self._dead_letter(message, (
                f"unit {unit.unit_id} is too stale: its oldest sample is from policy version "
                f"{oldest}{' (or of unknown version, taken as 0)' if unknown else ''}, "
                f"{self.step - oldest} behind the trainer's {self.step} (max_staleness "
                f"{self.recipe.schedule.max_staleness})"), "TooStale")
            return
        self.pending.append(unit)
        self.pending_ids.add(unit.unit_id)
        if len(self.pending) == self.recipe.schedule.units_per_step // self.ranks:
            if self.ranks == 1:
                self._train_step()
            else:
                self._meet(ready=True)

    # ----------------------------------------------------------------- one step

    def _train_step(self) -> None:
        """Train on the pending units (with every rank's, under data parallelism); checkpoint
        when one is due (``_checkpoint_due``).

        Every rank sees the whole step's units (gathered in rank order), so the
        objective computes one result and one proposed state everywhere; each
        rank trains on its own rows and DDP averages the gradients. Rank 0
        acknowledges the steps for all ranks; the others wait for its verdict.
        """
        started = time.monotonic()
        step, mine = self.step + 1, self.pending
        self.producer.flush(ACK_TIMEOUT_S)   # this rank's dead letters, before any commit
        shares = self.world.gather_shares(mine, self.offsets, self.registry,
                                          self.recipe.objective.unit_type)
        units = [u for units, _ in shares for u in units]
        offsets = {p: o for _, rank_offsets in shares for p, o in rank_offsets.items()}
        result = self.recipe.objective.compute(units, self.algorithm_state)
        if self.ranks > 1:
            counts = [len(unit_members(u)) for u in units]
            first = sum(counts[:self.rank * len(mine)])
            rows = np.arange(first, first + sum(counts[self.rank * len(mine):][:len(mine)]))
            local = dataclasses.replace(result, advantages=select_rows(result.advantages, rows))
        else:
            local = result
        metrics = self.backend.train_step(mine, local, step)
        members = [m for u in units for m in unit_members(u)]
        staleness = [self.step - m.policy_version for m in members if m.policy_version_known]
        if len(staleness) < len(members):
            self.summary.staleness[UNKNOWN_STALENESS] += len(members) - len(staleness)
        if staleness:
            metrics[TRAINER_STALENESS_MEAN] = float(np.mean(staleness))
            metrics[TRAINER_STALENESS_MAX] = float(max(staleness))
        ages = StepAges.of(units, now_ms())
        if ages.sample_age:
            metrics[TRAINER_SAMPLE_AGE_MEAN] = float(np.mean(ages.sample_age))
        # Trained: the step and its proposed state are the trainer's from here on, durable
        # once a checkpoint holds them (a failure before goes back to the newest checkpoint).
        self.algorithm_state = result.proposed_state
        self.trained.update(unit_hash(u.unit_id) for u in units)
        self.step, self.step_offsets, self.step_metrics = step, offsets, metrics
        self.unacknowledged.extend(u.unit_id for u in units)
        self.pending, self.pending_ids = [], set()
        if self._checkpoint_due():
            self._checkpoint()
        seconds = time.monotonic() - started
        self._count_step(len(units), seconds, metrics, staleness, ages)
        log.info("step %d: %d units, loss %.4f, %.2f s%s", step, len(units),
                 metrics.get("loss", float("nan")), seconds,
                 "" if self.durable_step == step else
                 f"; checkpoint at step {self.durable_step}")

    def _checkpoint_due(self) -> bool:
        """Whether to checkpoint the step just trained: every ``schedule.checkpoint_every``
        steps after the newest checkpoint, at ``max_steps``, and once ``checkpoint_every_s``
        seconds passed since the newest checkpoint (rank 0's clock decides for every rank)."""
        if (self.step - self.durable_step >= self.recipe.schedule.checkpoint_every
                or (self.max_steps is not None and self.step >= self.max_steps)):
            return True
        if self.checkpoint_every_s is None:
            return False
        late = self.rank == 0 and time.monotonic() - self.durable_at >= self.checkpoint_every_s
        return self.world.broadcast_bytes(b"1" if late else b"") == b"1"

    def _checkpoint(self) -> None:
        """Acknowledge every step trained since the newest checkpoint (``_acknowledge``): rank
        0 writes it, with every rank's RNG states; the others wait for its verdict. Raises (a
        ``RetryableError`` on every rank under data parallelism) when it failed: the caller
        goes back to the newest checkpoint. Every rank calls it after the same step."""
        step = self.step
        failpoint("trainer.before-checkpoint", step=step)
        weights, optimizer, rng = self.backend.state()
        if self.ranks > 1:
            rng = {k: v for blob in self.world.gather_bytes(safetensors.torch.save(rng))
                   for k, v in safetensors.torch.load(blob).items()}
        # Every rank's weights are the ones rank 0 writes, bitwise, or the step is not acknowledged.
        error, offsets = self.world.weights_differ(weights, held=self.backend.held()), ()
        if self.rank == 0 and error is None:
            offsets = tuple(TopicOffset(topic=self.topic, partition=p, offset=o)
                            for p, o in sorted(self.step_offsets.items()))
            contents = CheckpointContents(
                step=step, policy_version=step, model=self.model_name, recipe=self.recipe.name,
                trainer_group=self.group, weights=weights, optimizer=optimizer, rng=rng,
                algorithm_state=state_record(self.algorithm_state), offsets=offsets,
                trained_units=np.unique(np.fromiter(self.trained, dtype=np.uint64,
                                                    count=len(self.trained))),
                step_units=tuple(self.unacknowledged), metrics=self.step_metrics,
                created_at=now_ms())
            try:
                self._acknowledge(contents)
            except (RetryableError, CheckpointError, KafkaException) as failure:
                if self.ranks == 1:
                    raise
                error = f"{type(failure).__name__}: {failure}"
        if self.ranks > 1:
            error = self.world.broadcast_bytes((error or "").encode()).decode() or None
        if error is not None:
            raise RetryableError(f"rank 0 could not acknowledge step {step}: {error}")
        self.acknowledged, self.rolled_back_to = offsets, None
        self.durable_step, self.durable_at, self.unacknowledged = step, time.monotonic(), []
        pruned = self.store.prune(self.keep) if self.rank == 0 else []
        if pruned:
            log.info("checkpoint of step %d written; pruned steps %s", step, pruned)

    def _acknowledge(self, contents: CheckpointContents) -> StoredCheckpoint:
        """Acknowledge a trained step, in this order; any failure raises and aborts the step.

        1. Write the checkpoint durably, in this process's own directory
           (``CheckpointStore.write``: every file fsynced, the manifest last). Nothing reads
           it yet.
        2. In one Kafka transaction: produce its ``Checkpoint`` event, add the offsets the
           checkpoint holds (``send_offsets_to_transaction``), commit. From the commit on, the
           checkpoint exists and a restart resumes after this step.

        A crash before 2 commits leaves garbage files and nothing else: the restart trains the
        step again from the log. A newer trainer of the group fails 2 with ``TrainerFenced``.
        Rank 0 only; blocks for up to ``ACK_TIMEOUT_S`` per broker call.
        """
        stored = self.store.write(contents)
        failpoint("trainer.after-checkpoint", step=contents.step)
        producer = self.fence_producer
        self._watchdog.begin()
        try:
            if self._abort_pending:   # an earlier step's transaction is still open
                producer.abort_transaction(ACK_TIMEOUT_S)
                self._abort_pending = False
            producer.begin_transaction()
            self._produce_checkpoint_event(producer, stored, contents)
            failpoint("trainer.after-event", step=contents.step)
            producer.send_offsets_to_transaction(
                [TopicPartition(self.topic, o.partition, o.offset) for o in contents.offsets],
                self.consumer.consumer_group_metadata(), ACK_TIMEOUT_S)
            producer.commit_transaction(ACK_TIMEOUT_S)
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in FENCED_CODES:
                raise self._fenced(contents.step, error, stored.uri) from exc
            broken = error if error.fatal() else self._abort(producer, contents.step)
            if broken is not None:
                # A fatal state of this producer's own, not a newer trainer's fence (that
                # bumps the epoch: FENCED_CODES): INVALID_TXN_STATE when the answer to a
                # commit was lost while the coordinator's host was paused and the commit went
                # on. A new producer under the same id (``_fence``, at the resume) leaves it,
                # and the resume reads whether the step was committed.
                log.warning("the acknowledgement's producer cannot go on (%s); a new one takes "
                            "the group's transactional id at the resume", broken.str())
                self.fence_producer, self._abort_pending = None, False
            raise RetryableError(f"step {contents.step} was not acknowledged: "
                                 f"{error.str()}") from exc
        finally:
            self._watchdog.end()
        failpoint("trainer.after-commit", step=contents.step)
        return stored

    def _abort(self, producer: Any, step: int) -> KafkaError | None:
        """Abort the acknowledgement's open transaction after a failure that is not fatal.
        Such a failure leaves it open (a timed-out call, as when the host is partitioned from
        the coordinator, is retriable, not abortable, in librdkafka's terms): it is aborted
        here, or before the next step's if this abort fails too (``_abort_pending``), or every
        later begin_transaction fails with "Operation not valid in state InTransaction".
        Raises ``TrainerFenced`` when a newer trainer fenced the producer; returns the error
        when the abort left the producer in a fatal state of its own, else None."""
        self._abort_pending = True
        try:
            producer.abort_transaction(ACK_TIMEOUT_S)
            self._abort_pending = False
        except KafkaException as abort:
            error = abort.args[0]
            if error.code() in FENCED_CODES:
                raise self._fenced(step, error) from abort
            if error.fatal():
                return error
        return None

    def _fenced(self, step: int, error: KafkaError, files: str | None = None) -> TrainerFenced:
        """The error that stops this trainer: a newer trainer of the group fenced it at
        ``step`` (``files``: the step's checkpoint, written but never committed)."""
        garbage = "" if files is None else f"; its files at {files} are garbage"
        return TrainerFenced(
            f"trainer of group {self.group} (recipe {self.recipe.name}) was fenced at step "
            f"{step}: a newer trainer of the group took over, so this one stops{garbage} "
            f"({error.str()})")

    def _produce_checkpoint_event(self, producer: Any, stored: StoredCheckpoint,
                                  contents: CheckpointContents) -> None:
        """Produce the step's ``Checkpoint`` event in the open transaction (not flushed: the
        commit sends it)."""
        event = Checkpoint(
            checkpoint_id=stored.checkpoint_id, recipe=self.recipe.name, trainer_group=self.group,
            step=contents.step, model=contents.model, policy_version=contents.policy_version,
            uri=stored.uri, sha256=stored.sha256, offsets=contents.offsets,
            trained_unit_count=len(contents.trained_units),
            metrics={k: float(v) for k, v in contents.metrics.items() if np.isfinite(v)},
            created_at=contents.created_at or now_ms(), rolled_back_to=contents.rolled_back_to)
        value, headers = self.registry.encode(event)
        producer.produce(declarations.checkpoints(self.ns), key=self.group.encode(),
                         value=value, headers=headers)

    def _fence(self) -> None:
        """Rank 0, once: the acknowledgement's transactional producer, initialised, which
        fences every older trainer of the group and aborts its open transaction. Blocks (up
        to 60 s)."""
        if self.rank != 0 or self.fence_producer is not None:
            return
        identity = TransactionalIdentity(
            self.bootstrap, trainer_transactional_id(self.ns, self.recipe.name, self.group),
            timeout_ms=TRANSACTION_TIMEOUT_MS, probe_topic=declarations.checkpoints(self.ns),
            instance=self.group)
        self.fence_producer = identity.new_producer()

    # ----------------------------------------------------------------- rollback

    def _roll_back(self, version: int, target: tuple[Publication, str] | None) -> None:
        """Roll back to the weights of ``version`` as the next version: rank 0, which holds
        ``target`` (the incumbent's publication, the stall's reason), acknowledges the rollback
        checkpoint (``StallWatch.roll_back``) and tells the other ranks how it went; then every
        rank resumes from the newest checkpoint (the rollback's, unless it failed)."""
        if self.step > self.durable_step:   # what was trained since is acknowledged first
            try:
                self._checkpoint()
            except (RetryableError, CheckpointError, KafkaException) as error:
                log.error("checkpoint before the rollback failed: %s; resuming from the "
                          "newest checkpoint", error)
                self.consumer.assign(self._resume_after_failure())
                return
        verdict = Verdict.DONE
        if target is not None and self.watch is not None:
            verdict = self.watch.roll_back(
                target, self._acknowledge, step=self.step + 1, recipe=self.recipe.name,
                group=self.group, offsets=self.acknowledged, trained=self.trained)
        if self.ranks > 1:
            verdict = Verdict(self.world.broadcast_bytes(verdict.value.encode()).decode())
        if verdict is Verdict.CANNOT:
            return
        if verdict is Verdict.FAILED:
            time.sleep(RETRY_BACKOFF_S)
        else:
            self.summary.rollbacks += 1
            if self.rank == 0:
                self.metrics.write(TRAINER_ROLLBACKS, self.summary.rollbacks,
                                   to_version=str(version))
        self.consumer.assign(self._resume())

    # ----------------------------------------------------------------- resume

    def _resume(self) -> list[TopicPartition]:
        """Load the newest checkpoint (or start fresh) and finish its acknowledgement if it was
        interrupted. Returns where this rank's partitions start (the checkpoint's offsets, else
        the beginning): the loop's assignment at start, assigned again after a failed step.
        Blocks; idempotent."""
        self.backend = TorchBackend(self.recipe, between_micro_batches=self._micro_batch_done,
                                    rank=self.rank, ranks=self.ranks)
        self.algorithm_state = self.recipe.objective.initial_state()
        self.step, self.trained, self.offsets = 0, set(), {}
        self.acknowledged, self.rolled_back_to = (), None
        self.pending, self.pending_ids = [], set()
        self.unacknowledged, self.step_offsets, self.step_metrics = [], {}, {}
        self._fence()   # before the read: no older trainer commits after it
        latest = committed_checkpoint(self.bootstrap, self.ns, self.recipe.name, self.group,
                                      registry=self.registry)
        committed = {tp.partition: tp.offset for tp in ask_broker(
            "reading the group's committed offsets", lambda: self.consumer.committed(
                [TopicPartition(self.topic, p) for p in self.partitions], timeout=30))
            if tp.offset >= 0}
        if latest is not None:
            contents = self._load_newest(latest)
            if contents.recipe != self.recipe.name or contents.trainer_group != self.group:
                raise ConfigurationError(
                    f"the checkpoint at {latest.uri} holds recipe {contents.recipe!r}, group "
                    f"{contents.trainer_group!r}, not recipe {self.recipe.name!r}, group "
                    f"{self.group!r}: give this group its own store")
            self.backend.restore(contents.weights, contents.optimizer, contents.rng)
            state_type = type(self.recipe.objective.initial_state())
            self.algorithm_state = state_from_record(state_type, contents.algorithm_state)
            self.trained = {int(h) for h in contents.trained_units}
            self.step = contents.step
            self.acknowledged, self.rolled_back_to = contents.offsets, contents.rolled_back_to
            self.offsets = {o.partition: o.offset for o in contents.offsets if o.topic == self.topic}
            if self.rank == 0 and any(committed.get(p) != o for p, o in self.offsets.items()):
                log.warning("group %s's committed offsets %s are not its newest checkpoint's %s "
                            "(written before acknowledgements were transactions): the "
                            "checkpoint's win", self.group, committed, self.offsets)
        elif committed:
            log.warning("group %s has committed offsets %s but no committed checkpoint: "
                        "starting from fresh weights at those offsets", self.group, committed)
            self.offsets = dict(committed)
        self.offsets = {p: o for p, o in self.offsets.items() if p in self.owned}
        self.durable_step, self.durable_at = self.step, time.monotonic()
        self.merge = LogMerge(sorted(self.owned), log_append_time=True)
        if self.ranks > 1:
            self.world.gather_bytes(b"")   # every rank resumed before any trains
        return [TopicPartition(self.topic, p, self.offsets.get(p, OFFSET_BEGINNING))
                for p in self.owned]

    def _resume_after_failure(self, *, at_start: bool = False) -> list[TopicPartition]:
        """``_resume`` after a failed step, ``RETRY_BACKOFF_S`` after it and again every
        ``RETRY_BACKOFF_S`` while the brokers cannot answer it (a coordinator moving, a
        partition, a broker restarting): a broker fault is waited out, not an exit. Raises at
        once what is not a broker's passing trouble (a fatal client error, a bad checkpoint),
        and anything once a stop was asked. ``at_start``: the trainer's first resume, tried at
        once (a trainer restarted during a broker fault waits it out too, instead of exiting
        into its supervisor's restart loop). Blocks."""
        wait = not at_start
        while True:
            if wait:
                time.sleep(RETRY_BACKOFF_S)
            wait = True
            try:
                return self._resume()
            except (RetryableError, KafkaException, TimeoutError) as error:
                fatal = isinstance(error, KafkaException) and error.args \
                    and getattr(error.args[0], "fatal", lambda: False)()
                if fatal or self._stopping():
                    raise
                log.warning("resuming from the newest checkpoint failed (%s); trying again "
                            "in %g s", error, RETRY_BACKOFF_S)

    def _load_newest(self, latest: Checkpoint) -> CheckpointContents:
        """The newest committed checkpoint's contents. While its store cannot be reached (an
        object store down, a partition), tries again every ``RETRY_BACKOFF_S`` until it can or
        the trainer is asked to stop: an outage of the store is waited out, not an exit. A
        checkpoint that is missing or fails its sha256 raises at once."""
        while True:
            try:
                return load(latest.uri, latest.sha256)
            except CheckpointError as error:
                if not store_unreachable(error) or self._stopping():
                    raise
                log.warning("the store of step %d cannot be reached (%s); trying again in "
                            "%g s", latest.step, error, RETRY_BACKOFF_S)
                time.sleep(RETRY_BACKOFF_S)

    # ----------------------------------------------------------------- data parallelism

    def _meet(self, ready: bool) -> None:
        """Meet the other ranks (``reef_stream.publishing.rollback``: ``Vote``, ``agree``) and do
        what they agreed: stop, roll back (rank 0 looks for a stall, its vote names the
        version), train the step, or go on reading. ``ready``: this rank holds its share of the
        next step; it meets again until every rank holds its own (or they agree on a stop or a
        rollback). Blocks until every rank has voted; every rank calls it in the same order,
        between the same steps. One rank meets alone."""
        while True:
            target = (self.watch.target(self.step, self.rolled_back_to)
                      if self.watch is not None else None)
            mine = Vote(step=self.step, ready=ready, stop=self._stop_asked.is_set(),
                        roll_back_to=None if target is None else target[0].policy_version)
            votes = [Vote.decode(data, rank)
                     for rank, data in enumerate(self.world.gather_bytes(mine.encode()))]
            agreed = agree(votes)
            if agreed is Agreed.STOP:
                self._stop.set()
            elif agreed is Agreed.ROLL_BACK:
                self._roll_back(votes[0].roll_back_to, target)
            elif agreed is Agreed.STEP:
                self._train_step()
            if agreed is not Agreed.WAIT or not ready:
                return

    def _micro_batch_done(self, count: int) -> None:
        failpoint("trainer.in-step", step=self.step + 1)

    # ----------------------------------------------------------------- helpers

    def _ensure_topics(self) -> None:
        admin = new_admin(self.bootstrap)
        ensure_topics(admin, namespace_topics(admin, self.ns, (self.recipe.name,)))

    def _dead_letter(self, message: Any, reason: str, error_type: str) -> None:
        letter = dead_letter(reason, error_type, stage=STAGE_TRAINER, message=message)
        value, headers = self.registry.encode(letter)
        self.producer.produce(declarations.dead_letters(self.ns), key=message.key(), value=value,
                              headers=headers)

    def _count_step(self, units: int, seconds: float, metrics: dict[str, float],
                    staleness: list[int], ages: StepAges) -> None:
        summary = self.summary
        summary.steps += 1
        summary.units_trained += units
        summary.staleness.update(staleness)
        summary.sample_age.update(age_buckets(ages.sample_age))
        summary.sample_to_unit.update(age_buckets(ages.sample_to_unit))
        summary.unit_to_train.update(age_buckets(ages.unit_to_train))
        summary.step_seconds += seconds
        summary.metrics = metrics
        if summary.first_step_seconds is None:
            summary.first_step_seconds = time.monotonic() - self._started
            log.info("first step after start: %.2f s (resume %.2f s)",
                     summary.first_step_seconds, summary.resume_seconds)
        if self.rank != 0:
            return
        write = self.metrics.write
        write(TRAINER_STEPS, self.step)
        write(TRAINER_UNITS_TRAINED, summary.units_trained)
        write(TRAINER_UNITS_DUPLICATE, summary.duplicates)
        write(TRAINER_UNITS_STALE, summary.stale)
        write(TRAINER_UNITS_INVALID, summary.invalid)
        write(TRAINER_STEP_SECONDS, seconds)
        write(TRAINER_DATA_SECONDS, summary.data_seconds)
        for name, value in metrics.items():
            if np.isfinite(value):
                write(name, value)
        self.metrics.write_counts(TRAINER_STALENESS_SAMPLES, summary.staleness, "staleness")
        for name, counts in ((TRAINER_SAMPLE_AGE_SAMPLES, summary.sample_age),
                             (TRAINER_SAMPLE_TO_UNIT_SAMPLES, summary.sample_to_unit),
                             (TRAINER_UNIT_TO_TRAIN_SAMPLES, summary.unit_to_train)):
            self.metrics.write_counts(name, {le: counts[le] for le in AGE_LABELS if le in counts},
                                      "le")
        self.producer.poll(0)


class _Steps:
    """The trainer as the stage loop's strategy (``reef_stream.consumers.stage``). Records go
    into the log-order merge as they are fetched (``submit``, ``at_end``); after each fetch the
    settled ones are taken in order (``fetched``), a full step being trained and acknowledged
    there, synchronously: ``Trainer._acknowledge`` commits (``CommitsItself``). Manual
    assignment: this rank's partitions at its checkpoint's offsets (never revoked)."""

    capabilities = frozenset({CommitsItself, ManualAssignment, PartitionEnd, FetchEnd})

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        #: Monotonic seconds: when the current fetch began (``poll`` comes just before it),
        #: when a unit was last taken (``idle_exit``), when a stall was last looked for.
        self._fetch_started = self._last_unit = self._stall_checked = time.monotonic()

    def on_start(self, consumer: Any) -> None:
        """The loop's consumer: ``_resume`` reads the group's committed offsets with it and
        assigns it again after a failed step; ``_acknowledge`` commits with it."""
        self.trainer.consumer = consumer

    def assignment(self, partitions: Mapping[str, list[int]]) -> list[TopicPartition]:
        """Join the data-parallel ranks, resume from the newest checkpoint, and read the
        partitions this rank owns (``p % ranks == rank``) from its offsets. Blocks (loading
        the checkpoint; every rank waits for the others); called once."""
        trainer = self.trainer
        trainer.world = Ranks.join(trainer.recipe, trainer.ranks_timeout_s)
        trainer.rank, trainer.ranks = trainer.world.rank, trainer.world.ranks
        trainer.partitions = partitions[trainer.topic]
        trainer.owned = [p for p in trainer.partitions if p % trainer.ranks == trainer.rank]
        if trainer.ranks > 1:
            log.info("rank %d of %d owns partitions %s", trainer.rank, trainer.ranks,
                     trainer.owned)
        start = trainer._resume_after_failure(at_start=True)
        summary = trainer.summary
        summary.resumed_from = trainer.step
        summary.resume_seconds = time.monotonic() - trainer._started
        log.info("group %s at step %d (%s); resumed in %.2f s", trainer.group, trainer.step,
                 trainer.store.url, summary.resume_seconds)
        if trainer.rank == 0:   # it decides when to roll back, for every rank
            trainer.watch = StallWatch(
                trainer.bootstrap, trainer.ns, model=trainer.model_name,
                max_staleness=trainer.recipe.schedule.max_staleness, log=log).open()
        self._last_unit = self._stall_checked = time.monotonic()
        return start

    def poll(self) -> None:
        """Before each fetch, unless at ``max_steps`` (every rank is at the same step): every
        ``CHECK_EVERY_S``, and at once when this rank was asked to stop, meet the other ranks
        (``Trainer._meet``: rank 0 looks for a stall; they may roll back or stop); stop after
        ``idle_exit`` seconds without a new unit (the units of an unfinished step stay
        unacknowledged)."""
        trainer = self.trainer
        self._fetch_started = time.monotonic()
        if not trainer._done() and (trainer._stop_asked.is_set() or
                                    self._fetch_started - self._stall_checked >= CHECK_EVERY_S):
            trainer._meet(ready=False)   # one rank: a meeting of one, rank 0
            self._stall_checked = time.monotonic()
        if trainer._done():
            trainer._stop.set()
        elif trainer.idle_exit is not None \
                and time.monotonic() - self._last_unit > trainer.idle_exit:
            log.info("no new unit for %.0f s: leaving", trainer.idle_exit)
            trainer.stop()

    def submit(self, message: Any) -> None:
        """Into the merge; taken in ``fetched`` once settled. Never blocks or rejects (a unit
        that cannot be trained is dead-lettered by ``_take``, in log order)."""
        _, timestamp = message.timestamp()
        self.trainer.merge.add(message.partition(), message.offset(), timestamp, message)

    def at_end(self, topic: str, partition: int, offset: int) -> None:
        self.trainer.merge.at_end(partition)

    def fetched(self, drained_at_ms: int | None) -> None:
        """Take the settled units in log order; a full step is trained and acknowledged here
        (blocks for it). A step that fails goes back to the newest checkpoint: the consumer is
        assigned again at its offsets, after ``RETRY_BACKOFF_S``."""
        trainer = self.trainer
        settled = trainer.merge.drained(drained_at_ms if drained_at_ms is not None else 0)
        trainer.summary.data_seconds += time.monotonic() - self._fetch_started
        took = False
        try:
            while not trainer._done() and (record := trainer.merge.pop(settled)) is not None:
                took = True
                trainer._take(record)
        except (RetryableError, CheckpointError, KafkaException) as error:
            log.error("a step was aborted (%s); resuming from the newest checkpoint", error)
            trainer.consumer.assign(trainer._resume_after_failure())
            return
        if took:
            self._last_unit = time.monotonic()
        if trainer._done():
            trainer._stop.set()

    def join(self, timeout: float | None) -> None:
        """A stop (not a failure): acknowledge the steps trained since the newest checkpoint,
        so stopping loses none (``schedule.checkpoint_every``). Every rank, after the same
        step."""
        trainer = self.trainer
        if trainer.backend is not None and trainer.step > trainer.durable_step:
            trainer._checkpoint()

    def close(self) -> None:
        """The publications' reader; the consumer is the loop's, the producer the trainer's."""
        if self.trainer.watch is not None:
            self.trainer.watch.close()
