"""Where the Kafka cluster and the Redis server are, and how clients reach them.

The one rule: ``REEF_BOOTSTRAP_SERVERS`` / ``REEF_REDIS_URL`` name existing
servers and win; otherwise the local ones that ``reef kafka up`` and
``reef redis up`` started (their addresses are in their data directories).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from reef_stream.config import Settings
from reef_stream.errors import ConfigurationError

#: librdkafka's own log lines go through this logger (not straight to stderr).
KAFKA_LOGGER = logging.getLogger("reef_stream.kafka")


def bootstrap_servers(settings: Settings) -> str:
    """The cluster to use: REEF_BOOTSTRAP_SERVERS, or the running local cluster."""
    if settings.bootstrap_servers:
        return settings.bootstrap_servers
    state = settings.kafka_dir / "cluster.json"
    if not state.exists():
        raise ConfigurationError(
            "No Kafka cluster: start the local one with `reef kafka up`, "
            "or set REEF_BOOTSTRAP_SERVERS=host:port to use an existing cluster."
        )
    return json.loads(state.read_text())["bootstrap"]


def redis_url(settings: Settings) -> str:
    """The Redis server to use: REEF_REDIS_URL, or the running local one."""
    if settings.redis_url:
        return settings.redis_url
    state = settings.redis_dir / "redis.json"
    if not state.exists():
        raise ConfigurationError(
            "No Redis server: start the local one with `reef redis up`, "
            "or set REEF_REDIS_URL=redis://host:port/0 to use an existing server."
        )
    return json.loads(state.read_text())["url"]


def client_config(bootstrap: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The confluent-kafka configuration every reef-stream client starts from."""
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": KAFKA_LOGGER,
    }
    config.update(overrides or {})
    return config
