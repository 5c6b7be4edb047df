"""Metric names, in one place, and the ``Metric`` events every stage writes to ``<ns>.metrics``.

A metric is ``(stage, name, value, labels)``. Stage names are the pipeline's
stages (``STAGE_*``); metric names are the constants below, never strings
written inline at the call site, so a dashboard can rely on them. Counters
are emitted as running totals since the process started (``value`` only
grows; a restart starts again at 0, so readers take differences within one
``labels["instance"]``).

``MetricsWriter`` batches events onto a producer the caller owns; it never
blocks the pipeline: a metric that cannot be sent is logged and dropped
(metrics are observations, not records of the pipeline).

Every ``write`` also sets a gauge in the process's Prometheus exposition
(``reef_stream.ops.prometheus``: ``reef_<stage>_<name>``, the same labels), which a
stage serves at ``/metrics`` when started with ``--metrics-port``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from reef_stream.ops import prometheus
from reef_stream.topics.events import Metric, now_ms
from reef_stream.topics import declarations
from reef_stream.topics.serde import SchemaRegistry

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- stages

STAGE_INTAKE = "intake"
STAGE_PROCESSOR = "processor"
STAGE_REWARD = "reward"
STAGE_TRAINER = "trainer"
STAGE_EVALUATOR = "evaluator"
STAGE_FOLLOWER = "follower"

# --------------------------------------------------------------------------- every consumer

#: Records not yet read, per partition a stage's consumer holds: the partition's high watermark
#: (as of the consumer's last fetch) minus the consumer's position. Written by the reward
#: workers, the processor, the trainer and the evaluator with their other metrics. Labels:
#: topic, partition.
CONSUMER_LAG = "consumer_lag"
#: Seconds after which an unchanged lag is written again.
LAG_REPEAT_S = 30.0

# --------------------------------------------------------------------------- every process

#: CPU seconds (user + system: ``time.process_time()``) this process has used since it started,
#: a running total, written by the stage loop with the lag and once more at its end
#: (``MetricsWriter.write_process``). Label ``process``: ``<hostname>.<pid>``, so a restarted
#: process is a new series and a reader sums each series' last value (``ops/scorecard.py``).
#: A process that hosts several stages reports its whole CPU under each of them.
PROCESS_CPU_SECONDS = "process_cpu_seconds"      # labels: process

# --------------------------------------------------------------------------- intake

#: A ``RecordProducer``'s records (running totals, label ``topic``): handed to the client or the
#: spool / acknowledged by the broker / failed for good (the handle says why).
INTAKE_SENT = "sent"
INTAKE_ACKNOWLEDGED = "acknowledged"
INTAKE_FAILED = "failed"
#: Records refused before sending, by ``reason``: ``invalid`` (validation or the guard),
#: ``too_large`` (over the topic's max.message.bytes), ``spool_full`` (backpressure timed out).
INTAKE_REJECTED = "rejected"                    # labels: reason
#: Records held in the on-disk spool now (the broker unreachable or the client's queue full).
INTAKE_SPOOLED = "spooled"

# --------------------------------------------------------------------------- processor

#: Generations that ended in a unit / expired / too stale / invalid (running totals).
PROCESSOR_GENERATIONS = "generations"            # labels: outcome
#: Feedback records by fate: used, ignored, duplicate, late, unused, orphaned.
PROCESSOR_FEEDBACK = "feedback"                  # labels: fate
#: Duplicate generations dropped.
PROCESSOR_DUPLICATE_GENERATIONS = "duplicate_generations"
PROCESSOR_UNITS = "units"
PROCESSOR_TRANSACTIONS = "transactions"
#: Transactions aborted (the runtime rewound to its last committed state and offsets).
PROCESSOR_ABORTED_TRANSACTIONS = "aborted_transactions"
#: Input records that did not decode (dead-lettered).
PROCESSOR_INVALID_RECORDS = "invalid_records"
#: Checkpoint events (``<ns>.checkpoints``, read for staleness) that did not decode, read by this
#: process (running total). The evaluator, which consumes that topic as a group, dead-letters
#: them; the processor only counts them.
PROCESSOR_CHECKPOINTS_UNDECODABLE = "checkpoints_undecodable"
#: Units emitted that the newest checkpoint's offsets have not passed (schedule.max_backlog_steps).
PROCESSOR_TRAINER_BACKLOG = "trainer_backlog"
#: Distributions of what the processor joined (``reef_stream.ops.record_stats``), each written as
#: ``<name>.count``, ``.mean``, ``.std`` and a cumulative ``<name>.bucket`` per upper bound
#: ``le`` (Prometheus' histogram convention; the last bound is ``+Inf``), running totals since
#: the process started, labelled by the generation's ``policy_version``:
#: the rewards of used feedback, per feedback ``source``;
PROCESSOR_REWARD = "reward"                      # labels: source, policy_version
#: the completion lengths in tokens of generations that ended in a unit;
PROCESSOR_RESPONSE_TOKENS = "response_tokens"    # labels: policy_version
#: and the fraction of those cut at ``max_tokens`` (finish_reason LENGTH), with its count.
PROCESSOR_TRUNCATION_RATE = "truncation_rate"    # labels: policy_version

# --------------------------------------------------------------------------- trainer

TRAINER_STEPS = "steps"
TRAINER_UNITS_TRAINED = "units_trained"
#: Units skipped because their id was already trained (a re-emitted unit).
TRAINER_UNITS_DUPLICATE = "units_duplicate"
#: Units dropped because their behaviour policy was too far behind.
TRAINER_UNITS_STALE = "units_stale"
#: Units that could not be decoded (dead-lettered).
TRAINER_UNITS_INVALID = "units_invalid"
#: Policy versions between the trainer's weights and a trained sample's behaviour policy,
#: over the step's samples: mean and max.
TRAINER_STALENESS_MEAN = "staleness_mean"
TRAINER_STALENESS_MAX = "staleness_max"
#: The off-policy degree's distribution: trained samples by staleness (running totals since the
#: process started; label ``staleness``, the number of versions).
TRAINER_STALENESS_SAMPLES = "staleness_samples"  # labels: staleness
#: Where a trained sample's age comes from, in seconds (``Sample.created_at``, the generation's
#: creation; the unit's ``created_at``; the step's wall-clock time, taken once per step).
#: Histograms of trained samples, running totals since the process started, label ``le``: a
#: bucket's upper bound in seconds (``reef_stream.ops.histograms.AGE_LABELS``: "0.25" ... "256",
#: "+Inf"). Counts are per bucket, NOT cumulative: a sample counts only in the first bucket whose
#: bound it does not exceed. Samples with an unknown ``created_at`` (0) are not counted.
#: Generation -> the step that trained it (the whole age);
TRAINER_SAMPLE_AGE_SAMPLES = "sample_age_samples"            # labels: le
#: generation -> its unit (waiting for feedback, then the processor);
TRAINER_SAMPLE_TO_UNIT_SAMPLES = "sample_to_unit_samples"    # labels: le
#: unit -> the step (the units topic, then the trainer's queue).
TRAINER_UNIT_TO_TRAIN_SAMPLES = "unit_to_train_samples"      # labels: le
#: Mean age in seconds of the step's samples with a known created_at, per step (also in the
#: Checkpoint event's metrics; absent when no sample has one).
TRAINER_SAMPLE_AGE_MEAN = "sample_age_mean_s"
TRAINER_STEP_SECONDS = "step_seconds"
TRAINER_DATA_SECONDS = "data_seconds"
#: Rollback checkpoints written since the process started (``reef_stream.consumers.rollback``;
#: label ``to_version``, the promoted version whose weights the newest one holds again).
TRAINER_ROLLBACKS = "rollbacks"   # labels: to_version
#: Policy health, per step (``TorchBackend.train_step``; a policy-gradient family's only, but
#: ``update_ratio``). Mean ``|current - behaviour|`` logprob over completion tokens, before the
#: step's first update, of samples generated by the version the trainer holds (inference vs
#: training numerics) and of older ones (staleness), with each bucket's token count. A bucket
#: without tokens is not reported.
TRAINER_LOGPROB_GAP_SAME_VERSION = "logprob_gap.same_version"
TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS = "logprob_gap.same_version_tokens"
TRAINER_LOGPROB_GAP_OLDER = "logprob_gap.older"
TRAINER_LOGPROB_GAP_OLDER_TOKENS = "logprob_gap.older_tokens"
#: The gradient's global norm before clipping (``Backend.max_grad_norm``), mean over a step's
#: updates.
TRAINER_GRAD_NORM = "grad_norm"
#: Optimizer batches of a step with no sample to learn from (dynamic sampling dropped them all,
#: on every rank): no update was made for them. Reported only when there were some.
TRAINER_SKIPPED_UPDATES = "skipped_updates"
#: KL(behaviour || current) per completion token, before the step's first update (k3 estimator).
TRAINER_KL_BEHAVIOUR = "kl_behaviour"
#: ||weights after the step - weights before|| / ||weights before||, over every parameter.
TRAINER_UPDATE_RATIO = "update_ratio"
#: Metrics of the built-in policy-gradient losses (``reef_stream.api.losses``), per step (mean
#: over micro batches), next to ``loss``: the share of loss tokens whose clipped term was chosen
#: (both sides; below ``1 - epsilon`` with a negative advantage; above ``1 + epsilon_high`` with
#: a positive one), the share held by the dual clip, the mean importance ratio, the KL to the
#: reference policy (its estimator's mean over tokens, ``KLPenalty`` on), the policy's entropy
#: per token (``EntropyBonus`` on), the mean truncated behaviour weight (``DecoupledProximal``
#: on).
LOSS_CLIP_FRACTION = "clip_fraction"
LOSS_CLIP_FRACTION_LOW = "clip_fraction_low"
LOSS_CLIP_FRACTION_HIGH = "clip_fraction_high"
LOSS_DUAL_CLIP_FRACTION = "dual_clip_fraction"
LOSS_RATIO_MEAN = "ratio_mean"
LOSS_KL_REFERENCE = "kl_reference"
LOSS_ENTROPY = "entropy"
LOSS_BEHAVIOUR_WEIGHT_MEAN = "behaviour_weight_mean"
#: An objective's share of the step's groups dropped by dynamic sampling (all rewards equal;
#: reported as ``objective.dynamic_sampling_dropped_fraction``).
OBJECTIVE_DYNAMIC_SAMPLING_DROPPED = "dynamic_sampling_dropped_fraction"

# --------------------------------------------------------------------------- evaluator

#: Publications produced, by decision (running totals).
EVALUATOR_DECISIONS = "decisions"                # labels: decision (PROMOTED, REJECTED)
#: Checkpoint events given no decision: of another recipe or model (why=other), or already
#: decided (why=decided: a re-emitted event, or a version not newer than one decided).
EVALUATOR_CANDIDATES_SKIPPED = "candidates_skipped"  # labels: why
#: Candidates REJECTED without measuring because a newer candidate of their model was waiting
#: (the evaluator's ``supersede``, ``reef_stream.consumers.superseding``; running total, also
#: counted in ``decisions``).
EVALUATOR_CANDIDATES_SUPERSEDED = "candidates_superseded"
#: Seconds one try of the evaluator's ``measure`` took.
EVALUATOR_MEASURE_SECONDS = "measure_seconds"
#: Each value of the latest candidate's measurement (e.g. held-out accuracy), and the candidate's
#: policy version, written with each decision. Labels: model, measure (the measurement's key).
EVALUATOR_MEASUREMENT = "measurement"           # labels: model, measure
EVALUATOR_CANDIDATE_VERSION = "candidate_version"  # labels: model, decision

# --------------------------------------------------------------------------- follower

#: A replica's heartbeat: value = the policy version it serves (-1: none yet). Labels: replica,
#: model, host, state (serving, waiting, stopped). ``reef fleet --rebuild`` reads these back.
FOLLOWER_POLICY_VERSION = "policy_version"
#: Versions loaded and handed to the serving code (running total).
FOLLOWER_VERSIONS_LOADED = "versions_loaded"
#: Versions refused: checksum mismatch, unreadable checkpoint, or the callback raised.
FOLLOWER_VERSIONS_REFUSED = "versions_refused"
#: Records of ``<ns>.publications`` that did not decode, read by this replica (running total).
#: The evaluator dead-letters them; replicas only count them.
FOLLOWER_PUBLICATIONS_UNDECODABLE = "publications_undecodable"
#: Seconds from a publication's arrival to the serving code having its weights.
FOLLOWER_LOAD_SECONDS = "load_seconds"
#: Seconds from the checkpoint's creation by the trainer (the publication's
#: ``checkpoint_created_at``) / from the evaluator's decision to this replica serving it.
FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS = "checkpoint_to_serving_seconds"
FOLLOWER_PUBLICATION_TO_SERVING_SECONDS = "publication_to_serving_seconds"

# --------------------------------------------------------------------------- reward

#: A reward worker's counters (``RewardSummary``; running totals, label ``group``): generations
#: taken, feedback sent, calls failed on every try, results not a finite reward, records that did
#: not decode, retries, tries timed out, records dropped on a revoke or at stop.
REWARD_RECORDS = "records"
REWARD_REWARDED = "rewarded"
REWARD_FAILED = "failed"
REWARD_INVALID = "invalid"
REWARD_UNDECODABLE = "undecodable"
REWARD_RETRIED = "retried"
REWARD_TIMED_OUT = "timed_out"
REWARD_DROPPED = "dropped"
#: The mean reward of the feedback sent since the process started, per feedback source.
REWARD_MEAN = "reward_mean"                      # labels: source
#: The reward worker's call slots (``consumers.reward_calls``): slots busy with a call running
#: past the observed p99 (and that count over ``concurrency``: the saturation), the latency of
#: the tries that returned (p50, p99, seconds), and the slow lane (queued + running).
REWARD_SATURATED_SLOTS = "saturated_slots"
REWARD_SATURATION = "saturation"
REWARD_CALL_P50 = "call_seconds_p50"
REWARD_CALL_P99 = "call_seconds_p99"
REWARD_SLOW_LANE = "slow_lane"
#: The sandbox pool of ``reef reward --sandbox process`` (``reef_stream.sandbox.pool``): its
#: size and live workers, calls that found a worker idle (warm) or waited for one to start
#: (cold), workers replaced after a kill, worker start and call latency (p50, p99, seconds),
#: whether the calls' network is isolated (1) or not (0), and the calls that ended in each
#: sandbox failure category (label ``category``: timeout, memory, crashed, exit,
#: output_invalid, sandbox_unavailable).
SANDBOX_POOL_SIZE = "sandbox_pool_size"
SANDBOX_LIVE = "sandbox_live"
SANDBOX_WARM_STARTS = "sandbox_warm_starts"
SANDBOX_COLD_STARTS = "sandbox_cold_starts"
SANDBOX_RESTARTS = "sandbox_restarts"
SANDBOX_START_P50 = "sandbox_start_seconds_p50"
SANDBOX_START_P99 = "sandbox_start_seconds_p99"
SANDBOX_CALL_P50 = "sandbox_call_seconds_p50"
SANDBOX_CALL_P99 = "sandbox_call_seconds_p99"
SANDBOX_NETWORK_ISOLATED = "sandbox_network_isolated"
SANDBOX_FAILURES = "sandbox_failures"            # labels: category


def metric(stage: str, name: str, value: float, labels: Mapping[str, str] | None = None,
           *, created_at: int | None = None) -> Metric:
    """One ``Metric`` event (``created_at`` defaults to now)."""
    return Metric(stage=stage, name=name, value=float(value),
                  labels={k: str(v) for k, v in (labels or {}).items()},
                  created_at=created_at if created_at is not None else now_ms())


def metrics_producer(bootstrap: str, on_dropped: Callable[[], None]) -> Any:
    """A plain confluent-kafka producer for a stage's metrics, apart from the producer of its
    records (whose transactions, spool or fatal states are for records that must not be lost;
    a metric may be). ``acks=1`` and one request in flight keep one instance's events in order
    without the idempotent producer's fatal states; the queue is bounded. ``on_dropped()`` is
    called (on the thread that polls it) for each metric the broker did not take."""
    from reef_stream.topics.connect import new_producer

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            on_dropped()

    return new_producer(bootstrap, {
        "acks": 1, "enable.idempotence": False,
        "max.in.flight.requests.per.connection": 1,
        "linger.ms": 50, "message.timeout.ms": 30_000,
        "queue.buffering.max.messages": 10_000, "on_delivery": delivered,
    })


def consumer_lag(consumer: Any) -> list[tuple[str, int, int]]:
    """``(topic, partition, lag)`` for each partition assigned to a confluent-kafka ``consumer``:
    the high watermark its last fetch saw minus its position (no request to the broker).
    Partitions it has not fetched from yet, or holds no position in, are left out; an error is
    logged and gives nothing (a metric never fails the pipeline)."""
    try:
        assigned = consumer.assignment()
        lags = []
        for tp in consumer.position(assigned) if assigned else ():
            _, high = consumer.get_watermark_offsets(tp, cached=True) or (0, -1)
            if tp.offset >= 0 and high >= 0:
                lags.append((tp.topic, tp.partition, max(0, high - tp.offset)))
        return lags
    except Exception as error:  # noqa: BLE001
        log.warning("consumer lag not measured: %s", error)
        return []


class MetricsWriter:
    """Writes ``Metric`` events to ``<ns>.metrics`` through a confluent-kafka producer.

    ``write`` only enqueues (``produce``); the owner polls and flushes its
    producer as it does for its other records. Key: the stage. A metric
    the client refuses (queue full) is logged and dropped, never raised.
    Each write also sets the metric's gauge in ``exposition`` [default: the
    process's, ``reef_stream.ops.prometheus.exposition()``], before the send; a
    failure there is logged, never raised.
    """

    def __init__(self, producer: Any, namespace: str, stage: str,
                 labels: Mapping[str, str] | None = None,
                 exposition: prometheus.Exposition | None = None) -> None:
        self._producer = producer
        self._topic = declarations.metrics(namespace)
        self._stage = stage
        self._labels = dict(labels or {})
        self._registry = SchemaRegistry.default()
        self._exposition = exposition or prometheus.exposition()
        self._lags: dict[tuple[str, int], tuple[int, float]] = {}  # (lag, when) last written

    def write(self, name: str, value: float, *, created_at: int | None = None,
              **labels: str) -> None:
        """One metric event, stamped ``created_at`` (ms; now when not given)."""
        event = metric(self._stage, name, value, {**self._labels, **labels},
                       created_at=created_at)
        try:
            self._exposition.set(self._stage, name, event.value, event.labels)
        except Exception as error:  # noqa: BLE001 - Prometheus never fails the pipeline
            log.warning("metric %s.%s not set for Prometheus: %s", self._stage, name, error)
        value_bytes, headers = self._registry.encode(event)
        try:
            self._producer.produce(self._topic, key=self._stage.encode(), value=value_bytes,
                                   headers=headers)
        except BufferError:
            log.warning("metric %s.%s dropped: the producer's queue is full", self._stage, name)

    def write_lag(self, consumer: Any) -> None:
        """``CONSUMER_LAG`` for each partition ``consumer`` holds (``consumer_lag``): where it
        changed since this writer last wrote it, or ``LAG_REPEAT_S`` passed (so a steady lag is
        still seen, without an event per partition at every call)."""
        now = time.monotonic()
        for topic, partition, lag in consumer_lag(consumer):
            last = self._lags.get((topic, partition))
            if last is None or last[0] != lag or now - last[1] >= LAG_REPEAT_S:
                self.write(CONSUMER_LAG, lag, topic=topic, partition=str(partition))
                self._lags[(topic, partition)] = (lag, now)

    def write_process(self) -> None:
        """``PROCESS_CPU_SECONDS``: the CPU this process has used so far, labelled
        ``process=<hostname>.<pid>``. Never raises: a metric never fails the pipeline."""
        try:
            self.write(PROCESS_CPU_SECONDS, time.process_time(),
                       process=f"{socket.gethostname()}.{os.getpid()}")
        except Exception as error:  # noqa: BLE001
            log.warning("metric %s.%s not written: %s", self._stage, PROCESS_CPU_SECONDS, error)

    def write_counts(self, name: str, counts: Mapping[str, int], label: str) -> None:
        """One event per entry of ``counts``, labelled ``label=<key>``."""
        for key, count in counts.items():
            self.write(name, count, **{label: str(key)})


class PeriodicMetrics:
    """A stage's running counts written as ``Metric`` events through a metrics producer of its
    own (``metrics_producer``): at most every ``every_s`` and only when they changed.

        periodic = PeriodicMetrics(bootstrap, namespace, STAGE_REWARD, labels, every_s=1.0)
        periodic.emit(summary.counters, write)               # often: write(writer, counters)
        periodic.emit(summary.counters, write, final=True)   # at the end

    ``emit`` never blocks (but at ``final``, a flush of up to 5 s) and never raises: a metric
    that cannot be queued, written or delivered is counted in ``dropped`` and logged. Used by
    the thread that owns the stage's loop; delivery callbacks run there, in ``emit``'s poll.
    """

    def __init__(self, bootstrap: str, namespace: str, stage: str,
                 labels: Mapping[str, str], *, every_s: float) -> None:
        #: Metric events the client refused or the broker did not take.
        self.dropped = 0
        self.every_s, self.stage = every_s, stage
        self.producer = metrics_producer(bootstrap, self._drop)
        self.writer = MetricsWriter(self.producer, namespace, stage, dict(labels))
        self._sent: Any = None  # the state last written
        self._at = 0.0

    def _drop(self) -> None:
        self.dropped += 1

    def emit(self, state: Callable[[], Any], write: Callable[[MetricsWriter, Any], None], *,
             final: bool = False) -> None:
        """Once ``every_s`` passed (``final``: whether or not it passed, then flush for up to
        5 s): ``write(writer, state())`` when ``state()`` (anything comparable: the counts to
        write, or what changes with them) differs from the state last written. Then serve
        delivery reports."""
        try:
            if final or time.monotonic() - self._at >= self.every_s:
                current = state()
                if current != self._sent:
                    write(self.writer, current)
                    self._sent, self._at = current, time.monotonic()
            self.producer.poll(0)
            if final:
                self.dropped += self.producer.flush(5)
        except Exception as error:  # noqa: BLE001 - metrics never fail the pipeline
            self.dropped += 1
            log.warning("%s metrics not written: %s", self.stage, error)
