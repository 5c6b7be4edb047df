"""`reef kafka up|status|down` on a cluster of the test's own, through the real CLI."""

from __future__ import annotations

import json

from confluent_kafka import Producer

from reef_stream.topics.connect import client_config
from tests.helpers import consume_all, reef


def _local_env(cli_env, tmp_path):
    """The CLI's environment without REEF_BOOTSTRAP_SERVERS, so it runs its own cluster."""
    env = {k: v for k, v in cli_env.items() if k != "REEF_BOOTSTRAP_SERVERS"}
    env["REEF_HOME"] = str(tmp_path / "home")
    return env


def test_up_status_down_and_restart_keeps_every_record(cli_env, tmp_path, namespace):
    env = _local_env(cli_env, tmp_path)
    state_file = tmp_path / "home" / "kafka" / "cluster.json"

    started = reef("kafka", "up", "--port", "0", env=env)
    bootstrap = json.loads(state_file.read_text())["bootstrap"]
    pid = json.loads(state_file.read_text())["nodes"][0]["pid"]
    assert f"bootstrap: {bootstrap}" in started.stdout

    again = reef("kafka", "up", env=env)
    assert "already running" in again.stdout
    assert json.loads(state_file.read_text())["nodes"][0]["pid"] == pid

    reef("topics", "create", env=env)
    status = reef("kafka", "status", env=env).stdout
    assert "alive" in status and "active controller" in status
    assert f"{namespace}.generations" in status

    topic = f"{namespace}.generations"
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    for i in range(500):
        producer.produce(topic, key=str(i).encode(), value=f"record-{i}".encode())
    assert producer.flush(30) == 0

    reef("kafka", "down", env=env)
    assert "stopped" in reef("kafka", "status", env=env).stdout
    reef("kafka", "up", env=env)
    try:
        values = [m.value() for m in consume_all(bootstrap, topic, 500)]
        assert sorted(values) == sorted(f"record-{i}".encode() for i in range(500))
    finally:
        reef("kafka", "down", env=env)


def test_bootstrap_servers_means_nothing_is_started(cli_env, kafka_bootstrap):
    result = reef("kafka", "up", env=cli_env)
    assert "starting nothing" in result.stdout
    status = reef("kafka", "status", env=cli_env)
    assert "REEF_BOOTSTRAP_SERVERS" in status.stdout


def test_topic_commands_without_any_cluster_say_what_to_do(cli_env, tmp_path):
    env = _local_env(cli_env, tmp_path)
    result = reef("topics", "create", env=env, check=False)
    assert result.returncode == 2
    assert "reef kafka up" in result.stderr and "REEF_BOOTSTRAP_SERVERS" in result.stderr
