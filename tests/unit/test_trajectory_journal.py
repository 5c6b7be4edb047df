"""The proxy's journal of held trajectories (``reef_stream.intake.journal``), without a broker:
what it holds comes back when it is opened again, done trajectories do not, a torn last write
is skipped with a warning, and the file is compacted."""

from __future__ import annotations

import logging

from reef_stream.core.events import events_equal
from reef_stream.intake.journal import FILE_NAME, TrajectoryJournal
from reef_stream.intake.trajectories import Trajectories
from tests import factories
from tests.factories import ids, logprobs


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def turn(gid: str, prompt: list[int], completion: list[int]):
    return factories.generation(gid, prompt_token_ids=ids(prompt),
                                completion_token_ids=ids(completion),
                                completion_logprobs=logprobs([-0.5] * len(completion)),
                                group_id="c", metadata={"completion": gid})


def test_what_is_held_comes_back_in_the_order_of_last_turn_and_done_does_not(tmp_path):
    clock = Clock()
    journal = TrajectoryJournal(tmp_path, clock=clock)
    assert journal.restored == [] and len(journal) == 0
    a, b, a2 = turn("a", [1], [2]), turn("b", [3], [4]), turn("a2", [1], [2, 5])
    journal.hold("c1", "a", a)
    clock.now += 1
    journal.hold("c2", "b", b)
    journal.hold("c3", "x", turn("x", [9], [9]))
    clock.now += 1
    journal.hold("c1", "a", a2)   # the trajectory "a" extended: supersedes its entry
    journal.done("x")
    journal.done("never-held")    # idempotent, writes nothing
    assert len(journal) == 2
    # killed: no close
    again = TrajectoryJournal(tmp_path, clock=clock)
    assert [(r.conversation, r.trajectory, r.held_at) for r in again.restored] == [
        ("c2", "b", 1_001.0), ("c1", "a", 1_002.0)]
    assert events_equal(again.restored[1].generation, a2)
    assert events_equal(again.restored[0].generation, b)
    assert again.damaged == []
    assert again.file_bytes == (tmp_path / FILE_NAME).stat().st_size, "compacted at open"
    again.done("a")
    again.done("b")
    again.close()
    assert TrajectoryJournal(tmp_path).restored == []
    assert (tmp_path / FILE_NAME).stat().st_size == 0


def test_a_torn_last_write_is_skipped_with_a_warning_and_the_entry_before_stands(
        tmp_path, caplog):
    journal = TrajectoryJournal(tmp_path)
    journal.hold("c", "t0", turn("t0", [1], [2]))
    journal.hold("d", "u0", turn("u0", [7], [8]))
    whole = (tmp_path / FILE_NAME).stat().st_size
    journal.hold("c", "t0", turn("t1", [1, 2, 3], [4]))
    torn = whole + ((tmp_path / FILE_NAME).stat().st_size - whole) // 2
    with open(tmp_path / FILE_NAME, "r+b") as file:   # the crash cut the last append short
        file.truncate(torn)
    with caplog.at_level(logging.WARNING, logger="reef_stream.intake.journal"):
        again = TrajectoryJournal(tmp_path)
    assert [(r.trajectory, r.generation.generation_id) for r in again.restored] == [
        ("t0", "t0"), ("u0", "u0")]
    assert len(again.damaged) == 1 and "cut short" in again.damaged[0]
    assert "cut short" in caplog.text
    # the torn tail is gone: what is written next reads back whole
    again.hold("c", "t0", turn("t1", [1, 2, 3], [4]))
    third = TrajectoryJournal(tmp_path)
    assert third.damaged == []
    assert [r.generation.generation_id for r in third.restored] == ["u0", "t1"]


def test_a_frame_whose_checksum_does_not_match_ends_what_is_read(tmp_path):
    journal = TrajectoryJournal(tmp_path)
    journal.hold("c", "t0", turn("t0", [1], [2]))
    size = (tmp_path / FILE_NAME).stat().st_size
    journal.hold("d", "u0", turn("u0", [7], [8]))
    data = bytearray((tmp_path / FILE_NAME).read_bytes())
    data[size + 10] ^= 0xFF
    (tmp_path / FILE_NAME).write_bytes(bytes(data) + b"\x03\x00")
    again = TrajectoryJournal(tmp_path)
    assert [r.trajectory for r in again.restored] == ["t0"]
    assert again.damaged and "checksum" in again.damaged[0]


def test_the_file_is_compacted_while_running_and_stays_bounded(tmp_path):
    journal = TrajectoryJournal(tmp_path, compact_bytes=4096)
    prompt = list(range(1, 200))
    largest = 0
    for k in range(300):   # many conversations, each held for three turns, then done
        for t in range(3):
            journal.hold(f"c{k}", f"t{k}", turn(f"t{k}-{t}", prompt, [5] * (t + 1)))
        journal.done(f"t{k}")
        largest = max(largest, journal.file_bytes)
        assert journal.file_bytes == (tmp_path / FILE_NAME).stat().st_size
    assert len(journal) == 0
    assert largest < 3 * 4096, "rewritten once its dead bytes pass the bound"
    journal.hold("c", "kept", turn("kept", prompt, [5]))
    assert [r.trajectory for r in TrajectoryJournal(tmp_path).restored] == ["kept"]


def test_a_trajectory_restored_from_the_journal_chains_its_next_turn_as_the_original(tmp_path):
    first = turn("t0", [1, 2], [10, 11])
    second = turn("t1", [1, 2, 10, 11, 7], [12])
    answer = turn("t2", [1, 2, 10, 11, 7, 12, 8], [13])
    original = Trajectories()
    journal = TrajectoryJournal(tmp_path)
    for generation in (first, second):
        original.turn("c", generation, calls_tools=True, environment_role="tool:add")
        held = original.held("c")
        journal.hold("c", held.trajectory, held.generation)
    (want,) = original.turn("c", answer, calls_tools=False, environment_role="tool:add")

    (restored,) = TrajectoryJournal(tmp_path).restored
    again = Trajectories()
    again.restore(restored.conversation, restored.generation, restored.trajectory)
    (got,) = again.turn("c", answer, calls_tools=False, environment_role="tool:add")
    assert got.trajectory == want.trajectory == "t0"
    assert events_equal(got.generation, want.generation)
    assert got.generation.metadata["proxy.turns"] == "3"


def test_a_trajectory_ended_but_not_done_comes_back_to_be_recorded(tmp_path):
    journal = TrajectoryJournal(tmp_path)
    journal.hold("c", "t0", turn("t0", [1], [2]))
    whole = turn("t1", [1, 2, 3], [4])
    journal.end("t0", whole)   # given back; killed before it was handed to the producer
    again = TrajectoryJournal(tmp_path)
    (restored,) = again.restored
    assert restored.ended and restored.trajectory == "t0"
    assert events_equal(restored.generation, whole)
    again.done("t0")   # recorded by the proxy started again
    assert TrajectoryJournal(tmp_path).restored == []
