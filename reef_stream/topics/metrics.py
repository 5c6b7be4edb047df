"""The ``Metric`` events every stage writes to ``<ns>.metrics``, and their producer.

``MetricsWriter`` batches events onto a producer the caller owns; it never blocks the
pipeline: a metric that cannot be sent is logged and dropped (metrics are observations, not
records of the pipeline). The names are ``reef_stream.core.metric_names``.

Every ``write`` also sets a gauge in the process's Prometheus exposition
(``reef_stream.core.prometheus``: ``reef_<stage>_<name>``, the same labels), which a
stage serves at ``/metrics`` when started with ``--metrics-port``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from reef_stream.core import prometheus
from reef_stream.core.events import Metric, now_ms
from reef_stream.core.metric_names import CONSUMER_LAG, LAG_REPEAT_S, PROCESS_CPU_SECONDS
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations

log = logging.getLogger(__name__)

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
    process's, ``reef_stream.core.prometheus.exposition()``], before the send; a
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
