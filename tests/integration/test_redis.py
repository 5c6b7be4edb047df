"""The local Redis server: started by `reef redis up`, real commands against it."""

from __future__ import annotations

import redis as redis_client

from reef_stream.core.processes import free_ports
from tests.helpers import reef


def test_session_redis_answers(redis_url):
    client = redis_client.Redis.from_url(redis_url)
    client.set("reef-test-key", b"v1")
    assert client.get("reef-test-key") == b"v1"


def test_redis_up_status_down(tmp_path, cli_env):
    env = {k: v for k, v in cli_env.items() if k != "REEF_REDIS_URL"}
    port = free_ports(1)[0]
    data = str(tmp_path / "redis")

    started = reef("redis", "up", "--port", str(port), "--data", data, env=env)
    assert f"redis://127.0.0.1:{port}/0" in started.stdout
    again = reef("redis", "up", "--data", data, env=env)
    assert "already running" in again.stdout

    client = redis_client.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    client.set("replica:r1", "7")
    status = reef("redis", "status", "--data", data, env=env)
    assert "alive" in status.stdout and "keys 1" in status.stdout

    reef("redis", "down", "--data", data, env=env)
    status = reef("redis", "status", "--data", data, env=env)
    assert "stopped" in status.stdout


def test_redis_url_means_nothing_is_started(cli_env, tmp_path):
    result = reef("redis", "up", "--data", str(tmp_path / "unused"), env=cli_env)
    assert "starting nothing" in result.stdout
    assert not (tmp_path / "unused").exists()
