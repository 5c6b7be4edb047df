"""Create declared topics and verify that existing ones match their declaration.

A topic that exists with other settings (partition count, replication,
cleanup policy, retention, size limit) is never silently used: the keying of
records and the durability guarantees depend on them. ``ensure_topics``
raises one ``TopicMismatchError`` listing every difference instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from reef_stream.core.errors import RetryableError, TopicMismatchError
from reef_stream.topics import declarations
from reef_stream.topics.connect import list_topics
from reef_stream.topics.declarations import Topic

log = logging.getLogger(__name__)

TIMEOUT_S = 30.0
#: How long ``ensure_topics`` goes on creating a topic while the cluster cannot yet (its
#: controller is being elected, or too few brokers are up for the replication factor).
CREATE_DEADLINE_S = 120.0
#: Creation errors that a moment may cure.
_CREATE_RETRIABLE = {
    KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError.NOT_CONTROLLER,
    KafkaError._TRANSPORT, KafkaError.INVALID_REPLICATION_FACTOR,
    # The connection to the broker was torn down mid-request (seen on a three-node cluster
    # still electing its controller): like _TRANSPORT, the request may or may not have landed.
    KafkaError._DESTROY_BROKER,
}


@dataclass
class EnsureReport:
    created: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)


def replication_for(topic: Topic, brokers: int) -> int:
    """The replication factor a topic gets on a cluster of ``brokers`` brokers
    (``cluster_size``)."""
    return topic.replication if topic.replication is not None else min(3, brokers)


def cluster_size(admin: AdminClient, metadata) -> int:
    """How many brokers the cluster is meant to have, for ``replication_for``: those alive, or
    its ``default.replication.factor`` if that is more (a broker that is down, killed or
    restarting, must not make a new topic less replicated than its peers). The live count
    alone where the broker config cannot be read (not authorised, say)."""
    alive = len(metadata.brokers)
    if not metadata.brokers:
        return alive
    broker = ConfigResource(ResourceType.BROKER, str(next(iter(metadata.brokers))))
    try:
        (future,) = admin.describe_configs([broker], request_timeout=TIMEOUT_S).values()
        default = int(future.result()["default.replication.factor"].value)
    except (KafkaException, KeyError, ValueError, TypeError):
        return alive
    return max(alive, default)


def ensure_topics(admin: AdminClient, topics: list[Topic]) -> EnsureReport:
    """Create the missing topics and verify the existing ones. Idempotent.

    Raises TopicMismatchError listing every difference between an existing
    topic and its declaration; nothing is changed on the cluster in that case
    except the creation of topics that did not exist.
    """
    metadata = _metadata(admin)
    brokers = cluster_size(admin, metadata)
    missing = [t for t in topics if t.name not in metadata.topics]
    report = EnsureReport()
    appeared = []   # created meanwhile by another process, or by a request of ours that failed
    deadline = time.monotonic() + CREATE_DEADLINE_S
    while missing:
        futures = admin.create_topics([
            NewTopic(t.name, num_partitions=t.partitions,
                     replication_factor=replication_for(t, brokers), config=dict(t.config))
            for t in missing
        ], operation_timeout=TIMEOUT_S, request_timeout=TIMEOUT_S)
        retry = []
        for topic in missing:
            try:
                futures[topic.name].result()
                report.created.append(topic.name)
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # another process was quicker
                    appeared.append(topic.name)
                    continue
                if error.code() not in _CREATE_RETRIABLE or time.monotonic() > deadline:
                    raise RetryableError(f"Could not create topic {topic.name}: {exc}") from exc
                log.warning("topic %s not created yet (%s); trying again", topic.name, error.str())
                retry.append(topic)
        missing = retry
        if missing:
            time.sleep(1.0)
    if report.created or appeared:
        metadata = _wait_for_metadata(admin, report.created + appeared)
    problems = verify_topics(admin, topics, metadata)
    if problems:
        raise TopicMismatchError(problems)
    report.verified = [t.name for t in topics if t.name not in report.created]
    return report


def namespace_topics(admin: AdminClient, ns: str, recipes: tuple[str, ...] = ()) -> list[Topic]:
    """``declarations.declare_topics`` with the namespace's own partition count: that of its
    generations topic where it exists (chosen when the namespace was created,
    ``reef topics create --partitions``), ``DATA_PARTITIONS`` where it does not yet."""
    found = _metadata(admin).topics.get(declarations.generations(ns))
    partitions = len(found.partitions) if found is not None and found.partitions else None
    return declarations.declare_topics(ns, recipes, partitions or declarations.DATA_PARTITIONS)


def verify_topics(admin: AdminClient, topics: list[Topic], metadata=None) -> list[str]:
    """Every difference between the cluster and the declarations, as sentences."""
    metadata = metadata or _metadata(admin)
    brokers = cluster_size(admin, metadata)
    problems = []
    present = [t for t in topics if t.name in metadata.topics]
    problems += [f"topic {t.name} does not exist (run `reef topics create`)"
                 for t in topics if t.name not in metadata.topics]
    for topic in present:
        partitions = metadata.topics[topic.name].partitions
        if len(partitions) != topic.partitions:
            problems.append(f"topic {topic.name} has {len(partitions)} partitions, "
                            f"declared {topic.partitions}")
        replicas = {len(p.replicas) for p in partitions.values()}
        expected = replication_for(topic, brokers)
        if replicas != {expected}:
            found = "/".join(str(r) for r in sorted(replicas))
            problems.append(f"topic {topic.name} has replication factor {found}, declared {expected}")
    if not present:
        return problems
    configs = _describe_configs(admin, [t.name for t in present])
    for topic in present:
        actual = configs[topic.name]
        for key, value in topic.config.items():
            found = actual[key].value if key in actual else None
            if found != value:
                problems.append(f"topic {topic.name} has {key}={found}, declared {value}")
    return problems


def _describe_configs(admin: AdminClient, names: list[str]) -> dict:
    """Topic name -> its config entries.

    A broker that has not yet caught up with a topic's creation answers
    UNKNOWN_TOPIC_OR_PART for a moment; that is retried until TIMEOUT_S.
    """
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name) for name in names],
                                         request_timeout=TIMEOUT_S)
        try:
            return {resource.name: future.result() for resource, future in futures.items()}
        except KafkaException as exc:
            unknown = exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            if not unknown or time.monotonic() > deadline:
                raise RetryableError(f"Could not read the configs of {', '.join(names)}: {exc}") from exc
            time.sleep(0.2)


def _wait_for_metadata(admin: AdminClient, names: list[str]):
    """Metadata once every named topic is visible with a leader for each partition.

    A topic whose creation was acknowledged by the controller can take a
    moment to appear in the metadata of the broker that answers.
    """
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        metadata = _metadata(admin)
        ready = all(
            name in metadata.topics and metadata.topics[name].partitions
            and all(p.leader >= 0 for p in metadata.topics[name].partitions.values())
            for name in names
        )
        if ready or time.monotonic() > deadline:
            return metadata
        time.sleep(0.1)


def _metadata(admin: AdminClient):
    return list_topics(admin, "reading the cluster's topics", TIMEOUT_S)
