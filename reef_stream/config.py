"""Every ``REEF_*`` environment variable, documented in one place.

| variable | default | meaning |
| --- | --- | --- |
| ``REEF_BOOTSTRAP_SERVERS`` | unset | An existing Kafka cluster (``host:port,...``). When set, reef-stream starts no broker and uses this one. |
| ``REEF_REDIS_URL`` | unset | An existing Redis server (``redis://host:port/db``). When set, reef-stream starts no Redis. |
| ``REEF_NAMESPACE`` | ``reef`` | Prefix of every topic name (``<ns>.generations``, ...). |
| ``REEF_HOME`` | ``~/.local/share/reef-stream`` | Where the local broker and Redis keep their data, logs, pids and ports. |
| ``REEF_CACHE_DIR`` | ``~/.cache/reef-stream`` | Where the resolved Kafka classpath is cached (the jars themselves live in Maven's ``~/.m2``). |
| ``REEF_INTAKE_TOKEN`` | unset | Bearer token every POST to ``reef intake serve`` must carry (``Authorization: Bearer <token>``); unset: none needed. |

Nothing else in the package reads the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from reef_stream.errors import ConfigurationError

#: The repository root: schemas/ and infra/ are found from here.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
SCHEMAS_DIR = PROJECT_ROOT / "schemas"
KAFKA_INFRA_DIR = PROJECT_ROOT / "infra" / "kafka"

DEFAULT_NAMESPACE = "reef"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


@dataclass(frozen=True)
class Settings:
    """The environment, read once and validated."""

    bootstrap_servers: str | None
    redis_url: str | None
    namespace: str
    home: Path
    cache_dir: Path
    intake_token: str | None = None

    @property
    def kafka_dir(self) -> Path:
        """Default data directory of the local Kafka cluster."""
        return self.home / "kafka"

    @property
    def redis_dir(self) -> Path:
        """Default data directory of the local Redis server."""
        return self.home / "redis"


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Read the ``REEF_*`` variables; raise one ConfigurationError listing every bad one."""
    env = os.environ if environ is None else environ
    problems = []

    namespace = env.get("REEF_NAMESPACE", DEFAULT_NAMESPACE).strip()
    if not _NAMESPACE_RE.match(namespace) or len(namespace) > 100:
        problems.append(
            f"REEF_NAMESPACE={namespace!r} is not a valid topic prefix: use letters, digits, "
            "'-', '_' and '.' between words, at most 100 characters"
        )

    bootstrap = env.get("REEF_BOOTSTRAP_SERVERS", "").strip() or None
    if bootstrap is not None:
        for server in bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                problems.append(
                    f"REEF_BOOTSTRAP_SERVERS names {server.strip()!r}, which is not host:port"
                )

    redis_url = env.get("REEF_REDIS_URL", "").strip() or None
    if redis_url is not None and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        problems.append(
            f"REEF_REDIS_URL={redis_url!r} must start with redis://, rediss:// or unix://"
        )

    home = Path(env.get("REEF_HOME") or Path.home() / ".local" / "share" / "reef-stream")
    cache_dir = Path(env.get("REEF_CACHE_DIR") or Path.home() / ".cache" / "reef-stream")

    if problems:
        raise ConfigurationError(problems)
    return Settings(
        bootstrap_servers=bootstrap,
        redis_url=redis_url,
        namespace=namespace,
        home=home.expanduser(),
        cache_dir=cache_dir.expanduser(),
        intake_token=env.get("REEF_INTAKE_TOKEN") or None,
    )
