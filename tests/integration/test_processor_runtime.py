"""The processor runtime against a real broker: every generation ends in exactly one outcome.

The workload (``Workload``) is built of windows, each a few complete groups
and their feedback plus records meant to end elsewhere, shuffled within the
window: generations without feedback (EXPIRED), feedback for generations
that never come (ORPHANED), a group whose members disagree on its size
(INVALID, or a unit and an INVALID straggler, by arrival order), duplicate
generations and duplicate feedback (dropped). ``check_invariant`` reads the
units and dead letters back (``read_committed``; units deduplicated by id,
as the trainer does) and asserts that each generation is in exactly one
unit or exactly one generation dead letter, and every complete group in a
unit. ``RECIPE`` is loadable as
``tests.integration.test_processor_runtime:RECIPE`` (the fault test runs it
in a subprocess).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.core.events import (
    DeadLetter, Feedback, Generation, RolloutUnit, SamplingParams,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from tests import factories
from tests.helpers import consume_all, consume_events, wait_until
from tests.recipes.parts import GroupBaseline

TIMEOUT_MS = 3_000
GROUP_SIZE = 4

RECIPE = Recipe(
    name="rt",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=TIMEOUT_MS)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2,
                      max_staleness=2),
    backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT,)),
)

_PROMPT = np.arange(32, dtype=np.int32)
_COMPLETION = np.arange(100, 300, dtype=np.int32)
_LOGPROBS = -np.linspace(0.01, 3.0, 200, dtype=np.float32)


def generation(gid: str, group: str | None, size: int) -> Generation:
    """The factory's generation (tests/factories.py) with ~1 KB of tokens, ``group`` its prompt."""
    return factories.generation(
        gid, request_id=f"req-{gid}", prompt_id=f"prompt-{group or gid}", group_id=group,
        group_size=size, prompt_token_ids=_PROMPT, completion_token_ids=_COMPLETION,
        completion_logprobs=_LOGPROBS,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=200))


def feedback(gid: str, group: str | None, reward: float, *, source: str = "exact_match",
             suffix: str = "") -> Feedback:
    return factories.feedback(gid, feedback_id=f"fb-{gid}-{source}{suffix}", group_id=group,
                              source=source, reward=reward, created_at=factories.T0 + 1)


@dataclass
class Workload:
    """What was sent, and what each generation should become."""

    complete: set[str] = field(default_factory=set)  # in a complete group with all feedback
    other: set[str] = field(default_factory=set)  # must end somewhere, unit or dead letter
    orphan_feedback: set[str] = field(default_factory=set)  # feedback ids with no generation
    windows: list[list[Generation | Feedback]] = field(default_factory=list)

    @property
    def generations(self) -> set[str]:
        return self.complete | self.other

    def count(self) -> Counter[str]:
        return Counter(type(r).__name__ for w in self.windows for r in w)


def make_workload(windows: int, groups_per_window: int, seed: int) -> Workload:
    rng, work = random.Random(seed), Workload()
    for w in range(windows):
        records: list[Generation | Feedback] = []
        for g in range(groups_per_window):
            group = f"w{w:03d}g{g:03d}"
            for m in range(GROUP_SIZE):
                gid = f"{group}m{m}"
                records += [generation(gid, group, GROUP_SIZE), feedback(gid, group, rng.random())]
                work.complete.add(gid)
        # a duplicate generation and a duplicate feedback record of this window
        records += [records[0], feedback(records[1].generation_id, records[1].group_id, 0.5,
                                         suffix="-again")]
        # no feedback: expires
        lonely = f"w{w:03d}lonely"
        records.append(generation(lonely, None, 1))
        work.other.add(lonely)
        # feedback for a generation that never comes: orphaned
        ghost = feedback(f"w{w:03d}ghost", None, 1.0)
        records.append(ghost)
        work.orphan_feedback.add(ghost.feedback_id)
        # a group whose members disagree on its size
        bad = f"w{w:03d}bad"
        for m, size in enumerate((3, 3, 2)):
            gid = f"{bad}m{m}"
            records += [generation(gid, bad, size), feedback(gid, bad, 0.0)]
            work.other.add(gid)
        rng.shuffle(records)
        work.windows.append(records)
    return work


def key_of(record: Generation | Feedback) -> bytes:
    return (record.group_id or record.generation_id).encode()


def produce(bootstrap: str, namespace: str, windows: list[list[Generation | Feedback]],
            pause_s: float = 0.0) -> None:
    """Send the windows in order (each shuffled), ``pause_s`` apart; wait for every ack."""
    registry = SchemaRegistry.default()
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True,
                                                  "linger.ms": 5}))
    topics = {Generation: declarations.generations(namespace), Feedback: declarations.feedback(namespace)}
    failures: list[str] = []

    def delivered(error, message):
        if error is not None:
            failures.append(str(error))

    for records in windows:
        for record in records:
            value, headers = registry.encode(record)
            producer.produce(topics[type(record)], value=value, key=key_of(record),
                             headers=headers, on_delivery=delivered)
            producer.poll(0)
        producer.flush(30)
        if pause_s:
            time.sleep(pause_s)
    assert producer.flush(30) == 0 and not failures, failures


def create_topics(bootstrap: str, namespace: str) -> None:
    ensure_topics(AdminClient(client_config(bootstrap)),
                  declarations.declare_topics(namespace, (RECIPE.name,)))


@dataclass
class ReadBack:
    units: dict[str, tuple[str, ...]]  # unit id -> member generation ids (deduplicated)
    unit_records: int
    generation_letters: Counter[str]  # generation id -> dead letters
    feedback_letters: Counter[str]  # feedback id -> dead letters
    kinds: Counter[str]
    reasons: dict[str, str] = field(default_factory=dict)  # generation id -> its dead letter's reason


def read_back(bootstrap: str, namespace: str, work: Workload, *, isolation: str = "read_committed",
              deadline_s: float = 60, alive=lambda: True) -> ReadBack:
    """Units and dead letters, once every generation of ``work`` has an outcome (or the deadline)."""
    registry = SchemaRegistry.default()
    units_topic = declarations.units(namespace, RECIPE.name)
    dl_topic = declarations.dead_letters(namespace)
    end = time.monotonic() + deadline_s
    while True:
        units: dict[str, tuple[str, ...]] = {}
        unit_records = 0
        for message in consume_all(bootstrap, units_topic, 0, idle_rounds=1) if isolation == \
                "read_committed" else _consume_uncommitted(bootstrap, units_topic):
            unit = registry.decode(message.value(), message.headers(), RolloutUnit)
            members = tuple(m.generation_id for m in unit.members)
            assert units.setdefault(unit.unit_id, members) == members, "one unit id, two member sets"
            unit_records += 1
        gens, fbs, kinds, reasons = Counter(), Counter(), Counter(), {}
        for message in consume_all(bootstrap, dl_topic, 0, idle_rounds=1):
            letter = registry.decode(message.value(), message.headers(), DeadLetter)
            kinds[letter.error_type] += 1
            if letter.source_topic == declarations.generations(namespace):
                gid = registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                                      Generation).generation_id
                gens[gid] += 1
                reasons[gid] = letter.reason
            elif letter.source_topic == declarations.feedback(namespace):
                fbs[registry.decode(letter.value, [(h.key, h.value) for h in letter.headers],
                                    Feedback).feedback_id] += 1
        result = ReadBack(units, unit_records, gens, fbs, kinds, reasons)
        done = {g for members in units.values() for g in members} | set(gens)
        if done >= work.generations or time.monotonic() > end or not alive():
            return result
        time.sleep(1)


def _consume_uncommitted(bootstrap: str, topic: str) -> list:
    from confluent_kafka import Consumer

    consumer = Consumer(client_config(bootstrap, {
        "group.id": "verifier-uncommitted", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "isolation.level": "read_uncommitted"}))
    consumer.subscribe([topic])
    messages, idle = [], 0
    while idle < 3:
        batch = consumer.consume(5000, timeout=1.0)
        idle = 0 if batch else idle + 1
        messages += [m for m in batch if m.error() is None]
    consumer.close()
    return messages


def check_invariant(back: ReadBack, work: Workload) -> None:
    """Each generation in exactly one unit (by id) or exactly one dead letter; complete groups
    in units; every orphaned feedback record dead-lettered once."""
    in_units: dict[str, list[str]] = defaultdict(list)
    for uid, members in back.units.items():
        for gid in members:
            in_units[gid].append(uid)
    two_units = {g: u for g, u in in_units.items() if len(u) > 1}
    assert not two_units, f"generations in two different units: {list(two_units.items())[:5]}"
    outcomes = {g: len(in_units.get(g, ())) + back.generation_letters.get(g, 0)
                for g in work.generations}
    wrong = {g: n for g, n in outcomes.items() if n != 1}
    assert not wrong, (f"{len(wrong)} generations without exactly one outcome, e.g. "
                       f"{sorted(wrong.items())[:10]}")
    assert set(in_units) | set(back.generation_letters) == work.generations, "unknown generations"
    missing = work.complete - set(in_units)
    assert not missing, (f"{len(missing)} complete generations not in a unit, e.g. "
                         f"{[(g, back.reasons.get(g)) for g in sorted(missing)[:5]]}")
    assert all(back.feedback_letters.get(f) == 1 for f in work.orphan_feedback), \
        "every orphaned feedback record is dead-lettered exactly once"


def test_shuffled_generations_and_feedback_end_in_exactly_one_outcome(kafka_bootstrap, namespace):
    work = make_workload(windows=25, groups_per_window=50, seed=7)  # 5,000 complete + 100 others
    counts = work.count()
    assert len(work.complete) >= 5000 and counts["Feedback"] >= 5000
    create_topics(kafka_bootstrap, namespace)
    started = time.monotonic()
    produce(kafka_bootstrap, namespace, work.windows)
    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace,
                               log_every_s=5)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            runtime.run()
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        back = read_back(kafka_bootstrap, namespace, work, alive=thread.is_alive)
    finally:
        runtime.stop()
        thread.join(30)
    elapsed = time.monotonic() - started
    assert not failures, failures
    check_invariant(back, work)
    assert back.unit_records == len(back.units), "no unit written twice without a crash"
    assert runtime.counts["generations.duplicate"] == len(work.windows)
    assert runtime.counts["feedback.duplicate"] == len(work.windows)
    assert back.kinds["processor.expired"] >= len(work.windows)
    assert back.kinds["processor.orphaned"] == len(work.windows)
    print(f"\n{len(work.generations)} generations, {counts['Feedback']} feedback: "
          f"{len(back.units)} units, dead letters {dict(back.kinds)}, in {elapsed:.1f} s; "
          f"{runtime.transactions} transactions")


def test_generations_behind_the_newest_checkpoint_end_too_stale(kafka_bootstrap, namespace):
    """max_staleness is 2: with checkpoint 5 published, version 4 trains, version 0 does not."""
    import dataclasses

    from reef_stream.core.events import Checkpoint

    create_topics(kafka_bootstrap, namespace)
    registry = SchemaRegistry.default()
    producer = Producer(client_config(kafka_bootstrap))
    for recipe, version in (("rt", 5), ("another-recipe", 50)):  # only this recipe's counts
        value, headers = registry.encode(Checkpoint(
            checkpoint_id=f"ckpt-{recipe}", recipe=recipe, trainer_group="trainers", step=5,
            model="tiny", policy_version=version, uri="file:///tmp/ckpt", sha256="00" * 32,
            offsets=(), trained_unit_count=40, created_at=1_795_000_000_000))
        producer.produce(declarations.checkpoints(namespace), value=value, headers=headers)
    assert producer.flush(30) == 0

    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # for both waits together
        wait_until(lambda: runtime.newest_checkpoint is not None, 60, "the newest checkpoint")
        assert runtime.newest_checkpoint == 5
        fresh = [dataclasses.replace(generation(f"fresh-{i}", "fresh", 4), policy_version=4)
                 for i in range(4)]
        stale = [generation(f"stale-{i}", "stale", 4) for i in range(4)]  # policy_version 0
        records = fresh + stale + [feedback(g.generation_id, g.group_id, 1.0) for g in fresh + stale]
        produce(kafka_bootstrap, namespace, [records])

        units: list[RolloutUnit] = []
        letters: list[DeadLetter] = []

        def outcomes() -> bool:
            units[:] = consume_events(kafka_bootstrap, declarations.units(namespace, "rt"), 1,
                                      RolloutUnit)
            letters[:] = [d for d in consume_events(kafka_bootstrap, declarations.dead_letters(
                namespace), 4, DeadLetter) if d.stage == "processor"]
            return bool(units) and len(letters) >= 4

        wait_until(outcomes, deadline - time.monotonic(), lambda: "a unit and the four stale "
                   f"generations' dead letters; read {len(units)} units and "
                   f"{[(d.error_type, d.reason) for d in letters]}", poll_s=0.5)
    finally:
        runtime.stop()
        thread.join(30)

    assert [sorted(m.generation_id for m in u.members) for u in units] == [
        [f"fresh-{i}" for i in range(4)]]
    too_stale = [d for d in letters if "stale" in d.error_type]
    assert len(too_stale) == 4, [(d.error_type, d.reason) for d in letters]
    assert all("5" in d.reason for d in too_stale), [d.reason for d in too_stale]
