"""The metric → scalar mapping of `reef sink` (``reef_stream.ops.sinks``), without a broker: known
metrics give known tags, steps, values and wall times; a trainer's metrics take the step of its
last ``steps`` record; a missing extra names what to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.metric_names import (
    PROCESSOR_GENERATIONS, STAGE_PROCESSOR, STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, TRAINER_STEPS,
)
from reef_stream.ops.sinks import Scalar, ScalarMapper, TensorBoardSink, WandbSink, scalar_tag
from reef_stream.topics.metrics import metric

TRAINER = {"recipe": "sao", "group": "g"}


def test_tag_is_stage_name_and_sorted_labels_without_instance():
    event = metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 7,
                   {"recipe": "sao", "outcome": "unit", "instance": "host.12"}, created_at=1)
    assert scalar_tag(event) == "processor/generations/outcome=unit/recipe=sao"
    assert scalar_tag(metric(STAGE_TRAINER, "loss", 1.0, created_at=1)) == "trainer/loss"


def test_other_stages_step_is_created_at_in_ms_and_wall_time_in_seconds():
    event = metric(STAGE_PROCESSOR, PROCESSOR_GENERATIONS, 7, {"outcome": "unit"},
                   created_at=1_700_000_000_250)
    assert ScalarMapper().scalar(event) == Scalar(
        tag="processor/generations/outcome=unit", step=1_700_000_000_250, value=7.0,
        wall_time=1_700_000_000.25)


def test_trainer_metrics_take_the_step_of_their_trainers_last_steps_record():
    mapper = ScalarMapper()
    gap = metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, 0.5, TRAINER, created_at=2_000)
    assert mapper.scalar(gap) is None  # before the trainer's first step: no step known

    steps = mapper.scalar(metric(STAGE_TRAINER, TRAINER_STEPS, 3, TRAINER, created_at=3_000))
    assert steps == Scalar(tag="trainer/steps/group=g/recipe=sao", step=3, value=3.0,
                           wall_time=3.0)
    loss = mapper.scalar(metric(STAGE_TRAINER, "loss", -0.25, TRAINER, created_at=3_001))
    assert loss == Scalar(tag="trainer/loss/group=g/recipe=sao", step=3, value=-0.25,
                          wall_time=3.001)
    # Another trainer group has a step of its own.
    other = {"recipe": "sao", "group": "h"}
    mapper.scalar(metric(STAGE_TRAINER, TRAINER_STEPS, 10, other, created_at=3_002))
    assert mapper.scalar(metric(STAGE_TRAINER, "loss", 1.0, other, created_at=3_003)).step == 10
    assert mapper.scalar(metric(STAGE_TRAINER, "loss", 1.0, TRAINER, created_at=3_004)).step == 3
    assert mapper.steps == {"trainer/group=g/recipe=sao": 3, "trainer/group=h/recipe=sao": 10}


def test_restored_steps_give_a_resumed_sink_the_right_step():
    """What a restarted sink reads back from its committed offset's metadata."""
    mapper = ScalarMapper({"trainer/group=g/recipe=sao": 4})
    event = metric(STAGE_TRAINER, TRAINER_LOGPROB_GAP_OLDER, 0.125, TRAINER, created_at=9_000)
    scalar = mapper.scalar(event)
    assert (scalar.tag, scalar.step, scalar.value) == (
        "trainer/logprob_gap.older/group=g/recipe=sao", 4, 0.125)


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_extra_names_the_extra_to_install(kind, monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, kind, None)  # `import kind` raises ImportError
    with pytest.raises(ConfigurationError, match=rf"pip install 'reef-stream\[{kind}\]'"):
        if kind == "tensorboard":
            TensorBoardSink(tmp_path)
        else:
            WandbSink(project="p", dir=tmp_path, run_id="r", name="n")
