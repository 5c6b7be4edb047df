"""Processor runtime paths the main tests do not reach, against the real broker.

- A transaction that fails (the broker refuses a unit larger than the units
  topic's ``max.message.bytes``) is aborted and the runtime rewinds to its last
  committed state and offsets, again and again while the cause lasts; once it
  is gone nothing is lost or duplicated in the committed log, and the rewound
  state still knows the newest checkpoint (generations behind it stay
  TOO_STALE).
- A second instance with the same ``--instance`` (same transactional id) fences
  the first: the first stops with a FatalError, the second carries on, and the
  committed log holds every outcome exactly once.
- With a backlog bound (``schedule.max_backlog_steps``), units that complete
  while that many wait for the trainer (past the newest checkpoint's offsets)
  are shed: their generations are dead-lettered SHED, each once; a newer
  checkpoint whose offsets pass them lets units flow again. With
  ``schedule.backlog_wait_s`` what a full backlog reads is held for that long first,
  and a checkpoint that comes meanwhile trains it.
- A transaction held open past its timeout (as while a broker is down) is
  aborted by the broker, which fences the producer: the runtime starts a new
  producer, rewinds, and the committed log still holds every outcome once.
- A second live processor joins the group while input flows, and later the first
  leaves: the partitions move twice and every generation still gets exactly one
  outcome, none sits in two units, and the two instances' committed counts add
  up to the log.
- A unit larger than the units topic takes is not emitted: its members are
  dead-lettered (with their original records) and the rest flows, where it
  used to fail every transaction forever.
- The ordering safety valve (``MAX_IDLE_S``): records of one topic wait while
  the other topic of their pair has unread records (here: an open transaction
  of a reward worker) and at most ``MAX_IDLE_S`` each, then they are offered;
  the join still completes when the other topic's records come.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, OffsetSpec, ResourceType,
)

from reef_stream.consumers.processor.runtime import MAX_IDLE_S, ProcessorRuntime
from reef_stream.core.errors import FatalError
from reef_stream.core.events import Generation, RolloutUnit
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from tests.helpers import consume_all, wait_until
from tests.integration.test_processor_metrics import publish_checkpoint, wait_for
from tests.integration.test_processor_runtime import (
    RECIPE, Workload, check_invariant, create_topics, feedback, generation, key_of, make_workload,
    produce, read_back,
)


class Running:
    """A ProcessorRuntime in a thread of its own; ``error`` is what ``run`` raised."""

    def __init__(self, bootstrap: str, namespace: str, instance: str, **kwargs) -> None:
        self.runtime = ProcessorRuntime(RECIPE, bootstrap=bootstrap, namespace=namespace,
                                        instance=instance, log_every_s=5, **kwargs)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"processor-{instance}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.runtime.run(ready=self.ready)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            self.error = error

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(lambda: self.ready.is_set() or not self.thread.is_alive(), timeout,
                 "the processor's partitions")
        assert self.ready.is_set(), f"processor exited: {self.error!r}"

    def stop(self) -> None:
        self.runtime.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the processor did not stop"


def set_units_max_bytes(bootstrap: str, namespace: str, value: int) -> None:
    topic = declarations.units(namespace, RECIPE.name)
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[ConfigEntry(
        "max.message.bytes", str(value), incremental_operation=AlterConfigOpType.SET)])
    admin = AdminClient(client_config(bootstrap))  # alive until the futures resolve
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def open_transaction(bootstrap: str, namespace: str) -> bool:
    """Whether a transaction is open on a partition of ``namespace``'s topics: its last stable
    offset (the end a read_committed consumer sees) is behind its end. An aborted or committed
    transaction's marker brings the two together again."""
    admin = AdminClient(client_config(bootstrap))
    topics = admin.list_topics(timeout=10).topics
    latest = {TopicPartition(name, p): OffsetSpec.latest() for name, topic in topics.items()
              if name.startswith(f"{namespace}.") for p in topic.partitions}
    ends = [{tp: future.result(30).offset for tp, future in
             admin.list_offsets(latest, isolation_level=level).items()}
            for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED)]
    return any(ends[0][tp] < ends[1][tp] for tp in latest)


def fresh(work: Workload, version: int) -> Workload:
    """``work`` with every generation at ``policy_version`` ``version``."""
    work.windows = [[dataclasses.replace(r, policy_version=version) if isinstance(r, Generation)
                     else r for r in window] for window in work.windows]
    return work


# --------------------------------------------------------------------------- abort and rewind


def test_a_failed_transaction_is_aborted_and_rewound_losing_and_duplicating_nothing(
        kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    publish_checkpoint(kafka_bootstrap, namespace, 5)  # max_staleness 2: version 0 is too stale
    work = fresh(make_workload(windows=4, groups_per_window=10, seed=5), version=4)
    stale = [generation(f"stale-m{m}", "stale", 4) for m in range(4)]
    work.windows[0] += stale + [feedback(g.generation_id, "stale", 1.0) for g in stale]
    work.other |= {g.generation_id for g in stale}

    proc = Running(kafka_bootstrap, namespace, "abort")
    try:
        proc.wait_ready()
        wait_for(lambda: proc.runtime.newest_checkpoint == 5, 30, "the checkpoint")
        # (after the start: the runtime checks the declared configs of its topics)
        set_units_max_bytes(kafka_bootstrap, namespace, 256)  # every unit is refused
        produce(kafka_bootstrap, namespace, work.windows[:2])
        # Every transaction holding a unit fails; each is aborted and rewound, then retried.
        wait_for(lambda: proc.runtime.aborted >= 3 or proc.error, 60, "three aborted transactions")
        assert proc.error is None, proc.error
        assert proc.runtime.counts["units"] == 0, "an aborted transaction's counts were kept"
        assert consume_all(kafka_bootstrap, declarations.units(namespace, RECIPE.name), 0,
                           idle_rounds=1) == []
        set_units_max_bytes(kafka_bootstrap, namespace, 16 << 20)
        produce(kafka_bootstrap, namespace, work.windows[2:])
        back = read_back(kafka_bootstrap, namespace, work, alive=proc.thread.is_alive)
    finally:
        proc.stop()
    assert proc.error is None, proc.error
    check_invariant(back, work)
    assert back.unit_records == len(back.units), "a unit committed twice"
    assert proc.runtime.counts["units"] == len(back.units), "counts of aborted transactions kept"
    assert proc.runtime.counts["generations.unit"] == sum(len(m) for m in back.units.values())
    # The rewound state still measures staleness against the newest checkpoint.
    assert all("behind the newest checkpoint 5" in back.reasons.get(g.generation_id, "")
               for g in stale), {g.generation_id: back.reasons.get(g.generation_id) for g in stale}
    assert back.kinds["processor.too_stale"] == len(stale)


def test_a_second_instance_with_the_same_transactional_id_fences_the_first(
        kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    work = make_workload(windows=16, groups_per_window=10, seed=9)
    first = Running(kafka_bootstrap, namespace, "same")
    second = None
    try:
        first.wait_ready()
        produce(kafka_bootstrap, namespace, work.windows[:6])
        wait_for(lambda: first.runtime.counts["units"] > 0, 30, "the first instance's units")
        second = Running(kafka_bootstrap, namespace, "same")  # fences the first
        second.wait_ready()
        produce(kafka_bootstrap, namespace, work.windows[6:], pause_s=0.2)
        back = read_back(kafka_bootstrap, namespace, work, alive=second.thread.is_alive)
        wait_for(lambda: not first.thread.is_alive(), 30, "the fenced instance to stop")
    finally:
        first.runtime.stop()
        if second is not None:
            second.stop()
    assert isinstance(first.error, FatalError) and "fenced" in str(first.error), repr(first.error)
    assert second.error is None, second.error
    check_invariant(back, work)
    assert back.unit_records == len(back.units), "a unit committed twice"
    counted = first.runtime.counts["units"] + second.runtime.counts["units"]
    assert counted == len(back.units), "a unit committed by both instances, or by neither"


def test_a_transaction_the_broker_timed_out_gets_a_new_producer_and_loses_nothing(
        kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    work = make_workload(windows=8, groups_per_window=10, seed=11)
    # A 2-s transaction timeout; the broker looks for timed-out transactions every 10 s.
    proc = Running(kafka_bootstrap, namespace, "timed-out", transaction_timeout_ms=2_000)
    try:
        proc.wait_ready()
        produce(kafka_bootstrap, namespace, work.windows[:3])
        wait_for(lambda: proc.runtime.counts["units"] > 0, 30, "the first units")
        # The next transaction stalls after its first record, past the timeout and the
        # broker's next check: the broker aborts it and bumps the producer's epoch.
        real_poll, stalled = proc.runtime._poll, threading.Event()

        def stall_once() -> None:
            if not stalled.is_set():
                stalled.set()
                # Stalled until the broker saw the transaction open, then aborted it.
                wait_until(lambda: open_transaction(kafka_bootstrap, namespace), 30,
                           "the stalled transaction to be open on the broker")
                wait_until(lambda: not open_transaction(kafka_bootstrap, namespace), 60,
                           "the broker to abort the timed-out transaction", poll_s=0.5)
            real_poll()

        proc.runtime._poll = stall_once
        produce(kafka_bootstrap, namespace, work.windows[3:5])
        wait_for(lambda: proc.runtime.aborted >= 1 or proc.error, 60, "the fenced transaction")
        assert proc.error is None, proc.error
        produce(kafka_bootstrap, namespace, work.windows[5:])
        back = read_back(kafka_bootstrap, namespace, work, alive=proc.thread.is_alive)
    finally:
        proc.stop()
    assert stalled.is_set() and proc.runtime.aborted >= 1
    assert proc.error is None, proc.error
    check_invariant(back, work)
    assert back.unit_records == len(back.units), "a unit committed twice"
    assert proc.runtime.counts["units"] == len(back.units), "counts of aborted transactions kept"


def _checkpoint_at(bootstrap: str, namespace: str, version: int, offsets: dict[int, int]):
    from reef_stream.core.events import Checkpoint, TopicOffset

    topic = declarations.units(namespace, RECIPE.name)
    value, headers = SchemaRegistry.default().encode(Checkpoint(
        checkpoint_id=f"ckpt-{version}", recipe=RECIPE.name, trainer_group="trainers",
        step=version, model="tiny", policy_version=version, uri="file:///tmp/ckpt",
        sha256="00" * 32, offsets=tuple(TopicOffset(topic=topic, partition=p, offset=o)
                                          for p, o in offsets.items()),
        trained_unit_count=8 * version, created_at=1_795_000_000_000))
    producer = Producer(client_config(bootstrap))
    producer.produce(declarations.checkpoints(namespace), value=value, headers=headers)
    assert producer.flush(30) == 0


def _units_end(bootstrap: str, namespace: str) -> dict[int, int]:
    topic = declarations.units(namespace, RECIPE.name)
    consumer = Consumer(client_config(bootstrap, {"group.id": "ends"}))
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in partitions}
    finally:
        consumer.close()


def _start_bounded(bootstrap: str, namespace: str, instance: str,
                   **schedule) -> tuple[ProcessorRuntime, threading.Thread]:
    """A processor of ``RECIPE`` with ``schedule``'s fields changed, run in a thread, after a
    checkpoint at version 3 (a trainer exists from the start)."""
    create_topics(bootstrap, namespace)
    bounded = dataclasses.replace(RECIPE, schedule=dataclasses.replace(RECIPE.schedule,
                                                                       **schedule))
    _checkpoint_at(bootstrap, namespace, 3, {})
    runtime = ProcessorRuntime(bounded, bootstrap=bootstrap, namespace=namespace,
                               instance=instance, log_every_s=5)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    return runtime, thread


def test_units_past_the_backlog_bound_are_shed_until_a_checkpoint_passes_them(
        kafka_bootstrap, namespace):
    work = fresh(make_workload(windows=6, groups_per_window=10, seed=13), version=3)
    runtime, thread = _start_bounded(kafka_bootstrap, namespace, "bounded",
                                     max_backlog_steps=2)   # 2 steps of 8: 16 units
    try:
        wait_for(lambda: runtime.newest_checkpoint == 3, 60, "the checkpoint")
        produce(kafka_bootstrap, namespace, work.windows[:3], pause_s=1.5)
        wait_for(lambda: runtime.counts["generations.shed"] > 0, 60, "shed generations")
        emitted = runtime.counts["units"]
        # Exactly the bound went out: counted in units, not offsets (30 groups completed).
        assert emitted == 16 and runtime.backlog == 16, (runtime.counts, runtime.backlog)
        # The trainer "moves": a checkpoint past every unit so far. Units flow again.
        _checkpoint_at(kafka_bootstrap, namespace, 4, _units_end(kafka_bootstrap, namespace))
        wait_for(lambda: runtime.backlog == 0, 30, "the backlog measured empty")
        produce(kafka_bootstrap, namespace, work.windows[3:4])
        wait_for(lambda: runtime.counts["units"] > emitted, 30, "units after the checkpoint")
        produce(kafka_bootstrap, namespace, work.windows[4:])
        back = read_back(kafka_bootstrap, namespace, work, alive=thread.is_alive)
    finally:
        runtime.stop()
        thread.join(30)
    shed = {g for g, reason in back.reasons.items()
            if "wait for the trainer" in reason or "was shed" in reason}
    assert back.kinds["processor.shed"] == len(shed) > 0
    assert any("(max_backlog 16), so this unit would be trained stale" in back.reasons[g]
               for g in shed)
    # Every generation has one outcome: a unit, or (complete ones too) a SHED dead letter.
    in_units = {g for members in back.units.values() for g in members}
    assert not in_units & shed and work.complete <= in_units | shed
    assert all(n == 1 for n in back.generation_letters.values())
    assert back.unit_records == len(back.units) == runtime.counts["units"]


def test_a_full_backlog_holds_what_it_reads_for_a_checkpoint_and_sheds_only_after_the_wait(
        kafka_bootstrap, namespace):
    """``schedule.backlog_wait_s``: once the bound (one step: 8 units) is full, what the
    processor reads is held, not shed, from the record that would complete the 9th unit on,
    within one fetch too; a checkpoint that comes within the wait lets it through as units. A
    full backlog that no checkpoint relieves sheds what it holds once the wait is over, and
    not before."""
    wait_s = 6.0
    work = fresh(make_workload(windows=2, groups_per_window=12, seed=19), version=3)
    runtime, thread = _start_bounded(kafka_bootstrap, namespace, "waiting",
                                     max_backlog_steps=1, backlog_wait_s=wait_s)
    try:
        wait_for(lambda: runtime.newest_checkpoint == 3, 60, "the checkpoint")
        produce(kafka_bootstrap, namespace, work.windows[:1])      # 12 groups, one flush
        wait_for(lambda: runtime.counts["units"] == 8, 30, "the first step's units")
        wait_for(lambda: runtime.counts["fetches.held"] > 0, 30, "a held fetch")
        _checkpoint_at(kafka_bootstrap, namespace, 4, _units_end(kafka_bootstrap, namespace))
        wait_for(lambda: runtime.counts["units"] == 12, 30, "the held groups as units")
        assert runtime.counts["generations.shed"] == 0, runtime.counts
        produce(kafka_bootstrap, namespace, work.windows[1:])      # no checkpoint comes now
        wait_for(lambda: runtime.counts["units"] == 16, 30, "the bound full again")
        full_at = time.monotonic()
        wait_for(lambda: runtime.counts["generations.shed"] > 0, 30, "the shed after the wait")
        waited = time.monotonic() - full_at
        back = read_back(kafka_bootstrap, namespace, work, alive=thread.is_alive)
    finally:
        runtime.stop()
        thread.join(30)
    # The wait runs from the first fetch that found the backlog full, after full_at less the
    # polling step of wait_for: the shed cannot come sooner.
    assert waited >= wait_s - 0.5, waited
    shed = {g for g, reason in back.reasons.items() if "wait for the trainer" in reason}
    in_units = {g for members in back.units.values() for g in members}
    second = {g for g in work.complete if g.startswith("w001")}
    assert shed < second and len(shed) == 8 * len(second) // 12, sorted(shed)
    assert in_units == work.complete - shed
    assert back.kinds["processor.shed"] == len(shed)
    assert all(n == 1 for n in back.generation_letters.values())
    assert back.unit_records == len(back.units) == runtime.counts["units"] == 16


@pytest.mark.parametrize("skips", [0, 1])
def test_a_bound_of_one_step_never_stops_the_loop(kafka_bootstrap, namespace, skips):
    """The test is the trainer: it reads units (read_committed, in offset order) and, each
    time it holds a step's 8, publishes a checkpoint at the offsets after them. Counted in
    offsets, the bound (one step: 8) was passed by transaction commit markers before 8 units
    waited, every unit was shed and no step ever filled (bench/overload.py stopped after two
    steps). Counted in units it holds the queue to one step and the steps keep coming.

    With ``skips``, the trainer skips its first unit (as it skips a duplicate or a unit too
    stale): 7 held, 8 counted, every new unit shed. The processor suspends the bound once no
    checkpoint came for ``stall_min_s`` (2 s here), and the loop goes on."""
    create_topics(kafka_bootstrap, namespace)
    bounded = dataclasses.replace(RECIPE, schedule=dataclasses.replace(
        RECIPE.schedule, max_backlog_steps=1))
    _checkpoint_at(kafka_bootstrap, namespace, 1, {})
    work = fresh(make_workload(windows=200, groups_per_window=5, seed=17), version=100)
    runtime = ProcessorRuntime(bounded, bootstrap=kafka_bootstrap, namespace=namespace,
                               instance="one-step", log_every_s=5, stall_min_s=2.0)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    topic = declarations.units(namespace, RECIPE.name)
    trainer = Consumer(client_config(kafka_bootstrap, {
        "group.id": f"{namespace}.one-step-trainer", "isolation.level": "read_committed",
        "auto.offset.reset": "earliest", "enable.auto.commit": False}))
    trainer.subscribe([topic])
    done = threading.Event()

    # 20 groups a second until the test is done (at most 50 s)
    windows = itertools.takewhile(lambda _: not done.is_set(), work.windows)
    sender = threading.Thread(target=produce, args=(kafka_bootstrap, namespace, windows),
                              kwargs={"pause_s": 0.25}, daemon=True)
    steps, held, at, skipped = 1, [], {}, []
    try:
        wait_for(lambda: runtime.newest_checkpoint == 1, 60, "the checkpoint")
        sender.start()

        def trained() -> bool:
            """One round of the trainer: take what came and train every full step; true once
            9 steps are trained or the processor's thread has ended."""
            nonlocal steps, held, skipped, skips
            held += [m for m in trainer.consume(50, timeout=0.5) if m.error() is None]
            if skips and held:
                skips, skipped, held = 0, held[:1], held[1:]
            while len(held) >= 8:
                step, held = held[:8], held[8:]
                # The checkpoint's offsets pass what the step took and what was skipped before.
                for m in skipped + step:
                    at[m.partition()] = max(at.get(m.partition(), 0), m.offset() + 1)
                skipped = []
                steps += 1
                _checkpoint_at(kafka_bootstrap, namespace, steps, at)
            return steps >= 9 or not thread.is_alive()

        wait_until(trained, 90, lambda: f"9 trained steps; {steps} trained, {len(held)} held, "
                   f"{runtime.counts}, backlog {runtime.backlog}", poll_s=0)
        # Never more than a step waited (what the trainer held counts: it is not trained yet).
        assert steps == 9, (steps, len(held), runtime.counts, runtime.backlog)
        assert runtime.counts["generations.shed"] > 0, runtime.counts  # the bound did bind
    finally:
        done.set()
        runtime.stop()
        thread.join(30)
        sender.join(30)
        trainer.close()


# --------------------------------------------------------------------------- rebalance


def test_a_rebalance_between_two_live_processors_keeps_one_outcome_per_generation(
        kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    work = make_workload(windows=60, groups_per_window=10, seed=21)
    flowed: list = []  # windows sent so far
    finish, sent = threading.Event(), threading.Event()

    def flow() -> None:
        for window in work.windows:
            if finish.is_set():
                break
            produce(kafka_bootstrap, namespace, [window])
            flowed.append(window)
            time.sleep(0.3)
        sent.set()

    first = Running(kafka_bootstrap, namespace, "a")
    second = None
    try:
        first.wait_ready()
        threading.Thread(target=flow, daemon=True).start()
        wait_for(lambda: len(flowed) >= 6, 30, "six windows")
        second = Running(kafka_bootstrap, namespace, "b")  # joins: the partitions split
        second.wait_ready()
        joined = len(flowed)
        wait_for(lambda: len(flowed) >= joined + 6 or sent.is_set(), 30, "six more windows")
        first.stop()  # leaves: after the session timeout its partitions go to the second
        left = len(flowed)
        wait_for(lambda: len(flowed) >= left + 6 or sent.is_set(), 30, "six more windows")
        finish.set()
        wait_for(sent.is_set, 30, "the input to stop")
        assert 6 <= joined < left < len(flowed), "input flowed across both rebalances"
        sent_ids = {r.generation_id for w in flowed for r in w if isinstance(r, Generation)}
        work.complete &= sent_ids
        work.other &= sent_ids
        work.orphan_feedback &= {r.feedback_id for w in flowed for r in w
                                 if not isinstance(r, Generation)}
        work.windows = flowed
        back = read_back(kafka_bootstrap, namespace, work, alive=second.thread.is_alive)
    finally:
        finish.set()
        first.runtime.stop()
        if second is not None:
            second.stop()
    assert first.error is None and second.error is None, (first.error, second.error)
    check_invariant(back, work)
    assert back.unit_records == len(back.units), "a unit committed twice"
    a, b = first.runtime.counts, second.runtime.counts
    assert a["units"] > 0 and b["units"] > 0, "both processors worked"
    assert a["units"] + b["units"] == len(back.units), "a unit emitted by both, or by neither"
    outcomes = sum(n for c in (a, b) for k, n in c.items()
                   if k.startswith("generations.") and k != "generations.duplicate")
    assert outcomes == len(work.generations), "a generation concluded twice, or never"
    print(f"\n{len(flowed)} windows; the second joined after {joined}, the first left after "
          f"{left}; units a={a['units']} b={b['units']}; transactions "
          f"a={first.runtime.transactions} b={second.runtime.transactions}")


# --------------------------------------------------------------------------- the safety valve


def committed_offset(bootstrap: str, group: str, topic: str, partition: int) -> int:
    consumer = Consumer(client_config(bootstrap, {"group.id": group, "enable.auto.commit": False}))
    try:
        return consumer.committed([TopicPartition(topic, partition)], timeout=10)[0].offset
    finally:
        consumer.close()


def test_records_wait_for_a_lagging_topic_at_most_max_idle_s_each(kafka_bootstrap, namespace):
    """Feedback of group ``lagging`` sits in a reward worker's open transaction (so the
    feedback partition has records the processor cannot read yet); the group's
    generations, produced after it, wait for it, all of them together for MAX_IDLE_S,
    then are offered; when the transaction commits the group becomes one unit."""
    create_topics(kafka_bootstrap, namespace)
    gens_topic = declarations.generations(namespace)
    proc = Running(kafka_bootstrap, namespace, "valve")
    group = proc.runtime.group
    worker = Producer(client_config(kafka_bootstrap, {
        "transactional.id": f"rewarder-{uuid.uuid4().hex[:8]}", "transaction.timeout.ms": 120_000}))
    plain = Producer(client_config(kafka_bootstrap, {"acks": "all"}))
    registry = SchemaRegistry.default()
    partitions: dict[str, int] = {}

    def send(producer: Producer, record) -> None:
        topic = gens_topic if isinstance(record, Generation) else declarations.feedback(namespace)
        value, headers = registry.encode(record)

        def delivered(error, message):
            assert error is None, error
            partitions[record.generation_id] = message.partition()
            offsets[record.generation_id] = message.offset()

        producer.produce(topic, value=value, key=key_of(record), headers=headers,
                         on_delivery=delivered)
        assert producer.flush(30) == 0

    offsets: dict[str, int] = {}
    try:
        proc.wait_ready()
        worker.init_transactions(30)
        # Baseline: nothing unread on the other topic, so a generation is offered at once.
        alone = generation("alone", None, 1)
        send(plain, alone)
        started = time.monotonic()
        wait_for(lambda: committed_offset(kafka_bootstrap, group, gens_topic, partitions["alone"])
                 > offsets["alone"], 30, "the lone generation to be offered")
        assert time.monotonic() - started < MAX_IDLE_S - 1, "offered without waiting"

        members = [generation(f"lagging-m{m}", "lagging", 4) for m in range(4)]
        worker.begin_transaction()
        for g in members:
            send(worker, feedback(g.generation_id, "lagging", 1.0))  # in the log, not committed
        # The processor's fetches learn the feedback partition's new end. Nothing outside it
        # shows when (its consumer_lag metric leaves out a partition it has read nothing from),
        # so this waits a fetch round trip (fetch.wait.max.ms) several times over.
        time.sleep(1)
        for g in members:
            send(plain, g)
        sent_at = time.monotonic()
        p = partitions[members[0].generation_id]
        assert {partitions[g.generation_id] for g in members} == {p}, "one partition pair"
        last = max(offsets[g.generation_id] for g in members)
        offered: list[float] = []

        def all_offered() -> bool:
            if committed_offset(kafka_bootstrap, group, gens_topic, p) > last:
                offered.append(time.monotonic() - sent_at)
            return bool(offered)

        wait_for(all_offered, 3 * MAX_IDLE_S + 10, "the lagging group's generations")
        assert offered[0] >= MAX_IDLE_S - 0.5, f"offered after {offered[0]:.1f} s, without waiting"
        assert offered[0] <= MAX_IDLE_S + 3, (
            f"the 4 generations were offered {offered[0]:.1f} s after they were sent: each must "
            f"wait at most MAX_IDLE_S ({MAX_IDLE_S} s), not one after the other")
        assert proc.runtime.counts["units"] == 0

        worker.commit_transaction(30)  # the feedback becomes readable: the group completes
        wait_for(lambda: proc.runtime.counts["units"] == 1 or proc.error, 30, "the unit")
        units = [SchemaRegistry.default().decode(m.value(), m.headers(), RolloutUnit)
                 for m in consume_all(kafka_bootstrap, declarations.units(namespace, RECIPE.name), 1)]
    finally:
        proc.stop()
    assert proc.error is None, proc.error
    assert [sorted(m.generation_id for m in u.members) for u in units] == [
        [g.generation_id for g in members]]
    assert proc.runtime.counts["generations.unit"] == 4
    assert proc.runtime.counts["generations.expired"] == 1  # the lone one, never its group



def test_a_unit_too_large_for_its_topic_dead_letters_its_members_and_the_rest_flows(
        kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    work = make_workload(1, 3, seed=5)
    big_group = "huge"
    for m in range(4):   # one group whose completions are 20x longer
        gid = f"{big_group}m{m}"
        big = dataclasses.replace(
            generation(gid, big_group, 4),
            completion_token_ids=np.arange(4000, dtype=np.int32),
            completion_logprobs=np.full(4000, -1.0, dtype=np.float32))
        work.windows[0] += [big, feedback(gid, big_group, 1.0)]
        work.other.add(gid)
    produce(kafka_bootstrap, namespace, work.windows)
    # Units of 4 normal generations are ~6 KB encoded; the big group's is ~70 KB.
    running = Running(kafka_bootstrap, namespace, "0", max_unit_bytes=40_000)
    try:
        running.wait_ready()
        back = read_back(kafka_bootstrap, namespace, work, alive=running.thread.is_alive)
    finally:
        running.stop()
    check_invariant(back, work)
    assert {g for g in back.generation_letters if g.startswith(big_group)} == \
        {f"{big_group}m{m}" for m in range(4)}
    assert all("over the 40000 the units topic takes" in back.reasons[f"{big_group}m{m}"]
               for m in range(4))
    assert back.kinds["processor.unit_too_large"] == 4
    assert running.runtime.counts["oversized_units"] == 1 and running.runtime.aborted == 0
