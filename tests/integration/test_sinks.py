"""`reef sink tensorboard|wandb` on a real broker: Metric events with known values, written as
the stages write them (key = stage), come out of the real command as exactly the scalars the
mapping promises, read back with TensorBoard's own EventAccumulator and from W&B's offline run
file; a second run after more events adds only those (it resumed from its committed offsets),
and a trainer metric whose ``steps`` record came before the resume point keeps its step."""

from __future__ import annotations

import glob
import importlib
import json
import struct
import zlib
from pathlib import Path

import pytest
from confluent_kafka import Producer

from reef_stream.core.metric_names import (
    PROCESSOR_GENERATIONS, STAGE_PROCESSOR, STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, TRAINER_STEPS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from reef_stream.topics.metrics import metric
from tests.helpers import reef
from tests.unit_log import create_topics

T0 = 1_700_000_000_000
TRAINER = {"recipe": "sao", "group": "g"}
LOSS = "trainer/loss/group=g/recipe=sao"
GAP = "trainer/logprob_gap.older/group=g/recipe=sao"
STEPS = "trainer/steps/group=g/recipe=sao"
UNITS = "processor/generations/outcome=unit/recipe=sao"

#: Two trainer steps and two processor counts, then (after the first sink run) a metric of
#: step 2 whose `steps` record the sink has already committed, step 3, one more count.
FIRST = [
    metric(STAGE_TRAINER, TRAINER_STEPS, 1, TRAINER, created_at=T0 + 1),
    metric(STAGE_TRAINER, "loss", 0.5, TRAINER, created_at=T0 + 2),
    metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, 0.25, TRAINER, created_at=T0 + 3),
    metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 8,
           {"recipe": "sao", "outcome": "unit", "instance": "a.1"}, created_at=T0 + 4),
    metric(STAGE_TRAINER, TRAINER_STEPS, 2, TRAINER, created_at=T0 + 1_001),
    metric(STAGE_TRAINER, "loss", 0.375, TRAINER, created_at=T0 + 1_002),
    metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 16,
           {"recipe": "sao", "outcome": "unit", "instance": "a.1"}, created_at=T0 + 1_500),
]
SECOND = [
    metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, 0.125, TRAINER, created_at=T0 + 1_003),
    metric(STAGE_TRAINER, TRAINER_STEPS, 3, TRAINER, created_at=T0 + 2_001),
    metric(STAGE_TRAINER, "loss", -1.5, TRAINER, created_at=T0 + 2_002),
    metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 4,
           {"recipe": "sao", "outcome": "unit", "instance": "b.2"}, created_at=T0 + 2_500),
]
#: tag -> [(step, value, wall time)] of FIRST, then of SECOND.
EXPECTED_FIRST = {
    STEPS: [(1, 1.0, (T0 + 1) / 1000), (2, 2.0, (T0 + 1_001) / 1000)],
    LOSS: [(1, 0.5, (T0 + 2) / 1000), (2, 0.375, (T0 + 1_002) / 1000)],
    GAP: [(1, 0.25, (T0 + 3) / 1000)],
    UNITS: [(T0 + 4, 8.0, (T0 + 4) / 1000), (T0 + 1_500, 16.0, (T0 + 1_500) / 1000)],
}
EXPECTED_SECOND = {
    GAP: [(2, 0.125, (T0 + 1_003) / 1000)],
    STEPS: [(3, 3.0, (T0 + 2_001) / 1000)],
    LOSS: [(3, -1.5, (T0 + 2_002) / 1000)],
    UNITS: [(T0 + 2_500, 4.0, (T0 + 2_500) / 1000)],
}


def _write_metrics(bootstrap: str, namespace: str, events) -> None:
    """Append ``events`` to ``<ns>.metrics`` keyed by stage, as ``MetricsWriter`` does."""
    registry = SchemaRegistry.default()
    producer = Producer(client_config(bootstrap, {"acks": "all"}))
    for event in events:
        value, headers = registry.encode(event)
        producer.produce(declarations.metrics(namespace), key=event.stage.encode(), value=value,
                         headers=headers)
    assert producer.flush(30) == 0


def _merged(*parts):
    merged = {}
    for part in parts:
        for tag, points in part.items():
            merged.setdefault(tag, []).extend(points)
    return merged


# --------------------------------------------------------------------------- TensorBoard


def _tensorboard_scalars(logdir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def require_extra(name: str) -> None:
    """Fail (never skip: CI installs every extra) when the optional sink's package is missing."""
    try:
        importlib.import_module(name)
    except ImportError as error:
        pytest.fail(f"the {name} extra is not installed: pip install 'reef-stream[{name}]' "
                    f"(bash scripts/test.sh installs it): {error}", pytrace=False)


def test_tensorboard_sink_writes_known_scalars_and_resumes(kafka_bootstrap, namespace, cli_env,
                                                          tmp_path):
    require_extra("tensorboard")
    create_topics(kafka_bootstrap, namespace)
    logdir = tmp_path / "tb"
    _write_metrics(kafka_bootstrap, namespace, FIRST)
    result = reef("sink", "tensorboard", "--logdir", str(logdir), "--until-end", env=cli_env)
    assert "7 scalars (4 tags)" in result.stdout, result.stdout
    assert _tensorboard_scalars(logdir) == EXPECTED_FIRST

    _write_metrics(kafka_bootstrap, namespace, SECOND)
    result = reef("sink", "tensorboard", "--logdir", str(logdir), "--until-end", env=cli_env)
    assert "4 scalars (4 tags)" in result.stdout, result.stdout
    assert _tensorboard_scalars(logdir) == _merged(EXPECTED_FIRST, EXPECTED_SECOND)
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2

    # Caught up: a third run writes nothing.
    result = reef("sink", "tensorboard", "--logdir", str(logdir), "--until-end", env=cli_env)
    assert "0 scalars (0 tags)" in result.stdout, result.stdout


# --------------------------------------------------------------------------- W&B offline


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``,
    magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a header of CRC-32 (of its
    type byte and data), length and type (full, first, middle, last), as LevelDB's log."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:7] == b":W&B\xe1\xbe\x00", raw[:7]
    block, position, pending = 32 * 1024, 7, b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # too little room for a header: padding
            position += block - position % block
            continue
        crc, length, kind = struct.unpack_from("<IHB", raw, position)
        data = raw[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:  # zeros at the end of the file
            break
        assert zlib.crc32(bytes([kind]) + data) == crc, f"{path}: bad chunk at {position}"
        pending += data
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(run_dir: Path) -> tuple[dict, dict]:
    """(tag -> [(step, value, wall time)], step metric of each defined metric) of one run."""
    (path,) = run_dir.glob("run-*.wandb")
    scalars, step_metrics = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "metric" and record.metric.step_metric:
            step_metrics[record.metric.name] = record.metric.step_metric
        elif kind == "history":
            # A key with a dot in it comes as a one-element nested_key.
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            (tag,) = [key for key in row if f"{key}/step" in row]
            scalars.setdefault(tag, []).append((row[f"{tag}/step"], row[tag], row["_timestamp"]))
    return scalars, step_metrics


def test_wandb_sink_logs_known_scalars_offline_and_resumes(kafka_bootstrap, namespace, cli_env,
                                                          tmp_path):
    require_extra("wandb")
    create_topics(kafka_bootstrap, namespace)
    env = {k: v for k, v in cli_env.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path / "home")  # no settings or credentials of the machine's user
    directory = tmp_path / "wb"
    _write_metrics(kafka_bootstrap, namespace, FIRST)
    result = reef("sink", "wandb", "--dir", str(directory), "--until-end", env=env)
    assert "7 scalars (4 tags)" in result.stdout, result.stdout
    assert f"W&B run {namespace}.sink.wandb (offline)" in result.stdout, result.stdout

    _write_metrics(kafka_bootstrap, namespace, SECOND)
    reef("sink", "wandb", "--dir", str(directory), "--until-end", env=env)

    runs = sorted(glob.glob(str(directory / "wandb" / "offline-run-*")))
    assert len(runs) == 2, runs
    assert all(run.endswith(f"-{namespace}.sink.wandb") for run in runs), runs
    (first, step_metrics), (second, _) = (_wandb_run(Path(run)) for run in runs)
    assert first == EXPECTED_FIRST
    assert second == EXPECTED_SECOND
    escaped = GAP.replace(".", "\\.")
    assert step_metrics[escaped] == f"{escaped}/step"
