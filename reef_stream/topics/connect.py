"""Where the Kafka cluster and the Redis server are, and how clients reach them.

The one rule: ``REEF_BOOTSTRAP_SERVERS`` / ``REEF_REDIS_URL`` name existing
servers and win; otherwise the local ones that ``reef kafka up`` and
``reef redis up`` started (their addresses are in their data directories).

Kafka clients are built with ``new_producer``, ``new_consumer`` and ``new_admin``,
each from ``client_config``, so that no module outside ``reef_stream.topics`` needs
the client library (its types and constants: ``reef_stream.topics.kafka``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from reef_stream.core.errors import ConfigurationError, RetryableError
from reef_stream.core.settings import Settings, load_settings

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

T = TypeVar("T")

#: librdkafka's own log lines go through this logger (not straight to stderr).
KAFKA_LOGGER = logging.getLogger("reef_stream.kafka")
log = logging.getLogger(__name__)

# librdkafka's codes for a refused SASL login and a failed TLS handshake.
_AUTHENTICATION = KafkaError._AUTHENTICATION
_SSL = KafkaError._SSL
#: How long ``await_answer`` still waits for an answer after a refusal was reported.
REFUSAL_GRACE_S = 2.0


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


def client_config(bootstrap: str, overrides: dict[str, Any] | None = None, *,
                  settings: Settings | None = None, security: bool = True) -> dict[str, Any]:
    """The confluent-kafka configuration every reef-stream client starts from.

    It holds the security properties of ``REEF_KAFKA_*`` (TLS, SASL; see
    ``reef_stream.core.settings``), read from ``settings`` or else from the
    environment, so every producer, consumer and admin client reaches a secured
    cluster the same way; ``overrides`` (the client's own properties) win.
    With security configured, the client's ``error_cb`` is wrapped so that a
    refused login or TLS handshake is logged once, clearly and without a
    secret, on ``reef_stream.topics.connect`` (served when the client is polled).
    ``security=False`` leaves all of this out: only for the plaintext local
    cluster that ``reef_stream.servers.kafka_local`` starts and probes itself.
    """
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": KAFKA_LOGGER,
    }
    if not security:
        config.update(overrides or {})
        return config
    settings = settings or load_settings()
    config.update(settings.kafka_client)
    config.update(overrides or {})
    if settings.kafka_client:
        config["error_cb"] = _RefusalReporter(bootstrap, settings, config.get("error_cb"))
    return config


def new_producer(bootstrap: str, overrides: dict[str, Any] | None = None) -> Producer:
    """A producer of ``bootstrap``: ``client_config`` with ``overrides``, the producer's own
    delivery settings (acks, idempotence, batching, a transactional id). Does not block."""
    return Producer(client_config(bootstrap, overrides))


def new_consumer(bootstrap: str, group: str,
                 overrides: dict[str, Any] | None = None) -> Consumer:
    """A consumer in ``group`` that commits only when told to (``enable.auto.commit`` off:
    offsets are committed by the step that says so, never in the background) and reads only
    committed records (``isolation.level=read_committed``: what an aborted or open transaction
    wrote, a fenced writer's included, is never seen), with ``overrides`` added (they win). A
    reader that only ``assign``s uses it too: its group is then only a name, never committed
    to. Does not block."""
    return Consumer(client_config(bootstrap, {
        "group.id": group, "enable.auto.commit": False, "isolation.level": "read_committed",
        **(overrides or {})}))


def new_admin(bootstrap: str, overrides: dict[str, Any] | None = None, *,
              security: bool = True) -> AdminClient:
    """An admin client of ``bootstrap`` (``security`` as in ``client_config``). Imports
    ``confluent_kafka.admin`` on the first call, not with this module. Does not block."""
    from confluent_kafka.admin import AdminClient

    return AdminClient(client_config(bootstrap, overrides, security=security))


def describe_security(settings: Settings) -> str:
    """How clients reach the cluster, for a log line or an error: never a secret."""
    protocol = settings.kafka_security_protocol
    if protocol.startswith("SASL_"):
        client = settings.kafka_client
        return f"{protocol}, {client.get('sasl.mechanism')} as {client.get('sasl.username')!r}"
    return protocol


def last_refusal(since: float | None = None) -> str | None:
    """The last refused login or TLS handshake any client of this process reported, or None;
    with ``since`` (a ``time.monotonic()``), only one reported at or after then.

    For a caller whose request timed out, to say why (the librdkafka error
    alone says only "broker transport failure"). A client reports only when it
    is polled: see ``check_refused``.
    """
    if since is not None and _last_refusal_at < since:
        return None
    return _last_refusal


def check_refused(client: Any, since: float | None = None) -> None:
    """Serve ``client``'s callbacks (``poll(0)``: its ``error_cb`` runs then), and raise
    ``ConfigurationError`` with ``last_refusal(since)`` if there is one. Does not block.
    ``client``: an admin client, a producer, or a consumer with nothing assigned (a
    consumer's poll would take a message)."""
    client.poll(0)
    refusal = last_refusal(since)
    if refusal is not None:
        raise ConfigurationError(refusal)


def await_answer(client: Any, future: concurrent.futures.Future[T]) -> T:
    """``future.result()`` of a request of ``client`` (an admin client's futures), polling the
    client meanwhile: once a refused login or TLS handshake is reported and the answer has not
    come ``REFUSAL_GRACE_S`` later (a reconnect may still get through), raises
    ``ConfigurationError`` saying why, instead of waiting out the request's timeout for an
    error that says only "timed out" or "transport failure". Otherwise blocks until the future
    is done (the request's own timeout bounds that); its exception propagates as is."""
    since, refused_at = time.monotonic(), None
    while True:
        try:
            return future.result(timeout=0.2)
        except concurrent.futures.TimeoutError:
            client.poll(0)
            refusal = last_refusal(since)
            if refusal is None:
                continue
            refused_at = refused_at or time.monotonic()
            if time.monotonic() - refused_at >= REFUSAL_GRACE_S:
                raise ConfigurationError(refusal) from None


def list_topics(client: Any, what: str, timeout: float = 30.0) -> Any:
    """``client.list_topics()``: the cluster's metadata. That call blocks without serving the
    client's callbacks, so it is asked in growing slices of time (1, 2, 4, 8 s), polling in
    between: a refused login or TLS handshake is a ConfigurationError within seconds instead
    of a "transport failure" after ``timeout``. A cluster that does not answer within
    ``timeout`` is a RetryableError saying ``what`` was being done."""
    started = time.monotonic()
    deadline, wait = started + timeout, 1.0
    while True:
        try:
            return client.list_topics(timeout=max(min(wait, deadline - time.monotonic()), 0.1))
        except KafkaException as exc:
            error = exc.args[0]
            check_refused(client, started)
            if time.monotonic() >= deadline or error.code() not in (KafkaError._TRANSPORT,
                                                                     KafkaError._TIMED_OUT):
                raise RetryableError(
                    f"{what}: the Kafka cluster answered {error.str()}; check that it is "
                    "reachable and try again") from exc
            wait = min(wait * 2, 8.0)


_last_refusal: str | None = None
_last_refusal_at = float("-inf")


class _RefusalReporter:
    """``error_cb`` of a secured client: reports authentication and TLS failures, then
    calls the client's own ``error_cb``. Runs in whatever thread polls the client."""

    def __init__(self, bootstrap: str, settings: Settings, chained: Callable | None):
        self._bootstrap = bootstrap
        self._settings = settings
        self._chained = chained
        self._reported: set[int] = set()

    def __call__(self, error: Any) -> None:
        global _last_refusal, _last_refusal_at
        code = error.code()
        if code in (_AUTHENTICATION, _SSL):
            message = refusal_message(self._bootstrap, self._settings, code, error.str())
            _last_refusal, _last_refusal_at = message, time.monotonic()
            if code not in self._reported:
                self._reported.add(code)
                log.error("%s", message)
        if self._chained is not None:
            self._chained(error)


def refusal_message(bootstrap: str, settings: Settings, code: int, detail: str) -> str:
    """What to tell a user whose client the cluster refused: what to check, never a secret."""
    if code == _AUTHENTICATION and settings.kafka_security_protocol.startswith("SASL_"):
        what = (f"Kafka at {bootstrap} refused to authenticate "
                f"({describe_security(settings)}): check REEF_KAFKA_SASL_USERNAME, "
                "REEF_KAFKA_SASL_PASSWORD and REEF_KAFKA_SASL_MECHANISM against the "
                "cluster's SCRAM users")
    else:
        what = (f"The TLS connection to Kafka at {bootstrap} failed "
                f"({describe_security(settings)}): check that REEF_KAFKA_SSL_CA_LOCATION holds "
                "the CA that signed the brokers' certificates and that they name the hosts "
                "in REEF_BOOTSTRAP_SERVERS")
    return f"{what}. The client said: {detail}"


def watermarks(consumer: Consumer, topic: str, partition: int,
               timeout: float = 60.0) -> tuple[int, int]:
    """The (low, high) offsets of ``topic[partition]``, asked of the broker through
    ``ask_broker``. A consumer that is assigned nothing (or not that partition) never
    refreshes its metadata by itself: once a partition's leader was killed it no longer knows
    the partition (``_UNKNOWN_PARTITION``) and asking again alone fails until ``ask_broker``
    gives up (a broker fault test saw it). So the topic's metadata is refreshed before it
    asks again."""
    def ask() -> tuple[int, int]:
        try:
            return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        except KafkaException as exc:
            if exc.args and isinstance(exc.args[0], KafkaError) \
                    and exc.args[0].code() == KafkaError._UNKNOWN_PARTITION:
                try:
                    consumer.list_topics(topic, timeout=10)
                except KafkaException:
                    pass  # ask_broker asks again, and names the failure if it lasts
            raise

    return ask_broker(f"reading the offsets of {topic}[{partition}]", ask, timeout)


def ask_broker(what: str, call: Callable[[], T], timeout: float = 60.0) -> T:
    """``call()``, asked again while the broker answers with a retriable error (a partition
    whose leader is being elected, a coordinator that is loading). Blocks up to ``timeout``
    seconds; then, or for any other error, raises ``RetryableError`` saying ``what`` failed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            # _DESTROY_BROKER: the client dropped its handle of a broker that left the
            # cluster's metadata (killed, restarting) while the request waited on it.
            # _UNKNOWN_PARTITION: the client's metadata lost a partition whose leader is that
            # broker (callers check at start that their partitions exist; a fault test saw it).
            transient = error is not None and (error.retriable() or error.code() in (
                KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._DESTROY_BROKER,
                KafkaError._ALL_BROKERS_DOWN, KafkaError._UNKNOWN_PARTITION,
                KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                KafkaError.COORDINATOR_NOT_AVAILABLE))
            if not transient or time.monotonic() > deadline:
                raise RetryableError(f"{what} failed: {exc}; check that the cluster is "
                                     "reachable, then try again") from exc
            time.sleep(0.2)
