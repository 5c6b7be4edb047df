"""SchemaRegistry.decode's compiled Avro readers (reef_stream.core.avro_reader) give exactly the
event fastavro + from_avro give, or let them decode: every event type, random events, edge values,
every old schema version in schemas/history, and corrupted bytes (the same error)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from reef_stream.core import serde
from reef_stream.core.avro_reader import compile_reader
from reef_stream.core.events import (
    EVENT_TYPES, Checkpoint, DeadLetter, Decision, Feedback, Generation, MessageHeader, Publication,
    RolloutUnit, to_avro,
)
from reef_stream.core.serde import SchemaRegistry
from tests.unit.random_events import RandomEvents

REGISTRY = SchemaRegistry.default()
#: The reference: fastavro's schemaless_reader and from_avro for every record.
REFERENCE = SchemaRegistry(compiled=False)
TYPES = list(EVENT_TYPES.values())


def _identical(a, b) -> bool:
    """Same types all the way down, same values bit for bit (floats by their bytes, so NaN and
    -0.0 count), arrays of the same dtype, shape, contents and writability."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                and a.flags.writeable == b.flags.writeable)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(map(_identical, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(_identical(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    return a == b


def _outcome(registry: SchemaRegistry, value, headers, reader):
    try:
        return registry.decode(value, headers, reader, topic="t", partition=1, offset=2)
    except Exception as error:  # noqa: BLE001 - the error is part of the outcome
        return type(error), str(error)


def _same(value, headers, reader=None) -> None:
    """Decoding gives what the reference gives: the identical event, or the same error."""
    ours, reference = _outcome(REGISTRY, value, headers, reader), _outcome(REFERENCE, value,
                                                                           headers, reader)
    assert _identical(ours, reference), (ours, reference)


def test_every_event_type_is_compiled():
    for cls in TYPES:
        assert REGISTRY.reader_source(cls).startswith(f"def read_{cls.__name__}(v):")
        assert REFERENCE.reader_source(cls) is None


def test_a_schema_construct_it_does_not_know_is_not_compiled():
    known = REGISTRY.current(Feedback.SCHEMA).parsed
    as_float = {**known, "fields": [
        {**f, "type": "float"} if f["name"] == "reward" else f for f in known["fields"]]}
    assert compile_reader(as_float, Feedback) is None
    assert compile_reader(REGISTRY.current(Generation.SCHEMA).parsed, Feedback) is None


@pytest.mark.parametrize("cls", TYPES, ids=lambda cls: cls.__name__)
def test_random_events_of_every_type_decode_as_the_reference_decodes_them(cls):
    events = RandomEvents(sum(map(ord, cls.__name__)))
    for _ in range(200):
        value, headers = REFERENCE.encode(events.of(cls))
        _same(value, headers, cls)
        _same(value, headers)                      # the type the writer names
        _same(bytearray(value), headers, cls)      # not bytes: the reference path


@pytest.mark.parametrize("overrides", [
    {"policy_version": 2**63 - 1}, {"policy_version": -(2**63)},   # 10-byte varints: handed on
    {"policy_version": 2**62 - 1}, {"policy_version": -(2**62)},   # 9 bytes: compiled
    {"created_at": 253_402_300_799_999}, {"created_at": -62_135_596_800_000},
    {"created_at": 253_402_300_800_000}, {"created_at": -62_135_596_800_001},  # no datetime
    {"group_size": 2**31 - 1}, {"group_id": "x" * 70_000},
])
def test_edge_values_decode_as_the_reference_decodes_them(overrides):
    event = dataclasses.replace(RandomEvents(1).generation(), **overrides)
    _same(*REFERENCE.encode(event), Generation)


def test_ordinary_records_do_not_go_through_fastavro(monkeypatch):
    events = RandomEvents(9, edges=False)
    messages = [(REFERENCE.encode(events.of(cls)), cls) for cls in TYPES for _ in range(20)]
    expected = [REFERENCE.decode(value, headers, cls) for (value, headers), cls in messages]

    def refuse(*args, **kwargs):
        raise AssertionError("fastavro was asked to decode an ordinary record")

    monkeypatch.setattr(serde, "schemaless_reader", refuse)
    decoded = [REGISTRY.decode(value, headers, cls) for (value, headers), cls in messages]
    assert all(map(_identical, decoded, expected))


# --- old schema versions: the reference path, with the same result ----------------------------


def _project(schema, value):
    """``value`` (a fastavro dict of the current schema) as the old ``schema`` has it."""
    if isinstance(schema, dict) and schema.get("type") == "record":
        return {f["name"]: _project(f["type"], value[f["name"]]) for f in schema["fields"]}
    if isinstance(schema, dict) and schema.get("type") == "array":
        return [_project(schema["items"], item) for item in value]
    if isinstance(schema, list) and value is not None:
        return _project(schema[1], value)
    if isinstance(schema, dict) and schema.get("type") == "enum" and value not in schema["symbols"]:
        return schema.get("default", schema["symbols"][0])  # a symbol added later (CANARY)
    return value


@pytest.mark.parametrize("old", [known for known in REGISTRY.schemas() if not known.current],
                         ids=lambda known: known.path.parent.name + "/" + known.path.name)
def test_records_of_every_old_schema_version_decode_as_the_reference_decodes_them(old):
    cls = EVENT_TYPES[old.name]
    events = RandomEvents(5)
    for _ in range(100):
        value, headers = REFERENCE.encode_record(old, _project(old.parsed, to_avro(events.of(cls))))
        _same(value, headers, cls)
        _same(value, headers)


# --- corrupted bytes: the same error ----------------------------------------------------------


@pytest.mark.parametrize("cls", TYPES, ids=lambda cls: cls.__name__)
def test_corrupted_records_give_the_references_outcome(cls):
    events = RandomEvents(11)
    rng = np.random.default_rng(11)
    for _ in range(150):
        value, headers = REFERENCE.encode(events.of(cls))
        cut = int(rng.integers(0, len(value) + 1))
        at = int(rng.integers(0, len(value)))
        flipped = bytearray(value)
        flipped[at] = int(rng.integers(0, 256))
        for corrupt in (value[:cut], value + bytes([int(rng.integers(0, 256))]), bytes(flipped),
                        rng.bytes(len(value)), value[:at] + b"\xff" * 10 + value[at:]):
            _same(corrupt, headers, cls)


def test_hand_made_oddities_give_the_references_outcome():
    value, headers = REFERENCE.encode(DeadLetter(
        reason="r", error_type="E", source_topic="t", value=b"v", stage="s", created_at=1,
        headers=(MessageHeader(key="k", value=None),)))
    body = value[:-len(b"\x02")]
    _same(value, headers)
    _same(body, headers)
    publication = Publication(model="m", policy_version=1, checkpoint_id="c", uri="u",
                              sha256="s", decision=Decision.PROMOTED,
                              reason="r", evaluator="e", evaluated=True, created_at=5)
    value, headers = REFERENCE.encode(publication)
    for index in range(len(value)):
        for byte in (0x01, 0x02, 0x03, 0x7F, 0x80, 0xFF):
            odd = bytearray(value)
            odd[index] = byte
            _same(bytes(odd), headers, Publication)
    unit = RandomEvents(2).unit()
    value, headers = REFERENCE.encode(unit)
    _same(value, headers, RolloutUnit)
    _same(value, headers, Checkpoint)          # another type than the writer's: UnknownSchemaError
    _same(None, headers, RolloutUnit)          # a tombstone
    _same(value, [], RolloutUnit)              # no fingerprint
