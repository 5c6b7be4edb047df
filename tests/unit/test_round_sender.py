"""RoundSender: the send loop both demo replicas share counts what the producer took, per
version, and drops (and counts) the rest of a round the producer pushes back on."""

from __future__ import annotations

import threading

from reef_stream.demo.replica import Pacer, RoundSender
from reef_stream.intake.producer import SpoolFull


class _Producer:
    """Takes ``room`` records, then pushes back (as a full spool does)."""

    def __init__(self, room: int) -> None:
        self.room, self.took = room, []

    def send(self, record):
        if len(self.took) >= self.room:
            raise SpoolFull("spool full (test)")
        self.took.append(record)
        return f"handle-{record}"


def test_rounds_are_counted_per_version_and_a_push_back_drops_the_rest_of_the_round():
    stop = threading.Event()
    stop.set()  # waits return at once
    seen = []
    sender = RoundSender(_Producer(room=5), "r-0", stop, on_sent=lambda h, g: seen.append((h, g)))
    made = []

    def generations(n, start):
        for i in range(start, start + n):
            made.append(i)
            yield i

    assert sender.send_round(1, generations(3, 0), 3) == 3
    assert sender.send_round(2, generations(4, 3), 4) == 2  # the producer is full after 5
    assert sender.send_round(2, generations(4, 7), 4) == 0
    assert (sender.sent, sender.rounds, sender.backpressured) == (5, 3, 2 + 4)
    assert sender.by_version == {1: 3, 2: 2}
    assert seen == [(f"handle-{i}", i) for i in range(5)]
    assert made == [0, 1, 2, 3, 4, 5, 7], "generations are made lazily, up to the push-back"

    report = sender.report("m", 2, None)
    assert (report.sent, report.by_version, report.rounds, report.backpressured,
            report.final_version, report.acknowledged) == (5, {1: 3, 2: 2}, 3, 6, 2, 0)


def test_the_pacer_is_asked_after_every_round():
    asked = []

    class Counting(Pacer):
        def wait_after(self, sent):
            asked.append(sent)
            return 0.0

    stop = threading.Event()
    sender = RoundSender(_Producer(room=10), "r-0", stop, Counting(100.0))
    sender.send_round(0, iter(range(4)), 4)
    sender.send_round(0, iter(range(8)), 8)
    assert asked == [4, 6]


def test_a_round_another_process_records_is_only_counted():
    stop = threading.Event()
    stop.set()
    sender = RoundSender(None, "vllm-0", stop)   # the recording proxy produces, not the replica
    sender.count_round(0, 32)
    sender.count_round(1, 32)
    sender.count_round(1, 0)
    assert (sender.sent, sender.rounds, sender.by_version) == (64, 3, {0: 32, 1: 32})
    assert sender.report("policy", 1, None).acknowledged == 0
