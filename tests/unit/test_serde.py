"""The typed serde: every event round-trips; bad messages raise typed errors with their location."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from fastavro.schema import to_parsing_canonical_form

from reef_stream.core import serde
from reef_stream.core.errors import (
    ConfigurationError, CorruptRecordError, InvalidRecord, UnknownSchemaError,
)
from reef_stream.core.events import (
    EVENT_TYPES, Checkpoint, DeadLetter, Decision, DecisionKind, DecisionOutcome,
    DecisionRequest, Feedback, FinishReason, Generation,
    MessageHeader, Metric, Publication, RolloutUnit, Sample, SamplingParams, TopicOffset,
    events_equal, to_avro,
)
from reef_stream.core.serde import (
    FINGERPRINT_HEADER, SCHEMA_NAME_HEADER, SchemaRegistry, decode, encode, encode_record,
    schema_fingerprint,
)
from reef_stream.core.settings import SCHEMAS_DIR
from tests import factories

T0 = 1_732_885_200_123  # 2024-11-29T13:00:00.123Z
WHERE = {"topic": "reef.generations", "partition": 3, "offset": 41}


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def logprobs(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def generation(**overrides) -> Generation:
    """A realistic generation through the factory (tests/factories.py): every field its own."""
    fields = dict(
        generation_id="gen-0001",
        request_id="req-17",
        prompt_id="gsm8k/train/42",
        group_id="grp-9",
        group_size=8,
        model="qwen2.5-0.5b",
        policy_version=12,
        replica_id="vllm-a",
        prompt_token_ids=ids(151644, 872, 198, 3838, 374),
        completion_token_ids=ids(785, 4226, 374, 220, 19, 13, 151645),
        completion_logprobs=logprobs(-0.01, -1.5, -0.25, -3.0, -0.0, -0.7, -0.002),
        finish_reason=FinishReason.STOP,
        sampling=SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_tokens=512, seed=1234),
        created_at=T0,
        metadata={"dataset": "gsm8k", "prompt_key": "√2 ≈ 1.414 — 日本語"},
    )
    fields.update(overrides)
    return factories.generation(**fields)


def sample(generation_id: str, reward: float) -> Sample:
    return factories.sample(generation_id, prompt_id="gsm8k/train/42", policy_version=11,
                            completion_logprobs=logprobs(-0.5, -0.25), reward=reward,
                            reward_components={"format": 0.5, "correct": reward - 0.5})


EXAMPLES = [
    generation(),
    generation(
        group_id=None,
        group_size=1,
        prompt_id="prompt-ünïcødé-🙂",
        completion_token_ids=ids(),
        completion_logprobs=logprobs(),
        finish_reason=FinishReason.ABORT,
        sampling=SamplingParams(max_tokens=16),
        metadata={},
    ),
    Feedback(
        feedback_id="fb-1",
        generation_id="gen-0001",
        group_id="grp-9",
        source="judge:gpt",
        reward=0.75,
        components={"helpful": 1.0, "harmless": 0.5},
        created_at=T0 + 5,
    ),
    Feedback(feedback_id="fb-2", generation_id="gen-2", source="exact_match", reward=-1.0, created_at=T0),
    RolloutUnit(
        unit_id="unit-grp-9",
        recipe="sao",
        group_key="grp-9",
        members=(sample("gen-1", 1.0), sample("gen-2", 0.0)),
        created_at=T0,
    ),
    RolloutUnit(unit_id="unit-empty", recipe="sao", group_key="grp-0", members=(), created_at=T0),
    Checkpoint(
        checkpoint_id="ckpt-000100",
        recipe="sao",
        trainer_group="trainer.sao",
        step=100,
        model="qwen2.5-0.5b",
        policy_version=13,
        uri="file:///var/reef/ckpt/000100",
        sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        offsets=(TopicOffset(topic="reef.units.sao", partition=0, offset=1200),
                 TopicOffset(topic="reef.units.sao", partition=1, offset=0)),
        trained_unit_count=6400,
        metrics={"loss": 0.125, "kl": 0.003},
        created_at=T0,
    ),
    Publication(
        model="qwen2.5-0.5b",
        policy_version=13,
        checkpoint_id="ckpt-000100",
        uri="file:///var/reef/ckpt/000100",
        sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        decision=Decision.PROMOTED,
        reason="accuracy 0.61 > incumbent 0.58",
        evaluator="heldout_accuracy",
        evaluated=True,
        measurement={"accuracy": 0.61},
        incumbent_version=12,
        created_at=T0,
    ),
    Publication(
        model="qwen2.5-0.5b",
        policy_version=1,
        checkpoint_id="ckpt-000001",
        uri="file:///var/reef/ckpt/000001",
        sha256="00" * 32,
        decision=Decision.REJECTED,
        reason="NOT EVALUATED: the default evaluator accepts everything",
        evaluator="accept_all",
        evaluated=False,
        created_at=T0,
    ),
    Metric(stage="trainer", name="trainer.loss", value=0.125, labels={"recipe": "sao"}, created_at=T0),
    DeadLetter(
        reason="reward is NaN",
        error_type="InvalidRecord",
        source_topic="reef.feedback",
        source_partition=2,
        source_offset=991,
        key=b"gen-0001",
        value=b"\x00\xff raw bytes",
        headers=(MessageHeader(key="reef-schema", value=b"reef.events.Feedback"),
                 MessageHeader(key="trace", value=None),
                 MessageHeader(key="trace", value=b"2")),
        stage="processor",
        created_at=T0,
    ),
    DeadLetter(
        reason="oversized",
        error_type="InvalidRecord",
        source_topic="reef.generations",
        value=None,
        headers=(),
        stage="intake",
        created_at=T0,
    ),
    DecisionRequest(request_id="r1", kind=DecisionKind.ROLLBACK, model="m", version=3,
                    rolled_back_to=1, decided_by="ann", created_at=T0),
    DecisionOutcome(request_id="r1", model="m", applied=False, text="not waiting",
                    evaluator_group="reef.evaluate.sao", created_at=T0),
]


def test_the_examples_cover_every_event_type():
    assert {type(event) for event in EXAMPLES} == set(EVENT_TYPES.values())


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event):
    value, headers = encode(event)

    assert events_equal(decode(value, headers, type(event)), event)
    assert events_equal(decode(value, headers), event)  # the type named by the writer schema


def test_headers_name_the_writer_schema_by_its_avro_fingerprint():
    _, headers = encode(EXAMPLES[0])

    schema = json.loads((SCHEMAS_DIR / "generation.avsc").read_text())
    fingerprint = dict(headers)[FINGERPRINT_HEADER]
    assert dict(headers)[SCHEMA_NAME_HEADER] == b"reef.events.Generation"
    assert fingerprint == schema_fingerprint(schema)
    assert fingerprint == SchemaRegistry.default().current("reef.events.Generation").fingerprint
    # The reference algorithm of the Avro specification, read as a big-endian 64-bit number.
    canonical = to_parsing_canonical_form(schema).encode()
    assert int.from_bytes(fingerprint, "big") == crc64_avro(canonical)


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO (Rabin) as the Avro specification writes it."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_headers_may_be_a_dict_or_a_list_with_other_headers():
    event = EXAMPLES[2]
    value, headers = encode(event)

    assert events_equal(decode(value, dict(headers), Feedback), event)
    assert events_equal(decode(value, [("traceparent", None), *headers], Feedback), event)


def test_packed_arrays_are_little_endian_and_decode_without_a_copy():
    event = generation(prompt_token_ids=np.array([1, 2, 258], dtype=">i4"))
    value, headers = encode(event)

    assert np.array([1, 2, 258], dtype="<i4").tobytes() in value
    decoded = decode(value, headers, Generation)
    for array in (decoded.prompt_token_ids, decoded.completion_token_ids, decoded.completion_logprobs):
        assert not array.flags.owndata
        assert isinstance(array.base, bytes)
        assert not array.flags.writeable
    assert decoded.prompt_token_ids.dtype == np.dtype("<i4")
    assert decoded.completion_logprobs.dtype == np.dtype("<f4")
    assert decoded.prompt_token_ids.tolist() == [1, 2, 258]


# --- bad messages -----------------------------------------------------------------------

VALUE, HEADERS = encode(EXAMPLES[0])
UNKNOWN_FP = [(FINGERPRINT_HEADER, b"\x00" * 8), (SCHEMA_NAME_HEADER, b"reef.events.Generation")]
GARBAGE = random.Random(7).randbytes(200)

BAD_MESSAGES = {
    "truncated": (VALUE[:-1], HEADERS, CorruptRecordError),
    "cut in half": (VALUE[: len(VALUE) // 2], HEADERS, CorruptRecordError),
    "garbage": (GARBAGE, HEADERS, CorruptRecordError),
    "all ones": (b"\xff" * 64, HEADERS, CorruptRecordError),
    "trailing bytes": (VALUE + b"\x00", HEADERS, CorruptRecordError),
    "empty": (b"", HEADERS, CorruptRecordError),
    "tombstone": (None, HEADERS, CorruptRecordError),
    "no headers": (VALUE, None, UnknownSchemaError),
    "no fingerprint header": (VALUE, [(SCHEMA_NAME_HEADER, b"reef.events.Generation")], UnknownSchemaError),
    "unknown fingerprint": (VALUE, UNKNOWN_FP, UnknownSchemaError),
    "fingerprint of the wrong length": (VALUE, [(FINGERPRINT_HEADER, b"\x01\x02")], UnknownSchemaError),
    "another event type": (*encode(EXAMPLES[2]), UnknownSchemaError),
}


@pytest.mark.parametrize("case", BAD_MESSAGES)
def test_bad_messages_raise_a_typed_error_saying_where_they_were_read(case):
    value, headers, error_type = BAD_MESSAGES[case]

    with pytest.raises(error_type) as raised:
        decode(value, headers, Generation, **WHERE)

    error = raised.value
    assert (error.topic, error.partition, error.offset) == ("reef.generations", 3, 41)
    assert "reef.generations[3]@41" in str(error)


def test_mutated_messages_decode_or_raise_a_typed_error_never_anything_else():
    rng = random.Random(1)
    for _ in range(1000):
        event = rng.choice(EXAMPLES)
        value, headers = encode(event)
        mutated = bytearray(value)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if rng.random() < 0.3:
            del mutated[rng.randrange(len(mutated)) :]
        try:
            decode(bytes(mutated), headers, type(event))
        except (CorruptRecordError, UnknownSchemaError):
            pass


def test_an_unknown_fingerprint_error_says_what_to_deploy():
    with pytest.raises(UnknownSchemaError, match="0000000000000000.*reef.events.Generation.*schemas/history"):
        decode(VALUE, UNKNOWN_FP, Generation)


def test_reading_one_event_type_as_another_says_they_cannot_be_resolved():
    with pytest.raises(UnknownSchemaError, match="reef.events.Feedback.*cannot be read as.*Generation"):
        decode(*encode(EXAMPLES[2]), Generation)


def test_trailing_bytes_are_reported_as_left_over():
    with pytest.raises(CorruptRecordError, match="1 bytes left over"):
        decode(VALUE + b"\x00", HEADERS, Generation)


def test_a_packed_field_of_partial_items_is_corrupt_and_names_the_field():
    record = to_avro(EXAMPLES[0]) | {"completion_logprobs": b"\x00" * 5}
    value, headers = encode_record("reef.events.Generation", record)

    with pytest.raises(CorruptRecordError) as raised:
        decode(value, headers, Generation, **WHERE)

    assert raised.value.field == "completion_logprobs"
    assert raised.value.offset == 41


# --- encoding errors --------------------------------------------------------------------


def test_encoding_a_value_that_does_not_fit_its_field_is_an_invalid_record():
    with pytest.raises(InvalidRecord, match="Generation"):
        encode(generation(policy_version="twelve"))
    with pytest.raises(InvalidRecord) as raised:
        encode(generation(completion_token_ids=np.array([1.5, 2.5])))
    assert raised.value.field == "completion_token_ids"


def test_encode_record_rejects_fields_the_schema_does_not_have():
    metric = Metric(stage="trainer", name="trainer.loss", value=0.1, created_at=T0)
    record = to_avro(metric) | {"valeu": 1.0}

    with pytest.raises(InvalidRecord, match="valeu"):
        encode_record("reef.events.Metric", record)


# --- the registry -----------------------------------------------------------------------


def test_the_default_registry_is_loaded_once_and_knows_every_event():
    registry = SchemaRegistry.default()

    assert registry is SchemaRegistry.default()
    assert {known.name for known in registry.schemas() if known.current} == set(EVENT_TYPES)


def test_no_schema_is_parsed_per_record(monkeypatch):
    registry = SchemaRegistry.default()

    def parse_schema_again(*args, **kwargs):
        raise AssertionError("a schema was parsed on the per-record path")

    monkeypatch.setattr(serde, "parse_schema", parse_schema_again)
    for event in EXAMPLES:
        assert events_equal(registry.decode(*registry.encode(event)), event)


def test_a_registry_reports_every_broken_schema_file_at_once(tmp_path):
    (tmp_path / "a.avsc").write_text("{not json")
    (tmp_path / "b.avsc").write_text(json.dumps({"type": "record", "name": "B", "fields": [{"name": "x"}]}))

    with pytest.raises(ConfigurationError) as raised:
        SchemaRegistry(schemas_dir=tmp_path)

    assert len(raised.value.problems) == 2
    assert "a.avsc" in raised.value.problems[0] and "b.avsc" in raised.value.problems[1]


def test_a_registry_refuses_an_extra_directory_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigurationError, match="not a directory"):
        SchemaRegistry(dirs=[tmp_path / "missing"])
