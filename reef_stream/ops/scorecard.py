"""The standard scorecard of an RL loop, read back from one namespace's topics.

    card = read_scorecard(bootstrap, "reef", "sao", target=0.9)
    print("\\n".join(card.lines()))        # a readable block, one fact per line
    print("SCORECARD", card.line())        # one line of key=value

``docs/metrics.md`` defines every figure. Where each comes from:

- ``<ns>.generations``: how many there are (the sum over partitions of high minus low
  watermark) and when the first and the last were appended (the timestamps of each
  partition's first and last record); nothing else of it is read;
- ``<ns>.publications``: the first PROMOTED publication whose measurement reaches the target;
- ``<ns>.dead-letters``: every dead letter by kind (its ``error_type``), the sheds and the
  too-stale ones among them (``SHED_KINDS``, ``TOO_STALE_KINDS``);
- ``<ns>.metrics``: the trainer's ``staleness_samples`` and ``sample_age_samples`` (the
  samples trained, their staleness in versions and their age in seconds), the follower's
  ``checkpoint_to_serving_seconds`` and every process's ``process_cpu_seconds``.

``fold`` does all the arithmetic, from events already decoded: pure, so its tests need no
broker. ``read_scorecard`` reads the topics (``reef_stream.topics.reading``) and folds them.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import Checkpoint, DeadLetter, Decision, Metric, Publication
from reef_stream.core.histograms import AGE_BOUNDS_S
from reef_stream.core.metric_names import (
    FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS, PROCESS_CPU_SECONDS, STAGE_FOLLOWER, STAGE_PROCESSOR,
    STAGE_REWARD, STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, TRAINER_SAMPLE_TO_UNIT_SAMPLES,
    TRAINER_STALENESS_SAMPLES, TRAINER_UNIT_TO_TRAIN_SAMPLES, UNKNOWN_STALENESS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations

__all__ = ["Distribution", "GenerationsSpan", "Scorecard", "counter_total", "fold",
           "read_scorecard", "is_shed", "SHED_KINDS", "TOO_STALE_KINDS", "INFRA"]

#: Dead-letter kinds (``DeadLetter.error_type``) that are a shed: the processor's
#: ``processor.shed`` (``engine.join.Outcome.SHED``: a unit completed while the trainer's
#: backlog was full). Any kind whose last dotted part is ``shed`` counts too (``is_shed``), so
#: a stage that learns to shed under its own name is counted without a change here.
SHED_KINDS = frozenset({"processor.shed"})
#: Dead-letter kinds that are "too stale": the processor's (``processor.too_stale``, a
#: generation whose behaviour version was already too far behind the trainer) and the
#: trainer's (``TooStale``, a unit too far behind when the trainer reached it).
TOO_STALE_KINDS = frozenset({"processor.too_stale", "TooStale"})
#: What ``infra_cpu_share`` counts as plumbing: the reward workers, the processor, the broker
#: (``extra_cpu["broker"]``, when the caller measured it).
INFRA = (STAGE_REWARD, STAGE_PROCESSOR, "broker")
#: Written for a figure that has no value (``line``).
NA = "na"


def is_shed(kind: str) -> bool:
    """Whether a dead letter of this kind (``error_type``) is a shed."""
    return kind in SHED_KINDS or kind.rpartition(".")[2] == "shed"


# --------------------------------------------------------------------------- distributions


@dataclass(frozen=True)
class Distribution:
    """Of ``count`` observations: the mean and two percentiles, by nearest rank (pq is the
    smallest observation x such that at least a fraction q of them are <= x; of a histogram,
    the upper bound of the bucket where the cumulative count reaches that rank). Every field
    but ``count`` is None when there is no observation."""

    count: int
    mean: float | None
    p50: float | None
    p99: float | None

    @classmethod
    def empty(cls) -> Distribution:
        return cls(0, None, None, None)


def _rank(q: float, n: int) -> int:
    """The nearest rank of quantile ``q`` among ``n`` observations, 1-based: ceil(q n)."""
    return max(1, math.ceil(q * n - 1e-9))


def _from_counts(counts: Mapping[float, float], mean_of: Mapping[float, float]) -> Distribution:
    """``counts``: value (or a bucket's upper bound) -> how many; ``mean_of``: the value each
    stands for in the mean. Percentiles: the smallest key whose cumulative count reaches the
    rank."""
    keys = sorted(k for k, c in counts.items() if c > 0)
    n = sum(counts[k] for k in keys)
    if n <= 0:
        return Distribution.empty()
    mean = sum(counts[k] * mean_of[k] for k in keys) / n

    def percentile(q: float) -> float:
        rank, seen = _rank(q, round(n)), 0.0
        for k in keys:
            seen += counts[k]
            if seen >= rank:
                return k
        return keys[-1]

    return Distribution(round(n), mean, percentile(0.5), percentile(0.99))


def observed(values: Iterable[float]) -> Distribution:
    """Of single observations (each value once)."""
    counts = Counter(float(v) for v in values)
    return _from_counts(counts, {v: v for v in counts})


def counted(counts: Mapping[float, float]) -> Distribution:
    """Of a count per exact value (the trainer's staleness in versions)."""
    return _from_counts(counts, {v: float(v) for v in counts})


def bucketed(counts: Mapping[float, float], bounds: Iterable[float] = ()) -> Distribution:
    """Of a histogram: a count per bucket, keyed by the bucket's upper bound (``math.inf`` for
    the last); counts per bucket, not cumulative (``reef_stream.core.histograms``). ``bounds``:
    every bucket's upper bound, the empty ones too (a writer leaves those out), so that each
    bucket's lower bound is known. The percentiles are bucket upper bounds; the mean takes
    each bucket's midpoint (the first bucket's lower bound is 0; the last, unbounded bucket
    counts at its lower bound, so a mean with samples there is a lower bound)."""
    edges = sorted({*bounds, *counts} - {math.inf})
    mean_of = {}
    for bound in counts:
        lower = max((e for e in edges if e < bound), default=0.0)
        mean_of[bound] = lower if math.isinf(bound) else (lower + bound) / 2
    return _from_counts(counts, mean_of)


def counter_total(values: Iterable[float]) -> float:
    """What a running-total counter counted over its whole series, in the order written: the
    sum of the last value of each run of non-decreasing values. A process that restarts under
    the same labels starts again at 0, so a value below the one before is a restart (as
    Prometheus' ``increase()`` reads it); a restart whose first value is not below the last
    one is not seen."""
    total, last = 0.0, None
    for value in values:
        if last is not None and value < last:
            total += last
        last = value
    return total + (last or 0.0)


# --------------------------------------------------------------------------- the scorecard


@dataclass(frozen=True)
class GenerationsSpan:
    """The generations topic at a glance: how many records it holds, and the timestamps (ms) of
    the first and the last (None when it is empty)."""

    count: int
    first_ms: int | None
    last_ms: int | None


@dataclass
class Scorecard:
    """The standard figures of one loop (``docs/metrics.md`` defines each)."""

    namespace: str
    recipe: str
    #: The publication measurement used for the target, e.g. "accuracy".
    measure: str
    target: float | None
    #: First generation -> last record seen (on any topic read).
    seconds: float
    #: First generation -> the first PROMOTED publication with measurement[measure] >= target.
    time_to_target_s: float | None
    #: Generations in the topic.
    generated: int
    #: Samples trained.
    trained: int
    #: Dead letters whose kind is a shed, by kind.
    shed: dict[str, int]
    #: Every dead letter by kind (``error_type``), shed included.
    dead_lettered: dict[str, int]
    #: Dead letters too stale (``TOO_STALE_KINDS``), and the samples they held (a processor's
    #: letter holds one generation, a trainer's a whole unit).
    too_stale: int
    staleness_versions: Distribution
    staleness_seconds: Distribution
    checkpoint_to_serving_s: Distribution
    #: CPU seconds by stage (metric stage names), plus ``extra_cpu`` (e.g. "replica", "broker").
    cpu_seconds: dict[str, float]
    #: The unit ledger (``trained_twice``, ``lost``, ...), when given.
    ledger: dict[str, int] | None = None
    too_stale_samples: int = 0
    #: The two parts of a trained sample's age: generation -> unit, unit -> trainer step.
    sample_to_unit_s: Distribution = field(default_factory=Distribution.empty)
    unit_to_train_s: Distribution = field(default_factory=Distribution.empty)
    #: The highest measurement[measure] of a PROMOTED publication (None: none promoted).
    best: float | None = None
    #: The trainer group the figures are of (``fold``'s ``group``; None: every group's
    #: together, when none could be told), and the other groups that trained the recipe.
    group: str | None = None
    other_groups: tuple[str, ...] = ()

    @property
    def goodput(self) -> float | None:
        """Samples trained per generation."""
        return self.trained / self.generated if self.generated else None

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_seconds.values())

    @property
    def cpu_per_generation(self) -> float | None:
        """CPU seconds of every process counted, per generation."""
        return self.cpu_total / self.generated if self.generated and self.cpu_total else None

    @property
    def infra_cpu_share(self) -> float | None:
        """The CPU of the reward workers, the processor and the broker over all CPU counted."""
        total = self.cpu_total
        return (sum(self.cpu_seconds.get(k, 0.0) for k in INFRA) / total) if total else None

    def as_dict(self) -> dict[str, Any]:
        """Every field and property, JSON-ready (an unbounded percentile is ``"+Inf"``)."""
        data = asdict(self)
        data.update(goodput=self.goodput, cpu_total=self.cpu_total,
                    cpu_per_generation=self.cpu_per_generation,
                    infra_cpu_share=self.infra_cpu_share)
        return _json_ready(data)

    def lines(self) -> list[str]:
        """A readable block: one fact per line, the unit in its label."""
        target = (f"{self.measure} >= {_num(self.target)}" if self.target is not None
                  else "no target given")
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.cpu_seconds.items())) or NA
        of_group = (f", trainer group {self.group}" if self.group is not None
                    else ", every trainer group together" if self.other_groups else "")
        others = (f" (other groups: {', '.join(self.other_groups)}; --group names one)"
                  if self.other_groups and self.group is not None else "")
        lines = [
            f"scorecard of namespace {self.namespace}, recipe {self.recipe}{of_group}{others}",
            f"  time to target ({target}), s: {_num(self.time_to_target_s)}",
            f"  best promoted {self.measure}: {_num(self.best)}",
            f"  run length (first generation -> last record), s: {_num(self.seconds)}",
            f"  generations: {self.generated}",
            f"  samples trained: {self.trained}",
            f"  goodput (trained / generated): {_num(self.goodput)}",
            f"  shed, generations: {sum(self.shed.values())}{_by_kind(self.shed)}",
            f"  dead letters: {sum(self.dead_lettered.values())}{_by_kind(self.dead_lettered)}",
            f"  too stale, dead letters: {self.too_stale} ({self.too_stale_samples} samples)",
            f"  staleness of trained samples, versions: {_dist(self.staleness_versions)}",
            f"  age of trained samples, s: {_dist(self.staleness_seconds)}",
            f"    generation -> unit, s: {_dist(self.sample_to_unit_s)}",
            f"    unit -> trainer step, s: {_dist(self.unit_to_train_s)}",
            f"  checkpoint -> serving, s: {_dist(self.checkpoint_to_serving_s)}",
            f"  CPU by stage, s: {cpu}",
            f"  CPU in all, s: {self.cpu_total:.1f}",
            f"  CPU per generation, ms: {_num(_ms(self.cpu_per_generation))}",
            f"  infra CPU share (reward + processor + broker): {_num(self.infra_cpu_share)}",
        ]
        if self.ledger is not None:
            lines.append("  unit ledger: " + ", ".join(f"{k} {v}" for k, v in self.ledger.items()))
        return lines

    def line(self) -> str:
        """One line of ``key=value`` (``na`` for a figure without a value), for a bench to
        print after its own prefix."""
        figures = {
            "time_to_target_s": self.time_to_target_s, "generated": self.generated,
            "trained": self.trained, "goodput": self.goodput,
            "staleness_mean": self.staleness_versions.mean,
            "staleness_p99": self.staleness_versions.p99,
            "staleness_s_p50": self.staleness_seconds.p50, "too_stale": self.too_stale,
            "checkpoint_to_serving_p50_s": self.checkpoint_to_serving_s.p50,
            "infra_cpu_share": self.infra_cpu_share,
            "cpu_per_generation_ms": _ms(self.cpu_per_generation),
            "too_stale_samples": self.too_stale_samples, "shed": sum(self.shed.values()),
        }
        if self.ledger is not None:
            figures.update(trained_twice=self.ledger.get("trained_twice"),
                           lost=self.ledger.get("lost"))
        return " ".join(f"{k}={_num(v)}" for k, v in figures.items())


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _num(value: float | None) -> str:
    if value is None:
        return NA
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()
                                  and abs(value) < 1e15):
        return str(int(value))
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _dist(d: Distribution) -> str:
    if not d.count:
        return "none"
    return f"mean {_num(d.mean)}, p50 {_num(d.p50)}, p99 {_num(d.p99)} (n={d.count})"


def _by_kind(counts: Mapping[str, int]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})" if counts else ""


def _json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


# --------------------------------------------------------------------------- fold


def fold(namespace: str, recipe: str, *, generations: GenerationsSpan,
         publications: Iterable[Publication] = (), metrics: Iterable[Metric] = (),
         dead_letters: Iterable[DeadLetter] = (), target: float | None = None,
         measure: str = "accuracy", extra_cpu: Mapping[str, float] | None = None,
         ledger: Mapping[str, int] | None = None,
         registry: SchemaRegistry | None = None, group: str | None = None,
         checkpoints: Iterable[Checkpoint] = ()) -> Scorecard:
    """The scorecard of events already read and decoded. Pure.

    Goodput, staleness, age, time to target and the trainer's CPU are one trainer group's: a
    group replaying the units topic trains the same generations again, so counting every
    group's samples as the loop's overstates them. ``group``: whose [default: the group whose
    checkpoint the newest PROMOTED publication came from (``checkpoints`` tell), else the only
    one; with several groups and none promoted, all together]. Publications of another
    group's checkpoints are left out.

    ``metrics`` in log order (one stage's events share a partition of ``<ns>.metrics``, key =
    stage, so each series keeps its order); a metric labelled with another ``recipe`` is left
    out. ``dead_letters``: the trainer's letters of another recipe's units topic are left out;
    a trainer's too-stale letter counts the samples of the unit it holds (decoded with
    ``registry``; 1 when it does not decode)."""
    registry = registry or SchemaRegistry.default()
    units_topic = declarations.units(namespace, recipe)
    publications, dead_letters = list(publications), list(dead_letters)

    metrics = list(metrics)
    group, others, publications = _one_group(recipe, group, metrics, publications, checkpoints)
    series: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)
    serving: list[float] = []
    last_ms = generations.last_ms
    for metric in metrics:
        last_ms = _later(last_ms, metric.created_at)
        if metric.labels.get("recipe", recipe) != recipe:
            continue
        if group is not None and metric.stage == STAGE_TRAINER \
                and metric.labels.get("group", group) != group:
            continue
        if metric.stage == STAGE_FOLLOWER and metric.name == FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS:
            serving.append(metric.value)  # one event per version loaded: one observation each
        elif metric.name == PROCESS_CPU_SECONDS or metric.stage == STAGE_TRAINER:
            series[(metric.stage, metric.name, tuple(sorted(metric.labels.items())))].append(
                metric.value)

    def totals(stage: str, name: str, label: str) -> dict[str, float]:
        """Every series of ``stage``'s counter ``name``, its total by the value of ``label``."""
        found: dict[str, float] = defaultdict(float)
        for (s, n, labels), values in series.items():
            if s == stage and n == name and label in dict(labels):
                found[dict(labels)[label]] += counter_total(values)
        return found

    by_staleness = totals(STAGE_TRAINER, TRAINER_STALENESS_SAMPLES, "staleness")
    # samples of unknown version are trained, but have no staleness
    staleness = {float(k): v for k, v in by_staleness.items() if k != UNKNOWN_STALENESS}
    cpu: dict[str, float] = defaultdict(float)
    for (stage, name, _), values in series.items():
        if name == PROCESS_CPU_SECONDS:
            cpu[stage] += counter_total(values)
    for what, seconds in (extra_cpu or {}).items():
        cpu[what] += seconds

    kinds: Counter[str] = Counter()
    too_stale_samples = 0
    for letter in dead_letters:
        last_ms = _later(last_ms, letter.created_at)
        if letter.source_topic.startswith(f"{namespace}.units.") \
                and letter.source_topic != units_topic:
            continue  # another recipe's trainer
        kinds[letter.error_type] += 1
        if letter.error_type in TOO_STALE_KINDS:
            too_stale_samples += _samples_in(letter, units_topic, registry)

    reached = []
    best = None
    for publication in publications:
        last_ms = _later(last_ms, publication.created_at)
        value = publication.measurement.get(measure)
        if publication.decision is not Decision.PROMOTED or value is None:
            continue
        best = value if best is None else max(best, value)
        if target is not None and value >= target:
            reached.append(publication.created_at)
    first = generations.first_ms
    # (a target the policy met before the first generation, e.g. a low one, took 0 s)
    time_to_target = (max(min(reached) - first, 0) / 1000
                      if reached and first is not None else None)

    return Scorecard(
        namespace=namespace, recipe=recipe, measure=measure, target=target,
        seconds=(last_ms - first) / 1000 if first is not None and last_ms is not None else 0.0,
        time_to_target_s=time_to_target, generated=generations.count,
        trained=round(sum(by_staleness.values())),
        shed={k: n for k, n in sorted(kinds.items()) if is_shed(k)},
        dead_lettered=dict(sorted(kinds.items())),
        too_stale=sum(n for k, n in kinds.items() if k in TOO_STALE_KINDS),
        too_stale_samples=too_stale_samples,
        staleness_versions=counted(staleness),
        staleness_seconds=_ages(totals(STAGE_TRAINER, TRAINER_SAMPLE_AGE_SAMPLES, "le")),
        sample_to_unit_s=_ages(totals(STAGE_TRAINER, TRAINER_SAMPLE_TO_UNIT_SAMPLES, "le")),
        unit_to_train_s=_ages(totals(STAGE_TRAINER, TRAINER_UNIT_TO_TRAIN_SAMPLES, "le")),
        checkpoint_to_serving_s=observed(serving),
        cpu_seconds=dict(sorted(cpu.items())),
        ledger=dict(ledger) if ledger is not None else None,
        best=best, group=group, other_groups=others)


def _one_group(recipe: str, group: str | None, metrics: list[Metric],
               publications: list[Publication], checkpoints: Iterable[Checkpoint]
               ) -> tuple[str | None, tuple[str, ...], list[Publication]]:
    """The trainer group a scorecard is of (see ``fold``), the recipe's other groups, and the
    publications of that group's checkpoints (all when it cannot be told)."""
    seen = {m.labels["group"] for m in metrics if m.stage == STAGE_TRAINER
            and "group" in m.labels and m.labels.get("recipe", recipe) == recipe}
    group_of = {c.checkpoint_id: c.trainer_group for c in checkpoints if c.recipe == recipe}
    seen |= set(group_of.values())
    if group is None:
        promoted = [group_of[p.checkpoint_id] for p in publications
                    if p.decision is Decision.PROMOTED and p.checkpoint_id in group_of]
        group = promoted[-1] if promoted else (next(iter(seen)) if len(seen) == 1 else None)
    if group is not None and group_of:
        publications = [p for p in publications if group_of.get(p.checkpoint_id, group) == group]
    return group, tuple(sorted(seen - {group})), publications


def _later(ms: int | None, other: int) -> int:
    return other if ms is None else max(ms, other)


def _ages(by_le: Mapping[str, float]) -> Distribution:
    """A bucketed distribution from counts keyed by ``le`` ("0.25", ..., "+Inf")."""
    counts: dict[float, float] = {}
    for le, count in by_le.items():
        try:
            counts[float(le)] = counts.get(float(le), 0.0) + count   # float("+Inf") is inf
        except ValueError:
            continue
    return bucketed(counts, AGE_BOUNDS_S)


def _samples_in(letter: DeadLetter, units_topic: str, registry: SchemaRegistry) -> int:
    """The samples a too-stale letter stands for: the members of the trainer's unit, else 1."""
    if letter.source_topic != units_topic or letter.value is None:
        return 1
    try:
        unit = registry.decode(letter.value, [(h.key, h.value) for h in letter.headers])
    except InvalidRecord:
        return 1
    return len(getattr(unit, "members", ())) or 1


# --------------------------------------------------------------------------- reading


def read_scorecard(bootstrap: str, namespace: str, recipe: str, *, target: float | None = None,
                   measure: str = "accuracy", extra_cpu: Mapping[str, float] | None = None,
                   ledger: Mapping[str, int] | None = None,
                   group: str | None = None) -> Scorecard:
    """The scorecard of ``namespace``'s loop of ``recipe`` (its name, as in
    ``<ns>.units.<recipe>``) and trainer ``group`` (``fold``), read from the topics as they are
    now; see the module docstring.
    ``ConfigurationError`` naming the topics that are missing. Blocks for the reads (seconds
    on a long run: the metrics and dead-letter topics are read whole)."""
    topics = {"generations": declarations.generations(namespace),
              "publications": declarations.publications(namespace),
              "metrics": declarations.metrics(namespace),
              "dead letters": declarations.dead_letters(namespace),
              "checkpoints": declarations.checkpoints(namespace),
              "units": declarations.units(namespace, recipe)}
    _check_topics(bootstrap, namespace, topics)
    registry = SchemaRegistry.default()
    return fold(
        namespace, recipe, generations=_span(bootstrap, topics["generations"]),
        publications=_events(bootstrap, topics["publications"], Publication, registry),
        metrics=_events(bootstrap, topics["metrics"], Metric, registry),
        dead_letters=_events(bootstrap, topics["dead letters"], DeadLetter, registry),
        target=target, measure=measure, extra_cpu=extra_cpu, ledger=ledger, registry=registry,
        group=group,
        checkpoints=_events(bootstrap, topics["checkpoints"], Checkpoint, registry))


def _check_topics(bootstrap: str, namespace: str, topics: Mapping[str, str]) -> None:
    from reef_stream.topics.connect import list_topics, new_admin

    existing = set(list_topics(new_admin(bootstrap), "listing the topics").topics)
    missing = [name for name in topics.values() if name not in existing]
    if not missing:
        return
    recipes = sorted(t.removeprefix(f"{namespace}.units.") for t in existing
                     if t.startswith(f"{namespace}.units."))
    raise ConfigurationError(
        f"namespace {namespace!r} has no topic {', '.join(missing)}: check the namespace "
        f"(--namespace, REEF_NAMESPACE) and the recipe's name (the recipes with units in "
        f"{namespace!r}: {', '.join(recipes) or 'none'})")


def _span(bootstrap: str, topic: str) -> GenerationsSpan:
    """How many records ``topic`` holds and the timestamps of its first and last.

    The count is the sum over partitions of high minus low watermark: every offset is a record
    because the generations' producer (the SDK's) is not transactional, so no offset holds a
    transaction marker. Records removed by retention are not counted."""
    from reef_stream.topics.connect import new_consumer, watermarks
    from reef_stream.topics.kafka import TIMESTAMP_NOT_AVAILABLE
    from reef_stream.topics.reading import TopicReader

    consumer = new_consumer(bootstrap, "reef-scorecard")
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        marks = {p: watermarks(consumer, topic, p) for p in partitions}
    finally:
        consumer.close()
    marks = {p: (low, high) for p, (low, high) in marks.items() if high > max(low, 0)}
    count = sum(high - max(low, 0) for low, high in marks.values())
    stamps: list[int] = []
    with TopicReader(bootstrap, topic) as reader:
        for at, until in (({p: max(low, 0) for p, (low, _) in marks.items()},
                           {p: max(low, 0) + 1 for p, (low, _) in marks.items()}),
                          ({p: high - 1 for p, (_, high) in marks.items()},
                           {p: high for p, (_, high) in marks.items()})):
            reader.positions.update(at)
            for message in reader.to_end(until):
                kind, ms = message.timestamp()
                if kind != TIMESTAMP_NOT_AVAILABLE:
                    stamps.append(ms)
    return GenerationsSpan(count, min(stamps, default=None), max(stamps, default=None))


def _events(bootstrap: str, topic: str, reader: type, registry: SchemaRegistry) -> list[Any]:
    """Every record of ``topic`` that decodes as ``reader``, in log order per partition (one
    that does not decode is the dead letters' business, and left out here)."""
    from reef_stream.topics.reading import read_to_end

    events = []
    for message in read_to_end(bootstrap, topic):
        try:
            events.append(registry.decode(message.value(), message.headers(), reader))
        except InvalidRecord:
            continue
    return events
