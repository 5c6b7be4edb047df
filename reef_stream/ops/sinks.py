"""Copy the ``<ns>.metrics`` topic into tools users already watch: TensorBoard, Weights & Biases.

    sink = TensorBoardSink(Path("runs/reef"))          # or WandbSink(project=..., dir=...)
    group = default_group(namespace, sink.kind)        # <ns>.sink.tensorboard
    summary = MetricsSinkRunner(bootstrap, namespace, sink, group=group, until_end=True).run()

Every ``Metric`` becomes one ``Scalar`` (``ScalarMapper``, pure):

- **tag** ``<stage>/<name>`` then ``/<key>=<value>`` for each label but ``instance``, sorted by
  key: ``trainer/loss/group=g/recipe=sao``, ``processor/generations/outcome=unit/recipe=sao``.
  ``instance`` names a process (host.pid) and changes with every restart; one chart per
  restart would hide the series. A restarted stage's running totals start again at 0
  (``reef_stream.core.metric_names``), and the chart shows that drop.
- **step** of a trainer metric: the trainer step it belongs to. The trainer writes ``steps``
  (value: the step) first and then that step's other metrics, all keyed ``trainer`` and so
  in one partition, in order; its metrics carry no step label (labels ``recipe`` and
  ``group`` only), so the mapper remembers the last ``steps`` value per trainer (per stage +
  labels) and gives it to the metrics that follow. The step of every other stage's metric is
  its ``created_at`` in milliseconds: a time axis that stays right across restarts of the
  stage and of the sink, and with several instances of a stage (a per-tag counter would start
  again at 0 with each sink and interleave instances).
- **wall time**: ``created_at`` in seconds (TensorBoard's "Wall" and "Relative" axes; W&B's
  ``_timestamp``).

The runner is a consumer group (default ``<ns>.sink.<kind>``). Its durability order, in
``MetricsSinkRunner._commit``: write the scalars to the sink, flush the sink, then commit the
next offsets, so a sink killed anywhere resumes after the last flushed record (a record
flushed but not yet committed is written again: at least once). Flushed means handed to the
operating system, not fsynced: a machine that loses power may lose the last seconds. The
mapper's remembered trainer steps are per partition and travel in the committed offset's
metadata, so a resumed sink gives a trainer's metrics the right step even when their
``steps`` record was before the committed offset.

TensorBoard and wandb are optional extras, imported only by the sink that needs them;
a missing one raises ``ConfigurationError`` naming the extra to install.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.events import Metric
from reef_stream.core.metric_names import STAGE_TRAINER, TRAINER_STEPS

log = logging.getLogger(__name__)

__all__ = [
    "MetricsSinkRunner", "Scalar", "ScalarMapper", "ScalarSink", "SinkSummary",
    "TensorBoardSink", "WandbSink", "default_group", "scalar_tag",
]

#: Labels left out of a tag: the process that wrote the metric.
IGNORED_LABELS = frozenset({"instance"})


@dataclass(frozen=True, slots=True)
class Scalar:
    """One point of one chart."""

    tag: str
    step: int
    value: float
    #: Seconds since the Unix epoch (the metric's ``created_at``).
    wall_time: float


def _label_suffix(labels: Mapping[str, str]) -> str:
    return "".join(f"/{key}={labels[key]}" for key in sorted(labels) if key not in IGNORED_LABELS)


def scalar_tag(metric: Metric) -> str:
    """``<stage>/<name>`` then ``/<key>=<value>`` per label but ``instance``, sorted by key."""
    return f"{metric.stage}/{metric.name}{_label_suffix(metric.labels)}"


class ScalarMapper:
    """Metric → Scalar, remembering each trainer's current step (see the module docstring).

    Not thread-safe. ``steps`` is the state to save and restore: the last ``steps`` value per
    trainer (``trainer/group=g/recipe=sao``).
    """

    def __init__(self, steps: Mapping[str, int] | None = None) -> None:
        self.steps: dict[str, int] = dict(steps or {})

    def scalar(self, metric: Metric) -> Scalar | None:
        """The scalar of ``metric``; None for a trainer metric before its trainer's first
        ``steps`` record (its step is unknown)."""
        if metric.stage == STAGE_TRAINER:
            trainer = metric.stage + _label_suffix(metric.labels)
            if metric.name == TRAINER_STEPS:
                self.steps[trainer] = int(metric.value)
            step = self.steps.get(trainer)
            if step is None:
                return None
        else:
            step = metric.created_at
        return Scalar(tag=scalar_tag(metric), step=step, value=metric.value,
                      wall_time=metric.created_at / 1000)


# --------------------------------------------------------------------------- sinks


class ScalarSink(Protocol):
    """Where scalars go. Called from one thread, in this order: ``write`` any number of times,
    ``flush``, and so on; ``close`` once at the end."""

    #: Names the default consumer group (``<ns>.sink.<kind>``) and the extra to install.
    kind: str

    def write(self, scalar: Scalar) -> None:
        """Buffer one scalar. May block briefly; not durable until ``flush`` returns."""

    def flush(self) -> None:
        """Block until every scalar written so far is in the sink's files."""

    def close(self) -> None:
        """Flush and release the sink's files. Idempotent."""


def _missing_extra(kind: str, error: ImportError) -> ConfigurationError:
    return ConfigurationError(
        f"`reef sink {kind}` needs the {kind} extra ({error}): "
        f"pip install 'reef-stream[{kind}]'")


class TensorBoardSink:
    """Event files in ``logdir`` (``torch.utils.tensorboard.SummaryWriter``; the ``tensorboard``
    extra). Each run of a sink adds a new event file beside the earlier ones; TensorBoard reads
    them all as one run."""

    kind = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        try:
            importlib.import_module("tensorboard")  # torch's writer needs it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise _missing_extra(self.kind, error) from error
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=str(logdir))

    def write(self, scalar: Scalar) -> None:
        self._writer.add_scalar(scalar.tag, scalar.value, global_step=scalar.step,
                                walltime=scalar.wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run, offline unless ``WANDB_MODE`` says otherwise (the ``wandb``
    extra): nothing is sent over the network; ``wandb sync`` uploads the run directories later.

    Each tag gets its own x-axis, the hidden metric ``<tag>/step`` (``define_metric``), since
    trainer steps and times in milliseconds cannot share W&B's one ``_step``; ``_timestamp`` is
    the metric's wall time. W&B writes its files from a service process of its own, and
    ``run.finish()`` may return before that process has written the end of the run (seen with
    wandb 0.31); ``wandb.teardown()`` waits for it to finish and exit. So ``flush`` finishes
    the run and tears the service down; the next ``write`` starts a new run with the same run id
    (``run_id``). Every flush thus leaves one directory
    ``<dir>/wandb/offline-run-<time>-<run id>``; ``wandb sync --id RUN_ID`` uploads them in
    order as one run.
    """

    kind = "wandb"

    def __init__(self, *, project: str, dir: Path, run_id: str, name: str) -> None:
        try:
            import wandb
        except ImportError as error:
            raise _missing_extra(self.kind, error) from error
        self._wandb = wandb
        self.project, self.dir, self.name = project, dir, name
        #: W&B run ids may not hold / \ # ? % : and the like.
        self.run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self._run: Any = None
        self._started: float | None = None
        self._defined: set[str] = set()

    def _start(self) -> Any:
        # A run's directory is named by its start time in whole seconds and its id: two starts
        # within one second would share one directory.
        if self._started is not None:
            time.sleep(max(0.0, int(self._started) + 1 - time.time()))
        self._started = time.time()
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = self._wandb.Settings(console="off", silent=True, disable_git=True,
                                        save_code=False)
        self._defined = set()
        return self._wandb.init(mode=self.mode, project=self.project, dir=str(self.dir),
                                id=self.run_id, name=self.name, settings=settings)

    def write(self, scalar: Scalar) -> None:
        if self._run is None:
            self._run = self._start()
        step_key = f"{scalar.tag}/step"
        if scalar.tag not in self._defined:
            # define_metric reads "." as nesting; the tags' dots (logprob_gap.older) are not.
            escaped = scalar.tag.replace(".", "\\.")
            self._run.define_metric(f"{escaped}/step", hidden=True)
            self._run.define_metric(escaped, step_metric=f"{escaped}/step")
            self._defined.add(scalar.tag)
        self._run.log({scalar.tag: scalar.value, step_key: scalar.step,
                       "_timestamp": scalar.wall_time})

    def flush(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._wandb.teardown()
            self._run = None

    def close(self) -> None:
        self.flush()


# --------------------------------------------------------------------------- the runner


def default_group(namespace: str, kind: str) -> str:
    """The consumer group of a sink: ``<ns>.sink.<kind>``."""
    return f"{namespace}.sink.{kind}"


@dataclass
class SinkSummary:
    """What one run of a sink did."""

    scalars: int = 0
    tags: int = 0
    #: Trainer metrics read before their trainer's first ``steps`` record: no step known.
    without_step: int = 0
    #: Records on the metrics topic that are not ``Metric`` events or did not decode.
    undecodable: int = 0
    commits: int = 0

    def line(self) -> str:
        return (f"{self.scalars} scalars ({self.tags} tags) written and committed in "
                f"{self.commits} commits; skipped: {self.without_step} trainer metrics "
                f"before their trainer's first step, {self.undecodable} undecodable records")


class MetricsSinkRunner:
    """Reads ``<ns>.metrics`` as consumer group ``group`` into ``sink``; see the module docstring.

    ``run`` blocks until ``stop()`` (any thread, a signal handler) or, with ``until_end``, until
    every partition of the topic was read to its end; then commits what it wrote, closes the
    sink and returns the summary. ``flush_every``: seconds between flush-and-commit while
    records arrive. Call ``run`` once.
    """

    def __init__(self, bootstrap: str, namespace: str, sink: ScalarSink, *, group: str,
                 until_end: bool = False, flush_every: float = 10.0) -> None:
        from reef_stream.core.serde import SchemaRegistry
        from reef_stream.topics import declarations

        self.bootstrap, self.group, self.sink = bootstrap, group, sink
        self.topic = declarations.metrics(namespace)
        self.until_end, self.flush_every = until_end, flush_every
        self.summary = SinkSummary()
        self._registry = SchemaRegistry.default()
        self._mappers: dict[int, ScalarMapper] = {}
        self._positions: dict[int, int] = {}   # partition -> next offset, written, not committed
        self._at_end: set[int] = set()
        self._tags: set[str] = set()
        self._stopping = False
        self._consumer: Any = None

    def stop(self) -> None:
        """Stop after the records in hand are written and committed."""
        self._stopping = True

    def run(self) -> SinkSummary:
        from reef_stream.topics.connect import new_consumer
        from reef_stream.topics.kafka import KafkaError

        self._consumer = new_consumer(self.bootstrap, self.group, {
            "auto.offset.reset": "earliest", "enable.partition.eof": True})
        self._consumer.subscribe([self.topic], on_assign=self._assigned,
                                 on_revoke=self._revoked)
        last_commit = time.monotonic()
        try:
            while not self._stopping:
                for message in self._consumer.consume(1000, timeout=0.5):
                    error = message.error()
                    if error is None:
                        self._take(message)
                    elif error.code() == KafkaError._PARTITION_EOF:
                        self._at_end.add(message.partition())
                    elif error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                          KafkaError._UNKNOWN_TOPIC):
                        raise ConfigurationError(
                            f"no topic {self.topic}: run `reef topics create`")
                    elif error.fatal():
                        raise FatalError(f"reading {self.topic}: {error}")
                    else:
                        log.warning("reading %s: %s (the client retries)", self.topic, error)
                if self._positions and time.monotonic() - last_commit >= self.flush_every:
                    self._commit()
                    last_commit = time.monotonic()
                assigned = {tp.partition for tp in self._consumer.assignment()}
                if self.until_end and assigned and assigned <= self._at_end:
                    break
            self._commit()
        except BaseException:
            self._positions.clear()  # commit nothing more: unflushed records are read again
            raise
        finally:
            self._consumer.close()
            self.sink.close()
        self.summary.tags = len(self._tags)
        return self.summary

    def _take(self, message: Any) -> None:
        """Write the scalar of one record (if it has one); remember its next offset."""
        partition = message.partition()
        self._at_end.discard(partition)
        scalar = self._scalar(message)
        if scalar is not None:
            self.sink.write(scalar)
            self.summary.scalars += 1
            self._tags.add(scalar.tag)
        self._positions[partition] = message.offset() + 1

    def _scalar(self, message: Any) -> Scalar | None:
        try:
            metric = self._registry.decode(message.value(), message.headers())
        except Exception as error:  # noqa: BLE001 - metrics are observations: log, go on
            log.warning("%s [%d] offset %d does not decode: %s", self.topic,
                        message.partition(), message.offset(), error)
            metric = None
        if not isinstance(metric, Metric):
            self.summary.undecodable += 1
            return None
        scalar = self._mappers.setdefault(message.partition(), ScalarMapper()).scalar(metric)
        if scalar is None:
            self.summary.without_step += 1
        return scalar

    def _commit(self, partitions: set[int] | None = None) -> None:
        """Write → flush → commit: flush the sink, then commit the next offset of each partition
        read since the last commit, with its mapper's trainer steps as the offset's metadata.
        Blocks. A failure raises before the commit: the records are read again."""
        from reef_stream.topics.kafka import TopicPartition

        pending = {p: o for p, o in self._positions.items()
                   if partitions is None or p in partitions}
        if not pending:
            return
        self.sink.flush()
        self._consumer.commit(offsets=[
            TopicPartition(self.topic, partition, offset,
                           metadata=json.dumps(self._mappers.setdefault(
                               partition, ScalarMapper()).steps, sort_keys=True))
            for partition, offset in sorted(pending.items())], asynchronous=False)
        for partition in pending:
            del self._positions[partition]
        self.summary.commits += 1

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        """Restore each partition's trainer steps from its committed offset's metadata."""
        for committed in consumer.committed(partitions, timeout=30):
            steps = json.loads(committed.metadata) if committed.metadata else {}
            self._mappers[committed.partition] = ScalarMapper(steps)
            self._at_end.discard(committed.partition)

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        """Commit what was written from ``partitions`` before another member takes them."""
        self._commit({tp.partition for tp in partitions})
        for tp in partitions:
            self._mappers.pop(tp.partition, None)
            self._at_end.discard(tp.partition)
