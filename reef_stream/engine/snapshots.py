"""State snapshots of the join state machine: what a pending key holds (its members and the
feedback received for them) and its JSON form, as the processor's changelog stores it. Events
are kept as their Avro bytes and writer-schema fingerprint, so a snapshot written before a
schema change still restores after it. No pickle."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from reef_stream.api.processor import Origin, Score
from reef_stream.topics.events import Feedback, Generation
from reef_stream.topics.serde import FINGERPRINT_HEADER, SchemaRegistry

EventT = TypeVar("EventT")


@dataclass(slots=True, eq=False)
class Received:
    feedback: Feedback
    arrived: int
    origin: Origin | None
    record: dict[str, str] | None = None  # the feedback, encoded once for snapshots


@dataclass(slots=True, eq=False)
class Member:
    generation: Generation
    arrived: int
    deadline: int
    origin: Origin | None
    received: dict[str, Received] = field(default_factory=dict)  # held until scored
    seen: set[str] = field(default_factory=set)  # every source received, for duplicates
    score: Score | None = None
    scored_time: int = 0  # latest event time of the generation and the feedback it used
    record: dict[str, str] | None = None  # the generation, encoded once for snapshots


def event_record(event: Generation | Feedback) -> dict[str, str]:
    """An event as its Avro bytes (base64) and writer-schema fingerprint (hex): a snapshot
    written before a schema change still restores after it."""
    value, headers = SchemaRegistry.default().encode(event)
    return {"avro": base64.b64encode(value).decode("ascii"),
            "fingerprint": dict(headers)[FINGERPRINT_HEADER].hex()}


def event_from(cls: type[EventT], record: Mapping[str, str]) -> EventT:
    headers = {FINGERPRINT_HEADER: bytes.fromhex(record["fingerprint"])}
    return SchemaRegistry.default().decode(base64.b64decode(record["avro"]), headers, cls)


def origin_from(record: list[Any] | None) -> Origin | None:
    return None if record is None else Origin(*record)


def received_records(received: Mapping[str, Received]) -> list[dict[str, Any]]:
    for entry in received.values():
        entry.record = entry.record or event_record(entry.feedback)
    return [{"feedback": r.record, "arrived": r.arrived,
             "origin": r.origin and [r.origin.topic, r.origin.partition, r.origin.offset]}
            for _, r in sorted(received.items())]


def received_from(records: list[Mapping[str, Any]]) -> dict[str, Received]:
    entries = [Received(event_from(Feedback, r["feedback"]), r["arrived"],
                         origin_from(r["origin"]), r["feedback"]) for r in records]
    return {entry.feedback.source: entry for entry in entries}


def member_record(member: Member) -> dict[str, Any]:
    score, origin = member.score, member.origin
    member.record = member.record or event_record(member.generation)
    return {
        "generation": member.record, "arrived": member.arrived, "deadline": member.deadline,
        "origin": origin and [origin.topic, origin.partition, origin.offset],
        "received": received_records(member.received), "seen": sorted(member.seen),
        "score": score and {"reward": score.reward, "components": dict(score.components),
                            "sources": list(score.sources)},
        "scored_time": member.scored_time,
    }


def member_from(record: Mapping[str, Any]) -> Member:
    score = record["score"]
    return Member(
        generation=event_from(Generation, record["generation"]), arrived=record["arrived"],
        deadline=record["deadline"], origin=origin_from(record["origin"]),
        received=received_from(record["received"]), seen=set(record["seen"]),
        score=score and Score(score["reward"], dict(score["components"]), tuple(score["sources"])),
        scored_time=record["scored_time"], record=record["generation"])


def dumps_snapshot(snapshot: Mapping[str, Any]) -> bytes:
    """A snapshot as compact UTF-8 JSON (no pickle), e.g. for a table with a raw value codec."""
    return json.dumps(snapshot, separators=(",", ":"), allow_nan=False).encode()


def loads_snapshot(data: bytes) -> dict[str, Any]:
    """The snapshot ``dumps_snapshot`` wrote."""
    return json.loads(data)
