"""What ``reef top`` shows: the pipeline of one namespace, read from its topics.

    view = TopView(bootstrap, namespace)
    view.refresh()            # reads what is new; call again for rates
    console.print(view.render())
    view.close()

Sources, all Kafka (nothing else needs to run):

- records per topic (the sum of its partitions' high watermarks) and, between two refreshes,
  records per second: generations, feedback, units (every recipe's), checkpoints,
  publications, dead letters;
- every consumer group that committed offsets on the namespace's topics, with its state and
  total lag (``reef_stream.topics.cursors.lag``);
- versions per model: trained (the newest ``Checkpoint``), published (the newest ``PROMOTED``
  ``Publication``), rejected candidates, the trainer's rollbacks after rejections (``Checkpoint``
  events with ``rolled_back_to``: how many, and the newest as ``vR = vI``, version R holding
  the weights of version I again), and what each replica reported serving (its latest
  follower heartbeat ``Metric``);
- dead letters by stage, and the trainer's latest step staleness (``staleness_mean``).
- per reward worker: its saturation (call slots busy past the observed p99), call latency
  (p50, p99), slow lane, and its sandbox pool (``reef reward --sandbox process``: live / size,
  restarts, failures by category, whether the calls' network is isolated).

``refresh`` follows ``<ns>.checkpoints``, ``<ns>.publications``, ``<ns>.metrics`` and
``<ns>.dead-letters`` from their beginning with one consumer of its own (it commits nothing),
then keeps reading only what is new. Blocks for the reads (seconds on a long log the first
time). Not thread-safe.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from reef_stream.consumers.evaluator.superseding import SUPERSEDED
from reef_stream.core.events import Checkpoint, DeadLetter, Decision, Metric, Publication
from reef_stream.core.metric_names import (
    FOLLOWER_POLICY_VERSION, REWARD_ABANDONED, REWARD_CALL_P50, REWARD_CALL_P99,
    REWARD_CIRCUIT_OPEN, REWARD_HELD, REWARD_SATURATED_SLOTS,
    REWARD_SATURATION, REWARD_SLOW_LANE, SANDBOX_FAILURES, SANDBOX_LIVE, SANDBOX_NETWORK_ISOLATED,
    SANDBOX_POOL_SIZE, SANDBOX_RESTARTS, STAGE_FOLLOWER, STAGE_REWARD, STAGE_TRAINER,
    TRAINER_STALENESS_MEAN,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer, watermarks
from reef_stream.topics.cursors import lag
from reef_stream.topics.kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

__all__ = ["TopView"]

#: The reward workers' metrics ``reef top`` shows (their latest value per worker).
REWARD_SHOWN = frozenset({REWARD_SATURATED_SLOTS, REWARD_SATURATION, REWARD_CALL_P50,
                          REWARD_CALL_P99, REWARD_SLOW_LANE, REWARD_CIRCUIT_OPEN, REWARD_HELD,
                          REWARD_ABANDONED, SANDBOX_POOL_SIZE, SANDBOX_LIVE,
                          SANDBOX_RESTARTS, SANDBOX_NETWORK_ISOLATED})


@dataclass
class _Model:
    trained: int | None = None
    published: int | None = None
    rejected: int = 0
    superseded: int = 0  # of the rejected: unmeasured, a newer candidate was waiting
    rollbacks: dict[int, int] = field(default_factory=dict)  # version -> the version it holds
    staged: Publication | None = None  # the version waiting for a decision (a CANARY)


@dataclass
class _State:
    models: dict[str, _Model] = field(default_factory=dict)
    replicas: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (model, version)
    dead_letters: Counter = field(default_factory=Counter)               # stage -> count
    staleness: float | None = None
    #: Per reward worker (its ``instance`` label): its latest call-slot and sandbox metrics
    #: (``REWARD_SHOWN``), and its sandbox failures by category.
    rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    sandbox_failures: dict[str, dict[str, float]] = field(default_factory=dict)

    def model(self, name: str) -> _Model:
        return self.models.setdefault(name, _Model())


class TopView:
    """The namespace's pipeline at the last ``refresh`` (see the module docstring)."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        self.bootstrap, self.namespace = bootstrap, namespace
        self.state = _State()
        self.records: dict[str, int] = {}
        self.rates: dict[str, float] = {}
        self.groups: list[tuple[str, str, int]] = []  # (group, state, total lag)
        self._registry = SchemaRegistry.default()
        self._last: tuple[float, dict[str, int]] | None = None
        self._consumer = new_consumer(bootstrap, f"{namespace}.top",
                                      {"enable.partition.eof": True})
        # The topics' sizes are asked through a consumer of their own, which fetches nothing:
        # asked through the one above, each answer waited behind its fetch, which the broker
        # holds up to fetch.wait.max.ms (0.5 s) at the end of the log.
        self._sizes = new_consumer(bootstrap, f"{namespace}.top")
        self._followed = [declarations.checkpoints(namespace), declarations.publications(namespace),
                          declarations.metrics(namespace), declarations.dead_letters(namespace)]
        self._assigned = False

    def close(self) -> None:
        self._consumer.close()
        self._sizes.close()

    # ----------------------------------------------------------------- reading

    def refresh(self) -> None:
        """Read what is new on the followed topics, the topics' sizes and the groups' lag."""
        topics = self._consumer.list_topics(timeout=10).topics
        mine = sorted(t for t in topics if t.startswith(f"{self.namespace}."))
        if not self._assigned:
            self._consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING)
                                   for t in self._followed if t in topics
                                   for p in topics[t].partitions])
            self._assigned = True
        self._read_new()
        now = time.monotonic()
        self.records = {t.removeprefix(f"{self.namespace}."): self._size(t, topics[t])
                        for t in mine}
        if self._last is not None:
            then, before = self._last
            span = max(now - then, 1e-6)
            self.rates = {t: (n - before.get(t, 0)) / span for t, n in self.records.items()}
        self._last = (now, dict(self.records))
        self.groups = sorted(
            (g.group, g.state, g.total) for g in lag(self.bootstrap)
            if any(p.topic.startswith(f"{self.namespace}.") for p in g.partitions))

    def _size(self, topic: str, metadata) -> int:
        total = 0
        for p in metadata.partitions:
            _, high = watermarks(self._sizes, topic, p, timeout=10)  # assigned nothing
            total += max(high, 0)
        return total

    def _read_new(self) -> None:
        """Consume until every followed partition is at its end."""
        waiting = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        deadline = time.monotonic() + 60
        while waiting and time.monotonic() < deadline:
            for message in self._consumer.consume(5000, timeout=0.1):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        waiting.discard((message.topic(), message.partition()))
                    continue
                self._take(message)

    def _take(self, message) -> None:
        try:
            event = self._registry.decode(message.value(), message.headers())
        except Exception:  # noqa: BLE001 - an undecodable record is the dead letters' business
            return
        state = self.state
        if isinstance(event, Checkpoint):
            model = state.model(event.model)
            model.trained = max(model.trained or 0, event.policy_version)
            if event.rolled_back_to is not None:  # keyed by version: a re-sent event counts once
                model.rollbacks[event.policy_version] = event.rolled_back_to
        elif isinstance(event, Publication):
            model = state.model(event.model)
            if model.staged is not None and (model.staged.policy_version <= event.policy_version
                                             if event.decision is Decision.PROMOTED else
                                             model.staged.policy_version == event.policy_version):
                model.staged = None  # decided (a CANARY for it sets it again below)
            if event.decision is Decision.CANARY:
                model.staged = event
            elif event.decision is Decision.ROLLED_BACK:
                if event.share is None and event.rolled_back_to is not None:  # `reef rollback`
                    model.published = event.rolled_back_to
            elif event.decision is Decision.PROMOTED:
                model.published = max(model.published or 0, event.policy_version)
            else:
                model.rejected += 1
                model.superseded += event.reason.startswith(SUPERSEDED)
        elif isinstance(event, DeadLetter):
            state.dead_letters[event.stage] += 1
        elif isinstance(event, Metric):
            if event.stage == STAGE_FOLLOWER and event.name == FOLLOWER_POLICY_VERSION:
                replica, model = event.labels.get("replica"), event.labels.get("model", "?")
                if replica and event.value >= 0:
                    state.replicas[replica] = (model, int(event.value))
            elif event.stage == STAGE_TRAINER and event.name == TRAINER_STALENESS_MEAN:
                state.staleness = event.value
            elif event.stage == STAGE_REWARD and event.name in REWARD_SHOWN:
                instance = event.labels.get("instance", "?")
                state.rewards.setdefault(instance, {})[event.name] = event.value
            elif event.stage == STAGE_REWARD and event.name == SANDBOX_FAILURES:
                instance = event.labels.get("instance", "?")
                failures = state.sandbox_failures.setdefault(instance, {})
                failures[event.labels.get("category", "?")] = event.value

    # ----------------------------------------------------------------- showing

    def render(self) -> Group:
        """Rich tables of the last refresh: topics, consumer groups, versions, replicas, dead
        letters."""
        topics = Table(title=f"topics of {self.namespace}", title_justify="left")
        for column in ("topic", "records", "per second"):
            topics.add_column(column, justify="left" if column == "topic" else "right")
        for topic, count in self.records.items():
            rate = self.rates.get(topic)
            topics.add_row(topic, f"{count:,}", "-" if rate is None else f"{rate:,.0f}")

        groups = Table(title="consumer groups", title_justify="left")
        for column in ("group", "state", "lag"):
            groups.add_column(column, justify="right" if column == "lag" else "left")
        for group, state, total in self.groups:
            groups.add_row(group, state, f"{total:,}")

        versions = Table(title="versions", title_justify="left")
        for column in ("model", "trained", "published", "rejected", "rollbacks", "serving"):
            versions.add_column(column, justify="left" if column == "model" else "right")
        for name, model in sorted(self.state.models.items()):
            serving = sorted(v for m, v in self.state.replicas.values() if m == name)
            shown = "-" if not serving else (
                str(serving[0]) if serving[0] == serving[-1] else f"{serving[0]}-{serving[-1]}")
            newest = max(model.rollbacks, default=None)
            rollbacks = "0" if newest is None else (
                f"{len(model.rollbacks)}, v{newest} = v{model.rollbacks[newest]}")
            rejected = str(model.rejected) + (f" ({model.superseded} superseded)"
                                              if model.superseded else "")
            versions.add_row(name, _or_dash(model.trained), _or_dash(model.published),
                             rejected, rollbacks, shown)
        waiting = [f"waiting for a decision: {name} v{m.staged.policy_version} awaiting "
                   f"{m.staged.awaiting or '?'}"
                   + (f" (canary on {m.staged.share:.0%} of the replicas)" if m.staged.share
                      else "") for name, m in sorted(self.state.models.items()) if m.staged]

        replicas = Table(title="replicas", title_justify="left")
        for column in ("replica", "model", "version"):
            replicas.add_column(column, justify="right" if column == "version" else "left")
        for replica, (model, version) in sorted(self.state.replicas.items()):
            replicas.add_row(replica, model, str(version))

        letters = Table(title="dead letters", title_justify="left")
        letters.add_column("stage")
        letters.add_column("count", justify="right")
        for stage, count in sorted(self.state.dead_letters.items()):
            letters.add_row(stage, f"{count:,}")
        staleness = self.state.staleness
        footer = ("trainer staleness (last step, mean): "
                  + ("-" if staleness is None else f"{staleness:.1f} versions"))
        if not self.state.rewards:
            return Group(topics, groups, versions, *waiting, replicas, letters, footer)
        return Group(topics, groups, versions, replicas, letters, self._rewards(), footer)

    def _rewards(self) -> Table:
        """The reward workers: saturation (slots busy past the p99), call latency, the slow
        lane, the circuit (open: how many generations it holds), timed-out in-thread calls
        still running, and their sandbox pool (live / size, restarts, failures by category,
        network)."""
        table = Table(title="reward workers", title_justify="left")
        for column in ("worker", "saturated", "call p50", "call p99", "slow lane", "circuit",
                       "hung", "sandbox",
                       "restarts", "sandbox failures", "network"):
            table.add_column(column, justify="left" if column in (
                "worker", "sandbox failures", "network") else "right")
        for instance, got in sorted(self.state.rewards.items()):
            def shown(name: str, form: str = "{:.0f}") -> str:
                return "-" if name not in got else form.format(got[name])
            failures = self.state.sandbox_failures.get(instance, {})
            isolated = got.get(SANDBOX_NETWORK_ISOLATED)
            table.add_row(
                instance,
                f"{shown(REWARD_SATURATED_SLOTS)} ({shown(REWARD_SATURATION, '{:.0%}')})",
                shown(REWARD_CALL_P50, "{:.3f} s"), shown(REWARD_CALL_P99, "{:.3f} s"),
                shown(REWARD_SLOW_LANE),
                "-" if REWARD_CIRCUIT_OPEN not in got else
                f"OPEN ({shown(REWARD_HELD)} held)" if got[REWARD_CIRCUIT_OPEN] else "closed",
                shown(REWARD_ABANDONED),
                "-" if SANDBOX_POOL_SIZE not in got
                else f"{shown(SANDBOX_LIVE)}/{shown(SANDBOX_POOL_SIZE)}",
                shown(SANDBOX_RESTARTS),
                " ".join(f"{k}={v:.0f}" for k, v in sorted(failures.items()) if v) or "-",
                "-" if isolated is None else ("isolated" if isolated else "NOT isolated"))
        return table


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
