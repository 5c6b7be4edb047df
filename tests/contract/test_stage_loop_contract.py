"""The stage loop's contract, on the in-memory broker and on the real Kafka broker: records are
submitted in order, a rejected one is offered again after the next ``poll`` (backpressure), an
invalid one is dead-lettered (kept whole) before its position can be committed, the loop
commits only what ``committable`` says, a stop joins then commits then closes, a failing
assignment or a missing topic is raised from ``run``, and the declared capabilities work:
manual assignment, a strategy that commits itself, fetch and partition ends, a reader, a
fenced static member that rejoins."""

from __future__ import annotations

import threading
import time

import pytest

from reef_stream.consumers.stage import (
    Committing, CommitsItself, ConsumerFenced, DeadLetters, Fenced, FetchEnd, Group,
    ManualAssignment, MessageRejected, PartitionEnd, Reader, Rebalancing, StageLoop, StageOptions,
)
from reef_stream.core.errors import ConfigurationError, FatalError, InvalidRecord
from reef_stream.core.events import DeadLetter, MessageHeader
from reef_stream.topics.declarations import dead_letters
from reef_stream.topics.kafka import OFFSET_BEGINNING, TopicPartition
from tests.helpers import wait_until

RECORDS = 20
BAD = {5, 13}  # offsets of records the strategy cannot process
HOLD = 3  # records the strategy holds at most before it refuses more


def _options(backend, topic: str, group: str | None, **settings) -> StageOptions:
    return StageOptions(stage="test", topics=(topic,), namespace=backend.namespace,
                        reads="test record", membership=Group(group) if group else Reader(),
                        poll_timeout=0.02, **settings)


def _records(bad: set[int] = BAD):
    return [(None, f"k{n}".encode(), b"bad" if n in bad else f"ok-{n}".encode(),
             [("n", str(n).encode())]) for n in range(RECORDS)]


def _run(loop: StageLoop, timeout: float = 120) -> None:
    """``loop.run()`` on a thread of its own, raising what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as error:  # noqa: BLE001 - raised on the test's thread
            raised.append(error)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout)
    assert not runner.is_alive(), "the loop did not stop"
    if raised:
        raise raised[0]


class Holding:
    """Holds up to ``HOLD`` records and makes one durable every fourth ``poll``; refuses more
    while full, raises ``InvalidRecord`` for a bad one; stops once everything is durable."""

    capabilities = frozenset({Rebalancing, Committing, DeadLetters})

    def __init__(self, backend, topic: str) -> None:
        self.backend, self.topic = backend, topic
        self.loop: StageLoop | None = None
        self.held: list[int] = []  # offsets submitted, not durable yet
        self.durable = 0  # records before this offset are durable
        self.events: list[tuple] = []  # ("poll",), ("submit" | "reject" | "invalid", offset)
        self.letters_at: dict[int, int] = {}  # bad offset -> dead letters stored when told
        self.commits: list[int] = []
        self.calls: list[str] = []
        self.polls = 0

    def on_assign(self, partitions):
        self.calls.append("assign")

    def on_revoke(self, partitions):
        self.calls.append("revoke")

    def submit(self, message):
        if len(self.held) >= HOLD:
            self.events.append(("reject", message.offset()))
            raise MessageRejected
        if message.value() == b"bad":
            self.events.append(("invalid", message.offset()))
            raise InvalidRecord(f"bad record at {message.offset()}")
        self.events.append(("submit", message.offset()))
        self.held.append(message.offset())

    def dead_lettered(self, message):
        self.letters_at[message.offset()] = self.backend.size(dead_letters(self.backend.namespace))
        self.held.append(message.offset())  # durable: its letter is acknowledged

    def poll(self):
        self.polls += 1
        self.events.append(("poll",))
        if self.held and self.polls % 4 == 0:  # slower than records arrive: it fills up
            self.held.sort()
            offset = self.held.pop(0)
            assert offset == self.durable, "records become durable in offset order here"
            self.durable = offset + 1
        if self.durable == RECORDS:
            self.loop.stop()

    def committable(self):
        return {(self.topic, 0): self.durable} if self.durable else {}

    def committed(self, positions):
        (offset,) = positions.values()
        assert offset <= self.durable, "the loop committed past what is durable"
        self.commits.append(offset)

    def join(self, timeout):
        self.calls.append("join")

    def close(self):
        self.calls.append("close")


def _holding(backend) -> tuple[Holding, str, str]:
    """A ``Holding`` strategy run over ``RECORDS`` records (``BAD`` among them) to the end."""
    topic, group = f"{backend.namespace}.holding", f"{backend.namespace}.holding"
    backend.create(topic, 1)
    backend.produce(topic, _records())
    strategy = Holding(backend, topic)
    strategy.loop = StageLoop(strategy, _options(backend, topic, group),
                              consumers=backend.consumers, producer=backend.producer())
    _run(strategy.loop)
    return strategy, topic, group


def test_submits_in_order_and_offers_a_rejected_record_again_after_a_poll(backend):
    strategy, _, _ = _holding(backend)
    submitted = [event[1] for event in strategy.events if event[0] == "submit"]
    assert submitted == [n for n in range(RECORDS) if n not in BAD]  # each once, in order
    rejects = [i for i, event in enumerate(strategy.events) if event[0] == "reject"]
    assert rejects, "the strategy never pushed back: backpressure untested"
    for i in rejects:  # the same record again, after the next poll
        offset = strategy.events[i][1]
        after = strategy.events[i + 1:]
        assert after[0] == ("poll",)
        assert next(e for e in after if e[0] != "poll")[1] == offset


def test_dead_letters_an_invalid_record_before_its_position_is_committable(backend):
    strategy, topic, _ = _holding(backend)
    # acknowledged by the broker before the strategy was told (which makes it committable)
    assert sorted(strategy.letters_at) == sorted(BAD)
    assert [strategy.letters_at[n] for n in sorted(BAD)] == [1, 2]
    letters = backend.dead_letters(len(BAD))
    assert sorted(letter.source_offset for letter in letters) == sorted(BAD)
    for letter in letters:
        n = letter.source_offset
        assert letter == DeadLetter(
            reason=f"undecodable test record: bad record at {n}", error_type="InvalidRecord",
            source_topic=topic, source_partition=0, source_offset=n, key=f"k{n}".encode(),
            value=b"bad", headers=(MessageHeader(key="n", value=str(n).encode()),),
            stage="test", created_at=letter.created_at)


def test_commits_only_what_the_strategy_says_is_committable(backend):
    strategy, topic, group = _holding(backend)
    # never past what was durable (Holding.committed), never backwards, the last one at the end
    assert strategy.commits == sorted(strategy.commits) and strategy.commits[-1] == RECORDS
    assert len(strategy.commits) > 1, "committed once: commit-last untested while running"
    assert backend.committed(group, topic, 0) == RECORDS
    assert strategy.calls[0] == "assign" and strategy.calls[-3:] == ["join", "revoke", "close"]


class Finishing:
    """Holds every record until ``join``, which makes them all durable."""

    capabilities = frozenset({Committing})

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.submitted: list[int] = []
        self.durable = 0
        self.calls: list[tuple] = []

    def submit(self, message):
        self.submitted.append(message.offset())

    def poll(self):
        pass

    def committable(self):
        return {(self.topic, 0): self.durable} if self.durable else {}

    def committed(self, positions):
        self.calls.append(("committed", *positions.values()))

    def join(self, timeout):
        self.calls.append(("join", timeout))
        self.durable = len(self.submitted)

    def close(self):
        self.calls.append(("close",))


def test_a_stop_joins_then_commits_then_closes(backend):
    topic, group = f"{backend.namespace}.finishing", f"{backend.namespace}.finishing"
    backend.create(topic, 1)
    backend.produce(topic, _records(bad=set()))
    strategy = Finishing(topic)
    loop = StageLoop(strategy, _options(backend, topic, group, join_timeout=7.0),
                     consumers=backend.consumers)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    wait_until(lambda: len(strategy.submitted) == RECORDS, 60, "every record submitted")
    assert backend.committed(group, topic, 0) < 0, "committed what was not durable"
    loop.stop()
    runner.join(60)
    assert not runner.is_alive(), "the loop did not stop"
    # the final commit, then (on some backends) the revocation's, of the same position
    assert strategy.calls[:2] == [("join", 7.0), ("committed", RECORDS)]
    assert set(strategy.calls[2:-1]) <= {("committed", RECORDS)}
    assert strategy.calls[-1] == ("close",)
    assert backend.committed(group, topic, 0) == RECORDS


def test_a_failing_assignment_is_raised_from_run(backend):
    topic = f"{backend.namespace}.refuses"
    backend.create(topic, 1)

    class Refuses(Holding):
        def on_assign(self, partitions):
            raise ValueError("cannot restore")

    strategy = Refuses(backend, topic)
    loop = strategy.loop = StageLoop(strategy, _options(backend, topic, topic),
                                     consumers=backend.consumers, producer=backend.producer())
    with pytest.raises(ValueError, match="cannot restore"):
        _run(loop)
    assert strategy.calls[-1] == "close" and "join" not in strategy.calls


def test_a_missing_topic_is_a_configuration_error(backend):
    topic = f"{backend.namespace}.nowhere"
    strategy = Holding(backend, topic)
    loop = strategy.loop = StageLoop(strategy, _options(backend, topic, topic),
                                     consumers=backend.consumers, producer=backend.producer())
    with pytest.raises(ConfigurationError, match="does not exist"):
        _run(loop)
    assert strategy.calls == ["close"]


def test_an_invalid_record_without_dead_letters_is_fatal_and_nothing_past_it_commits(backend):
    topic, group = f"{backend.namespace}.fatal", f"{backend.namespace}.fatal"
    backend.create(topic, 1)
    backend.produce(topic, _records(bad={5}))

    class Strict(Finishing):
        def submit(self, message):
            if message.value() == b"bad":
                raise InvalidRecord("bad")
            super().submit(message)
            self.durable = message.offset() + 1

    strategy = Strict(topic)
    with pytest.raises(FatalError, match="does not declare DeadLetters"):
        _run(StageLoop(strategy, _options(backend, topic, group), consumers=backend.consumers,
                       producer=backend.producer()))
    assert strategy.submitted == [0, 1, 2, 3, 4]
    assert backend.committed(group, topic, 0) == 5
    assert not any(call[0] == "join" for call in strategy.calls)
    assert strategy.calls[-1] == ("close",)


class Taking:
    """Records, in order, what it was handed."""

    capabilities = frozenset({Rebalancing, PartitionEnd})

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.loop: StageLoop | None = None
        self.consumer = None
        self.events: list[tuple] = []  # ("record", p, offset) / ("end", p, offset) in order
        self.next: dict[int, int] = {}
        self.calls: list[str] = []

    def on_assign(self, partitions):
        self.calls.append("assign")

    def on_revoke(self, partitions):
        pass

    def submit(self, message):
        self.events.append(("record", message.partition(), message.offset()))
        self.next[message.partition()] = message.offset() + 1

    def at_end(self, topic, partition, offset):
        self.events.append(("end", partition, offset))

    def poll(self):
        pass

    def join(self, timeout):
        self.calls.append("join")

    def close(self):
        self.calls.append("close")


PER_PARTITION, START, BATCH = 25, 4, 7


def _three_partitions(backend, topic: str) -> None:
    backend.create(topic, 3)
    backend.produce(topic, [(p, None, f"{p}-{n}".encode(), None)
                            for p in range(3) for n in range(PER_PARTITION)])


class Batches(Taking):
    """Like the trainer: assigned manually (partitions 0 and 2 of three, partition 0 from
    offset ``START``), taking fetches of up to ``BATCH`` records and committing, itself, what
    it took after each fetch; it stops once it has read both partitions to their end."""

    capabilities = frozenset({CommitsItself, Rebalancing, PartitionEnd, ManualAssignment,
                              FetchEnd})

    def __init__(self, topic: str) -> None:
        super().__init__(topic)
        self.fetches: list[tuple[int, int | None]] = []  # (records, drained_at_ms)
        self._seen = 0

    def on_start(self, consumer):
        self.consumer = consumer
        self.calls.append("start")

    def assignment(self, partitions):
        assert partitions == {self.topic: [0, 1, 2]}
        return [TopicPartition(self.topic, 0, START),
                TopicPartition(self.topic, 2, OFFSET_BEGINNING)]

    def fetched(self, drained_at_ms):
        records = sum(1 for e in self.events if e[0] == "record")
        self.fetches.append((records - self._seen, drained_at_ms))
        self._seen = records
        if self.next:
            self.consumer.commit(offsets=[TopicPartition(self.topic, p, o)
                                          for p, o in sorted(self.next.items())],
                                 asynchronous=False)
        ends = {p for kind, p, _ in self.events if kind == "end"}
        if self.next.get(0) == PER_PARTITION and self.next.get(2) == PER_PARTITION \
                and ends == {0, 2}:
            self.loop.stop()


def test_a_manual_assignment_fetch_ends_and_a_strategy_that_commits_itself(backend):
    topic = group = f"{backend.namespace}.batches"
    _three_partitions(backend, topic)
    strategy = Batches(topic)
    strategy.loop = StageLoop(
        strategy, _options(backend, topic, group, batch=BATCH,
                           consumer_config={"enable.partition.eof": True}),
        consumers=backend.consumers)
    _run(strategy.loop)

    # only the assigned partitions, from where the assignment said, each record once, in
    # offset order, and each partition's end after its last record
    for p, first in ((0, START), (2, 0)):
        seen = [(kind, offset) for kind, q, offset in strategy.events if q == p]
        assert [offset for kind, offset in seen if kind == "record"] == \
            list(range(first, PER_PARTITION))
        assert ("end", PER_PARTITION) in seen
        assert seen.index(("end", PER_PARTITION)) > seen.index(("record", PER_PARTITION - 1))
    assert not any(q == 1 for _, q, _ in strategy.events), "read a partition not assigned"
    # fetches of at most BATCH records; one that emptied the client's queue is stamped
    assert all(records <= BATCH for records, _ in strategy.fetches)
    assert any(drained is not None for _, drained in strategy.fetches)
    assert strategy.calls == ["start", "assign", "join", "close"]
    # what is committed is exactly what the strategy committed: the loop committed nothing
    # of its own (partition 1 has no committed offset at all)
    assert [backend.committed(group, topic, p) for p in (0, 2)] == [PER_PARTITION] * 2
    assert backend.committed(group, topic, 1) < 0


class Reading(Taking):
    """A reader: stops once every partition was read to its end."""

    capabilities = frozenset({Rebalancing, PartitionEnd})

    def __init__(self, topic: str) -> None:
        super().__init__(topic)
        self.assigned: list[TopicPartition] = []

    def on_assign(self, partitions):
        self.assigned = partitions

    def at_end(self, topic, partition, offset):
        super().at_end(topic, partition, offset)
        if {p for kind, p, _ in self.events if kind == "end"} == {0, 1, 2}:
            self.loop.stop()


def test_a_reader_reads_every_partition_from_the_beginning_and_commits_nothing(backend):
    topic = f"{backend.namespace}.read"
    _three_partitions(backend, topic)
    groups: list[str] = []

    def consumers(group, config):
        groups.append(group)
        return backend.consumers(group, config)

    strategy = Reading(topic)
    strategy.loop = StageLoop(
        strategy, _options(backend, topic, None, consumer_config={"enable.partition.eof": True}),
        consumers=consumers)
    _run(strategy.loop)
    assert sorted((tp.partition, tp.offset) for tp in strategy.assigned) == \
        [(p, OFFSET_BEGINNING) for p in range(3)]
    for p in range(3):
        assert [(kind, offset) for kind, q, offset in strategy.events if q == p] == \
            [*(("record", n) for n in range(PER_PARTITION)), ("end", PER_PARTITION)]
    (group,) = groups
    assert group.startswith("reef-reader-")
    assert all(backend.committed(group, topic, p) < 0 for p in range(3))


class Counting(Taking):
    """Stops once ``count`` records were handed to it."""

    def __init__(self, topic: str, count: int) -> None:
        super().__init__(topic)
        self.count = count

    def submit(self, message):
        super().submit(message)
        if len(self.events) == self.count:
            self.loop.stop()


def test_a_fetch_hands_over_what_arrived_without_waiting_for_its_batch_to_fill(backend):
    """A stage that needs a few records must not wait out ``poll_timeout`` at every fetch for
    a batch that will not fill (librdkafka's ``consume`` waits for ``num_messages`` or the
    timeout): 5 records with a batch of 1000 and a poll timeout of 30 s are handed over at
    once. Before, on Kafka, the fetch took the whole 30 s."""
    topic = f"{backend.namespace}.prompt"
    backend.create(topic, 1)
    backend.produce(topic, _records(bad=set())[:5])
    strategy = Counting(topic, 5)
    strategy.loop = StageLoop(strategy, StageOptions(
        stage="test", topics=(topic,), namespace=backend.namespace, reads="test record",
        membership=Reader(), batch=1000, poll_timeout=30.0), consumers=backend.consumers)
    started = time.monotonic()
    _run(strategy.loop)
    assert [offset for _, _, offset in strategy.events] == [0, 1, 2, 3, 4]
    assert time.monotonic() - started < 15, "the fetch waited for its batch to fill"


class Rejoins(Taking):
    """Subscribes as a static member; rejoins when fenced."""

    capabilities = frozenset({CommitsItself, Rebalancing, PartitionEnd, Fenced})

    def __init__(self, topic: str) -> None:
        super().__init__(topic)
        self.fenced: list[Exception] = []

    def on_start(self, consumer):
        self.calls.append("start")

    def on_fenced(self, fenced):
        self.fenced.append(fenced)


def test_a_fenced_static_member_rejoins_with_a_new_consumer(backend):
    topic = group = f"{backend.namespace}.static"
    backend.create(topic, 1)
    static = {"group.instance.id": f"{group}.0", "session.timeout.ms": 10_000}
    strategy = Rejoins(topic)
    loop = strategy.loop = StageLoop(strategy, _options(backend, topic, group,
                                                        consumer_config=static),
                                     consumers=backend.consumers)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: "assign" in strategy.calls, 60, "the first assignment")
        usurper = backend.consumers(group, static)
        usurper.subscribe([topic])

        def fenced() -> bool:
            usurper.consume(1, 0.2)  # polled: its join goes on
            return bool(strategy.fenced)

        try:
            wait_until(fenced, 60, "the loop's consumer to be fenced by the usurper")
        finally:
            try:
                usurper.close()
            except Exception:  # noqa: BLE001 - fenced in turn by the loop's new consumer
                pass
        wait_until(lambda: strategy.calls.count("start") == 2, 60, "a new consumer")
        backend.produce(topic, _records(bad=set()))
        wait_until(lambda: len([e for e in strategy.events if e[0] == "record"]) >= RECORDS,
                   60, "the records produced after the rejoin")
    finally:
        loop.stop()
        runner.join(60)
    assert isinstance(strategy.fenced[0], ConsumerFenced)
    assert runner.is_alive() is False


class Sharing:
    """Makes every record durable at once; records what it took, what the loop committed and
    what was revoked, in order."""

    capabilities = frozenset({Rebalancing, Committing})

    def __init__(self, topic: str, taken: list[tuple[int, int]]) -> None:
        self.topic, self.taken = topic, taken
        self.durable: dict[tuple[str, int], int] = {}
        self.events: list[tuple] = []

    def on_assign(self, partitions):
        self.events.append(("assign", sorted(tp.partition for tp in partitions)))

    def on_revoke(self, partitions):
        self.events.append(("revoke", sorted(tp.partition for tp in partitions)))
        for tp in partitions:
            self.durable.pop((tp.topic, tp.partition), None)

    def submit(self, message):
        self.taken.append((message.partition(), message.offset()))
        self.durable[(message.topic(), message.partition())] = message.offset() + 1

    def poll(self): ...

    def committable(self):
        return dict(self.durable)

    def committed(self, positions):
        self.events.append(("committed", dict(positions)))

    def join(self, timeout): ...

    def close(self): ...


def test_a_revocation_commits_what_is_committable_before_the_partitions_move(backend):
    """A second member joins; the first, committing while running only once an hour, commits
    at the revocation, so the partitions' new owners go on exactly where it stopped."""
    topic = group = f"{backend.namespace}.sharing"
    backend.create(topic, 2)
    half = [(p, None, f"{p}-{n}".encode(), None) for p in range(2) for n in range(RECORDS)]
    backend.produce(topic, half)
    taken: list[tuple[int, int]] = []
    first, second = Sharing(topic, taken), Sharing(topic, taken)
    loops = [StageLoop(strategy, _options(backend, topic, group, commit_every_s=3600.0),
                       consumers=backend.consumers) for strategy in (first, second)]
    runners = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
    runners[0].start()
    try:
        wait_until(lambda: len(taken) == 2 * RECORDS, 60, "the first member to take everything")
        runners[1].start()
        wait_until(lambda: any(e[0] == "assign" for e in second.events), 60,
                   "the second member's assignment")
        backend.produce(topic, half)
        wait_until(lambda: len(taken) >= 4 * RECORDS, 60, "the records produced after it")
    finally:
        for loop, runner in zip(loops, runners, strict=True):
            loop.stop()
            if runner.is_alive():
                runner.join(60)
    assert not any(runner.is_alive() for runner in runners), "a loop did not stop"
    assert sorted(taken) == sorted({(p, n) for p in range(2) for n in range(2 * RECORDS)})
    revoked = first.events.index(("revoke", [0, 1]))
    assert first.events[revoked - 1] == \
        ("committed", {(topic, 0): RECORDS, (topic, 1): RECORDS})
    assert [backend.committed(group, topic, p) for p in range(2)] == [2 * RECORDS] * 2
