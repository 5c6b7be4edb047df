"""The fleet projections in Redis: which replica serves which version, and what routers should use.

Redis holds projections only; every key below can be rebuilt from Kafka
(``Fleet.rebuild``, ``reef fleet --rebuild``). Keys, under ``reef:<ns>:``:

| key | type | written by | what |
| --- | --- | --- | --- |
| ``models`` | set | evaluator, replicas | every model with a decision or a replica |
| ``published:<model>`` | hash | evaluator | the newest PROMOTED publication: version, checkpoint_id, uri, sha256, evaluator, evaluated, decided_at |
| ``staged:<model>`` | hash | evaluator (a person's decisions included) | the version waiting for a decision (a CANARY): version, share, awaiting (canary or approval), reason, evaluator, decided_at |
| ``serving:<model>`` | string, expires | replicas | the current serving version: the newest version a live replica serves (for routers) |
| ``replicas:<model>`` | sorted set | replicas | replica ids scored by last heartbeat (ms); entries older than the TTL are pruned |
| ``replica:<id>`` | hash, expires | replicas | model, version ('' before the first load), host, state (serving, canary, waiting), last_seen (ms) |

Expiry: a replica's hash and the serving version live ``ttl_s`` seconds
after the last heartbeat that refreshed them, so a replica that died
disappears by itself, and when the last replica of the newest version goes,
``serving:<model>`` expires and the next heartbeat sets the version that is
still served. A replica that stops cleanly removes itself (``leave``).

Sources in Kafka, for the rebuild: ``<ns>.publications`` for the published
versions; ``<ns>.metrics`` for the replicas, whose heartbeats are also
written there as ``Metric`` events (stage ``follower``, name
``policy_version``, value = the version, labels replica, model, host, state),
of which the last ``ttl_s`` seconds are read back.

Every write is one Lua script or transaction, so a reader never sees half a
heartbeat or half a rebuild. Replica clocks stamp ``last_seen``; expiry is
Redis's own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import redis

from reef_stream.core.errors import ConfigurationError, InvalidRecord, RetryableError
from reef_stream.core.events import Decision, Metric, Publication, now_ms
from reef_stream.core.metric_names import FOLLOWER_POLICY_VERSION, STAGE_FOLLOWER
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import Settings, load_settings
from reef_stream.publishing.publications import READ_TIMEOUT_S, PublicationLedger
from reef_stream.topics import declarations
from reef_stream.topics.connect import ask_broker, new_consumer, redis_url, watermarks
from reef_stream.topics.kafka import KafkaError, TopicPartition

__all__ = ["DEFAULT_HEARTBEAT_S", "DEFAULT_TTL_S", "Fleet", "FleetSnapshot", "ModelStatus",
           "PublishedVersion", "RebuildReport", "ReplicaStatus", "StagedVersion"]

log = logging.getLogger(__name__)

#: How often a replica heartbeats unless told.
DEFAULT_HEARTBEAT_S = 5.0
#: How long a heartbeat keeps a replica (and its serving version) in the projection.
DEFAULT_TTL_S = 20.0

# KEYS: published hash, models set. ARGV: model, version, then field/value pairs.
# Sets the published version unless a newer one is there already.
_PUBLISH = """
redis.call('SADD', KEYS[2], ARGV[1])
local current = redis.call('HGET', KEYS[1], 'version')
if current and tonumber(current) > tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
return 1
"""

# KEYS: replica hash, replicas zset, serving key, models set.
# ARGV: last_seen ms, replica id, model, version ('' = none), keep ms (how long from now the keys
# live), prune-before ms (older replica entries are dropped), then the replica hash's field/value
# pairs. The serving version is raised, or its expiry extended when equal. Only relative expiry
# (PEXPIRE, PTTL), so the Redis clock need not agree with the replicas'.
_HEARTBEAT = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[6])
redis.call('SADD', KEYS[4], ARGV[3])
if ARGV[4] ~= '' then
  local current = redis.call('GET', KEYS[3])
  if (not current) or tonumber(ARGV[4]) > tonumber(current) then
    redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
  elseif tonumber(ARGV[4]) == tonumber(current) then
    if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[5]) then redis.call('PEXPIRE', KEYS[3], ARGV[5]) end
  end
end
return 1
"""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as its heartbeat describes it. ``version`` is None before its first load;
    ``state`` is ``serving``, ``waiting`` (nothing loaded yet) or ``stopped``."""

    replica_id: str
    model: str
    version: int | None
    host: str
    last_seen: int
    state: str = "serving"

    def age_s(self, now: int | None = None) -> float:
        """Seconds since its last heartbeat."""
        return max(0.0, ((now if now is not None else now_ms()) - self.last_seen) / 1000)


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    """A model's newest PROMOTED publication, as the projection keeps it."""

    model: str
    version: int
    checkpoint_id: str
    uri: str
    sha256: str
    evaluator: str
    evaluated: bool
    decided_at: int

    @classmethod
    def of(cls, publication: Publication) -> PublishedVersion:
        return cls(model=publication.model, version=publication.policy_version,
                   checkpoint_id=publication.checkpoint_id, uri=publication.uri,
                   sha256=publication.sha256, evaluator=publication.evaluator,
                   evaluated=publication.evaluated, decided_at=publication.created_at)

    def fields(self) -> dict[str, str]:
        return {"version": str(self.version), "checkpoint_id": self.checkpoint_id,
                "uri": self.uri, "sha256": self.sha256, "evaluator": self.evaluator,
                "evaluated": "1" if self.evaluated else "0", "decided_at": str(self.decided_at)}

    @classmethod
    def from_fields(cls, model: str, fields: Mapping[str, str]) -> PublishedVersion:
        return cls(model=model, version=int(fields["version"]),
                   checkpoint_id=fields.get("checkpoint_id", ""), uri=fields.get("uri", ""),
                   sha256=fields.get("sha256", ""), evaluator=fields.get("evaluator", ""),
                   evaluated=fields.get("evaluated") == "1",
                   decided_at=int(fields.get("decided_at") or 0))


@dataclass(frozen=True, slots=True)
class StagedVersion:
    """A model's version waiting for a decision (its open CANARY publication): on ``share`` of
    the replicas, awaiting ``canary`` (live feedback) or ``approval`` (a person)."""

    model: str
    version: int
    share: float
    awaiting: str
    reason: str
    evaluator: str
    decided_at: int

    @classmethod
    def of(cls, publication: Publication) -> StagedVersion:
        return cls(model=publication.model, version=publication.policy_version,
                   share=publication.share or 0.0, awaiting=publication.awaiting or "",
                   reason=publication.reason, evaluator=publication.evaluator,
                   decided_at=publication.created_at)

    def fields(self) -> dict[str, str]:
        return {"version": str(self.version), "share": repr(self.share),
                "awaiting": self.awaiting, "reason": self.reason, "evaluator": self.evaluator,
                "decided_at": str(self.decided_at)}

    @classmethod
    def from_fields(cls, model: str, fields: Mapping[str, str]) -> StagedVersion:
        return cls(model=model, version=int(fields["version"]),
                   share=float(fields.get("share") or 0), awaiting=fields.get("awaiting", ""),
                   reason=fields.get("reason", ""), evaluator=fields.get("evaluator", ""),
                   decided_at=int(fields.get("decided_at") or 0))


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model: its published version, the serving version routers use, its live replicas,
    and the version waiting for a decision (None when none waits)."""

    model: str
    published: PublishedVersion | None
    serving: int | None
    replicas: tuple[ReplicaStatus, ...] = ()
    staged: StagedVersion | None = None


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The whole projection of a namespace at ``taken_at`` (ms), models sorted by name."""

    namespace: str
    models: tuple[ModelStatus, ...]
    taken_at: int

    def model(self, name: str) -> ModelStatus | None:
        return next((m for m in self.models if m.model == name), None)

    def replica(self, replica_id: str) -> ReplicaStatus | None:
        return next((r for m in self.models for r in m.replicas if r.replica_id == replica_id),
                    None)


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What ``rebuild`` read and wrote."""

    publications: int
    heartbeats: int
    models: int
    replicas: int
    deleted_keys: int
    elapsed_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)


class Fleet:
    """The fleet projection of one namespace in one Redis; see the module docstring.

    Every method blocks for one or a few Redis round trips (``socket_timeout`` on the
    client bounds them) and raises ``redis.RedisError`` when Redis is unreachable: callers
    that serve traffic catch it, since Redis only holds projections.
    """

    def __init__(self, client: redis.Redis, namespace: str, *, ttl_s: float = DEFAULT_TTL_S):
        if not ttl_s > 0:
            raise ConfigurationError(f"the fleet TTL must be more than 0 seconds, not {ttl_s}")
        self.client = client
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.prefix = f"reef:{namespace}:"
        self._publish = client.register_script(_PUBLISH)
        self._heartbeat = client.register_script(_HEARTBEAT)

    @classmethod
    def from_settings(cls, settings: Settings | None = None, *, namespace: str | None = None,
                      ttl_s: float = DEFAULT_TTL_S) -> Fleet:
        """The fleet in the Redis that REEF_REDIS_URL (or the local ``reef redis up``) names.
        Raises ``ConfigurationError`` when there is none. Does not connect yet."""
        settings = settings or load_settings()
        client = redis.Redis.from_url(redis_url(settings), socket_timeout=5,
                                      socket_connect_timeout=5, decode_responses=True)
        return cls(client, namespace or settings.namespace, ttl_s=ttl_s)

    # ----------------------------------------------------------------- keys

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # ----------------------------------------------------------------- writing

    def heartbeat(self, status: ReplicaStatus, *, client: object | None = None) -> None:
        """Record ``status``: the replica's hash and the serving version (both expiring
        ``ttl_s`` after ``status.last_seen``) and its entry in the model's replicas. One atomic
        script; idempotent; a status already older than the TTL writes nothing. Call it every
        heartbeat interval and right after each load. ``client``: a pipeline to queue it on."""
        ttl_ms = int(self.ttl_s * 1000)
        now = now_ms()
        keep_ms = status.last_seen + ttl_ms - now
        if keep_ms <= 0:
            return
        fields = {"model": status.model, "host": status.host, "state": status.state,
                  "version": "" if status.version is None else str(status.version),
                  "last_seen": str(status.last_seen)}
        self._heartbeat(
            keys=[self._key("replica", status.replica_id), self._key("replicas", status.model),
                  self._key("serving", status.model), self._key("models")],
            args=[status.last_seen, status.replica_id, status.model, fields["version"], keep_ms,
                  now - ttl_ms, *_pairs(fields)],
            client=client)

    def leave(self, replica_id: str, model: str) -> None:
        """Remove a replica that stopped cleanly. Idempotent. The serving version it kept
        alive expires by itself unless another replica serves it."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("replica", replica_id))
            pipe.zrem(self._key("replicas", model), replica_id)
            pipe.execute()

    def record_publication(self, publication: Publication,
                           incumbent: Publication | None = None) -> bool:
        """Fold one publication in: a PROMOTED one becomes the model's published version
        unless a newer one is there; a CANARY one the staged version; a decision on the staged
        version ends it; the rollback of a promoted version (ROLLED_BACK without a share)
        publishes ``incumbent`` (what the ledger serves after it; None: the rolled-back-to
        version from the event). Any decision adds the model. Idempotent; True if the
        published version changed."""
        model, decision = publication.model, publication.decision
        staged = self._key("staged", model)
        if decision is Decision.CANARY:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.sadd(self._key("models"), model)
                pipe.delete(staged)
                pipe.hset(staged, mapping=StagedVersion.of(publication).fields())
                pipe.execute()
            return False
        current = self.client.hget(staged, "version")
        if current is not None and (int(current) == publication.policy_version or (
                decision is Decision.PROMOTED and int(current) < publication.policy_version)):
            self.client.delete(staged)
        if decision is Decision.ROLLED_BACK and publication.share is None:
            target = incumbent or dataclasses.replace(
                publication, policy_version=publication.rolled_back_to,
                decision=Decision.PROMOTED)
            with self.client.pipeline(transaction=True) as pipe:
                pipe.sadd(self._key("models"), model)
                pipe.delete(self._key("published", model))
                pipe.hset(self._key("published", model),
                          mapping=PublishedVersion.of(target).fields())
                pipe.execute()
            return True
        if decision is not Decision.PROMOTED:
            self.client.sadd(self._key("models"), model)
            return False
        published = PublishedVersion.of(publication)
        return bool(self._publish(keys=[self._key("published", model), self._key("models")],
                                  args=[model, published.version, *_pairs(published.fields())]))

    def staged(self, model: str) -> StagedVersion | None:
        """The version of ``model`` waiting for a decision, or None."""
        fields = self.client.hgetall(self._key("staged", model))
        return StagedVersion.from_fields(model, fields) if fields.get("version") else None

    def clear(self) -> int:
        """Delete every key of this namespace's projection; returns how many. Idempotent."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=500))
        if keys:
            self.client.delete(*keys)
        return len(keys)

    # ----------------------------------------------------------------- reading

    def serving_version(self, model: str) -> int | None:
        """The version routers should send ``model``'s traffic to: the newest one a live replica
        serves; None when no replica serves any."""
        value = self.client.get(self._key("serving", model))
        return int(value) if value else None

    def published(self, model: str) -> PublishedVersion | None:
        fields = self.client.hgetall(self._key("published", model))
        return PublishedVersion.from_fields(model, fields) if fields.get("version") else None

    def replicas(self, model: str, *, now: int | None = None) -> list[ReplicaStatus]:
        """The live replicas of ``model`` (heartbeat within the TTL), by replica id."""
        now = now if now is not None else now_ms()
        ids = self.client.zrangebyscore(self._key("replicas", model),
                                        now - int(self.ttl_s * 1000), "+inf")
        if not ids:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.hgetall(self._key("replica", replica_id))
            found = pipe.execute()
        replicas = []
        for replica_id, fields in zip(ids, found):
            if not fields or fields.get("model") != model:  # expired, or moved to another model
                continue
            replicas.append(ReplicaStatus(
                replica_id=replica_id, model=model,
                version=int(fields["version"]) if fields.get("version") else None,
                host=fields.get("host", ""), last_seen=int(fields.get("last_seen") or 0),
                state=fields.get("state", "")))
        return sorted(replicas, key=lambda r: r.replica_id)

    def snapshot(self, model: str | None = None) -> FleetSnapshot:
        """Every model (or only ``model``) with its published, serving and replica versions."""
        now = now_ms()
        names = sorted(self.client.smembers(self._key("models")))
        if model is not None:
            names = [name for name in names if name == model]
        models = tuple(ModelStatus(model=name, published=self.published(name),
                                   serving=self.serving_version(name),
                                   replicas=tuple(self.replicas(name, now=now)),
                                   staged=self.staged(name))
                       for name in names)
        return FleetSnapshot(namespace=self.namespace, models=models, taken_at=now)

    # ----------------------------------------------------------------- rebuilding

    def rebuild(self, bootstrap: str, *, timeout: float = READ_TIMEOUT_S) -> RebuildReport:
        """Replace this namespace's projection with one rebuilt from Kafka.

        Reads ``<ns>.publications`` to its end (the published version of every model) and the
        last ``ttl_s`` seconds of ``<ns>.metrics`` (replica heartbeats; each replica's newest
        one counts, and one saying ``stopped`` removes it), then deletes every key of the
        namespace and writes the rebuilt ones in one transaction. Blocks for the reads (up to
        ``timeout`` seconds each; ``RetryableError`` beyond). Idempotent. A heartbeat that
        lands during the rebuild is overwritten by the rebuilt state until the replica's next
        one.
        """
        started = time.monotonic()
        with PublicationLedger(bootstrap, self.namespace) as ledger:
            ledger.catch_up(timeout)
            published = {m: ledger.incumbent(m) for m in ledger.models()}
            staged = {m: ledger.waiting(m) for m in ledger.models()}
            read = ledger.read
        since = now_ms() - int(self.ttl_s * 1000)
        heartbeats, latest = _read_heartbeats(bootstrap, self.namespace, since, timeout)
        ttl_ms = int(self.ttl_s * 1000)
        live = [r for r in latest.values()
                if r.state != "stopped" and r.last_seen + ttl_ms > now_ms() + 100]
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=500))
        with self.client.pipeline(transaction=True) as pipe:
            if keys:
                pipe.delete(*keys)
            for name, publication in published.items():
                pipe.sadd(self._key("models"), name)
                if publication is not None:
                    pipe.hset(self._key("published", name),
                              mapping=PublishedVersion.of(publication).fields())
                if staged[name] is not None:
                    pipe.hset(self._key("staged", name),
                              mapping=StagedVersion.of(staged[name]).fields())
            for replica in sorted(live, key=lambda r: r.last_seen):
                self.heartbeat(replica, client=pipe)
            pipe.execute()
        models = set(published) | {r.model for r in live}
        return RebuildReport(publications=read, heartbeats=heartbeats, models=len(models),
                             replicas=len(live), deleted_keys=len(keys),
                             elapsed_s=time.monotonic() - started)


def heartbeat_metric_labels(status: ReplicaStatus) -> dict[str, str]:
    """The labels of the heartbeat ``Metric`` a replica writes to ``<ns>.metrics``."""
    return {"replica": status.replica_id, "model": status.model, "host": status.host,
            "state": status.state}


def _status_of(metric: Metric) -> ReplicaStatus | None:
    """The replica status a heartbeat metric describes, or None if it is not one."""
    if metric.stage != STAGE_FOLLOWER or metric.name != FOLLOWER_POLICY_VERSION:
        return None
    labels = metric.labels
    if not labels.get("replica") or not labels.get("model"):
        return None
    version = int(metric.value) if metric.value >= 0 else None
    return ReplicaStatus(replica_id=labels["replica"], model=labels["model"], version=version,
                         host=labels.get("host", ""), last_seen=metric.created_at,
                         state=labels.get("state", "serving"))


def _read_heartbeats(bootstrap: str, namespace: str, since_ms: int,
                     timeout: float) -> tuple[int, dict[str, ReplicaStatus]]:
    """Heartbeat metrics written at or after ``since_ms``: (how many, the newest per replica)."""
    topic = declarations.metrics(namespace)
    registry = SchemaRegistry.default()
    consumer = new_consumer(bootstrap, f"reef-fleet-rebuild-{now_ms()}", {
        "enable.auto.offset.store": False, "enable.partition.eof": True})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None:
            raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
        partitions = sorted(metadata.partitions)
        starts = ask_broker(f"finding the heartbeats of the last seconds in {topic}",
                            lambda: consumer.offsets_for_times(
                                [TopicPartition(topic, p, since_ms) for p in partitions],
                                timeout=10), timeout)
        ends = {p: watermarks(consumer, topic, p, timeout)[1] for p in partitions}
        pending = {tp.partition: ends[tp.partition] for tp in starts
                   if 0 <= tp.offset < ends[tp.partition]}
        latest: dict[str, ReplicaStatus] = {}
        count = 0
        if not pending:
            return 0, latest
        consumer.assign([tp for tp in starts if tp.partition in pending])
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise RetryableError(f"could not read {topic} to its end within {timeout:.0f} s; "
                                     "check that the cluster is reachable, then try again")
            for message in consumer.consume(1000, timeout=0.2):
                p = message.partition()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.pop(p, None)
                    continue
                if message.offset() + 1 >= pending.get(p, 0):
                    pending.pop(p, None)
                try:
                    metric = registry.decode(message.value(), message.headers(), Metric)
                except InvalidRecord:
                    continue
                status = _status_of(metric)
                if status is None or status.last_seen < since_ms:
                    continue
                count += 1
                known = latest.get(status.replica_id)
                if known is None or status.last_seen >= known.last_seen:
                    latest[status.replica_id] = status
        return count, latest
    finally:
        consumer.close()


def _pairs(fields: Mapping[str, str]) -> Iterable[str]:
    for name, value in fields.items():
        yield name
        yield value
