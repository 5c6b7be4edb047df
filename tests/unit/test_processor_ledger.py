"""What the processor state keeps of concluded generations and closed groups (no broker).

A concluded generation is remembered, for the retention, by a ledger entry
without any of its records (``reef_stream.engine.ledger``); these tests
hold it to the promises that entry serves: a duplicate of a concluded
generation (or of its feedback) is still recognised, a generation for a
closed group still refused, until exactly ``retention_ms`` after the end; a
state restored from the changelog equals the live one; and a concluded
generation costs far less memory than its records did.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc

import pytest

from reef_stream.api.parts import ByGroupId, ComposedProcessor, Ungrouped
from reef_stream.api.processor import DEFAULT_RETENTION_MS, unit_id
from reef_stream.consumers.processor.runtime import _key_bytes, _key_str
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Feedback, Generation
from reef_stream.engine.join import FeedbackFate, Outcome, ProcessorState
from reef_stream.engine.ledger import segment_key, segment_of
from reef_stream.engine.snapshots import dumps_snapshot, loads_snapshot
from reef_stream.engine.testing import Advance, NewCheckpoint, Restart, run_processor
from tests.unit.test_processor import GROUPED, TIMEOUT, _AlsoWants, _stream, feedback, generation

UNGROUPED = ComposedProcessor(grouping=Ungrouped(), feedback=GROUPED.feedback)
WITH_JUDGE = ComposedProcessor(grouping=ByGroupId(), feedback=_AlsoWants(GROUPED.feedback, "judge"))
RETENTION = 10 * TIMEOUT


def fates(out, feedback_id: str) -> list[FeedbackFate]:
    return [o.fate for o in out.fates_of(feedback_id)]


# --------------------------------------------------------------------------- what is kept


def test_a_concluded_generation_leaves_a_ledger_entry_and_none_of_its_records():
    state = ProcessorState(UNGROUPED, recipe="r")
    state.offer_generation(generation("gen-7f3a"), at=5_000)
    assert state.keys() == ["gen-7f3a"]  # pending: its own key, with its records
    assert "avro" in json.dumps(state.snapshot("gen-7f3a"))
    step = state.offer_feedback(feedback("gen-7f3a"), at=5_001)
    assert [o.outcome for o in step.generations] == [Outcome.UNIT]
    # its key is deleted from the changelog; its ledger segment (second 5) is written
    assert set(step.touched) == {"gen-7f3a", segment_key(5)}
    assert state.snapshot("gen-7f3a") is None and state.keys() == [segment_key(5)]
    record = state.snapshot(segment_key(5))
    ((digest, at, outcome, sources, own_group),) = record["generations"]
    assert (at, outcome, sources, own_group) == (5_001, "UNIT", ["exact"], True)
    assert isinstance(digest, int) and 0 <= digest < 2**64
    assert record["groups"] == []  # its group of one is implied by its entry
    text = dumps_snapshot(record).decode()
    assert "gen-7f3a" not in text and "avro" not in text  # not even its id, only a digest
    assert state.pending_generations() == [] and state.waiting_feedback() == 0


def test_a_closed_group_of_several_is_remembered_once_beside_its_members():
    out = run_processor(GROUPED, [generation("a", "grp", 2), generation("b", "grp", 2),
                                  feedback("a"), feedback("b")])
    (emitted,) = out.units
    ((key, record),) = [(k, out.state.snapshot(k)) for k in out.state.keys()]
    assert segment_of(key) is not None
    assert [(o, s, own) for _, _, o, s, own in record["generations"]] == \
        [("UNIT", ["exact"], False)] * 2
    ((_, _, how, detail),) = record["groups"]
    assert (how, detail) == ("emitted", f"emitted as unit {emitted.unit_id} with 2 members")


# --------------------------------------------------------------------------- duplicates


@pytest.mark.parametrize("restart", [False, True])
def test_a_concluded_generation_and_its_feedback_are_still_duplicates(restart):
    records = [generation("g"), feedback("g"), *([Restart()] if restart else []),
               generation("g"), feedback("g"), feedback("g", "judge"), Advance(TIMEOUT),
               generation("g"), feedback("g", "judge"), feedback("g")]
    out = run_processor(WITH_JUDGE, records, finish=True)
    assert [u.member_ids for u in out.units] == [("g",)]
    assert [d.generation.generation_id for d in out.duplicates] == ["g", "g"]
    assert fates(out, "g:exact") == [FeedbackFate.USED, FeedbackFate.DUPLICATE,
                                     FeedbackFate.DUPLICATE]
    # a new source after the end is LATE once (a dead letter), then a duplicate
    assert fates(out, "g:judge") == [FeedbackFate.LATE, FeedbackFate.DUPLICATE]
    assert out.fates_of("g:judge")[0].reason == "arrived after generation g concluded as UNIT"
    assert out.counts["generations.duplicate"] == 2 and out.counts["units"] == 1


@pytest.mark.parametrize("outcome", [Outcome.EXPIRED, Outcome.TOO_STALE, Outcome.INVALID])
def test_a_generation_that_ended_without_a_unit_is_still_a_duplicate(outcome):
    first = {Outcome.EXPIRED: [generation("g"), Advance(TIMEOUT)],
             Outcome.TOO_STALE: [generation("g", version=1)],
             Outcome.INVALID: [generation("g", None, 3)]}[outcome]
    records = [*first, Restart(), generation("g"), feedback("g"), Advance(TIMEOUT)]
    out = run_processor(GROUPED, records, max_staleness=2, newest_checkpoint_version=5)
    assert out.outcome("g").outcome is outcome and out.units == ()
    assert [d.generation.generation_id for d in out.duplicates] == ["g"]
    assert fates(out, "g:exact") == [FeedbackFate.LATE]
    assert f"concluded as {outcome.name}" in out.fates_of("g:exact")[0].reason


@pytest.mark.parametrize("restart", [False, True])
def test_a_generation_for_a_closed_group_is_still_refused(restart):
    again = [Restart()] if restart else []
    out = run_processor(GROUPED, [generation("a", "grp", 2), generation("b", "grp", 2),
                                  feedback("a"), feedback("b"), *again,
                                  generation("a", "grp", 2), generation("c", "grp", 2)])
    (emitted,) = out.units
    assert [d.generation.generation_id for d in out.duplicates] == ["a"]
    assert out.outcome("c").outcome is Outcome.INVALID
    assert out.outcome("c").reason == \
        f"its group 'grp' is closed: emitted as unit {emitted.unit_id} with 2 members"


@pytest.mark.parametrize("restart", [False, True])
def test_a_group_of_one_closed_by_its_own_generation_is_refused_as_before(restart):
    again = [Restart()] if restart else []
    out = run_processor(GROUPED, [generation("x"), feedback("x"), generation("y"),
                                  Advance(TIMEOUT), *again, generation("late-x", "x", 1),
                                  generation("late-y", "y", 1), Advance(TIMEOUT)])
    assert out.outcome("x").outcome is Outcome.UNIT and out.outcome("y").outcome is Outcome.EXPIRED
    assert out.outcome("late-x").outcome is Outcome.INVALID
    assert out.outcome("late-x").reason == \
        f"its group 'x' is closed: emitted as unit {unit_id('test', ['x'])} with 1 members"
    assert out.outcome("late-y").outcome is Outcome.EXPIRED
    assert out.outcome("late-y").reason == ("arrived after its group 'y' closed: incomplete "
                                            "(it can no longer complete: 0 of 1 members scored)")


# --------------------------------------------------------------------------- retention


def test_a_concluded_generation_is_forgotten_exactly_retention_ms_after_it_ended():
    state = ProcessorState(GROUPED, recipe="r", retention_ms=RETENTION)
    state.offer_generation(generation("a"), at=1_000)
    state.offer_generation(generation("b"), at=1_100)
    state.offer_feedback(feedback("a"), at=1_200)  # a concluded at 1_200
    state.offer_feedback(feedback("b"), at=1_700)  # b at 1_700, the same second
    assert state.keys() == [segment_key(1)] and state.next_deadline() == 1_200 + RETENTION

    assert state.tick(1_200 + RETENTION - 1).touched == ()
    assert state.offer_generation(generation("a"), at=1_200 + RETENTION - 1).duplicates
    step = state.tick(1_200 + RETENTION)
    assert step.touched == (segment_key(1),) and state.next_deadline() == 1_700 + RETENTION
    assert len(state.snapshot(segment_key(1))["generations"]) == 1  # b only
    assert not state.offer_generation(generation("a"), at=1_200 + RETENTION).duplicates
    assert state.offer_feedback(feedback("b"), at=1_300 + RETENTION).feedback[0].fate \
        is FeedbackFate.DUPLICATE

    step = state.tick(1_700 + RETENTION)
    assert step.touched == (segment_key(1),) and state.snapshot(segment_key(1)) is None
    assert segment_key(1) not in state.keys()
    assert state.offer_feedback(feedback("b"), at=1_700 + RETENTION).feedback == ()  # waits
    assert state.waiting_feedback() == 1


def test_a_closed_group_reopens_after_the_retention():
    records = [generation("a", "grp", 1), feedback("a"), Advance(RETENTION),
               generation("b", "grp", 1), feedback("b")]
    out = run_processor(GROUPED, records, retention_ms=RETENTION)
    assert [u.member_ids for u in out.units] == [("a",), ("b",)]
    records[2] = Advance(RETENTION - 2)  # a concluded at 1: b arrives 1 ms too early
    out = run_processor(GROUPED, records, retention_ms=RETENTION)
    assert [u.member_ids for u in out.units] == [("a",)]
    assert out.outcome("b").outcome is Outcome.INVALID


def test_the_retention_is_a_processor_setting_with_a_one_hour_default():
    assert DEFAULT_RETENTION_MS == 3_600_000
    assert ProcessorState(GROUPED, recipe="r").retention_ms == DEFAULT_RETENTION_MS
    short = ComposedProcessor(grouping=ByGroupId(), feedback=GROUPED.feedback,
                              retention_ms=RETENTION)
    assert ProcessorState(short, recipe="r").retention_ms == RETENTION
    assert ProcessorState(short, recipe="r", retention_ms=2 * RETENTION).retention_ms \
        == 2 * RETENTION
    bad = ComposedProcessor(grouping=ByGroupId(), feedback=GROUPED.feedback,
                            retention_ms=TIMEOUT)
    with pytest.raises(ConfigurationError, match="retention_ms must be an integer above"):
        ProcessorState(bad, recipe="r")


# --------------------------------------------------------------------------- restore


class _Runtime:
    """Drives a state as the runtime does: offer, tick, and keep the changelog table (the last
    snapshot of every touched key)."""

    def __init__(self, state: ProcessorState):
        self.state, self.table, self.decided = state, {}, []

    def feed(self, record, at: int) -> None:
        if isinstance(record, NewCheckpoint):
            self.record(self.state.observe_checkpoint(record.policy_version))
        elif isinstance(record, (Generation, Feedback)):
            self.record(self.state.offer(record, at=at))
        if (due := self.state.next_deadline()) is not None and due <= at:
            self.record(self.state.tick(at))

    def record(self, step) -> None:
        self.decided += [(o.generation_id, o.outcome, o.reason) for o in step.generations]
        self.decided += [(o.feedback.feedback_id, o.fate, o.reason) for o in step.feedback]
        self.decided += [(d.generation.generation_id, "duplicate") for d in step.duplicates]
        for key in step.touched:
            snapshot = self.state.snapshot(key)
            if snapshot is None:
                self.table.pop(key, None)
            else:
                self.table[key] = dumps_snapshot(snapshot)


def _restored(live: _Runtime, newest: int | None) -> _Runtime:
    state = ProcessorState(GROUPED, recipe="test", max_staleness=2, retention_ms=RETENTION)
    for key, data in live.table.items():
        state.restore(key, loads_snapshot(data))
    restored = _Runtime(state)
    restored.table = dict(live.table)
    if newest is not None:
        restored.record(state.observe_checkpoint(newest))
    return restored


def _same_state(a: ProcessorState, b: ProcessorState) -> None:
    assert a.keys() == b.keys()
    assert {k: a.snapshot(k) for k in a.keys()} == {k: b.snapshot(k) for k in b.keys()}
    assert a.pending_generations() == b.pending_generations()
    assert a.waiting_feedback() == b.waiting_feedback()
    assert a.next_deadline() == b.next_deadline()


@pytest.mark.parametrize("seed", range(4))
def test_a_state_restored_from_its_changelog_equals_the_live_one(seed):
    rng = random.Random(seed)
    timed, at = [], 0
    records = _stream(rng, groups=60)
    events = [r for r in records if isinstance(r, (Generation, Feedback))]
    # records 100 ms apart (the retention passes a few times), then replayed: the first ones
    # after the retention (new again), the last ones within it (duplicates)
    for record in [*records, *events[:40], *events[-40:]]:
        at += record.ms if isinstance(record, Advance) else 100
        timed.append((record, at))
    timed += [(Advance(0), at + TIMEOUT), (Advance(0), at + TIMEOUT + RETENTION)]  # all ends
    live = _Runtime(ProcessorState(GROUPED, recipe="test", max_staleness=2,
                                   retention_ms=RETENTION))
    twins: list[tuple[_Runtime, int]] = []  # restored from the live changelog, and from when
    for position, (record, at) in enumerate(timed):
        live.feed(record, at)
        for twin, _ in twins:
            twin.feed(record, at)
        if position % 20 == 0:
            twin = _restored(live, live.state.newest_checkpoint_version)
            _same_state(live.state, twin.state)
            assert twin.table == live.table  # nothing to rewrite
            twins.append((twin, len(live.decided)))
    assert live.state.keys() == [] and len(twins) > 5  # everything concluded, then forgotten
    kinds = {o for _, o, *_ in live.decided}
    assert {"duplicate", FeedbackFate.DUPLICATE, FeedbackFate.LATE} <= kinds
    for twin, since in twins:  # each decided from then on exactly as the live state did
        assert twin.decided == live.decided[since:]
        _same_state(live.state, twin.state)


def test_version_1_snapshots_still_restore_and_are_rewritten_by_the_next_step():
    # What the processor wrote before the ledger (snapshot version 1): a closed group keeping
    # its concluded members, and a pending generation (its record as version 2 writes it).
    pending = ProcessorState(GROUPED, recipe="r")
    pending.offer_generation(generation("p"), at=1_900)
    member = pending.snapshot("p")["members"]
    table = {
        "grp": {"version": 1, "size": 2, "admitted": 2, "deadline": 2_500,
                "closed": {"how": "emitted", "at": 1_500,
                           "detail": "emitted as unit U with 2 members"},
                "members": [], "orphans": [],
                "concluded": [{"generation_id": g, "outcome": "UNIT", "at": 1_500,
                               "sources": ["exact"], "detail": "U"} for g in ("a", "b")]},
        "p": {"version": 1, "size": 1, "admitted": 1, "deadline": 1_900 + TIMEOUT,
              "closed": None, "members": member, "orphans": [], "concluded": []},
    }
    state = ProcessorState(GROUPED, recipe="r")
    for key, snapshot in table.items():
        state.restore(key, json.loads(json.dumps(snapshot)))
        state.restore(key, json.loads(json.dumps(snapshot)))  # idempotent
    assert state.pending_generations() == ["p"]
    step = state.offer_generation(generation("a", "grp", 2), at=2_000)
    assert step.duplicates and set(step.touched) == {"grp", "p", segment_key(1)}
    rewritten = {k: state.snapshot(k) for k in step.touched}
    assert rewritten["grp"] is None and rewritten["p"]["version"] == 2
    assert len(rewritten[segment_key(1)]["generations"]) == 2
    assert rewritten[segment_key(1)]["groups"][0][2:] == ["emitted",
                                                        "emitted as unit U with 2 members"]
    again = ProcessorState(GROUPED, recipe="r")
    for key, snapshot in rewritten.items():
        if snapshot is not None:
            again.restore(key, snapshot)
    _same_state(state, again)
    for each in (state, again):
        step = each.offer_generation(generation("c", "grp", 2), at=2_100)
        assert step.generations[0].reason == \
            "its group 'grp' is closed: emitted as unit U with 2 members"
        assert each.offer_feedback(feedback("b"), at=2_200).feedback[0].fate \
            is FeedbackFate.DUPLICATE
        assert each.offer_feedback(feedback("p"), at=2_300).units[0].member_ids == ("p",)


def test_ledger_keys_reach_the_changelog_as_bytes_no_utf8_key_can_be():
    key = segment_key(1_795_000_123)
    assert _key_bytes(key) == b"\x80ended.1795000123" and _key_str(_key_bytes(key)) == key
    assert _key_bytes("grp-é") == "grp-é".encode() and _key_str("grp-é".encode()) == "grp-é"
    with pytest.raises(UnicodeDecodeError):
        _key_bytes(key).decode()


def test_a_grouping_key_that_is_not_utf8_is_invalid():
    class Odd:
        description = "odd"

        def key(self, generation):
            return "\udc80ended.1"

        def size(self, generation):
            return 1

        def accept_incomplete(self, scored, size):
            return False

    odd = ComposedProcessor(grouping=Odd(), feedback=GROUPED.feedback)
    out = run_processor(odd, [generation("g"), feedback("g")])
    assert out.outcome("g").outcome is Outcome.INVALID and "not UTF-8" in out.outcome("g").reason


# --------------------------------------------------------------------------- memory


def test_a_concluded_generation_costs_a_small_fraction_of_its_records():
    count = 3_000
    state = ProcessorState(UNGROUPED, recipe="r")
    gc.collect()
    tracemalloc.start()
    try:
        for number in range(count):
            gid = f"{number:032x}"
            state.offer_generation(generation(gid, created_at=number), at=number)
            state.offer_feedback(feedback(gid), at=number)
        state.tick(count)
        gc.collect()
        with_state = tracemalloc.get_traced_memory()[0]
        assert state.keys() and all(segment_of(k) is not None for k in state.keys())
        del state
        gc.collect()
        per_generation = (with_state - tracemalloc.get_traced_memory()[0]) / count
    finally:
        tracemalloc.stop()
    # ~90-110 bytes measured (an 8-byte digest as a Python int, its dict slot, its conclusion time);
    # a generation's state key held ~1.3 KB before the ledger
    assert 16 < per_generation < 200
