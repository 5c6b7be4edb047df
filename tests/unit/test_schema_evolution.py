"""Schema evolution: old and new versions of a schema read each other; the current files follow the rules."""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from reef_stream.core import events
from reef_stream.core.errors import UnknownSchemaError
from reef_stream.core.events import (
    EVENT_TYPES, FinishReason, Generation, RolloutUnit, Sample, SamplingParams, events_equal,
    to_avro,
)
from reef_stream.core.serde import SchemaRegistry, schema_fingerprint
from reef_stream.core.settings import SCHEMAS_DIR
from tests import factories

T0 = 1_732_885_200_123
CURRENT_FILES = sorted(SCHEMAS_DIR.glob("*.avsc"))


def current_schema(file: str) -> dict:
    return json.loads((SCHEMAS_DIR / file).read_text())


def without_field(schema: dict, name: str) -> dict:
    older = copy.deepcopy(schema)
    older["fields"] = [f for f in older["fields"] if f["name"] != name]
    return older


def with_field(schema: dict, new_field: dict) -> dict:
    newer = copy.deepcopy(schema)
    newer["fields"].append(new_field)
    return newer


def registry_with(tmp_path: Path, *versions: dict) -> SchemaRegistry:
    """The project's registry plus ``versions`` written as history files under tmp_path."""
    for number, version in enumerate(versions):
        path = tmp_path / "generation" / f"v{number}.avsc"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(version))
    return SchemaRegistry(dirs=[tmp_path])


def generation(**overrides) -> Generation:
    """The factory's generation (tests/factories.py), grouped, cut at its length, with metadata:
    every optional field set."""
    fields = dict(
        generation_id="gen-1", request_id="req-1", prompt_id="prompt-1", group_id="grp-1",
        group_size=4, policy_version=7, replica_id="replica-0",
        completion_logprobs=factories.logprobs([-0.5, -1.0]), finish_reason=FinishReason.LENGTH,
        sampling=SamplingParams(max_tokens=2, seed=3), created_at=T0, metadata={"k": "v"})
    fields.update(overrides)
    return factories.generation(**fields)


def record_without(event: Generation, name: str) -> dict:
    record = to_avro(event)
    del record[name]
    return record


# --- writer and reader versions ----------------------------------------------------------


def test_a_record_written_with_an_older_version_gets_the_new_fields_default(tmp_path):
    older = without_field(current_schema("generation.avsc"), "group_size")
    registry = registry_with(tmp_path, older)
    old_version = registry.by_fingerprint(schema_fingerprint(older))
    assert not old_version.current

    value, headers = registry.encode_record(old_version, record_without(generation(), "group_size"))
    decoded = registry.decode(value, headers, Generation)

    assert decoded.group_size == 1
    assert events_equal(decoded, generation(group_size=1))


def test_a_record_written_with_the_current_version_reads_with_an_older_one(tmp_path):
    older = without_field(current_schema("generation.avsc"), "metadata")
    registry = registry_with(tmp_path, older)
    event = generation()

    value, headers = registry.encode(event)
    record = registry.decode_record(value, headers, registry.by_fingerprint(schema_fingerprint(older)))

    expected = record_without(event, "metadata")
    expected["created_at"] = datetime.fromtimestamp(T0 / 1000, tz=timezone.utc)
    assert record == expected


def test_without_its_history_file_an_old_version_is_unknown(tmp_path):
    older = without_field(current_schema("generation.avsc"), "group_size")
    registry = registry_with(tmp_path, older)
    value, headers = registry.encode_record(
        registry.by_fingerprint(schema_fingerprint(older)), record_without(generation(), "group_size")
    )

    with pytest.raises(UnknownSchemaError, match="schemas/history"):
        SchemaRegistry.default().decode(value, headers, Generation, topic="t", partition=0, offset=5)


def test_a_new_required_field_cannot_read_old_records(tmp_path):
    newer = with_field(
        current_schema("generation.avsc"),
        {"name": "reward_model", "type": "string", "doc": "Added without a default: a breaking change."},
    )
    registry = registry_with(tmp_path, newer)
    value, headers = registry.encode(generation())

    with pytest.raises(UnknownSchemaError, match="cannot be read as.*reward_model") as raised:
        registry.decode_record(
            value, headers, registry.by_fingerprint(schema_fingerprint(newer)), topic="t", partition=1, offset=2
        )
    assert (raised.value.topic, raised.value.partition, raised.value.offset) == ("t", 1, 2)


def test_an_enum_symbol_the_reader_does_not_know_reads_as_the_enum_default(tmp_path):
    newer = current_schema("generation.avsc")
    finish_reason = next(f for f in newer["fields"] if f["name"] == "finish_reason")
    finish_reason["type"]["symbols"].append("TOOL_CALL")
    registry = registry_with(tmp_path, newer)
    record = to_avro(generation()) | {"finish_reason": "TOOL_CALL"}

    value, headers = registry.encode_record(registry.by_fingerprint(schema_fingerprint(newer)), record)

    assert registry.decode(value, headers, Generation).finish_reason is FinishReason.UNKNOWN


def test_editing_only_docs_keeps_the_fingerprint():
    schema = current_schema("generation.avsc")
    edited = copy.deepcopy(schema)
    edited["doc"] = "reworded"
    edited["fields"][0]["doc"] = "reworded too"

    assert schema_fingerprint(edited) == schema_fingerprint(schema)


# --- rollout_unit v2 -> v3 (Sample.created_at), both ways, through the project's history -------


def rollout_unit(created_at: int) -> RolloutUnit:
    sample = Sample(generation_id="gen-1", prompt_id="prompt-1", policy_version=3,
                    prompt_token_ids=np.array([1, 2], dtype=np.int32),
                    completion_token_ids=np.array([3], dtype=np.int32),
                    completion_logprobs=np.array([-0.25], dtype=np.float32), reward=1.0,
                    finish_reason=FinishReason.LENGTH, temperature=0.5, created_at=created_at)
    return RolloutUnit(unit_id="u-1", recipe="r", group_key="prompt-1", members=(sample,),
                       created_at=T0 + 2_000)


def rollout_unit_v2() -> dict:
    return json.loads((SCHEMAS_DIR / "history" / "rollout_unit" / "v2.avsc").read_text())


def test_a_rollout_unit_written_with_v2_reads_with_sample_created_at_zero():
    registry = SchemaRegistry.default()
    v2 = registry.by_fingerprint(schema_fingerprint(rollout_unit_v2()))
    assert not v2.current
    record = to_avro(rollout_unit(T0))
    del record["members"][0]["created_at"]
    del record["members"][0]["policy_mask"]  # added in v4
    del record["members"][0]["policy_version_known"]  # added in v5

    decoded = registry.decode(*registry.encode_record(v2, record), RolloutUnit)

    assert decoded.members[0].created_at == 0
    assert events_equal(decoded, rollout_unit(0))


def test_a_rollout_unit_written_with_v3_reads_with_v2_without_sample_created_at():
    registry = SchemaRegistry.default()
    v2 = registry.by_fingerprint(schema_fingerprint(rollout_unit_v2()))
    value, headers = registry.encode(rollout_unit(T0))

    record = registry.decode_record(value, headers, v2)

    assert "created_at" not in record["members"][0]
    assert record["members"][0]["temperature"] == 0.5
    assert record["created_at"] == datetime.fromtimestamp((T0 + 2_000) / 1000, tz=timezone.utc)


def test_a_rollout_unit_written_with_v3_keeps_sample_created_at():
    registry = SchemaRegistry.default()
    decoded = registry.decode(*registry.encode(rollout_unit(T0)), RolloutUnit)
    assert decoded.members[0].created_at == T0


# --- the rules every current schema follows -----------------------------------------------


def fields_of_every_record(schema: dict):
    """(record name, field) for every field of the record and the records nested in it."""
    for schema_field in schema["fields"]:
        yield schema["name"], schema_field
        for nested in named_types(schema_field["type"]):
            if nested["type"] == "record":
                yield from fields_of_every_record(nested)


def named_types(avro_type) -> list[dict]:
    """The records and enums defined inside a field's type (through unions, arrays and maps)."""
    if isinstance(avro_type, list):
        return [named for branch in avro_type for named in named_types(branch)]
    if not isinstance(avro_type, dict):
        return []
    if avro_type["type"] in ("record", "enum"):
        return [avro_type]
    if avro_type["type"] == "array":
        return named_types(avro_type["items"])
    if avro_type["type"] == "map":
        return named_types(avro_type["values"])
    return []


def records_and_enums(schema: dict) -> list[dict]:
    found = [schema]
    for schema_field in schema["fields"]:
        for named in named_types(schema_field["type"]):
            found += records_and_enums(named) if named["type"] == "record" else [named]
    return found


@pytest.mark.parametrize("path", CURRENT_FILES, ids=lambda p: p.name)
def test_every_current_schema_follows_the_rules(path):
    schema = json.loads(path.read_text())

    assert schema["namespace"] == "reef.events"
    assert f"reef.events.{schema['name']}" in EVENT_TYPES
    assert schema.get("doc")
    for record, schema_field in fields_of_every_record(schema):
        name = f"{record}.{schema_field['name']}"
        assert schema_field.get("doc"), f"{name} has no doc"
        if isinstance(schema_field["type"], list):
            assert schema_field["type"][0] == "null", f"{name}: nullable unions are ['null', T]"
        if schema_field["type"] == "bytes" and schema_field["name"].endswith("_token_ids"):
            assert schema_field.get("reef.dtype") == "<i4", name
            assert "int32" in schema_field["doc"], name
        if schema_field["type"] == "bytes" and schema_field["name"].endswith("_logprobs"):
            assert schema_field.get("reef.dtype") == "<f4", name
            assert "float32" in schema_field["doc"], name


@pytest.mark.parametrize("path", CURRENT_FILES, ids=lambda p: p.name)
def test_every_dataclass_matches_its_schema(path):
    for named in records_and_enums(json.loads(path.read_text())):
        python_type = getattr(events, named["name"])
        if named["type"] == "enum":
            assert [member.value for member in python_type] == named["symbols"]
            continue
        dataclass_fields = dataclasses.fields(python_type)
        hints = typing.get_type_hints(python_type)
        assert [f.name for f in dataclass_fields] == [f["name"] for f in named["fields"]]
        for py_field, schema_field in zip(dataclass_fields, named["fields"]):
            where = f"{named['name']}.{py_field.name}"
            schema_nullable = isinstance(schema_field["type"], list) and "null" in schema_field["type"]
            assert is_optional(hints[py_field.name]) == schema_nullable, where
            assert py_field.metadata.get("dtype") == schema_field.get("reef.dtype"), where
            if "default" in schema_field:
                assert dataclass_default(py_field) == schema_field["default"], where
            else:
                assert dataclass_default(py_field) is dataclasses.MISSING, where


def is_optional(hint) -> bool:
    return type(None) in typing.get_args(hint)


def dataclass_default(py_field: dataclasses.Field):
    if py_field.default_factory is not dataclasses.MISSING:
        default = py_field.default_factory()
    else:  # an enum field's Avro default is its symbol
        default = getattr(py_field.default, "value", py_field.default)
    if isinstance(default, np.ndarray) and not default.size:
        return ""  # an empty packed array's Avro default is empty bytes
    if isinstance(default, tuple) and not default:
        return []  # an empty tuple of records: an empty Avro array
    return default


# --- rollout_unit v4 -> v5 (Sample.policy_version_known), both ways -------------------------


def test_a_rollout_unit_written_with_v4_reads_as_known_versions_and_v4_skips_the_field():
    registry = SchemaRegistry.default()
    v4 = registry.by_fingerprint(schema_fingerprint(json.loads(
        (SCHEMAS_DIR / "history" / "rollout_unit" / "v4.avsc").read_text())))
    assert not v4.current
    record = to_avro(rollout_unit(T0))
    del record["members"][0]["policy_version_known"]
    decoded = registry.decode(*registry.encode_record(v4, record), RolloutUnit)
    assert decoded.members[0].policy_version_known is True

    written = rollout_unit(T0)
    unknown = dataclasses.replace(written, members=(dataclasses.replace(
        written.members[0], policy_version=0, policy_version_known=False),))
    value, headers = registry.encode(unknown)
    assert registry.decode(value, headers, RolloutUnit).members[0].policy_version_known is False
    assert "policy_version_known" not in registry.decode_record(value, headers, v4)["members"][0]


# --- publication v4 -> v5 (recipe), both ways ---------------------------------------------


def test_a_publication_written_with_v4_reads_without_a_recipe_and_v4_skips_the_field():
    """Publications written before they named their recipe read with ``recipe`` None (the
    evaluator then goes by the evaluator's name, ``publications.written_by``)."""
    registry = SchemaRegistry.default()
    v4 = registry.by_fingerprint(schema_fingerprint(json.loads(
        (SCHEMAS_DIR / "history" / "publication" / "v4.avsc").read_text())))
    assert not v4.current
    written = factories.publication(2, recipe="sao")
    record = to_avro(written)
    del record["recipe"]
    decoded = registry.decode(*registry.encode_record(v4, record), events.Publication)
    assert decoded == dataclasses.replace(written, recipe=None)

    value, headers = registry.encode(written)
    assert registry.decode(value, headers, events.Publication).recipe == "sao"
    assert "recipe" not in registry.decode_record(value, headers, v4)
