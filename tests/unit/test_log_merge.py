"""LogMerge: one timestamp order over several sources, handed over once nothing earlier can
still arrive. The trainer's rule (``drained``) makes the order depend on the log, never on
fetch timing; the processor's (``PartitionPair.ready``: caught up, or waited ``max_wait_s``)
keeps its clock from running ahead on one topic."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE

from reef_stream.consumers.processor.pairs import PartitionPair
from reef_stream.core.events import now_ms
from reef_stream.engine.join import ProcessorState
from reef_stream.engine.log_merge import LogMerge, in_log_order
from tests.unit.test_processor import GROUPED

# A log of three partitions: (partition, offset, broker timestamp).
LOG = [(p, o, 1_000 + 7 * o + 3 * p + (o * p) % 5) for p in range(3) for o in range(20)]
EXPECTED = sorted(LOG, key=lambda r: (r[2], r[0], r[1]))


def _drain(merge: LogMerge, now: int, grace_ms: int = 100) -> list[tuple[int, int, int]]:
    out = []
    while (record := merge.pop(merge.drained(now, grace_ms=grace_ms))) is not None:
        out.append((record.source, record.offset, record.timestamp_ms))
    return out


def _everything_settled(source, timestamp_ms) -> bool:
    return True


def _nothing_settled(source, timestamp_ms) -> bool:
    return False


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------- the trainer's rule


@pytest.mark.parametrize("seed", range(25))
def test_any_fetch_interleaving_gives_the_same_order(seed):
    rng = random.Random(seed)
    per_partition = {p: [r for r in LOG if r[0] == p] for p in range(3)}
    merge, out, now = LogMerge(range(3), log_append_time=True), [], 0
    while any(per_partition.values()):
        p = rng.choice([p for p, rows in per_partition.items() if rows])
        chunk = rng.randint(1, 6)   # a fetch response of a few records of one partition
        for row in per_partition[p][:chunk]:
            merge.add(row[0], row[1], row[2], item=row)
        per_partition[p] = per_partition[p][chunk:]
        if not per_partition[p]:
            merge.at_end(p)
        out += _drain(merge, now)   # while fetching, "now" has not passed any grace
    out += _drain(merge, now=10_000)  # everything read to its end, the grace elapsed
    assert out == EXPECTED


def test_a_small_log_comes_out_in_timestamp_partition_offset_order():
    merge = LogMerge([0, 1, 2], log_append_time=True)
    for partition, offset, timestamp in [(0, 0, 100), (0, 1, 105), (0, 2, 110),
                                         (1, 0, 100), (1, 1, 103),
                                         (2, 0, 99), (2, 1, 110)]:
        merge.add(partition, offset, timestamp, None)
    for partition in (0, 1, 2):
        merge.at_end(partition)
    assert _drain(merge, now=10_000) == [(2, 0, 99), (0, 0, 100), (1, 0, 100), (1, 1, 103),
                                         (0, 1, 105), (0, 2, 110), (2, 1, 110)]


def test_an_idle_partition_holds_records_back_until_read_to_its_end_and_the_grace_passed():
    merge = LogMerge([0, 1], log_append_time=True)
    merge.add(0, 0, 1_000, "a")
    assert merge.pop(merge.drained(5_000, grace_ms=500)) is None   # partition 1 not read yet
    assert merge.waiting_on() == [1] and len(merge) == 1
    merge.at_end(1)
    assert merge.waiting_on() == []
    assert merge.pop(merge.drained(1_499, grace_ms=500)) is None   # within the grace
    assert merge.pop(merge.drained(1_500, grace_ms=500)).item == "a"
    assert len(merge) == 0


def test_the_default_grace_is_one_second():
    merge = LogMerge([0, 1], log_append_time=True)
    merge.add(0, 0, 1_000, "a")
    merge.at_end(1)
    assert merge.pop(merge.drained(1_999)) is None
    assert merge.pop(merge.drained(2_000)).item == "a"


def test_a_record_arriving_on_the_idle_partition_within_the_grace_goes_first():
    merge = LogMerge([0, 1], log_append_time=True)
    merge.add(0, 0, 1_000, "later")
    merge.at_end(1)
    assert merge.pop(merge.drained(1_200, grace_ms=500)) is None
    merge.add(1, 0, 999, "earlier")   # and partition 1 is no longer at its end
    assert merge.pop(merge.drained(1_200, grace_ms=500)).item == "earlier"
    assert merge.pop(merge.drained(9_999, grace_ms=500)) is None
    merge.at_end(1)
    assert merge.pop(merge.drained(9_999, grace_ms=500)).item == "later"


def test_equal_timestamps_break_ties_by_partition_then_offset():
    merge = LogMerge([0, 1], log_append_time=True)
    merge.add(1, 5, 1_000, "p1")
    merge.add(0, 9, 1_000, "p0")
    merge.add(0, 10, 1_000, "p0 next")
    merge.at_end(0)
    merge.at_end(1)
    settled = merge.drained(2_000, grace_ms=0)
    assert [merge.pop(settled).item for _ in range(3)] == ["p0", "p0 next", "p1"]


def test_timestamps_going_backwards_in_a_partition_are_refused():
    merge = LogMerge([0], log_append_time=True)
    merge.add(0, 0, 1_000, None)
    with pytest.raises(ValueError, match="LogAppendTime"):
        merge.add(0, 1, 999, None)


@pytest.mark.parametrize("log_append_time", [True, False])
def test_offsets_going_backwards_in_a_source_are_refused(log_append_time):
    merge = LogMerge(["a"], log_append_time=log_append_time)
    merge.add("a", 5, 1_000, None)
    with pytest.raises(ValueError, match="offsets must increase"):
        merge.add("a", 5, 1_001, None)


# ----------------------------------------------------------------- the processor's rule


def test_at_equal_timestamps_the_first_source_goes_first_whatever_its_name():
    for sources, expected in [(("generations", "feedback"), ["generations", "feedback"]),
                              (("feedback", "generations"), ["feedback", "generations"])]:
        merge = LogMerge(sources)
        merge.add("feedback", 0, 1_000, "feedback")
        merge.add("generations", 0, 1_000, "generations")
        assert [merge.pop(_everything_settled).item for _ in range(2)] == expected


def test_a_topic_whose_timestamps_go_backwards_keeps_its_read_order_and_heads_are_compared():
    merge = LogMerge(("g", "f"))   # CreateTime: nothing refused
    for source, offset, timestamp in [("g", 0, 50), ("g", 1, 30), ("g", 2, 60),
                                      ("f", 0, 40), ("f", 1, 55)]:
        merge.add(source, offset, timestamp, None)
    out = []
    while (record := merge.pop(_everything_settled)) is not None:
        out.append((record.source, record.offset, record.timestamp_ms))
    # heads g50 f40 -> f0; g50 f55 -> g0; g30 f55 -> g1; g60 f55 -> f1; g60 alone -> g2
    assert out == [("f", 0, 40), ("g", 0, 50), ("g", 1, 30), ("f", 1, 55), ("g", 2, 60)]


def test_an_empty_source_that_is_not_caught_up_blocks_and_is_asked_only_when_empty():
    merge, asked = LogMerge(("g", "f")), []

    def caught_up(answer: bool):
        def settled(source, timestamp_ms):
            asked.append((source, timestamp_ms))
            return answer
        return settled

    merge.add("g", 0, 1_000, "g0")
    merge.add("f", 0, 2_000, "f0")
    merge.add("g", 1, 3_000, "g1")
    assert merge.pop(caught_up(False)).item == "g0"    # f has a head: nothing asked
    assert merge.pop(caught_up(False)).item == "f0"    # g has a head: nothing asked
    assert asked == []
    assert merge.pop(caught_up(False)) is None         # f is empty, not caught up
    assert asked == [("f", 3_000)]
    assert merge.pop(caught_up(True)).item == "g1"     # f is empty, caught up
    assert asked == [("f", 3_000), ("f", 3_000)]


def test_each_record_waits_at_most_max_wait_from_when_it_was_read_not_one_after_the_other():
    clock = FakeClock()
    merge = LogMerge(("g", "f"), clock=clock)
    merge.add("g", 0, 1_000, "g0")        # read at 0 s
    clock.now = 2.0
    merge.add("g", 1, 1_001, "g1")        # read at 2 s
    clock.now = 4.9
    assert merge.pop(_nothing_settled, max_wait_s=5) is None
    clock.now = 5.0
    assert merge.pop(_nothing_settled, max_wait_s=5).item == "g0"
    assert merge.pop(_nothing_settled, max_wait_s=5) is None   # g1 has waited 3 s
    clock.now = 7.0
    assert merge.pop(_nothing_settled, max_wait_s=5).item == "g1"


def test_without_max_wait_an_unsettled_source_blocks_for_ever():
    clock = FakeClock()
    merge = LogMerge(("g", "f"), clock=clock)
    merge.add("g", 0, 1_000, "g0")
    clock.now = 1e9
    assert merge.pop(_nothing_settled) is None and len(merge) == 1


@pytest.mark.parametrize("seed", range(100))
def test_the_two_source_path_pops_what_the_general_path_does(seed):
    """``in_log_order`` compares two sources' heads directly (the processor's pairs); a third
    source, empty and always settled, changes nothing in the order but takes the general
    path: both must agree, under a timestamp-dependent ``settled`` and ``max_wait_s``."""
    rng, clock = random.Random(seed), FakeClock()
    two = [("g", deque()), ("f", deque())]
    three = [("g", deque()), ("f", deque()), ("idle", deque())]
    out_two, out_three, read = [], [], 0
    for _ in range(rng.randrange(1, 20)):
        for _ in range(rng.randrange(0, 6)):
            index, entry = rng.randrange(2), (rng.randrange(0, 20) * 10, clock.now, read)
            two[index][1].append(entry)
            three[index][1].append(entry)
            read += 1
        clock.now += rng.choice((0.0, 1.0, 3.0))
        horizon = {"g": rng.randrange(0, 250), "f": rng.randrange(0, 250), "idle": 10**9}
        max_wait = rng.choice((None, 2.0))

        def settled(source, at, horizon=horizon):
            return at <= horizon[source]

        out_two += list(in_log_order(two, settled, max_wait_s=max_wait, clock=clock))
        out_three += list(in_log_order(three, settled, max_wait_s=max_wait, clock=clock))
        assert out_two == out_three
    assert [len(queue) for _, queue in two] == [len(queue) for _, queue in three[:2]]


def test_in_log_order_is_lazy_what_is_not_taken_stays_queued():
    queues = [("g", deque([(10, 0.0, "g0"), (30, 0.0, "g1")])), ("f", deque([(20, 0.0, "f0")]))]
    order = in_log_order(queues, _everything_settled)
    assert next(order) == ("g", "g0", 10)
    order.close()
    assert [item for _, item, _ in in_log_order(queues, _everything_settled)] == ["f0", "g1"]


# ----------------------------------------------------------------- PartitionPair


@dataclass
class Message:
    """What PartitionPair reads of a confluent_kafka Message."""

    _topic: str
    _offset: int
    _at: int
    _kind: int = TIMESTAMP_CREATE_TIME

    def topic(self) -> str:
        return self._topic

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return self._kind, self._at


def _pair() -> PartitionPair:
    return PartitionPair(ProcessorState(GROUPED, recipe="r"), ("gens", "fb"))


def _offered(pair: PartitionPair, caught_up, max_idle_s: float = 3_600):
    return [(topic, message.offset(), at) for topic, message, at in
            pair.ready(caught_up, max_idle_s)]


def test_a_pair_offers_in_timestamp_order_until_an_empty_topic_that_is_not_caught_up():
    pair, asked = _pair(), []

    def nothing_caught_up() -> set[str]:
        asked.append(1)
        return set()

    for message in [Message("gens", 10, 2_000), Message("fb", 3, 1_000),
                    Message("gens", 11, 1_500), Message("fb", 4, 2_500)]:
        pair.queue(message)
    assert pair.next == {"gens": 12, "fb": 5}
    # heads gens2000 fb1000 -> fb3; gens2000 fb2500 -> gens10; gens1500 fb2500 -> gens11;
    # gens is empty and not caught up: fb4 waits
    assert _offered(pair, nothing_caught_up) == [("fb", 3, 1_000), ("gens", 10, 2_000),
                                                 ("gens", 11, 1_500)]
    assert asked == [1] and pair.held()
    assert _offered(pair, lambda: {"gens"}) == [("fb", 4, 2_500)]
    assert not pair.held()


def test_a_pair_offers_the_generation_first_at_equal_timestamps():
    pair = _pair()
    pair.queue(Message("fb", 0, 1_000))
    pair.queue(Message("gens", 0, 1_000))
    assert _offered(pair, lambda: {"gens", "fb"}) == [("gens", 0, 1_000), ("fb", 0, 1_000)]


def test_a_pair_offers_a_record_that_waited_max_idle_s():
    pair = _pair()
    pair.queue(Message("gens", 0, 1_000))
    assert _offered(pair, set) == [] and pair.held()
    assert _offered(pair, set, max_idle_s=0) == [("gens", 0, 1_000)]


def test_a_record_without_a_timestamp_is_on_the_clock_when_it_was_read():
    pair = _pair()
    before = now_ms()
    pair.queue(Message("gens", 0, -1, TIMESTAMP_NOT_AVAILABLE))
    after = now_ms()
    ((topic, offset, at),) = _offered(pair, lambda: {"fb"})
    assert (topic, offset) == ("gens", 0) and before <= at <= after
