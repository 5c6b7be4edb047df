"""The processor's counts as ``Metric`` events, through a producer of its own.

``ProcessorMetrics`` writes a ``ProcessorRuntime``'s running totals since the process
started (names in ``reef_stream.core.metric_names``, labels ``recipe``, ``group``, ``instance``):
generations by outcome (and those of unknown policy version apart), feedback by fate, duplicate generations, units, invalid records,
transactions and aborted transactions, and the distributions of
``reef_stream.consumers.processor.record_stats`` (rewards per feedback source and policy version, completion
lengths, truncation). The stage loop writes the consumer's lag per partition with the same
writer (``MetricsWriter.write_lag``, every second, whether or not anything committed); the
runtime writes the trainer's backlog and the undecodable checkpoint events it saw.

Why not inside the transactions (which would make the metrics exactly as durable as the
outputs they count): a transaction can commit only if every partition it wrote to accepts
its records, so a metrics topic that is missing, unavailable, full or not writable would
abort every transaction and stall the pipeline behind it, which metrics must never do. The
runtime's counts only change when a transaction commits, so a value sent here never counts
what an aborted transaction decided; a crash merely loses the last second of observations
(the next process starts its running totals at 0, as ``reef_stream.core.metric_names`` says).
``acks=1`` and one request in flight keep one instance's events in order without the
idempotent producer's fatal states (``metrics.metrics_producer``); the queue is bounded, and
a metric that cannot be queued or delivered is counted in ``dropped`` and otherwise dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from reef_stream.consumers.processor.record_stats import RecordStats
from reef_stream.core import metric_names
from reef_stream.engine.join import FeedbackFate, Outcome
from reef_stream.topics import metrics


class ProcessorMetrics(metrics.PeriodicMetrics):
    """The metrics producer of one processor and what it last wrote (``PeriodicMetrics``)."""

    def __init__(self, bootstrap: str, namespace: str, labels: Mapping[str, str], *,
                 every_s: float) -> None:
        super().__init__(bootstrap, namespace, metric_names.STAGE_PROCESSOR, labels, every_s=every_s)
        self._sent = (0, 0)  # (transactions, aborted): nothing to write before the first

    def emit_counts(self, counts: Counter[str], transactions: int, aborted: int,
                    stats: RecordStats, *, final: bool = False) -> None:
        """Write the running counts if a transaction committed or aborted since the last write
        and ``every_s`` has passed (``final``: if anything changed at all, then flush for up
        to 5 s). Never blocks otherwise, never raises."""

        def write(writer: metrics.MetricsWriter, _: tuple[int, int]) -> None:
            writer.write_counts(metric_names.PROCESSOR_GENERATIONS,
                                {o.value: counts[f"generations.{o.value}"] for o in Outcome},
                                "outcome")
            unknown = {o.value: counts[f"unknown_version.{o.value}"] for o in Outcome}
            if any(unknown.values()):  # none where no producer marks a version unknown
                writer.write_counts(metric_names.PROCESSOR_UNKNOWN_VERSION_GENERATIONS, unknown,
                                    "outcome")
            writer.write_counts(metric_names.PROCESSOR_FEEDBACK,
                                {f.value: counts[f"feedback.{f.value}"] for f in FeedbackFate},
                                "fate")
            writer.write(metric_names.PROCESSOR_DUPLICATE_GENERATIONS, counts["generations.duplicate"])
            writer.write(metric_names.PROCESSOR_UNITS, counts["units"])
            writer.write(metric_names.PROCESSOR_INVALID_RECORDS, counts["invalid_records"])
            writer.write(metric_names.PROCESSOR_TRANSACTIONS, transactions)
            writer.write(metric_names.PROCESSOR_ABORTED_TRANSACTIONS, aborted)
            stats.write(writer)

        self.emit(lambda: (transactions, aborted), write, final=final)
