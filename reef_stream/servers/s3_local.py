"""The local object store: S3Proxy serving the S3 API over a directory, run from Maven jars.

``LocalS3(data_dir, cache_dir).up()`` is what ``reef s3 up`` does: resolve S3Proxy's classpath
with Maven from ``infra/s3/pom.xml`` (once), start ``java org.gaul.s3proxy.Main`` on
127.0.0.1 in a session of its own (it outlives the command), and wait until it answers. The
objects live under ``<data>/objects`` (the ``filesystem-nio2`` backend), so they survive a
restart. Port, pid and the credentials it was started with are kept in ``<data>/s3.json``
(mode 0600): a client takes them from the environment ``environment()`` gives
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), never from a URL, so an ``s3://`` URL in a
log line carries no secret. For tests and development only, never production.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.processes import log_tail, port_is_free, process_matches, terminate
from reef_stream.core.settings import S3_INFRA_DIR
from reef_stream.servers.kafka_local import check_java
from reef_stream.servers.maven import maven_classpath

S3PROXY_VERSION = "3.0.0"
DEFAULT_PORT = 19090
#: The region clients are told: S3Proxy accepts a bucket created without a location there.
REGION = "us-east-1"
#: The access key of the local store; its secret is drawn at the first ``up``.
ACCESS_KEY = "reef"
MAIN_CLASS = "org.gaul.s3proxy.Main"
#: Heap of the S3Proxy JVM.
JAVA_HEAP = "256m"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class S3Status:
    data_dir: Path
    endpoint: str
    pid: int | None
    alive: bool
    buckets: list[str] | None


class LocalS3:
    """An S3Proxy process on 127.0.0.1 (or ``address``), kept in ``data_dir``. ``up``/``down``
    are idempotent and block until the server answers or is gone."""

    def __init__(self, data_dir: Path, cache_dir: Path, address: str = "127.0.0.1",
                 wrap: Sequence[str] = ()):
        """``address``: where S3Proxy listens (an emulated host's address for the cluster
        tests). ``wrap``: an argv prefix it is started under (``ip netns exec NS``, which execs
        it: the recorded pid is the JVM's)."""
        self.address, self.wrap = address, list(wrap)
        self.data_dir = Path(data_dir).resolve()
        self.cache_dir = Path(cache_dir)
        self.state_file = self.data_dir / "s3.json"
        self.log_file = self.data_dir / "s3proxy.log"
        self.properties_file = self.data_dir / "s3proxy.properties"

    def _load(self) -> dict:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def _save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    @property
    def endpoint(self) -> str:
        state = self._load()
        if not state:
            raise ConfigurationError(f"No local object store in {self.data_dir}: run `reef s3 up`")
        return state["endpoint"]

    def is_alive(self) -> bool:
        return process_matches(self._load().get("pid"), str(self.properties_file))

    def environment(self) -> dict[str, str]:
        """What an S3 client (s3fs, boto3) needs in its environment to reach this store.
        The checksum settings: current botocore sends checksum headers S3Proxy answers with
        "not implemented" unless asked only when an operation requires them."""
        state = self._load()
        if not state:
            raise ConfigurationError(f"No local object store in {self.data_dir}: run `reef s3 up`")
        return {
            "AWS_ENDPOINT_URL": state["endpoint"],
            "AWS_ACCESS_KEY_ID": state["access_key"],
            "AWS_SECRET_ACCESS_KEY": state["secret_key"],
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        }

    def up(self, port: int = DEFAULT_PORT, timeout: float = 60.0,
           progress: Progress = _quiet) -> str:
        """Start S3Proxy if it is not running and return its endpoint URL. ``port`` applies the
        first time; later starts reuse the recorded port and credentials."""
        state = self._load()
        if state and self.is_alive():
            progress(f"The object store is already running at {state['endpoint']}; nothing to do")
            return state["endpoint"]
        java = check_java()
        classpath = maven_classpath(
            S3_INFRA_DIR / "pom.xml", self.cache_dir, f"S3Proxy {S3PROXY_VERSION}'s jars",
            instead="point checkpoint URLs at an existing S3 service", progress=progress)
        port = state.get("port", port)
        if not self.wrap and not port_is_free(port):
            raise ConfigurationError(
                f"Port {port} on 127.0.0.1 is already in use by another process, so the object "
                "store cannot listen there. Stop that process, or use another --data directory "
                "with another --port.")
        objects = self.data_dir / "objects"
        objects.mkdir(parents=True, exist_ok=True)
        state = {"port": port, "endpoint": f"http://{self.address}:{port}",
                 "access_key": state.get("access_key", ACCESS_KEY),
                 "secret_key": state.get("secret_key") or secrets.token_hex(16), "pid": None}
        properties = self.properties_file
        properties.touch(mode=0o600)
        properties.write_text("\n".join([
            f"s3proxy.endpoint={state['endpoint']}",
            "s3proxy.authorization=aws-v2-or-v4",
            f"s3proxy.identity={state['access_key']}",
            f"s3proxy.credential={state['secret_key']}",
            "jclouds.provider=filesystem-nio2",
            f"jclouds.filesystem.basedir={objects}",
            f"jclouds.identity={state['access_key']}",
            f"jclouds.credential={state['secret_key']}",
        ]) + "\n")
        with open(self.log_file, "ab") as out:
            process = subprocess.Popen(
                [*self.wrap, java, f"-Xmx{JAVA_HEAP}", "-cp", classpath, MAIN_CLASS,
                 "--properties", str(properties)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.data_dir,
            )
        state["pid"] = process.pid
        self._save(state)
        progress(f"Started S3Proxy {S3PROXY_VERSION} (pid {process.pid}) on port {port}")
        deadline = time.monotonic() + timeout
        while not _answers(state["endpoint"]):
            if process.poll() is not None:
                raise FatalError(
                    f"S3Proxy exited with status {process.returncode} while starting. Its log "
                    f"is {self.log_file}; last lines:\n{log_tail(self.log_file)}")
            if time.monotonic() > deadline:
                raise FatalError(f"S3Proxy did not answer within {timeout:.0f}s; see "
                                 f"{self.log_file}")
            time.sleep(0.1)
        progress(f"The object store is ready at {state['endpoint']}")
        return state["endpoint"]

    def down(self, timeout: float = 20.0, progress: Progress = _quiet) -> None:
        """Stop S3Proxy (SIGTERM); SIGKILL after ``timeout``. The objects stay."""
        state = self._load()
        if not state or not self.is_alive():
            progress("The object store is not running")
            return
        terminate(state["pid"], self.is_alive, timeout)
        self._save({**state, "pid": None})
        progress("Stopped the object store")

    def client(self):  # noqa: ANN201 - botocore's client type is generated at run time
        """A botocore S3 client of this store (botocore comes with the ``s3`` extra)."""
        try:
            import botocore.config
            import botocore.session
        except ImportError as error:
            raise ConfigurationError("the local object store's client needs botocore: "
                                     "pip install 'reef-stream[s3]'") from error
        env = self.environment()
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=REGION,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required",
                                          retries={"max_attempts": 2}))

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` unless it exists (idempotent)."""
        client = self.client()
        if name not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=name)

    def status(self) -> S3Status:
        state = self._load()
        if not state:
            raise ConfigurationError(f"No local object store in {self.data_dir}: run `reef s3 up`")
        alive = self.is_alive()
        buckets = None
        if alive:
            try:
                buckets = sorted(b["Name"] for b in self.client().list_buckets()["Buckets"])
            except Exception:  # noqa: BLE001 - a status line, not a failure
                buckets = None
        return S3Status(self.data_dir, state["endpoint"], state.get("pid"), alive, buckets)


def _answers(endpoint: str) -> bool:
    """True once an HTTP server answers at ``endpoint`` (S3Proxy refuses an unsigned request
    with 403, which is an answer)."""
    try:
        urllib.request.urlopen(endpoint, timeout=1).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True
