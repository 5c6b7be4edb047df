"""The processor's counts as ``Metric`` events, through a producer of its own.

``ProcessorMetrics`` writes a ``ProcessorRuntime``'s running totals since the process
started (names in ``reef_stream.ops.metrics``, labels ``recipe``, ``group``, ``instance``):
generations by outcome, feedback by fate, duplicate generations, units, invalid records,
transactions and aborted transactions, and the distributions of
``reef_stream.ops.record_stats`` (rewards per feedback source and policy version, completion
lengths, truncation). The stage loop writes the consumer's lag per partition with the same
writer (``MetricsWriter.write_lag``, every second, whether or not anything committed); the
runtime writes the trainer's backlog and the undecodable checkpoint events it saw.

Why not inside the transactions (which would make the metrics exactly as durable as the
outputs they count): a transaction can commit only if every partition it wrote to accepts
its records, so a metrics topic that is missing, unavailable, full or not writable would
abort every transaction and stall the pipeline behind it, which metrics must never do. The
runtime's counts only change when a transaction commits, so a value sent here never counts
what an aborted transaction decided; a crash merely loses the last second of observations
(the next process starts its running totals at 0, as ``reef_stream.ops.metrics`` says).
``acks=1`` and one request in flight keep one instance's events in order without the
idempotent producer's fatal states (``metrics.metrics_producer``); the queue is bounded, and
a metric that cannot be queued or delivered is counted in ``dropped`` and otherwise dropped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping

from reef_stream.engine.join import FeedbackFate, Outcome
from reef_stream.ops import metrics
from reef_stream.ops.record_stats import RecordStats

log = logging.getLogger("reef_stream.engine.join")


class ProcessorMetrics:
    """The metrics producer of one processor and what it last wrote. Used by the processor's
    loop thread only (its delivery callbacks run there too, in ``emit``'s poll)."""

    def __init__(self, bootstrap: str, namespace: str, labels: Mapping[str, str], *,
                 every_s: float) -> None:
        #: Metric events the client refused or the broker did not take.
        self.dropped = 0
        self.every_s = every_s
        self.producer = metrics.metrics_producer(bootstrap, self._drop)
        self.writer = metrics.MetricsWriter(self.producer, namespace, metrics.STAGE_PROCESSOR,
                                            dict(labels))
        self._sent: tuple[int, int] = (0, 0)  # (transactions, aborted) last written
        self._at = 0.0

    def _drop(self) -> None:
        self.dropped += 1

    def emit(self, counts: Counter[str], transactions: int, aborted: int, stats: RecordStats,
             *, final: bool = False) -> None:
        """Write the running counts if a transaction committed or aborted since the last write
        and ``every_s`` has passed (``final``: if anything changed at all, then flush for up
        to 5 s). Never blocks otherwise, never raises."""
        writer, producer = self.writer, self.producer
        try:
            sent = (transactions, aborted)
            if sent != self._sent and (final or time.monotonic() - self._at >= self.every_s):
                writer.write_counts(metrics.PROCESSOR_GENERATIONS,
                                    {o.value: counts[f"generations.{o.value}"] for o in Outcome},
                                    "outcome")
                writer.write_counts(metrics.PROCESSOR_FEEDBACK,
                                    {f.value: counts[f"feedback.{f.value}"] for f in FeedbackFate},
                                    "fate")
                writer.write(metrics.PROCESSOR_DUPLICATE_GENERATIONS,
                             counts["generations.duplicate"])
                writer.write(metrics.PROCESSOR_UNITS, counts["units"])
                writer.write(metrics.PROCESSOR_INVALID_RECORDS, counts["invalid_records"])
                writer.write(metrics.PROCESSOR_TRANSACTIONS, transactions)
                writer.write(metrics.PROCESSOR_ABORTED_TRANSACTIONS, aborted)
                stats.write(writer)
                self._sent, self._at = sent, time.monotonic()
            producer.poll(0)
            if final:
                self.dropped += producer.flush(5)
        except Exception as error:  # noqa: BLE001 - metrics never fail the pipeline
            self.dropped += 1
            log.warning("metrics not written: %s", error)
