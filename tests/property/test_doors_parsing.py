"""Bad input at the doors, without a broker: the parsing and validation every door shares.

Properties, over many generated examples:

- any JSON value given to ``formats.parse_record`` (what ``reef produce`` and the HTTP intake
  call for each record) either becomes events that every reader can decode back unchanged, or
  raises ``InvalidRecord``; nothing else ever escapes;
- a valid record with one field broken (a wrong type, missing, NaN or an infinity, a negative
  version, a lone surrogate, past int32, an unknown field, ...) is rejected with an
  ``InvalidRecord`` naming that field;
- an SDK event with a hostile Python value in any field is refused by ``validate`` naming the
  field, or else it encodes, decodes to an equal event and fits its Avro types: the producer
  never hands over a record that a reader would dead-letter;
- a raw message that is not a record of the reader's schema raises ``InvalidRecord``
  (``UnknownSchemaError`` or ``CorruptRecordError``) from ``serde.decode`` and nothing else.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reef_stream.core.errors import CorruptRecordError, InvalidRecord, UnknownSchemaError
from reef_stream.core.events import (
    Checkpoint, Decision, Feedback, Generation, Publication, RolloutUnit,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.intake.formats import parse_record
from reef_stream.intake.validation import validate
from tests.property.hostile import (
    INT32_MAX, MAX_MILLIS, Mutation, feedback_event, generation_event, hostile_feedback_event,
    hostile_generation_event, hostile_json, json_roundtrip, mutated_feedback, mutated_generation,
    native_feedback, native_generation, raw_message,
)
from tests.unit_log import rollout_unit

MANY = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
registry = SchemaRegistry.default()


def assert_readers_get_it_back(event) -> None:
    """``event`` passed validation: it encodes, decodes equal and fits its Avro int fields."""
    value, headers = registry.encode(event)
    back = registry.decode(value, headers, type(event))
    assert registry.encode(back)[0] == value, (event, back)
    if isinstance(event, Generation):
        for name, number in (("group_size", event.group_size),
                             ("sampling.max_tokens", event.sampling.max_tokens),
                             ("sampling.top_k", event.sampling.top_k)):
            assert -(2**31) <= number <= INT32_MAX, f"{name} {number} is past the Avro int"
    assert 0 <= event.created_at <= MAX_MILLIS


@MANY
@given(kind=st.sampled_from(["generations", "feedback"]), value=hostile_json())
def test_any_json_value_becomes_readable_events_or_an_invalid_record(kind, value):
    try:
        events = parse_record(kind, json_roundtrip(value))
    except InvalidRecord:
        return
    for event in events:
        validate(event)
        assert_readers_get_it_back(event)


@MANY
@given(record=native_generation())
def test_valid_native_generations_pass_and_read_back(record):
    (generation,) = parse_record("generations", json_roundtrip(record))
    assert generation.generation_id == record["generation_id"]
    assert_readers_get_it_back(generation)


@MANY
@given(record=native_feedback())
def test_valid_native_feedback_passes_and_reads_back(record):
    (feedback,) = parse_record("feedback", json_roundtrip(record))
    assert feedback.reward == record["reward"]
    assert_readers_get_it_back(feedback)


def _rejected_naming(kind: str, mutation: Mutation) -> InvalidRecord:
    try:
        events = parse_record(kind, json_roundtrip(mutation.record))
    except InvalidRecord as error:
        assert mutation.names_the_field(error.field), (
            f"{mutation.what}: the error names {error.field!r}, not {mutation.field!r}: {error}")
        assert error.reason and str(error)
        return error
    raise AssertionError(f"{mutation.what} was accepted: {events}")


@MANY
@given(mutation=mutated_generation())
def test_a_generation_with_a_broken_field_is_rejected_naming_it(mutation):
    _rejected_naming("generations", mutation)


@MANY
@given(mutation=mutated_feedback())
def test_feedback_with_a_broken_field_is_rejected_naming_it(mutation):
    _rejected_naming("feedback", mutation)


@MANY
@given(st.one_of(hostile_generation_event(), hostile_feedback_event()))
def test_sdk_events_are_refused_naming_the_field_or_read_back_unchanged(drawn):
    event, name = drawn
    try:
        validate(event)
    except InvalidRecord as error:
        assert error.field is not None, f"{name}: {error}"
        partners = {"completion_token_ids": "completion_logprobs",
                    "completion_logprobs": "completion_token_ids", "group_size": "group_id"}
        assert error.field.split(".")[0] in (name, partners.get(name)), \
            (name, error.field, str(error))
        return
    assert_readers_get_it_back(event)


def test_duplicate_ids_are_accepted_at_the_door_and_read_back_alike():
    """Duplicates are the readers' to drop (by generation id, by feedback source): the door takes
    both copies; the processor test shows they are counted and dropped."""
    first, second = generation_event("dup"), generation_event("dup", policy_version=1)
    for event in (first, second, feedback_event("dup"), feedback_event("dup")):
        validate(event)
        assert_readers_get_it_back(event)


READERS = [(Generation, generation_event()), (Feedback, feedback_event()),
           (RolloutUnit, rollout_unit(0)),
           (Checkpoint, Checkpoint(checkpoint_id="c", recipe="r", trainer_group="t", step=1,
                                   model="m", policy_version=1, uri="file:///x", sha256="0" * 64,
                                   offsets=(), trained_unit_count=0, created_at=1)),
           (Publication, Publication(model="m", policy_version=1, checkpoint_id="c", uri="u",
                                     sha256="s", decision=Decision.PROMOTED, reason="r",
                                     evaluator="e", evaluated=True, created_at=1))]


@MANY
@given(data=st.data())
def test_raw_messages_that_are_not_the_readers_schema_raise_invalid_record(data):
    reader, sample = data.draw(st.sampled_from(READERS))
    message = data.draw(raw_message(reader, sample))  # the strategy keeps what does not decode
    try:
        registry.decode(message.value, message.headers, reader, topic="t", partition=0, offset=7)
    except (UnknownSchemaError, CorruptRecordError) as error:
        assert (error.topic, error.partition, error.offset) == ("t", 0, 7)
        assert error.reason
    else:
        raise AssertionError(f"{message.what} decoded as {reader.__name__}")

