"""PartitionMerge: the order records come out in depends on the log, never on fetch timing."""

from __future__ import annotations

import random

import pytest

from reef_stream.engine.unit_order import PartitionMerge

# A log of three partitions: (partition, offset, broker timestamp).
LOG = [(p, o, 1_000 + 7 * o + 3 * p + (o * p) % 5) for p in range(3) for o in range(20)]
EXPECTED = sorted(LOG, key=lambda r: (r[2], r[0], r[1]))


def _drain(merge: PartitionMerge, now: int) -> list[tuple[int, int, int]]:
    out = []
    while (record := merge.pop(now)) is not None:
        out.append((record.partition, record.offset, record.timestamp_ms))
    return out


@pytest.mark.parametrize("seed", range(25))
def test_any_fetch_interleaving_gives_the_same_order(seed):
    rng = random.Random(seed)
    per_partition = {p: [r for r in LOG if r[0] == p] for p in range(3)}
    merge, out, now = PartitionMerge(range(3), grace_ms=100), [], 0
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


def test_an_idle_partition_holds_records_back_until_read_to_its_end_and_the_grace_passed():
    merge = PartitionMerge([0, 1], grace_ms=500)
    merge.add(0, 0, 1_000, "a")
    assert merge.pop(5_000) is None and merge.waiting_on() == [1]   # partition 1 not read yet
    merge.at_end(1)
    assert merge.pop(1_400) is None                                 # within the grace
    assert merge.pop(1_500).item == "a"


def test_a_record_arriving_on_the_idle_partition_within_the_grace_goes_first():
    merge = PartitionMerge([0, 1], grace_ms=500)
    merge.add(0, 0, 1_000, "later")
    merge.at_end(1)
    assert merge.pop(1_200) is None
    merge.add(1, 0, 999, "earlier")
    assert [merge.pop(1_200).item, merge.pop(9_999)] == ["earlier", None]
    merge.at_end(1)
    assert merge.pop(9_999).item == "later"


def test_equal_timestamps_break_ties_by_partition_then_offset():
    merge = PartitionMerge([0, 1], grace_ms=0)
    merge.add(1, 5, 1_000, "p1")
    merge.add(0, 9, 1_000, "p0")
    merge.at_end(0)
    merge.at_end(1)
    assert [merge.pop(2_000).item, merge.pop(2_000).item] == ["p0", "p1"]


def test_timestamps_going_backwards_in_a_partition_are_refused():
    merge = PartitionMerge([0])
    merge.add(0, 0, 1_000, None)
    with pytest.raises(ValueError, match="LogAppendTime"):
        merge.add(0, 1, 999, None)
