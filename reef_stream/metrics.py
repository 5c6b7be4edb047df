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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from reef_stream.events import Metric, now_ms
from reef_stream.topics import declarations
from reef_stream.topics.serde import SchemaRegistry

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- stages

STAGE_PROCESSOR = "processor"
STAGE_REWARD = "reward"
STAGE_TRAINER = "trainer"
STAGE_EVALUATOR = "evaluator"
STAGE_FOLLOWER = "follower"

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
TRAINER_STEP_SECONDS = "step_seconds"
TRAINER_DATA_SECONDS = "data_seconds"

# --------------------------------------------------------------------------- evaluator

#: Publications produced, by decision (running totals).
EVALUATOR_DECISIONS = "decisions"                # labels: decision (PROMOTED, REJECTED)
#: Checkpoint events given no decision: of another recipe or model (why=other), or already
#: decided (why=decided: a re-emitted event, or a version not newer than one decided).
EVALUATOR_CANDIDATES_SKIPPED = "candidates_skipped"  # labels: why
#: Seconds one try of the evaluator's ``measure`` took.
EVALUATOR_MEASURE_SECONDS = "measure_seconds"

# --------------------------------------------------------------------------- follower

#: A replica's heartbeat: value = the policy version it serves (-1: none yet). Labels: replica,
#: model, host, state (serving, waiting, stopped). ``reef fleet --rebuild`` reads these back.
FOLLOWER_POLICY_VERSION = "policy_version"
#: Versions loaded and handed to the serving code (running total).
FOLLOWER_VERSIONS_LOADED = "versions_loaded"
#: Versions refused: checksum mismatch, unreadable checkpoint, or the callback raised.
FOLLOWER_VERSIONS_REFUSED = "versions_refused"
#: Seconds from a publication's arrival to the serving code having its weights.
FOLLOWER_LOAD_SECONDS = "load_seconds"


def metric(stage: str, name: str, value: float, labels: Mapping[str, str] | None = None,
           *, created_at: int | None = None) -> Metric:
    """One ``Metric`` event (``created_at`` defaults to now)."""
    return Metric(stage=stage, name=name, value=float(value),
                  labels={k: str(v) for k, v in (labels or {}).items()},
                  created_at=created_at if created_at is not None else now_ms())


class MetricsWriter:
    """Writes ``Metric`` events to ``<ns>.metrics`` through a confluent-kafka producer.

    ``write`` only enqueues (``produce``); the owner polls and flushes its
    producer as it does for its other records. Key: the stage. A metric
    the client refuses (queue full) is logged and dropped, never raised.
    """

    def __init__(self, producer: Any, namespace: str, stage: str,
                 labels: Mapping[str, str] | None = None) -> None:
        self._producer = producer
        self._topic = declarations.metrics(namespace)
        self._stage = stage
        self._labels = dict(labels or {})
        self._registry = SchemaRegistry.default()

    def write(self, name: str, value: float, **labels: str) -> None:
        event = metric(self._stage, name, value, {**self._labels, **labels})
        value_bytes, headers = self._registry.encode(event)
        try:
            self._producer.produce(self._topic, key=self._stage.encode(), value=value_bytes,
                                   headers=headers)
        except BufferError:
            log.warning("metric %s.%s dropped: the producer's queue is full", self._stage, name)

    def write_counts(self, name: str, counts: Mapping[str, int], label: str) -> None:
        """One event per entry of ``counts``, labelled ``label=<key>``."""
        for key, count in counts.items():
            self.write(name, count, **{label: str(key)})
