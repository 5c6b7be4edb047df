"""``PartitionPair.ready`` hands records over in the order ``LogMerge.pop`` does under the
processor's rule (caught up, or waited ``max_idle_s``): both go through
``log_merge.in_log_order``, the pair over its own deques and its ``caught_up()`` sets
(``reef_stream.consumers.processor.pairs``), so the two are checked against each other on random
interleavings of reads, timestamps going backwards, caught-up sets and idle waits."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME

from reef_stream.consumers.processor.pairs import PartitionPair
from reef_stream.engine.join import ProcessorState
from reef_stream.engine.log_merge import LogMerge
from tests.unit.test_processor import GROUPED as PROCESSOR


@dataclass
class Message:
    _topic: str
    _offset: int
    _at: int

    def topic(self) -> str:
        return self._topic

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return TIMESTAMP_CREATE_TIME, self._at


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(200))
def test_a_pair_offers_what_a_log_merge_pops_in_the_same_order(seed):
    rng = random.Random(seed)
    topics = ("gens", "fb")
    clock = Clock()
    pair = PartitionPair(ProcessorState(PROCESSOR, recipe="r"), topics, clock=clock)
    merge = LogMerge(topics, clock=clock)
    offsets = dict.fromkeys(topics, rng.randrange(100))
    offered, popped, queued = [], [], []
    turns = rng.randrange(1, 30)
    for turn in range(turns):
        for _ in range(rng.randrange(0, 8)):  # a fetch: records of either topic
            topic = rng.choice(topics)
            offsets[topic] += rng.randrange(1, 3)  # transaction markers skip offsets
            message = Message(topic, offsets[topic], rng.randrange(0, 50) * 10)
            pair.queue(message)
            merge.add(topic, message.offset(), message.timestamp()[1], message)
            queued.append((topic, message.offset(), message.timestamp()[1]))
        clock.now += rng.choice((0.0, 0.5, 2.0))
        caught = set(rng.sample(topics, rng.randrange(0, 3)))
        max_idle = rng.choice((1.0, 3.0))
        if turn == turns - 1:  # at the end both topics are caught up: everything goes
            caught = set(topics)
        offered += [(topic, message.offset(), at)
                    for topic, message, at in pair.ready(lambda: caught, max_idle)]
        while (record := merge.pop(lambda topic, _at: topic in caught,
                                   max_wait_s=max_idle)) is not None:
            popped.append((record.source, record.offset, record.timestamp_ms))
        assert offered == popped
        assert pair.held() == (len(merge) > 0)
    assert not pair.held() and sorted(offered, key=lambda o: o[:2]) == sorted(
        (topic, offset, at) for topic, offset, at in queued)


def test_a_pair_refuses_an_offset_read_out_of_order():
    pair = PartitionPair(ProcessorState(PROCESSOR, recipe="r"), ("gens", "fb"))
    pair.queue(Message("gens", 5, 1_000))
    with pytest.raises(ValueError, match="gens: offset 4 read after offset 5"):
        pair.queue(Message("gens", 4, 1_000))
