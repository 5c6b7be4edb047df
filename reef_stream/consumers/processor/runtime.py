"""The processor runtime: a recipe's processor over ``<ns>.generations`` + ``<ns>.feedback``.

``ProcessorRuntime`` (``reef process --recipe X``) runs ``reef_stream.engine.join.ProcessorState``
as a transactional consume-transform-produce stage on the stage loop (strategy
``_Processing``, ``CommitsItself``): the loop fetches up to ``BATCH`` records (waiting at
most ``POLL_TIMEOUT_S``), and per fetch one Kafka transaction (``_commit``, the one place the
order is written) holds, atomically: the units, a dead letter for every non-unit outcome,
the changed state keys on the compacted changelog ``<ns>.processor-state.<recipe>``, and the
consumed offsets (``send_offsets_to_transaction``, KIP-447; the loop never commits). So a
processor killed at any moment restarts with exactly the state that went with its committed
offsets, and every generation gets exactly one outcome in the committed log.

Generations and feedback are co-partitioned (``range`` assignor, checked in ``_assign``); a
pair's records are offered in timestamp order, each waiting at most ``MAX_IDLE_S`` for the
other topic (``consumers.processor.pairs``). ``group.instance.id`` is ``--instance``: a
restart fences its predecessor (``reef_stream.topics.fencing``). With
``max_backlog_steps`` the units waiting for the trainer are bounded and the surplus SHED
(``consumers.processor.backlog``; a trainer stalled ``STALL_STEPS`` intervals, at least
``STALL_MIN_S``, suspends the bound), after holding what it reads for up to
``schedule.backlog_wait_s`` while the bound is full, for a checkpoint to make room
(``backlog.BacklogWait``). Beside it: ``pairs``, ``offers``, ``step_records``,
``changelog``, ``backlog``, ``metrics``. The long form: ``docs/processor.md`` ("How the
runtime works"); measurements and why not faust-streaming: the same file.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from reef_stream.consumers.processor.backlog import BacklogWait, UnitBacklog, share
from reef_stream.consumers.processor.changelog import changelog, changelog_topic, read_changelog
from reef_stream.consumers.processor.metrics import ProcessorMetrics
from reef_stream.consumers.processor.offers import decode_offers
from reef_stream.consumers.processor.pairs import PartitionPair
from reef_stream.consumers.processor.record_stats import RecordStats
from reef_stream.consumers.processor.step_records import Record, StepRecords
from reef_stream.consumers.stage import (
    CommitsItself, ConsumerFenced, Fenced, FetchEnd, Group, Rebalancing, StageLoop, StageOptions,
    kafka_consumers,
)
from reef_stream.core import metric_names
from reef_stream.core.errors import FatalError, InvalidRecord
from reef_stream.core.events import Checkpoint, now_ms
from reef_stream.core.processes import stop_on_signals
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import DEFAULT_STUCK_COMMIT_S
from reef_stream.engine.join import ProcessorState, Step
from reef_stream.engine.snapshots import loads_snapshot
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics, namespace_topics
from reef_stream.topics.connect import ask_broker, new_admin, new_consumer, watermarks
from reef_stream.topics.declarations import MiB
from reef_stream.topics.fencing import (
    CommitWatchdog, TransactionalIdentity, exit_for_restart,
)
from reef_stream.topics.kafka import (
    OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition,
)

log = logging.getLogger(__name__)

STAGE = metric_names.STAGE_PROCESSOR
#: Most records taken per transaction.
BATCH = 2000
#: Longest the loop waits for a fetch to fill ``batch``: a record read waits this long at most
#: before its transaction begins, and below ``batch`` records a fetch is one transaction, so it
#: also sets how many transactions a second cost: 0.1 s, nearly the latency of 0.05 s at
#: nearly the cost of 0.2 s (measured: ``docs/processor.md``).
POLL_TIMEOUT_S = 0.1
#: How long the broker keeps a transaction of a vanished producer open (a restarted
#: instance aborts it at once; another instance's would block readers this long).
TRANSACTION_TIMEOUT_MS = 30_000
#: What an abort of a transaction open past its timeout is refused with once its coordinator
#: aborted it (and bumped the producer's epoch): then the fence is the broker's, and the
#: processor renews its producer (``_renew_producer``) as a restart would.
ABORTED_BY_COORDINATOR = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                          KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.INVALID_TXN_STATE)
SESSION_TIMEOUT_MS = 10_000
#: Longest a record waits (wall clock, from when it was read) for the other topic of its
#: pair to be read past its timestamp while that topic has unread records.
MAX_IDLE_S = 5.0
#: Seconds between two writes of the trainer's backlog metric (with ``max_backlog_steps``).
BACKLOG_EVERY_S = 1.0
#: The bound is suspended while full and no checkpoint came for this many of the trainer's
#: step intervals (the shortest of its last ``STALL_INTERVALS``), and at least ``STALL_MIN_S``
#: (see the module docstring).
STALL_STEPS = 3
STALL_INTERVALS = 8
STALL_MIN_S = 30.0
#: The cyclic collector's thresholds in a processor's own process (``tune_collector``). With
#: the default (700, 10, 10) its collections scanned the state's live objects over and over
#: (17% of the Python work per generation: ``docs/processor.md``). Records and states are freed
#: by reference counting; only cycles wait longer.
GC_THRESHOLDS = (10_000, 10, 10)


class ProcessorRuntime:
    """Runs one recipe's processor until ``stop()``; see the module docstring. ``run`` blocks;
    ``stop`` may be called from any thread or a signal handler. Not reusable after ``run``.

    On the stage loop as ``_Processing``, committing its input offsets itself inside each
    batch's transaction (``CommitsItself``): the exactly-once guarantee."""

    def __init__(self, recipe: Any, *, bootstrap: str, namespace: str, group: str | None = None,
                 instance: str = "0", batch: int = BATCH, log_every_s: float = 10.0,
                 metrics_every_s: float = 1.0, registry: SchemaRegistry | None = None,
                 max_unit_bytes: int | None = None,
                 on_stuck: Callable[[str], None] | None = None,
                 transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS,
                 stall_min_s: float = STALL_MIN_S,
                 stuck_commit_s: float = DEFAULT_STUCK_COMMIT_S):
        self.recipe, self.ns = recipe, namespace
        #: The producer's ``transaction.timeout.ms``: the broker aborts (and fences) a
        #: transaction open longer (see ``_renew_producer``).
        self.transaction_timeout_ms = transaction_timeout_ms
        #: The shortest wait before a full backlog bound is suspended (module docstring).
        self.stall_min_s = stall_min_s
        self.group = group or f"{namespace}.process.{recipe.name}"
        self.instance = instance
        self.batch, self.log_every_s, self.metrics_every_s = batch, log_every_s, metrics_every_s
        self.registry = registry or SchemaRegistry.default()
        self.bootstrap = bootstrap
        self.generations = declarations.generations(namespace)
        self.feedback = declarations.feedback(namespace)
        self.units_topic = declarations.units(namespace, recipe.name)
        #: Encoded units larger than this are dead-lettered member by member instead of
        #: failing every transaction (the topic's max.message.bytes, less room for the key
        #: and headers).
        self.max_unit_bytes = max_unit_bytes or next(
            t.max_message_bytes for t in declarations.declare_topics(namespace, (recipe.name,))
            if t.name == self.units_topic) - 4096
        self.dead_letters = declarations.dead_letters(namespace)
        self._records = StepRecords(self.registry, self.units_topic, self.dead_letters,
                                    self.generations, self.feedback, self.max_unit_bytes)
        self.changelog = changelog(namespace, recipe.name)
        self._topics = (self.generations, self.feedback)
        self.counts: Counter[str] = Counter()
        self.transactions = 0
        self.aborted = 0  # transactions aborted and rewound
        self._metrics: ProcessorMetrics | None = None
        self._identity = TransactionalIdentity(
            bootstrap, f"reef-process.{namespace}.{recipe.name}.{self.group}.{instance}",
            timeout_ms=transaction_timeout_ms, probe_topic=self.changelog, instance=instance)
        #: Calls ``on_stuck(why)`` (on its thread) when a transaction has not committed
        #: ``stuck_commit_s`` after it began; see ``fencing.CommitWatchdog``. None: logged only.
        self._watchdog = CommitWatchdog(f"processor {recipe.name}", on_stuck,
                                        stuck_after_s=stuck_commit_s)
        #: Rewards per source and version, completion lengths, truncation (committed steps only).
        self.stats = RecordStats()
        self._parts: dict[int, PartitionPair] = {}
        self._stop = threading.Event()
        #: The loop's consumer (``on_start``: a new one after a rejoin); the ``ready`` of ``run``.
        self._consumer: Consumer | None = None
        self._ready: threading.Event | None = None
        self._logged_at = 0.0
        self._producer: Producer | None = None
        self.checkpoints_topic = declarations.checkpoints(namespace)
        self._checkpoints: Consumer | None = None
        #: The newest policy version among this recipe's Checkpoint events, and the one
        #: every partition's state has observed (None: apply it at the next batch).
        self.newest_checkpoint: int | None = None
        self._observed: int | None = None
        #: The units waiting for the trainer (``processor.backlog``), the figure the states got
        #: at the last batch (None: no bound, or no checkpoint yet), when the metric was last
        #: written, when the newest checkpoint came (monotonic) and the last intervals between
        #: checkpoints.
        self._backlog = UnitBacklog()
        self._wait = BacklogWait(recipe.schedule.backlog_wait_s)
        self.backlog: int | None = None
        self._backlog_at = 0.0
        self._checkpoint_at: float | None = None
        self._intervals: deque[float] = deque(maxlen=STALL_INTERVALS)
        self._suspended = False
        self._partitions = 0

    # ----------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask ``run`` to return after the current transaction. Idempotent, non-blocking."""
        self._stop.set()

    @property
    def metrics_dropped(self) -> int:
        """Metric events the client refused or the broker did not take (``processor.metrics``)."""
        return self._metrics.dropped if self._metrics is not None else 0

    def run(self, *, ready: threading.Event | None = None) -> None:
        """Create the topics it needs, then process on the stage loop until ``stop``. Blocks.
        ``ready`` is set once partitions are assigned and their states restored."""
        partitions = self._partitions = self._ensure_topics()
        self._producer = self._identity.new_producer()
        self._metrics = ProcessorMetrics(
            self.bootstrap, self.ns,
            {"recipe": self.recipe.name, "group": self.group, "instance": self.instance},
            every_s=self.metrics_every_s)
        self._ready, self._logged_at = ready, time.monotonic()
        self._watchdog.start(self._stop)
        self._checkpoints = new_consumer(self.bootstrap, f"{self.group}.checkpoints",
                                         {"isolation.level": "read_committed"})
        self._checkpoints.assign([TopicPartition(self.checkpoints_topic, p, OFFSET_BEGINNING)
                                  for p in range(self._partition_count(self.checkpoints_topic))])
        log.info("processing %s + %s -> %s (recipe %s, group %s, instance %s, %d partitions)",
                 self.generations, self.feedback, self.units_topic, self.recipe.name,
                 self.group, self.instance, partitions)
        StageLoop(
            _Processing(self), StageOptions(
                stage=STAGE, topics=tuple(self._topics), namespace=self.ns,
                reads="generation or feedback", membership=Group(self.group),
                # One transaction per fetch: a fetch waits POLL_TIMEOUT_S for a batch.
                batch=self.batch, poll_timeout=POLL_TIMEOUT_S, fill_batch=True, consumer_config={
                    # static membership: a restarted instance takes its predecessor's place
                    "group.instance.id": f"{self.group}.{self.instance}",
                    "partition.assignment.strategy": "range",  # co-partitioned (module doc)
                    "session.timeout.ms": SESSION_TIMEOUT_MS,
                    "isolation.level": "read_committed",
                    "fetch.max.bytes": 64 * MiB,
                }),
            consumers=kafka_consumers(self.bootstrap),
            producer=None,  # dead letters go out inside the transactions
            registry=self.registry, metrics=self._metrics.writer, stop_event=self._stop,
            logger=log).run()

    def _between_fetches(self) -> None:
        """What the loop does between fetches besides processing: ``ready`` once partitions
        are held, the metrics, the counts to the log every ``log_every_s``."""
        if self._ready is not None and self._parts:
            self._ready.set()
        self._emit_metrics()
        if time.monotonic() - self._logged_at >= self.log_every_s:
            self._logged_at = time.monotonic()
            self._log_counts()

    def _close(self) -> None:
        """At the end of ``run``, after the loop closed its consumer, also after a failure: the
        counts to the log; then the checkpoint reader, the producer and the final metrics, each
        even if another fails, and none hiding why ``run`` is leaving (a fenced producer's flush
        raises the fencing again, as a bare KafkaException)."""
        self._log_counts()
        for what, close in (("checkpoint reader", self._checkpoints.close),
                            ("producer", lambda: self._producer.flush(10)),
                            ("metrics", lambda: self._emit_metrics(final=True))):
            try:
                close()
            except Exception as error:  # noqa: BLE001 - shutting down anyway
                log.warning("processor %s: closing the %s: %s", self.recipe.name, what, error)

    def _log_counts(self) -> None:
        log.info("processor %s: %d transactions (%d aborted); %s%s", self.recipe.name,
                 self.transactions, self.aborted,
                 ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "nothing yet",
                 f"; {self.metrics_dropped} metric events dropped" if self.metrics_dropped else "")

    def _emit_metrics(self, *, final: bool = False) -> None:
        if self._metrics is not None:
            self._metrics.emit_counts(self.counts, self.transactions, self.aborted, self.stats,
                                      final=final)

    def _ensure_topics(self) -> int:
        """Create the units, dead-letter and changelog topics if missing; the partition count."""
        admin = new_admin(self.bootstrap)
        topics = namespace_topics(admin, self.ns, (self.recipe.name,))
        ensure_topics(admin, topics)
        partitions = next(t.partitions for t in topics if t.name == self.generations)
        ensure_topics(admin, [changelog_topic(self.ns, self.recipe.name, partitions)])
        return partitions

    # ----------------------------------------------------------------- rebalancing

    def _assign(self, assigned: list[TopicPartition]) -> None:
        """Check co-partitioning, then rebuild each partition's state from its changelog.
        Inside the rebalance: an error is kept by the loop and raised from ``run``."""
        by_topic: dict[str, set[int]] = {}
        for tp in assigned:
            by_topic.setdefault(tp.topic, set()).add(tp.partition)
        gens, fbs = by_topic.get(self.generations, set()), by_topic.get(self.feedback, set())
        if gens != fbs:
            raise FatalError(f"not co-partitioned: assigned {self.generations} {sorted(gens)} but "
                             f"{self.feedback} {sorted(fbs)}; both topics need the same partition "
                             "count and every member the range assignor")
        started = time.monotonic()
        self._parts = self._restore(sorted(gens))
        self._observed = None  # restored states have not seen the newest checkpoint
        self._start_positions(assigned)
        log.info("assigned partitions %s; state restored in %.2f s (%d keys)", sorted(gens),
                 time.monotonic() - started, sum(len(p.state.keys()) for p in self._parts.values()))

    def _start_positions(self, assigned: list[TopicPartition]) -> None:
        """Where consumption of each assigned partition starts: its committed offset, or its
        start (auto.offset.reset=earliest)."""
        committed = ask_broker("reading the group's committed offsets",
                               lambda: self._consumer.committed(assigned, timeout=30))
        for tp in committed:
            offset = tp.offset
            if offset < 0:
                offset, _ = watermarks(self._consumer, tp.topic, tp.partition)
            self._parts[tp.partition].next[tp.topic] = offset

    def _rejoin(self, fenced: ConsumerFenced) -> None:
        """Before the loop replaces a consumer fenced as a static member by a new one with the
        same instance id: allowed at most ``MAX_REJOINS`` times in ``REJOIN_WINDOW_S`` (then
        ``fenced`` is raised, and the loop stops).

        A fenced static member is often this very process: after a broker failure moved the
        group coordinator, librdkafka may rejoin under a new member id and so fence its own old
        one. The transactional id decides: an empty transaction (one tombstone for a key no
        state has, in the changelog) must commit, or a newer instance fenced this producer at
        its ``init_transactions`` and this one stops (``FatalError``). Nothing is lost by
        rejoining: the fence arrives between transactions (the records of the fetch it ended
        are dropped with the states), and the new member restores the states from the
        changelog and reads from the committed offsets, as a restart would.
        """
        self._identity.prove(self._producer, fenced)
        self._identity.count(fenced)
        self._parts = {}

    def _renew_producer(self, fenced: FatalError) -> None:
        """Replace a producer fenced at a transaction by a new one with the same transactional
        id, at most ``MAX_REJOINS`` times in ``REJOIN_WINDOW_S`` (counted with ``_rejoin``'s;
        then ``fenced`` is raised).

        Called only for a transaction open longer than ``transaction.timeout.ms``: then the
        fence is the broker's, not a newer instance's. A transaction that could not finish in
        time while a broker was down is aborted by its coordinator, which bumps the producer's
        epoch, and the old producer's next request fails as fenced (seen after SIGKILLing a
        broker under load). The transaction is aborted, so renewing is what a restart would
        do; the caller rewinds the states and offsets. A fence within the timeout is a newer
        instance's (another process with this ``--instance``): that one stays fatal.
        """
        self._identity.count(fenced)
        log.warning("%s; starting a new transactional producer (instance %s) and going back "
                    "to the committed state", fenced, self.instance)
        self._producer = self._identity.new_producer()

    def _restore(self, partitions: list[int]) -> dict[int, PartitionPair]:
        """Each partition's state, from its changelog partition read to the end."""
        parts = {p: PartitionPair(ProcessorState.for_recipe(self.recipe), self._topics)
                 for p in partitions}
        bound = self.recipe.schedule.max_backlog_units
        for part in parts.values() if bound is not None else ():
            # Its states count this instance's units: against its share (module docstring).
            part.state.max_backlog = share(bound, len(partitions),
                                           max(self._partitions, len(partitions)))
        tables = read_changelog(self.bootstrap, f"{self.group}.restore", self.changelog,
                                partitions)
        for p, table in tables.items():
            for key, data in table.items():
                parts[p].state.restore(_key_str(key), loads_snapshot(data))
        return parts

    # ----------------------------------------------------------------- processing

    def _queue(self, message: Message) -> None:
        """Hold a record in its partition pair until ``_process`` offers it."""
        part = self._parts.get(message.partition())
        if part is not None:  # else a record of a partition revoked within this fetch
            part.queue(message)

    def _process(self) -> None:
        """After each fetch (also an empty one): offer each pair's records in timestamp order
        as far as both topics have been read, tick, and commit it all in one transaction."""
        steps: list[tuple[int, Step]] = []
        bad: list[Any] = []
        positions: dict[tuple[str, int], int] = {}
        self._observe_backlog()
        if self.newest_checkpoint is not None and self._observed != self.newest_checkpoint:
            # Generations now more than max_staleness behind end TOO_STALE, in this transaction.
            steps += [(p, part.state.observe_checkpoint(self.newest_checkpoint))
                      for p, part in self._parts.items()]
            self._observed = self.newest_checkpoint
        if self._wait.holding(full=self._full(), now=time.monotonic()):
            # The records read stay in their pairs, unoffered; the next fetch decides again.
            self.counts["fetches.held"] += 1
            if steps:
                self._commit(steps, bad, positions)
            return
        emitted = 0  # units of this batch, so far
        for p, part in self._parts.items():
            if self.backlog is not None:
                # Units other partitions emitted since the measurement count for this one too.
                part.state.observe_backlog(0 if self._suspended else self._backlog.units + emitted)
                first = len(steps)
            caught: list[set[str]] = []  # _caught_up(p), asked at most once per batch

            def caught_up(p: int = p, caught: list[set[str]] = caught) -> set[str]:
                if not caught:
                    caught.append(self._caught_up(p))
                return caught[0]

            self._offer(p, part, part.ready(caught_up, MAX_IDLE_S), steps, positions, bad)
            due = part.state.next_deadline()
            if due is not None:
                now = part.state.clock
                if not part.held() and due > now:
                    if caught_up().issuperset(self._topics):
                        now = now_ms()  # nothing unread: the wall clock is the frontier
                if due <= now:
                    steps.append((p, part.state.tick(now)))
            if self.backlog is not None:
                emitted += sum(len(step.units) for _, step in steps[first:])
                self.backlog = self._backlog.estimate(len(self._parts), self._partitions, emitted)
        if not positions and not steps:
            return
        self._commit(steps, bad, positions)

    def _offer(self, p: int, part: PartitionPair, ready: Iterator[tuple[str, Any, int]],
               steps: list[tuple[int, Step]], positions: dict[tuple[str, int], int],
               bad: list[Any]) -> None:
        """Offer ``ready``'s records to ``part``'s state (a ``Step`` into ``steps``). With a
        wait for a full backlog (``schedule.backlog_wait_s``): at most as many records at a
        time as there is room for units (a record completes at most one group), and none once
        the backlog is full while the wait lasts: they stay held in the pair. Else all of
        them, and the state sheds what completes past the bound."""
        while True:
            room = part.state.backlog_room() if self._wait.wait_s else None
            if room == 0 and self._wait.holding(full=True, now=time.monotonic()):
                return
            chunk = list(itertools.islice(ready, room)) if room else ready
            offers = decode_offers(self.registry, self.generations, p, chunk, positions, bad)
            if offers:
                steps.append((p, part.state.offer_all(offers)))
            if not room or len(chunk) < room:   # all of them, or all there were
                return

    def _read_checkpoints(self) -> None:
        """Take in the Checkpoint events published since the last call (never blocks).

        Only this recipe's checkpoints count; the newest policy version among
        them is what staleness is measured against. A checkpoint event that
        does not decode is logged (naming its topic, partition and offset),
        counted in ``counts["checkpoints.undecodable"]`` (read once per
        process, outside any transaction) and in the metric
        ``PROCESSOR_CHECKPOINTS_UNDECODABLE``, and otherwise ignored; no dead
        letter here: the evaluator, which consumes that topic as a group,
        dead-letters it.
        """
        for message in self._checkpoints.consume(100, timeout=0):
            if message.error() is not None:
                continue
            try:
                checkpoint = self.registry.decode(
                    message.value(), message.headers(), Checkpoint, topic=message.topic(),
                    partition=message.partition(), offset=message.offset())
            except InvalidRecord as error:
                self.counts["checkpoints.undecodable"] += 1
                log.warning("ignoring a checkpoint event that does not decode (the evaluator "
                            "dead-letters it): %s", error)
                if self._metrics is not None:
                    self._metrics.writer.write(metric_names.PROCESSOR_CHECKPOINTS_UNDECODABLE,
                                               self.counts["checkpoints.undecodable"])
                continue
            if checkpoint.recipe == self.recipe.name and (
                    self.newest_checkpoint is None or checkpoint.policy_version > self.newest_checkpoint):
                self.newest_checkpoint = checkpoint.policy_version
                self._backlog.passed({o.partition: o.offset for o in checkpoint.offsets
                                      if o.topic == self.units_topic})
                now = time.monotonic()
                if self._checkpoint_at is not None:
                    self._intervals.append(now - self._checkpoint_at)
                self._checkpoint_at = now

    def _observe_backlog(self) -> None:
        """With a backlog bound (``schedule.max_backlog_steps``) and a trainer (a checkpoint
        seen): count the units waiting for it (``UnitBacklog.estimate``), suspending the bound
        while the trainer looks stuck behind it (module docstring), and give the figure to
        every partition's state; every ``BACKLOG_EVERY_S``, to the metrics too."""
        bound = self.recipe.schedule.max_backlog_units
        if bound is None or self.newest_checkpoint is None or not self._parts:
            return
        self.backlog = self._backlog.estimate(len(self._parts), self._partitions)
        waited = time.monotonic() - self._checkpoint_at
        stuck = self.backlog >= bound and waited >= max(
            STALL_STEPS * min(self._intervals, default=0.0), self.stall_min_s)
        if stuck != self._suspended:
            self._suspended = stuck
            if stuck:
                log.warning("the trainer's backlog is full (%d units, bound %d) and no checkpoint "
                            "came for %.0f s: admitting units until its next checkpoint (units it "
                            "skipped may be holding its step short)", self.backlog, bound, waited)
        for part in self._parts.values():
            part.state.observe_backlog(0 if stuck else self._backlog.units)
        if self._metrics is not None and time.monotonic() - self._backlog_at >= BACKLOG_EVERY_S:
            self._backlog_at = time.monotonic()
            self._metrics.writer.write(metric_names.PROCESSOR_TRAINER_BACKLOG, self.backlog)

    def _full(self) -> bool:
        """Whether the backlog bound is in force and reached (``_observe_backlog``'s figure)."""
        bound = self.recipe.schedule.max_backlog_units
        return (bound is not None and self.newest_checkpoint is not None and bool(self._parts)
                and not self._suspended and self.backlog is not None and self.backlog >= bound)

    def _partition_count(self, topic: str) -> int:
        metadata = self._checkpoints.list_topics(topic, timeout=30).topics[topic]
        return len(metadata.partitions)

    def _caught_up(self, p: int) -> set[str]:
        """The topics whose partition ``p`` has nothing unread, as of the last fetch."""
        done, part = set(), self._parts[p]
        for tp in self._consumer.position([TopicPartition(t, p) for t in self._topics]):
            _, high = self._consumer.get_watermark_offsets(tp, cached=True) or (0, -1)
            if 0 <= high <= max(tp.offset, part.next.get(tp.topic, -1)):
                done.add(tp.topic)
        return done

    def _commit(self, steps: list[tuple[int, Step]], bad: list[Any],
                positions: dict[tuple[str, int], int]) -> None:
        """The durability order, in one transaction (all of it or none of it survives a crash):
        units → dead letters → changed state snapshots → consumed offsets → commit.

        A retriable error of ``send_offsets_to_transaction`` or ``commit_transaction`` is
        retried (``_retry``). Any other failure that is not fatal aborts the transaction,
        rebuilds the states from the changelog and rewinds consumption to the committed
        offsets (what a restart would do). That includes a ``produce`` refused with
        ``_STATE`` because an earlier record of the transaction already failed (the
        transaction is then abortable, but that error does not say so). A producer fenced
        after the transaction was open longer than its timeout gets a successor
        (``_renew_producer``) and rewinds the same way; any other fatal error, or an abort
        that fails (e.g. being fenced), is fatal. Offsets refused with ``FENCED_INSTANCE_ID``
        say that this consumer's static membership was taken by a member with its instance id:
        the transaction is aborted and ``ConsumerFenced`` raised, so the loop rejoins with a
        new consumer (``_rejoin``) instead of rewinding the fenced one, whose ``seek`` fails
        with ``_STATE`` (the nemesis, seed 26, after an isolation of the processor's host)."""
        producer, counts = self._producer, Counter()
        began = self._watchdog.begin()
        try:
            producer.begin_transaction()
            for p, step in steps:  # units, then dead letters (``step_records``)
                step.count_into(counts)
                self._parts[p].touched.update(step.touched)
                for record in self._records.of_step(step, counts):
                    self._produce(record)
            for message, error in bad:
                counts["invalid_records"] += 1
                self._produce(self._records.of_invalid(message, error))
            for p, part in self._parts.items():
                for key in sorted(part.touched):
                    producer.produce(self.changelog, partition=p, key=_key_bytes(key),
                                     value=part.state.snapshot_bytes(key))
                    self._poll()
            offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(positions.items())]
            if offsets:
                metadata = self._consumer.consumer_group_metadata()
                self._retry(lambda: producer.send_offsets_to_transaction(offsets, metadata, 30))
            self._retry(lambda: producer.commit_transaction(60))
            producer.poll(0)  # delivery reports not yet served (commit_transaction flushes)
            self._backlog.committed()
        except KafkaException as exc:
            self._backlog.aborted()
            error = exc.args[0]
            # Open past its timeout: a fence (or the fatal state it leaves) is the broker's.
            timed_out = time.monotonic() - began >= self.transaction_timeout_ms / 1000
            if timed_out and error.code() in (KafkaError._FENCED, KafkaError._FATAL):
                self._renew_producer(FatalError(f"the processor's transaction failed: {error}"))
            elif error.fatal():
                raise FatalError(f"the processor's transaction failed: {error}") from exc
            elif error.code() == KafkaError.FENCED_INSTANCE_ID:
                self._abort_for_fence(producer, error)
                self.aborted += 1
                raise ConsumerFenced(f"the processor's consumer was fenced at its transaction's "
                                     f"offsets: {error.str()}") from exc
            else:
                log.warning("transaction failed (%s); aborting it and rebuilding state from "
                            "the changelog", error)
                try:
                    producer.abort_transaction(60)
                except KafkaException as abort:
                    failed = FatalError(f"the processor's transaction failed ({error}) and could "
                                        f"not be aborted: {abort.args[0]}")
                    # Open past its timeout, the coordinator aborted it itself: the abort is
                    # refused as fenced, or as INVALID_TXN_STATE when the coordinator's host
                    # was paused past the timeout (the seeded nemesis, seed 29).
                    timed_out = time.monotonic() - began >= self.transaction_timeout_ms / 1000
                    if not (timed_out and abort.args[0].code() in ABORTED_BY_COORDINATOR):
                        raise failed from abort
                    self._renew_producer(failed)
            self.aborted += 1
            self._rewind()
            return
        finally:
            self._watchdog.end()
            for part in self._parts.values():
                part.touched.clear()
        self.transactions += 1
        self.counts.update(counts)
        self.stats.observe(step for _, step in steps)

    @staticmethod
    def _abort_for_fence(producer: Producer, error: KafkaError) -> None:
        """Abort the transaction whose offsets the consumer's fence refused. The producer is
        not the one fenced, so the abort is expected to succeed; a refused abort is logged,
        the coordinator aborts the transaction at its timeout, and ``_rejoin``'s empty
        transaction then says whether this producer may go on."""
        try:
            producer.abort_transaction(60)
        except KafkaException as abort:
            log.warning("the transaction the consumer's fence refused (%s) was not aborted: %s",
                        error.str(), abort.args[0])

    @staticmethod
    def _retry(call: Any, attempts: int = 3) -> None:
        """``call()``, again while it raises a retriable error (at most ``attempts`` times)."""
        for attempt in range(attempts):
            try:
                return call()
            except KafkaException as exc:
                if not exc.args[0].retriable() or attempt == attempts - 1:
                    raise
                log.warning("retrying: %s", exc.args[0])

    def _produce(self, record: Record) -> None:
        self._producer.produce(record.topic, value=record.value, key=record.key,
                               headers=record.headers,
                               on_delivery=self._unit_delivered if record.topic == self.units_topic
                               else None)
        self._poll()

    def _unit_delivered(self, error: KafkaError | None, message: Message) -> None:
        """A unit's delivery report: where it went counts for the backlog once committed."""
        if error is None:
            self._backlog.delivered(message.partition(), message.offset())

    def _poll(self) -> None:
        if len(self._producer) > 50_000:
            self._producer.poll(0)

    def _rewind(self) -> None:
        """After an aborted transaction: the states as committed, input from the committed offsets."""
        assignment = self._consumer.assignment()
        self._parts = self._restore(sorted({tp.partition for tp in assignment}))
        self._observed = None  # restored states have not seen the newest checkpoint (as in _assign)
        committed = self._consumer.committed(assignment, timeout=30)
        for tp in committed:
            tp.offset = tp.offset if tp.offset >= 0 else 0
            self._consumer.seek(tp)


class _Processing:
    """The processor's strategy on the stage loop (``CommitsItself``): ``submit`` queues a
    record into its partition pair, ``fetched`` processes a fetch and commits it, offsets
    included, in one transaction; ``poll`` does what goes on between fetches, ``on_fenced`` is
    ``_rejoin`` and ``close`` closes what the runtime holds besides the loop's consumer. A
    record that does not decode is dead-lettered inside its transaction, not by the loop."""

    capabilities = frozenset({CommitsItself, Rebalancing, FetchEnd, Fenced})

    def __init__(self, runtime: ProcessorRuntime) -> None:
        self.runtime = runtime

    def on_start(self, consumer: Consumer) -> None:
        """The loop's consumer (a new one after a rejoin): the group metadata, positions,
        watermarks and committed offsets come from it, and ``_rewind`` seeks it."""
        self.runtime._consumer = consumer

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        self.runtime._assign(partitions)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self.runtime._parts = {}  # eager protocol: everything, always between transactions

    def submit(self, message: Message) -> None:
        self.runtime._queue(message)

    def fetched(self, drained_at_ms: int | None) -> None:
        self.runtime._read_checkpoints()
        self.runtime._process()

    def poll(self) -> None:
        self.runtime._between_fetches()

    def on_fenced(self, fenced: ConsumerFenced) -> None:
        self.runtime._rejoin(fenced)

    def join(self, timeout: float | None) -> None:
        """Nothing to finish: a record queued but not committed is read again after a restart."""

    def close(self) -> None:
        self.runtime._close()


def _key_bytes(key: str) -> bytes:
    """A state key as its changelog key (a ledger segment key's lone surrogate as one byte)."""
    return key.encode("utf-8", "surrogateescape")


def _key_str(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def run_processor_runtime(recipe: Any, *, bootstrap: str, namespace: str, group: str | None = None,
                          instance: str = "0", batch: int = BATCH,
                          handle_signals: bool = True,
                          stuck_commit_s: float = DEFAULT_STUCK_COMMIT_S) -> ProcessorRuntime:
    """Run until SIGINT / SIGTERM (with ``handle_signals``); the runtime, for its counts. A
    transaction still open ``stuck_commit_s`` after it began ends the process with
    ``EXIT_RESTART`` (see ``fencing.CommitWatchdog``)."""
    tune_collector()
    runtime = ProcessorRuntime(recipe, bootstrap=bootstrap, namespace=namespace, group=group,
                               instance=instance, batch=batch,
                               on_stuck=exit_for_restart("processor"),
                               stuck_commit_s=stuck_commit_s)
    stopping = stop_on_signals(runtime.stop) if handle_signals else contextlib.nullcontext()
    try:
        with stopping:
            runtime.run()
    except KafkaException as exc:
        raise FatalError(f"the processor stopped: {exc.args[0]}") from exc
    return runtime


def tune_collector() -> None:
    """Set this process's cyclic-collector thresholds to ``GC_THRESHOLDS``: for a process that
    runs a processor (process-wide, so not done by ``ProcessorRuntime`` itself)."""
    gc.set_threshold(*GC_THRESHOLDS)
