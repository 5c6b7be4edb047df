"""The local Redis server: Debian's ``redis-server`` on its own port and data directory.

Redis holds projections only (which replica serves which version, the current
serving version per model); all of them can be rebuilt from Kafka, so this
server keeps an append-only file for convenience, not for safety.

``LocalRedis(data_dir).up()`` is what ``reef redis up`` does. The address it
listens on is recorded in ``<data>/redis.json``, where ``reef_stream.topics.connect``
finds it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import redis

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.processes import log_tail, port_is_free, process_matches, terminate

DEFAULT_PORT = 16379

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class RedisStatus:
    data_dir: Path
    url: str
    pid: int | None
    alive: bool
    version: str | None
    keys: int | None


class LocalRedis:
    """A redis-server process on 127.0.0.1, kept in ``data_dir``. ``up``/``down`` are idempotent."""

    def __init__(self, data_dir: Path, address: str = "127.0.0.1", wrap: Sequence[str] = ()):
        """``address``: where the server listens (an emulated host's address for the cluster
        tests). ``wrap``: an argv prefix the server is started under (``ip netns exec NS``,
        which execs it: the recorded pid is the server's own)."""
        self.data_dir = Path(data_dir).resolve()
        self.address, self.wrap = address, list(wrap)
        self.state_file = self.data_dir / "redis.json"
        self.log_file = self.data_dir / "redis.log"

    def _load(self) -> dict:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def _save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    @property
    def url(self) -> str:
        return self._load()["url"]

    def is_alive(self) -> bool:
        state = self._load()
        return process_matches(state.get("pid"), f":{state.get('port')}")

    def up(self, port: int = DEFAULT_PORT, timeout: float = 20.0,
           progress: Progress = _quiet) -> str:
        """Start redis-server if it is not running and return its URL.

        ``port`` applies the first time; later starts reuse the recorded one.
        """
        server = shutil.which("redis-server")
        if server is None:
            raise ConfigurationError(
                "redis-server was not found. Install it (Debian: apt-get install redis-server), "
                "or set REEF_REDIS_URL=redis://host:port/0 to use an existing server."
            )
        state = self._load()
        if state and self.is_alive():
            progress(f"Redis is already running at {state['url']}; nothing to do")
            return state["url"]
        port = state.get("port", port)
        if not self.wrap and not port_is_free(port):
            raise ConfigurationError(
                f"Port {port} on 127.0.0.1 is already in use by another process, so Redis cannot "
                "listen there. Stop that process, or use another --data directory with another --port."
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            process = subprocess.Popen(
                [*self.wrap, server, "--bind", self.address, "--port", str(port), "--dir", str(self.data_dir),
                 "--appendonly", "yes", "--daemonize", "no", "--protected-mode",
                 # Off only on an address of its own (an emulated host's private bridge).
                 "yes" if self.address.startswith("127.") else "no",
                 "--save", ""],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        url = f"redis://{self.address}:{port}/0"
        self._save({"port": port, "pid": process.pid, "url": url})
        progress(f"Started Redis (pid {process.pid}) on port {port}")

        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise FatalError(
                    f"redis-server exited with status {process.returncode} while starting. "
                    f"Its log is {self.log_file}; last lines:\n{log_tail(self.log_file)}"
                )
            try:
                client.ping()
                progress(f"Redis is ready at {url}")
                return url
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise FatalError(f"Redis did not answer within {timeout:.0f}s; see {self.log_file}")
                time.sleep(0.1)

    def down(self, timeout: float = 20.0, progress: Progress = _quiet) -> None:
        """Stop redis-server (SIGTERM); SIGKILL after ``timeout``."""
        state = self._load()
        if not state or not self.is_alive():
            progress("Redis is not running")
            return
        terminate(state["pid"], self.is_alive, timeout)
        self._save({**state, "pid": None})
        progress("Stopped Redis")

    def status(self) -> RedisStatus:
        state = self._load()
        if not state:
            raise ConfigurationError(f"No local Redis in {self.data_dir}: run `reef redis up`")
        alive = self.is_alive()
        version = keys = None
        if alive:
            try:
                client = redis.Redis.from_url(state["url"], socket_connect_timeout=1)
                version = client.info("server")["redis_version"]
                keys = client.dbsize()
            except redis.RedisError:
                pass
        return RedisStatus(self.data_dir, state["url"], state.get("pid"), alive, version, keys)

