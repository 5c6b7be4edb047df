"""The lineage of one generation, read back from the log: ``reef trace GENERATION_ID``.

    lineage = trace_generation(bootstrap, namespace, "3f2a...")
    for link in lineage.links:
        print(link.line())

Every record is an event with an id and a policy version, so the path of a
generation through the pipeline can be rebuilt from the topics alone:

1. the ``Generation`` (``<ns>.generations``): when, by which replica, from which version;
   for a multi-turn trajectory, one ``turn`` link per segment (who produced it, trained or
   masked, its token ids and the policy's mean logprob);
2. its ``Feedback`` records (``<ns>.feedback``), by source;
3. the unit that holds it (``<ns>.units.<recipe>``, every recipe's topic), or the dead letter
   that ended it (``<ns>.dead-letters``: invalid, too stale, expired, failed reward);
4. the trainer step that consumed the unit: the first ``Checkpoint`` of a trainer group whose
   committed offset of the unit's partition is past the unit's offset (the acknowledgement
   order makes that the step that took it, or with ``schedule.checkpoint_every`` the
   checkpoint of the steps that did); whether it was trained (the checkpoint's
   ``step_units``, when the checkpoint is still in its store) or dropped;
5. the first ``PROMOTED`` publication of that model at or after the step's version: the
   first served version that includes the generation's effect -- unless that version is a
   trainer's rollback (its ``Checkpoint`` has ``rolled_back_to``) to a version before the
   step: then the step's effect was discarded, and the lineage ends there;
6. the replicas that reported serving a version at or after that one (their heartbeat
   ``Metric`` events on ``<ns>.metrics``).

Each link names the topic, partition and offset it was read from, so it can be checked with
``reef tail``. A missing link says what is missing (e.g. not trained yet). The topics are
scanned from the beginning to their current end: the cost grows with the log (fine for
inspection, not for a hot path). Blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from reef_stream.core.events import (
    Checkpoint, DeadLetter, Decision, Feedback, Generation, Metric, Publication, RolloutUnit,
)
from reef_stream.core.metric_names import FOLLOWER_POLICY_VERSION, STAGE_FOLLOWER
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer
from reef_stream.topics.reading import read_to_end

__all__ = ["Lineage", "Link", "trace_checkpoint", "trace_generation", "trace_unit",
           "turn_links"]


@dataclass(frozen=True)
class Link:
    """One link of a lineage: ``kind`` (generation, feedback, unit, dead-letter, step,
    publication, replica, rollback, canary, missing), what it says, and where it was read
    (``topic``, ``partition``, ``offset``; None for what is not a record, e.g. a missing link)."""

    kind: str
    text: str
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

    def line(self) -> str:
        where = "" if self.topic is None else f"  [{self.topic}:{self.partition}@{self.offset}]"
        return f"{self.kind:<12} {self.text}{where}"


@dataclass(frozen=True)
class Lineage:
    """The links found for ``generation_id`` (or the unit or checkpoint id traced), in
    pipeline order. ``complete``: every link down to a replica serving a version that includes
    it was found."""

    generation_id: str
    links: tuple[Link, ...]

    @property
    def complete(self) -> bool:
        kinds = {link.kind for link in self.links}
        return {"step", "publication", "replica"} <= kinds and "missing" not in kinds


#: A record found: the event, its partition and its offset.
Found = tuple[Any, int, int]


def _records(bootstrap: str, topic: str, registry: SchemaRegistry,
             reader: type | None = None) -> Iterator[tuple[Any, int, int]]:
    """``(event, partition, offset)`` for every record of ``topic`` up to its current end;
    records that do not decode (or are not ``reader``) are skipped."""
    for message in read_to_end(bootstrap, topic):
        if message.value() is None:
            continue
        try:
            event = registry.decode(message.value(), message.headers())
        except Exception:  # noqa: BLE001 - not ours to judge here: skipped
            continue
        if reader is None or isinstance(event, reader):
            yield event, message.partition(), message.offset()


def trace_generation(bootstrap: str, namespace: str, generation_id: str) -> Lineage:
    """The lineage of ``generation_id`` in ``namespace`` (see the module docstring)."""
    registry = SchemaRegistry.default()
    links: list[Link] = []
    generations = declarations.generations(namespace)
    found = _first(bootstrap, generations, registry, Generation,
                   lambda g: g.generation_id == generation_id)
    if found is None:
        return Lineage(generation_id, (Link("missing", f"no generation {generation_id} in "
                                                       f"{generations}"),))
    generation, partition, offset = found
    links.append(Link("generation", f"{generation_id} by replica {generation.replica_id} from "
                                    f"{generation.model} version {generation.policy_version}, "
                                    f"at {generation.created_at} ms", generations, partition,
                      offset))
    if generation.segments:
        links += turn_links(generation, generations, partition, offset)
    links += _canary_links(bootstrap, namespace, registry, generation)

    feedback_topic = declarations.feedback(namespace)
    for feedback, p, o in _records(bootstrap, feedback_topic, registry, Feedback):
        if feedback.generation_id == generation_id:
            links.append(Link("feedback", f"{feedback.source}: reward {feedback.reward:g}",
                              feedback_topic, p, o))

    unit = _find_unit(bootstrap, namespace, registry,
                      lambda u: any(m.generation_id == generation_id for m in u.members))
    if unit is not None and generation.segments:
        sample = next(m for m in unit[0].members if m.generation_id == generation_id)
        masked = int((sample.policy_mask == 0).sum()) if sample.policy_mask.size else 0
        links.append(Link("mask", f"its sample in unit {unit[0].unit_id} trains "
                                  f"{len(sample.completion_token_ids) - masked} policy tokens; "
                                  f"{masked} environment tokens masked", *unit[1:]))
    if unit is None:
        links += _dead_letters(bootstrap, namespace, registry, generations, partition, offset)
        links.append(Link("missing", "in no unit (yet): still waiting, or ended by a dead letter"))
        return Lineage(generation_id, tuple(links))
    links += _from_unit(bootstrap, namespace, registry, unit)
    return Lineage(generation_id, tuple(links))


#: Token ids a turn link shows before eliding the rest.
TURN_TOKENS_SHOWN = 12


def turn_links(generation: Generation, topic: str | None = None, partition: int | None = None,
               offset: int | None = None) -> list[Link]:
    """One ``turn`` link per segment of a multi-turn generation: its number, role, source
    (policy: trained; environment: masked), token ids and, for a policy turn, its mean
    behaviour logprob. A generation whose segments do not split its completion gets one
    ``missing`` link saying so."""
    from reef_stream.core.errors import InvalidRecord
    from reef_stream.core.events import SegmentSource

    try:
        turns = generation.turns()
    except InvalidRecord as error:
        return [Link("missing", f"its turns cannot be shown: {error}")]
    links = []
    for number, turn in enumerate(turns, 1):
        ids = turn.token_ids.tolist()
        shown = " ".join(map(str, ids[:TURN_TOKENS_SHOWN])) + (
            f" ... (+{len(ids) - TURN_TOKENS_SHOWN})" if len(ids) > TURN_TOKENS_SHOWN else "")
        policy = turn.source is SegmentSource.POLICY
        what = (f"policy, trained, mean logprob {float(turn.logprobs.mean()):.3f}" if policy
                else "environment, masked")
        links.append(Link("turn", f"{number}/{len(turns)} {turn.role or '-'} ({what}): "
                                  f"{len(ids)} tokens [{shown}]", topic, partition, offset))
    return links


def trace_unit(bootstrap: str, namespace: str, unit_id: str) -> Lineage:
    """The lineage of the unit ``unit_id`` from the unit on: its trainer step, publication and
    replicas (links as for ``trace_generation``; ``Lineage.generation_id`` holds the unit id)."""
    registry = SchemaRegistry.default()
    unit = _find_unit(bootstrap, namespace, registry, lambda u: u.unit_id == unit_id)
    if unit is None:
        return Lineage(unit_id, (Link("missing", f"no unit {unit_id} on any units topic of "
                                                 f"{namespace}"),))
    return Lineage(unit_id, tuple(_from_unit(bootstrap, namespace, registry, unit)))


def trace_checkpoint(bootstrap: str, namespace: str, checkpoint_id: str) -> Lineage:
    """The lineage of the checkpoint ``checkpoint_id`` on: the step, the first promoted
    publication that includes it and the replicas that served it."""
    registry = SchemaRegistry.default()
    topic = declarations.checkpoints(namespace)
    checkpoints = _checkpoints(bootstrap, namespace, registry)
    found = next(((c, p, o) for c, p, o in checkpoints if c.checkpoint_id == checkpoint_id), None)
    if found is None:
        return Lineage(checkpoint_id, (Link("missing", f"no checkpoint {checkpoint_id} in "
                                                       f"{topic}"),))
    checkpoint, p, o = found
    what = ("" if checkpoint.rolled_back_to is None else
            f" (a rollback: the weights of version {checkpoint.rolled_back_to} again)")
    links = [Link("step", f"step {checkpoint.step} of trainer group {checkpoint.trainer_group}, "
                          f"checkpoint {checkpoint.checkpoint_id}, version "
                          f"{checkpoint.policy_version}{what}", topic, p, o)]
    links += _from_checkpoint(bootstrap, namespace, registry, checkpoint, checkpoints)
    return Lineage(checkpoint_id, tuple(links))


def _from_unit(bootstrap: str, namespace: str, registry: SchemaRegistry,
               unit: tuple[RolloutUnit, str, int, int]) -> list[Link]:
    """The unit's link, the dead letter that dropped it (if any), its step and what follows."""
    rolled, units_topic, unit_partition, unit_offset = unit
    links = [Link("unit", f"{rolled.unit_id} of recipe {rolled.recipe} ({len(rolled.members)} "
                          f"samples)", units_topic, unit_partition, unit_offset)]
    links += _dead_letters(bootstrap, namespace, registry, units_topic, unit_partition,
                           unit_offset)
    checkpoints = _checkpoints(bootstrap, namespace, registry)
    step = _consuming_step(checkpoints, units_topic, unit_partition, unit_offset,
                           rolled.unit_id)
    if step is None:
        links.append(Link("missing", "no trainer has acknowledged a step past this unit yet"))
        return links
    checkpoint, trained, p, o = step
    links.append(Link("step", f"step {checkpoint.step} of trainer group "
                              f"{checkpoint.trainer_group} ({trained}), checkpoint "
                              f"{checkpoint.checkpoint_id}, version {checkpoint.policy_version}",
                      declarations.checkpoints(namespace), p, o))
    return links + _from_checkpoint(bootstrap, namespace, registry, checkpoint, checkpoints)


def _from_checkpoint(bootstrap: str, namespace: str, registry: SchemaRegistry,
                     checkpoint: Checkpoint, checkpoints: list[Found]) -> list[Link]:
    """The first promoted publication at or after ``checkpoint``'s version, and the replicas
    that reported serving that version or a later one; or the rollback that discarded it
    (``checkpoints``: the namespace's, as ``_checkpoints`` read them)."""
    publications = declarations.publications(namespace)
    rollbacks = {c.checkpoint_id: c.rolled_back_to
                 for c, _, _ in checkpoints if c.rolled_back_to is not None}
    promoted = sorted(((e, p, o) for e, p, o in _records(bootstrap, publications, registry,
                                                         Publication)
                       if e.model == checkpoint.model and e.decision is Decision.PROMOTED
                       and e.policy_version >= checkpoint.policy_version),
                      key=lambda found: found[0].policy_version)
    if not promoted:
        return [Link("missing", f"no version of {checkpoint.model} at or after "
                                f"{checkpoint.policy_version} is promoted yet")]
    publication, p, o = promoted[0]
    held = rollbacks.get(publication.checkpoint_id)
    if held is not None and held < checkpoint.policy_version \
            and publication.checkpoint_id != checkpoint.checkpoint_id:
        return [Link("rollback", f"{publication.model} version {publication.policy_version} is a "
                                 f"rollback to the weights of version {held}: the effect of "
                                 f"version {checkpoint.policy_version} was discarded, never "
                                 "served", publications, p, o)]
    links = [Link("publication", f"{publication.model} version {publication.policy_version} "
                                 f"promoted by {publication.evaluator}: {publication.reason}",
                  publications, p, o)]
    metrics_topic = declarations.metrics(namespace)
    replicas: dict[str, tuple[int, int, int]] = {}
    for metric, p, o in _records(bootstrap, metrics_topic, registry, Metric):
        if (metric.stage == STAGE_FOLLOWER and metric.name == FOLLOWER_POLICY_VERSION
                and metric.labels.get("model") == publication.model
                and metric.value >= publication.policy_version
                and metric.labels.get("replica") not in replicas):
            replicas[metric.labels.get("replica", "?")] = (int(metric.value), p, o)
    for replica, (version, p, o) in sorted(replicas.items()):
        links.append(Link("replica", f"{replica} served version {version} (includes it)",
                          metrics_topic, p, o))
    if not replicas:
        links.append(Link("missing", f"no replica has reported serving version "
                                     f"{publication.policy_version} or later"))
    return links


def _first(bootstrap: str, topic: str, registry: SchemaRegistry, reader: type,
           matches: Callable[[Any], bool]) -> tuple[Any, int, int] | None:
    """The first ``reader`` record of ``topic`` that ``matches``, with its partition and offset."""
    return next(((e, p, o) for e, p, o in _records(bootstrap, topic, registry, reader)
                 if matches(e)), None)


def _dead_letters(bootstrap: str, namespace: str, registry: SchemaRegistry, topic: str,
                  partition: int, offset: int) -> list[Link]:
    """The dead letters whose source is the record at ``topic``/``partition``/``offset``."""
    letters = declarations.dead_letters(namespace)
    return [Link("dead-letter", f"stage {letter.stage}: {letter.reason}", letters, p, o)
            for letter, p, o in _records(bootstrap, letters, registry, DeadLetter)
            if letter.source_topic == topic and letter.source_partition == partition
            and letter.source_offset == offset]


def _find_unit(bootstrap: str, namespace: str, registry: SchemaRegistry,
               wanted: Callable[[RolloutUnit], bool]) -> tuple[RolloutUnit, str, int, int] | None:
    """The first unit, on any recipe's units topic, that is ``wanted``."""
    consumer = new_consumer(bootstrap, "reef-trace")
    try:
        prefix = declarations.units(namespace, "")
        topics = sorted(t for t in consumer.list_topics(timeout=10).topics if t.startswith(prefix))
    finally:
        consumer.close()
    for topic in topics:
        for unit, p, o in _records(bootstrap, topic, registry, RolloutUnit):
            if wanted(unit):
                return unit, topic, p, o
    return None


def _checkpoints(bootstrap: str, namespace: str, registry: SchemaRegistry) -> list[Found]:
    """Every checkpoint event of the namespace, with its partition and offset (read once per
    trace: a trace asks several questions of them)."""
    return list(_records(bootstrap, declarations.checkpoints(namespace), registry, Checkpoint))


def _consuming_step(checkpoints: list[Found], units_topic: str, partition: int,
                    offset: int, unit_id: str) -> tuple[Checkpoint, str, int, int] | None:
    """The earliest acknowledged step (of any trainer group) whose
    committed offset of ``units_topic``/``partition`` is past ``offset``, with whether it
    trained the unit: ``trained``, ``not trained (dropped)`` or ``checkpoint pruned``."""
    from reef_stream.engine.checkpoints import CheckpointError, load

    past = [(c, p, o) for c, p, o in checkpoints
            if any(t.topic == units_topic and t.partition == partition and t.offset > offset
                   for t in c.offsets)]
    if not past:
        return None
    checkpoint, p, o = min(past, key=lambda found: (found[0].created_at, found[0].step))
    try:
        units = load(checkpoint.uri, checkpoint.sha256).step_units
    except (CheckpointError, OSError):
        return checkpoint, "checkpoint pruned: not verifiable", p, o
    return checkpoint, "trained" if unit_id in units else "not trained (dropped)", p, o


def _canary_links(bootstrap: str, namespace: str, registry: SchemaRegistry,
                  generation: Generation) -> list[Link]:
    """The canary stage of the version that made ``generation``, if it had one
    (``reef_stream.consumers.evaluator.canary``): its CANARY publication (or, compacted, the decision
    that ended it, which keeps the share) and the decisions on that version after it."""
    topic = declarations.publications(namespace)
    links: list[Link] = []
    for p, part, off in _records(bootstrap, topic, registry, Publication):
        if p.model != generation.model or p.policy_version != generation.policy_version:
            continue
        who = "" if p.decided_by is None else f" by {p.decided_by}"
        if p.decision is Decision.CANARY:
            links.append(Link("canary", f"version {p.policy_version} staged on a share of "
                                        f"{p.share or 0:g} of the replicas, awaiting "
                                        f"{p.awaiting}: {p.reason}", topic, part, off))
        elif links or p.share is not None:
            links.append(Link("canary", f"version {p.policy_version} {p.decision.value}{who}: "
                                        f"{p.reason}", topic, part, off))
    return links
