"""State snapshots of the join state machine: what a pending key holds (its members and the
feedback received for them) and its JSON form, as the processor's changelog stores it. Events
are kept as their Avro bytes and writer-schema fingerprint, so a snapshot written before a
schema change still restores after it. No pickle.

An event's record is made once per member or feedback entry, at its first snapshot: from the
bytes it was read as when the caller kept them (``Encoded``: the runtime passes each consumed
record's value and fingerprint header), else by encoding it with its current schema. The
bytes read decode to the very event the state machine holds (it was decoded from them), so
either way the snapshot restores that event."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from reef_stream.api.processor import Origin, Score
from reef_stream.core.events import Feedback, Generation
from reef_stream.core.serde import FINGERPRINT_HEADER, SchemaRegistry

EventT = TypeVar("EventT")


class Encoded(NamedTuple):
    """An event as it was read: its Avro bytes and its writer schema's 8-byte fingerprint."""

    value: bytes
    fingerprint: bytes


@dataclass(slots=True, eq=False)
class Received:
    feedback: Feedback
    arrived: int
    origin: Origin | None
    record: dict[str, str] | None = None  # the feedback, encoded once for snapshots
    encoded: Encoded | None = None  # the feedback as it was read, if the caller kept it


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
    encoded: Encoded | None = None  # the generation as it was read, if the caller kept it


def event_record(event: Generation | Feedback, encoded: Encoded | None = None) -> dict[str, str]:
    """An event as its Avro bytes (base64) and writer-schema fingerprint (hex): a snapshot
    written before a schema change still restores after it. ``encoded``: the bytes the event
    was read from, used as they are (else it is encoded with its current schema)."""
    if encoded is None:
        value, headers = SchemaRegistry.default().encode(event)
        encoded = Encoded(value, dict(headers)[FINGERPRINT_HEADER])
    return {"avro": base64.b64encode(encoded.value).decode("ascii"),
            "fingerprint": encoded.fingerprint.hex()}


def event_from(cls: type[EventT], record: Mapping[str, str]) -> EventT:
    headers = {FINGERPRINT_HEADER: bytes.fromhex(record["fingerprint"])}
    return SchemaRegistry.default().decode(base64.b64decode(record["avro"]), headers, cls)


def origin_from(record: list[Any] | None) -> Origin | None:
    return None if record is None else Origin(*record)


def received_records(received: Mapping[str, Received]) -> list[dict[str, Any]]:
    for entry in received.values():
        if entry.record is None:
            entry.record, entry.encoded = event_record(entry.feedback, entry.encoded), None
    return [{"feedback": r.record, "arrived": r.arrived,
             "origin": r.origin and [r.origin.topic, r.origin.partition, r.origin.offset]}
            for _, r in sorted(received.items())]


def received_from(records: list[Mapping[str, Any]]) -> dict[str, Received]:
    entries = [Received(event_from(Feedback, r["feedback"]), r["arrived"],
                         origin_from(r["origin"]), r["feedback"]) for r in records]
    return {entry.feedback.source: entry for entry in entries}


def member_record(member: Member) -> dict[str, Any]:
    score, origin = member.score, member.origin
    if member.record is None:
        member.record, member.encoded = event_record(member.generation, member.encoded), None
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
