"""REEF_* settings: defaults, and one error listing every bad variable."""

from __future__ import annotations

import pytest

from reef_stream.config import load_settings
from reef_stream.errors import ConfigurationError


def test_defaults(tmp_path):
    settings = load_settings({"HOME": str(tmp_path)})
    assert settings.namespace == "reef"
    assert settings.bootstrap_servers is None and settings.redis_url is None
    assert settings.kafka_dir == settings.home / "kafka"


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigurationError) as caught:
        load_settings({
            "REEF_NAMESPACE": "bad namespace!",
            "REEF_BOOTSTRAP_SERVERS": "localhost",
            "REEF_REDIS_URL": "localhost:6379",
        })
    problems = caught.value.problems
    assert len(problems) == 3
    assert "REEF_NAMESPACE" in problems[0]
    assert "'localhost', which is not host:port" in problems[1]
    assert "REEF_REDIS_URL" in problems[2]
    assert str(caught.value).startswith("3 problems:")


def test_existing_servers_are_taken_as_given():
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": "a:9092,b:9092",
                              "REEF_REDIS_URL": "redis://r:6379/0", "REEF_NAMESPACE": "prod.rl"})
    assert settings.bootstrap_servers == "a:9092,b:9092"
    assert settings.redis_url == "redis://r:6379/0"
    assert settings.namespace == "prod.rl"
