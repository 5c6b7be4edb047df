"""The names ``reef_stream`` exports, imported lazily; and its package data."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest

import reef_stream
from reef_stream.core.settings import KAFKA_INFRA_DIR, SCHEMAS_DIR

HEAVY = ("confluent_kafka", "redis", "torch")


def _loaded_after(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has imported after running ``code``."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_the_names_a_user_starts_with_import_from_the_top():
    from reef_stream import Backend, Follower, Recipe, RecordProducer, Schedule

    assert Recipe.__module__ == "reef_stream.api.recipe"
    assert Backend.__module__ == "reef_stream.api.recipe"
    assert Schedule.__module__ == "reef_stream.api.schedule"
    assert RecordProducer.__module__ == "reef_stream.intake.producer"
    assert Follower.__module__ == "reef_stream.serving.follower"


def test_every_name_in_all_resolves():
    assert reef_stream.__all__ == sorted(set(reef_stream.__all__))
    unresolved = [name for name in reef_stream.__all__ if getattr(reef_stream, name, None) is None]
    assert unresolved == []
    assert set(reef_stream.__all__) <= set(dir(reef_stream))
    for name in ("Recipe", "Backend", "Schedule", "Processor", "Grouping", "FeedbackPolicy",
                 "UnitBuilder", "Score", "Scored", "MissingFeedback", "ComposedProcessor",
                 "Objective", "ObjectiveResult", "LossFamily", "POLICY_GRADIENT",
                 "CandidateEvaluator", "Reward", "load_recipe", "RecordProducer",
                 "AsyncRecordProducer", "Follower", "Generation", "Feedback", "RolloutUnit",
                 "Checkpoint", "Publication", "DeadLetter", "ReefError"):
        assert name in reef_stream.__all__, name


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        reef_stream.Nope  # noqa: B018
    from reef_stream.core import errors  # submodules, not exported names
    from reef_stream.core import settings as config

    assert errors.ReefError is reef_stream.ReefError
    assert config.SCHEMAS_DIR == SCHEMAS_DIR


def test_import_reef_stream_imports_no_kafka_redis_or_torch():
    assert _loaded_after("import reef_stream") == []


def test_the_author_api_names_do_not_bring_kafka_or_redis():
    loaded = _loaded_after("from reef_stream import Recipe, Schedule, Backend, Processor, "
                           "ComposedProcessor, Objective, CandidateEvaluator, Reward, load_recipe")
    assert "confluent_kafka" not in loaded and "redis" not in loaded


def test_the_schemas_and_kafka_templates_are_found_through_the_package():
    data = Path(str(importlib.resources.files("reef_stream") / "_data")).resolve()
    assert SCHEMAS_DIR == (data / "schemas").resolve()
    assert KAFKA_INFRA_DIR == (data / "kafka").resolve()
    assert {"generation.avsc", "feedback.avsc", "rollout_unit.avsc", "checkpoint.avsc",
            "publication.avsc", "metric.avsc", "dead_letter.avsc"} <= {
                path.name for path in SCHEMAS_DIR.glob("*.avsc")}
    assert list((SCHEMAS_DIR / "history").rglob("*.avsc"))
    for name in ("pom.xml", "server.properties.template", "log4j.properties"):
        assert (KAFKA_INFRA_DIR / name).is_file(), name


def test_the_example_methods_ship_inside_reef_stream(tmp_path):
    """``reef_stream.methods.sao`` imports from anywhere (the checkout's ``methods/``, mapped).

    In a fresh interpreter: ``methods.sao`` (what the tests of this checkout import) and
    ``reef_stream.methods.sao`` are the same files under two names, and each registers its
    loss family once, so one process must not import both.
    """
    result = subprocess.run(
        [sys.executable, "-c", "import reef_stream.methods.sao as sao, reef_stream.methods.grpo\n"
                               "print(sao.__name__, sao.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    name, file = result.stdout.split()
    assert name == "reef_stream.methods.sao" and Path(file).parent.name == "sao"
