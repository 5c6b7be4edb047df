"""Where a trainer resumes (``committed_checkpoint``), read back from the end of the real
``<ns>.checkpoints`` topic: the newest committed event of the recipe's group, the same one a
read from the beginning ends with, for a number of records read that does not grow with the
checkpoints before it."""

from __future__ import annotations

import uuid

from confluent_kafka import Producer

from reef_stream.consumers.trainer.trainer import committed_checkpoint
from reef_stream.core.events import Checkpoint, TopicOffset
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.verify import committed_checkpoints
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config, new_admin
from reef_stream.topics.reading import NEWEST_FIRST_WINDOW, NewestFirst

REGISTRY = SchemaRegistry.default()


def _event(group: str, step: int, recipe: str = "trainable") -> Checkpoint:
    return Checkpoint(checkpoint_id=f"{group}-{step}-{uuid.uuid4().hex[:6]}", recipe=recipe,
                      trainer_group=group, step=step, model="m", policy_version=step,
                      uri=f"file:///nowhere/{group}/{step}", sha256="0" * 64,
                      offsets=(TopicOffset(topic="units", partition=0, offset=step * 4),), trained_unit_count=step * 4,
                      created_at=1_700_000_000_000 + step)


class Checkpoints:
    """Writes Checkpoint events to ``<ns>.checkpoints`` as trainers do: one transaction each
    (or several in one), keyed by the group."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        self.topic = declarations.checkpoints(namespace)
        ensure_topics(new_admin(bootstrap), [t for t in declarations.declare_topics(namespace)
                                             if t.name == self.topic])
        self.producer = Producer(client_config(bootstrap, {"transactional.id": uuid.uuid4().hex}))
        self.producer.init_transactions(30)

    def write(self, *events: Checkpoint, commit: bool = True) -> None:
        self.producer.begin_transaction()
        for event in events:
            value, headers = REGISTRY.encode(event)
            self.producer.produce(self.topic, key=event.trainer_group.encode(), value=value,
                                  headers=headers)
        if commit:
            self.producer.commit_transaction(30)
        else:
            self.producer.abort_transaction(30)


def _resume_point(bootstrap: str, namespace: str, group: str,
                  recipe: str = "trainable") -> tuple[Checkpoint | None, int]:
    reader = NewestFirst(bootstrap, declarations.checkpoints(namespace), timeout=60)
    newest = committed_checkpoint(bootstrap, namespace, recipe, group, reader=reader)
    return newest, reader.records_read


def test_resume_reads_as_many_records_after_a_thousand_checkpoints_as_after_one(
        kafka_bootstrap, namespace):
    log = Checkpoints(kafka_bootstrap, namespace)
    log.write(_event("g", 1))
    first, read_after_one = _resume_point(kafka_bootstrap, namespace, "g")
    assert first is not None and first.step == 1 and read_after_one == 1

    # 1,000 more: one transaction per acknowledgement for the last 100 (a record and a commit
    # marker each), the rest in batches to keep the test short.
    for start in range(2, 902, 100):
        log.write(*(_event("g", s) for s in range(start, start + 100)))
    for step in range(902, 1002):
        log.write(_event("g", step))
    newest, read = _resume_point(kafka_bootstrap, namespace, "g")
    assert newest == committed_checkpoints(kafka_bootstrap, namespace, "trainable", "g")[-1]
    assert newest.step == 1001
    # One window back from the end: at most its records, not the thousand before them.
    assert read <= NEWEST_FIRST_WINDOW, read


def test_resume_finds_the_newest_committed_event_of_its_recipe_and_group_behind_others(
        kafka_bootstrap, namespace):
    log = Checkpoints(kafka_bootstrap, namespace)
    for step in range(1, 21):
        log.write(_event("g", step))
    # After the group's newest: another group's 150 events, another recipe's under the same
    # key, and a zombie's aborted event of the group (never seen by read_committed).
    log.write(*(_event("other", s) for s in range(1, 151)))
    log.write(_event("g", 99, recipe="another-recipe"))
    log.write(_event("g", 21), commit=False)
    newest, read = _resume_point(kafka_bootstrap, namespace, "g")
    assert newest == committed_checkpoints(kafka_bootstrap, namespace, "trainable", "g")[-1]
    assert newest.step == 20
    # Windows of 64, 128, 256 offsets: the 150 + 1 events and the markers after step 20 are
    # read, and a window's worth of what came before, not all of the topic.
    assert 150 < read < 150 + 4 * NEWEST_FIRST_WINDOW, read

    # A group with no checkpoint reads the topic to its beginning and finds none; an empty
    # or missing topic has none.
    assert _resume_point(kafka_bootstrap, namespace, "never-trained")[0] is None
    assert committed_checkpoint(kafka_bootstrap, f"{namespace}x", "trainable", "g") is None


def test_newest_first_reads_every_committed_record_once_newest_window_first(
        kafka_bootstrap, namespace):
    log = Checkpoints(kafka_bootstrap, namespace)
    for step in range(1, 41):
        log.write(_event("g", step), commit=step % 5 != 0)   # every fifth aborted
    with NewestFirst(kafka_bootstrap, log.topic, window=8, timeout=60) as reader:
        windows = [[REGISTRY.decode(m.value(), m.headers(), Checkpoint).step for m in records]
                   for records in reader]
    steps = [step for window in reversed(windows) for step in window]
    assert steps == [s for s in range(1, 41) if s % 5 != 0]
    assert all(w == sorted(w) for w in windows)
    # 40 transactions of two offsets each: windows of 8, 16, 32 and the last 24.
    assert reader.windows_read == 4 and reader.records_read == 32
