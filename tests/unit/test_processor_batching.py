"""The processor's per-fetch batching: ``ProcessorState.offer_all`` decides exactly what one
``offer`` per record decides, and a snapshot made from the bytes a record was read as
(``snapshots.Encoded``) restores the same event as one made by encoding it again (no broker)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from reef_stream.api.processor import Origin
from reef_stream.core.events import Feedback, Generation
from reef_stream.core.serde import FINGERPRINT_HEADER, SchemaRegistry
from reef_stream.engine.join import ProcessorState
from reef_stream.engine.snapshots import Encoded, dumps_snapshot, loads_snapshot
from reef_stream.engine.testing import Advance, NewCheckpoint
from tests.unit.test_processor import GROUPED, _stream, feedback, generation


def _decided(steps) -> tuple:
    """Everything a sequence of steps decided, in order, and the keys they touched."""
    units = [(u.unit_id, u.member_ids) for s in steps for u in s.units]
    generations = [(o.generation_id, o.outcome, o.reason, o.unit_id, o.origin, o.at)
                   for s in steps for o in s.generations]
    fates = [(o.feedback.feedback_id, o.fate, o.reason, o.origin, o.at, o.policy_version)
             for s in steps for o in s.feedback]
    duplicates = [(d.generation.generation_id, d.reason) for s in steps for d in s.duplicates]
    counts: Counter[str] = Counter()
    for s in steps:
        s.count_into(counts)
    return units, generations, fates, duplicates, counts


def _state_of(state: ProcessorState) -> dict:
    return {key: state.snapshot(key) for key in state.keys()}


@pytest.mark.parametrize("seed", range(8))
def test_offering_a_batch_decides_what_offering_each_record_does(seed):
    rng = random.Random(seed)
    records = _stream(rng, groups=40)
    one = ProcessorState(GROUPED, recipe="r", max_staleness=2)
    batched = ProcessorState(GROUPED, recipe="r", max_staleness=2)
    one_steps, batch_steps, touched_one, touched_batch = [], [], set(), set()
    now, pending = 0, []

    def flush():
        if pending:
            step = batched.offer_all(pending)
            batch_steps.append(step)
            touched_batch.update(step.touched)
            pending.clear()

    for number, record in enumerate(records):
        if isinstance(record, (Generation, Feedback)):
            origin = Origin("t", 0, number)
            step = one.offer(record, at=now, origin=origin)
            one_steps.append(step)
            touched_one.update(step.touched)
            pending.append((record, now, origin, None))
            now += rng.choice([0, 1, 5])
        if isinstance(record, (Advance, NewCheckpoint)) or rng.random() < 0.1:
            flush()  # the runtime ticks and observes checkpoints between its batches
            if isinstance(record, Advance):
                now += record.ms
            for state, steps, touched in ((one, one_steps, touched_one),
                                          (batched, batch_steps, touched_batch)):
                step = (state.observe_checkpoint(record.policy_version)
                        if isinstance(record, NewCheckpoint) else state.tick(now))
                steps.append(step)
                touched.update(step.touched)
    flush()
    assert _decided(batch_steps) == _decided(one_steps)
    assert touched_batch == touched_one
    assert _state_of(batched) == _state_of(one)
    assert batched.next_deadline() == one.next_deadline()
    assert batched.pending_generations() == one.pending_generations()
    # and what is pending still ends the same
    end = now + 10 * GROUPED.feedback.timeout_ms
    assert _decided([batched.tick(end)]) == _decided([one.tick(end)])


def test_step_counts_are_the_counted_outcomes():
    state = ProcessorState(GROUPED, recipe="r", max_staleness=None)
    step = state.offer_all([(generation("a", "grp", 2), 1, None, None),
                            (generation("a", "grp", 2), 2, None, None),
                            (feedback("a", group="grp"), 3, None, None),
                            (feedback("x", source="elsewhere"), 4, None, None),
                            (generation("b", "grp", 2), 5, None, None),
                            (feedback("b", group="grp"), 6, None, None)])
    assert step.counts() == Counter({"generations.unit": 2, "generations.duplicate": 1,
                                     "feedback.used": 2, "feedback.ignored": 1, "units": 1})


def _encoded(event, registry=None) -> Encoded:
    value, headers = (registry or SchemaRegistry.default()).encode(event)
    return Encoded(value, dict(headers)[FINGERPRINT_HEADER])


def test_a_snapshot_from_the_bytes_read_equals_one_encoded_again():
    """With the current schema the bytes read are the bytes an encoding makes: the changelog
    holds the same snapshot either way."""
    gen, fb = generation("a", "grp", 2), feedback("b", group="grp")
    kept = ProcessorState(GROUPED, recipe="r")
    kept.offer_all([(gen, 10, None, _encoded(gen)), (fb, 11, None, _encoded(fb))])
    again = ProcessorState(GROUPED, recipe="r")
    again.offer_all([(gen, 10, None, None), (fb, 11, None, None)])
    assert dumps_snapshot(kept.snapshot("grp")) == dumps_snapshot(again.snapshot("grp"))
    fresh = ProcessorState(GROUPED, recipe="r")
    fresh.restore("grp", loads_snapshot(dumps_snapshot(kept.snapshot("grp"))))
    assert fresh.snapshot("grp") == again.snapshot("grp")



def _check_bytes(state: ProcessorState, keys) -> None:
    for key in keys:
        snapshot = state.snapshot(key)
        expected = None if snapshot is None else dumps_snapshot(snapshot)
        assert state.snapshot_bytes(key) == expected, key


@pytest.mark.parametrize("seed", range(6))
def test_snapshot_bytes_are_the_dumped_snapshot_through_growth_updates_and_expiry(seed):
    """The changelog record the runtime writes (``snapshot_bytes``, a ledger segment's from its
    entries' kept text) is byte for byte ``dumps_snapshot(snapshot(key))`` after every step:
    segments growing, entries updated by late feedback and closing groups, expired in part
    and whole, over many segments; and a state restored from those bytes has the same ones."""
    rng = random.Random(seed)
    records = _stream(rng, groups=60)
    state = ProcessorState(GROUPED, recipe="r", max_staleness=2, retention_ms=2_500)
    now, table = 0, {}
    for number, record in enumerate(records):
        if isinstance(record, Advance):
            step = state.tick(now := now + record.ms)
        elif isinstance(record, NewCheckpoint):
            step = state.observe_checkpoint(record.policy_version)
        else:
            step = state.offer(record, at=now, origin=Origin("t", 0, number))
            now += rng.choice([0, 40, 150])
        if rng.random() < 0.3:
            step = state.tick(now)
        _check_bytes(state, step.touched)
        for key in step.touched:
            data = state.snapshot_bytes(key)
            table.pop(key, None) if data is None else table.__setitem__(key, data)
        if rng.random() < 0.05:
            _check_bytes(state, state.keys())
    _check_bytes(state, state.keys())
    fresh = ProcessorState(GROUPED, recipe="r", max_staleness=2, retention_ms=2_500)
    for key, data in table.items():
        fresh.restore(key, loads_snapshot(data))
    assert {k: fresh.snapshot_bytes(k) for k in fresh.keys()} == table
    for later in (now + 10_000, now + 20_000):  # all concludes, then expires
        step = fresh.tick(later)
        _check_bytes(fresh, step.touched)
    assert fresh.keys() == []


def test_a_digest_restored_into_a_later_segment_leaves_the_earlier_one():
    from reef_stream.engine.ledger import segment_key

    state = ProcessorState(GROUPED, recipe="r")
    state.offer(generation("a"), at=500)
    state.tick(500 + GROUPED.feedback.timeout_ms)  # a expires in segment 1
    first = segment_key(1)
    assert state.snapshot_bytes(first) is not None
    later = loads_snapshot(state.snapshot_bytes(first))
    later["segment"] = 3
    later["generations"] = [[d, 3_200, *rest] for d, _, *rest in later["generations"]]
    state.restore(segment_key(3), later)
    _check_bytes(state, [first, segment_key(3)])
    assert state.snapshot_bytes(first) is None


def test_snapshot_bytes_escape_text_as_json_does():
    odd = 'grp "ü\\\n\u2028'
    state = ProcessorState(GROUPED, recipe="r")
    step = state.offer_all([(generation("a", odd, 2), 10, None, None),
                            (generation("b", odd, 3), 11, None, None)])  # sizes disagree
    assert {o.outcome.name for o in step.generations} == {"INVALID"}
    _check_bytes(state, step.touched)
    _check_bytes(state, state.keys())
