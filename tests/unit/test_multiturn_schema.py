"""Multi-turn trajectories in the events: Generation v2 (segments) and RolloutUnit v4 (a sample's
policy_mask) read records written before them, and are read by readers from before them."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import (
    Generation, RolloutUnit, Sample, SamplingParams, Segment, SegmentSource,
    events_equal, mask_problem, to_avro,
)
from reef_stream.core.serde import SchemaRegistry, schema_fingerprint
from reef_stream.core.settings import SCHEMAS_DIR
from tests import factories

POLICY, ENVIRONMENT = SegmentSource.POLICY, SegmentSource.ENVIRONMENT


def history(event: str, version: int) -> dict:
    return json.loads((SCHEMAS_DIR / "history" / event / f"v{version}.avsc").read_text())


def generation(segments=(), completion=(4, 5, 6, 7), logprobs=(-0.5, 0.0, 0.0, -1.0)) -> Generation:
    return factories.generation(
        "gen-1", request_id="req-1", prompt_id="prompt-1", policy_version=7, replica_id="replica-0",
        completion_token_ids=factories.ids(completion),
        completion_logprobs=factories.logprobs(logprobs), sampling=SamplingParams(max_tokens=8),
        created_at=1_732_885_200_123, segments=tuple(segments))


TOOL_CALL = (Segment(source=POLICY, length=1, role="assistant"),
             Segment(source=ENVIRONMENT, length=2, role="tool:add"),
             Segment(source=POLICY, length=1, role="assistant"))


def test_a_generation_written_with_v1_reads_as_single_turn():
    registry = SchemaRegistry.default()
    v1 = registry.by_fingerprint(schema_fingerprint(history("generation", 1)))
    assert not v1.current
    record = to_avro(generation())
    del record["segments"]

    decoded = registry.decode(*registry.encode_record(v1, record), Generation)

    assert decoded.segments == ()
    assert events_equal(decoded, generation())
    assert decoded.policy_mask().size == 0  # every token is the policy's
    (turn,) = decoded.turns()
    assert turn.source is POLICY and turn.token_ids.tolist() == [4, 5, 6, 7]


def test_a_multi_turn_generation_round_trips_and_a_v1_reader_skips_its_segments():
    registry = SchemaRegistry.default()
    multi = generation(TOOL_CALL)
    value, headers = registry.encode(multi)

    decoded = registry.decode(value, headers, Generation)
    assert events_equal(decoded, multi)
    assert SchemaRegistry(compiled=False).encode(multi)[0] == value  # the reference's bytes

    v1 = registry.by_fingerprint(schema_fingerprint(history("generation", 1)))
    old = registry.decode_record(value, headers, v1)
    assert "segments" not in old
    assert np.frombuffer(old["completion_token_ids"], "<i4").tolist() == [4, 5, 6, 7]


def test_turns_and_policy_mask_follow_the_segments():
    multi = generation(TOOL_CALL)
    assert multi.policy_mask().tolist() == [1, 0, 0, 1]
    turns = multi.turns()
    assert [(t.source, t.role, t.start, t.token_ids.tolist()) for t in turns] == [
        (POLICY, "assistant", 0, [4]), (ENVIRONMENT, "tool:add", 1, [5, 6]),
        (POLICY, "assistant", 3, [7])]
    assert turns[0].logprobs.tolist() == [-0.5] and turns[1].logprobs is None
    # Only POLICY segments (turn boundaries, no tool): nothing masked, the mask stays empty.
    two = generation((Segment(source=POLICY, length=2), Segment(source=POLICY, length=2)))
    assert two.policy_mask().size == 0


@pytest.mark.parametrize("lengths", [(1, 2), (1, 2, 2), (0, 3, 1)])
def test_segments_that_do_not_split_the_completion_are_named(lengths):
    segments = [Segment(source=POLICY if i % 2 == 0 else ENVIRONMENT, length=n)
                for i, n in enumerate(lengths)]
    bad = generation(segments)
    with pytest.raises(InvalidRecord) as error:
        bad.policy_mask()
    assert error.value.field == "segments"
    with pytest.raises(InvalidRecord):
        bad.turns()


def test_a_segment_source_this_reader_does_not_know_reads_as_environment(tmp_path):
    newer = copy.deepcopy(json.loads((SCHEMAS_DIR / "generation.avsc").read_text()))
    segment = next(f for f in newer["fields"] if f["name"] == "segments")["type"]["items"]
    segment["fields"][0]["type"]["symbols"].append("JUDGE")
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation" / "v99.avsc").write_text(json.dumps(newer))
    registry = SchemaRegistry(dirs=[tmp_path])
    newer_schema = registry.by_fingerprint(schema_fingerprint(newer))
    record = to_avro(generation(TOOL_CALL))
    record["segments"][1]["source"] = "JUDGE"

    decoded = registry.decode(*registry.encode_record(newer_schema, record), Generation)

    assert decoded.segments[1].source is ENVIRONMENT  # masked, never trained
    assert decoded.policy_mask().tolist() == [1, 0, 0, 1]


def sample(mask=None) -> Sample:
    extra = {} if mask is None else {"policy_mask": np.array(mask, dtype=np.uint8)}
    return factories.sample("gen-1", prompt_id="prompt-1", policy_version=3,
                            prompt_token_ids=factories.ids([1, 2]),
                            completion_token_ids=factories.ids([4, 5, 6, 7]),
                            completion_logprobs=factories.logprobs([-0.5, 0, 0, -1]),
                            created_at=1_732_885_200_000, **extra)


def unit(member: Sample) -> RolloutUnit:
    return factories.rollout_unit(member, unit_id="u-1", recipe="r",
                                  created_at=1_732_885_201_000)


def test_a_rollout_unit_written_with_v3_reads_with_an_empty_policy_mask():
    registry = SchemaRegistry.default()
    v3 = registry.by_fingerprint(schema_fingerprint(history("rollout_unit", 3)))
    assert not v3.current
    record = to_avro(unit(sample()))
    del record["members"][0]["policy_mask"]
    del record["members"][0]["policy_version_known"]  # added in v5

    for compiled in (True, False):
        decoded = SchemaRegistry(compiled=compiled).decode(
            *registry.encode_record(v3, record), RolloutUnit)
        mask = decoded.members[0].policy_mask
        assert mask.dtype == np.uint8 and mask.size == 0
        assert events_equal(decoded, unit(sample()))


def test_a_rollout_unit_with_a_mask_round_trips_and_a_v3_reader_skips_it():
    registry = SchemaRegistry.default()
    masked = unit(sample([1, 0, 0, 1]))
    value, headers = registry.encode(masked)

    assert registry.decode(value, headers, RolloutUnit).members[0].policy_mask.tolist() == [
        1, 0, 0, 1]
    assert SchemaRegistry(compiled=False).encode(masked)[0] == value
    v3 = registry.by_fingerprint(schema_fingerprint(history("rollout_unit", 3)))
    assert "policy_mask" not in registry.decode_record(value, headers, v3)["members"][0]
    # an unmasked sample costs one byte: the empty bytes' length (and v5's boolean one more)
    plain = registry.encode(unit(sample()))[0]
    old = registry.encode_record(v3, {**to_avro(unit(sample())), "members": [
        {k: v for k, v in to_avro(sample()).items()
         if k not in ("policy_mask", "policy_version_known")}]})[0]
    assert len(plain) == len(old) + 2


@pytest.mark.parametrize(("mask", "problem"), [
    ([], None), ([1, 0, 0, 1], None), ([1, 1, 1, 1], None),
    ([1, 0, 1], "3 values for 4 completion tokens"),
    ([1, 0, 2, 1], "other than 0 and 1"),
    ([0, 0, 0, 0], "nothing to train"),
])
def test_mask_problem(mask, problem):
    found = mask_problem(np.array(mask, dtype=np.uint8), 4)
    assert found is None if problem is None else problem in found
