"""Raw corrupt bytes and unknown schemas on every topic a consumer reads, against the real broker.

For each stage, hypothesis draws one batch of hostile messages (``hostile.raw_message``: random
bytes, valid Avro of another schema, an unknown or malformed fingerprint, no headers, a
tombstone, a truncated record, bytes left over), they go onto the stage's input topic between
valid records, and the stage runs once over all of it. Every hostile message must end as a dead
letter naming its topic, partition and offset with a reason (side readers count instead: the
follower, which reads the publications without a group, logs and counts them and the
evaluator, the topic's owner, dead-letters them; the processor counts the checkpoint events it
reads for staleness, which the evaluator dead-letters); the stage must not crash or stall, and
the valid records around them must flow on:

- processor (generations + feedback; also generations and feedback that decode but break the
  intake's rules, and duplicates): the valid groups become units;
- reward worker (generations): the valid generations get their feedback;
- trainer (units; also units that decode but cannot be trained: a token id outside the model's
  vocabulary, a NaN or infinite logprob or reward, logprobs of another length, no samples): a
  step is trained and checkpointed;
- evaluator (checkpoints; also checkpoints whose URI no filesystem can open): a decision for
  every decodable candidate, the valid ones promoted;
- follower (publications; also a promoted publication whose URI no filesystem can open): it
  refuses that one, keeps running and loads the next valid version; then an evaluator letters
  every hostile publication but tombstones, keyed by where it is;
- processor (checkpoints, its side read): it counts them and still sees the valid checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
from confluent_kafka import Producer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from reef_stream.api.recipe import load_recipe
from reef_stream.consumers.evaluator.evaluator import coordinates_key
from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
from reef_stream.consumers.trainer.trainer import Trainer
from reef_stream.core import metric_names
from reef_stream.core.events import (
    Checkpoint, DeadLetter, Decision, Feedback, Generation, Publication, RolloutUnit,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import load_settings
from reef_stream.serving.follower import Follower
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from tests.helpers import consume_all, consume_events, wait_until
from tests.integration.publishing import (
    Loads, create_topics, promoted, run_evaluator, write_checkpoint,
)
from tests.integration.test_processor_runtime import RECIPE, feedback, generation
from tests.integration.test_processor_runtime import create_topics as create_processor_topics
from tests.property.hostile import RawMessage, feedback_event, generation_event, raw_message
from tests.unit_log import create_topics as create_unit_topics
from tests.unit_log import after_stamp, rollout_unit

ONCE = settings(max_examples=1, deadline=None, database=None,
                phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
registry = SchemaRegistry.default()
Where = tuple[str, int, int]


def draw_once(strategy):
    """One example of ``strategy``, drawn by hypothesis (``@given``, one example)."""
    drawn = []

    @ONCE
    @given(strategy)
    def draw(value) -> None:
        drawn.append(value)

    draw()
    return drawn[-1]


def produce(bootstrap: str, items: list[tuple[str, object]], key_of=None,
            one_by_one: bool = False) -> list[Where]:
    """Each (topic, RawMessage or event) in order, acknowledged; where each one landed. With
    ``one_by_one``, each is acknowledged before the next is sent (a later broker time each)."""
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
    landed: list[Where | None] = [None] * len(items)
    stamped: list[int] = []  # the broker's timestamps (LogAppendTime where the topic says so)

    def delivered(i):
        def report(error, message):
            assert error is None, error
            landed[i] = (message.topic(), message.partition(), message.offset())
            stamped.append(message.timestamp()[1])
        return report

    for i, (topic, item) in enumerate(items):
        if isinstance(item, RawMessage):
            value, headers, key = item.value, item.headers, item.key
        else:
            value, headers = registry.encode(item)
            key = key_of(item) if key_of else b"k"
        producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered(i))
        producer.poll(0)
        if one_by_one:
            assert producer.flush(30) == 0
            # Two records appended in one millisecond tie on LogAppendTime, and the trainer
            # orders ties by partition: a later broker millisecond each keeps "this order".
            after_stamp(stamped[-1])
    assert producer.flush(30) == 0
    return landed


def letters_at(bootstrap: str, namespace: str, stage: str) -> dict[Where, list[DeadLetter]]:
    found: dict[Where, list[DeadLetter]] = {}
    for letter in consume_events(bootstrap, declarations.dead_letters(namespace), 1, DeadLetter):
        if letter.stage == stage:
            where = (letter.source_topic, letter.source_partition, letter.source_offset)
            found.setdefault(where, []).append(letter)
    return found


def wait_for(predicate, timeout: float, what: str) -> None:
    """``wait_until``, polling every 0.5 s."""
    wait_until(predicate, timeout, what, poll_s=0.5)


def _key(record) -> bytes:
    return (record.group_id or record.generation_id).encode()


# --------------------------------------------------------------------------- processor

#: Generations and feedback that decode but that the SDK would have refused.
NOT_VALID_GENERATIONS = [
    generation_event("nan-logprob", completion_logprobs=np.array([np.nan, -1], np.float32)),
    generation_event("negative-version", policy_version=-3),
    generation_event("negative-token", prompt_token_ids=np.array([-1], np.int32)),
    generation_event("mismatch", completion_logprobs=np.array([-1.0], np.float32)),
    generation_event(" ", group_id="", group_size=0),
    generation_event("surrogate-free-but-empty-prompt", prompt_token_ids=np.array([], np.int32)),
]
NOT_VALID_FEEDBACK = [feedback_event("g-x", reward=float("nan")),
                      feedback_event("g-y", reward=float("inf"), source="exact_match"),
                      feedback_event("", source="exact_match")]


def test_the_processor_dead_letters_every_hostile_record_and_units_flow_on(
        kafka_bootstrap, namespace):
    create_processor_topics(kafka_bootstrap, namespace)
    gens, fbs = declarations.generations(namespace), declarations.feedback(namespace)
    hostile_gens = draw_once(st.lists(raw_message(Generation, generation_event()), min_size=8,
                                      max_size=14))
    hostile_fbs = draw_once(st.lists(raw_message(Feedback, feedback_event()), min_size=8,
                                     max_size=14))
    valid = [r for g in range(3) for m in range(4) for r in (
        generation(f"v{g}m{m}", f"v{g}", 4), feedback(f"v{g}m{m}", f"v{g}", 0.25 * m))]
    duplicate = valid[0]
    hostile = [(gens, m) for m in hostile_gens] + [(fbs, m) for m in hostile_fbs] + \
        [(gens, g) for g in NOT_VALID_GENERATIONS] + [(fbs, f) for f in NOT_VALID_FEEDBACK]
    # hostile first, then valid ones, more hostile, a duplicate: all on the same partitions
    items = hostile[::2] + [(gens if isinstance(r, Generation) else fbs, r) for r in valid] + \
        hostile[1::2] + [(gens, duplicate)]
    landed = produce(kafka_bootstrap, items, key_of=_key)
    hostile_at = {landed[i] for i, item in enumerate(items) if item in hostile}
    assert len(hostile_at) == len(hostile)

    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace,
                               log_every_s=60)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(runtime.run, errors), daemon=True)
    thread.start()
    units: list[RolloutUnit] = []
    try:
        def done() -> bool:
            assert thread.is_alive(), f"the processor stopped: {errors}"
            units[:] = consume_events(kafka_bootstrap, declarations.units(namespace, RECIPE.name),
                                      3, RolloutUnit)
            return len(units) >= 3 and hostile_at <= set(
                letters_at(kafka_bootstrap, namespace, "processor"))
        wait_for(done, 90, "three units and a dead letter per hostile record")
    finally:
        runtime.stop()
        thread.join(30)
    assert not errors, errors
    assert sorted(sorted(m.generation_id for m in u.members) for u in units) == \
        [[f"v{g}m{m}" for m in range(4)] for g in range(3)]
    letters = letters_at(kafka_bootstrap, namespace, "processor")
    for where in hostile_at:
        assert len(letters[where]) == 1 and letters[where][0].reason, letters[where]
    assert runtime.counts["generations.duplicate"] == 1
    assert runtime.counts["invalid_records"] == len(hostile)


def _run(run, errors: list) -> None:
    try:
        run()
    except BaseException as error:  # noqa: BLE001 - the test reports it
        errors.append(error)


# --------------------------------------------------------------------------- reward worker


def test_the_reward_worker_dead_letters_undecodable_generations_and_rewards_the_rest(
        kafka_bootstrap, namespace, tmp_path):
    from tests.recipes.rewards import quick

    create_topics(kafka_bootstrap, namespace)
    gens = declarations.generations(namespace)
    hostile = draw_once(st.lists(raw_message(Generation, generation_event()), min_size=10,
                                 max_size=20))
    valid = [generation_event(f"ok-{i}") for i in range(6)]
    items = [(gens, r) for pair in zip(hostile, valid) for r in pair] + \
        [(gens, r) for r in hostile[len(valid):]] + [(gens, r) for r in valid[len(hostile):]]
    landed = produce(kafka_bootstrap, items, key_of=_key)
    hostile_at = {landed[i] for i, (_, item) in enumerate(items) if isinstance(item, RawMessage)}

    worker = RewardWorker(quick, bootstrap=kafka_bootstrap, settings=load_settings(),
                          namespace=namespace, spool_dir=tmp_path / "spool",
                          options=RewardOptions(group=f"{namespace}-r", retries=0,
                                                max_records=len(items), idle_exit=20))
    summary = worker.run()

    assert (summary.undecodable, summary.rewarded) == (len(hostile), len(valid))
    rewarded = consume_events(kafka_bootstrap, declarations.feedback(namespace), len(valid),
                              Feedback)
    assert sorted(f.generation_id for f in rewarded) == sorted(g.generation_id for g in valid)
    letters = letters_at(kafka_bootstrap, namespace, "reward")
    assert set(letters) == hostile_at
    assert all(len(v) == 1 and "undecodable generation" in v[0].reason for v in letters.values())


# --------------------------------------------------------------------------- trainer


@st.composite
def untrainable_unit(draw, i: int) -> RolloutUnit:
    """Unit ``i`` of ``rollout_unit`` (vocabulary 64), spoiled so that it decodes but cannot be
    trained: one sample gets a token id outside the vocabulary, a NaN or infinite logprob or
    reward, or logprobs of another length than its completion; or the unit has no samples."""
    unit = rollout_unit(i)
    kind = draw(st.sampled_from(["token", "logprob", "reward", "lengths", "no samples"]))
    if kind == "no samples":
        return dataclasses.replace(unit, members=())
    member = draw(st.integers(0, len(unit.members) - 1))
    sample = unit.members[member]
    not_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
    if kind == "token":
        name = draw(st.sampled_from(["prompt_token_ids", "completion_token_ids"]))
        ids = getattr(sample, name).copy()
        ids[draw(st.integers(0, len(ids) - 1))] = draw(
            st.one_of(st.integers(-2**31, -1), st.integers(64, 2**31 - 1)))
        changes = {name: ids}
    elif kind == "logprob":
        logprobs = sample.completion_logprobs.copy()
        logprobs[draw(st.integers(0, len(logprobs) - 1))] = draw(not_finite)
        changes = {"completion_logprobs": logprobs}
    elif kind == "reward":
        changes = {"reward": draw(not_finite)}
    else:
        length = draw(st.integers(0, 30).filter(lambda n: n != len(sample.completion_token_ids)))
        changes = {"completion_logprobs": np.full(length, -1.0, np.float32)}
    members = list(unit.members)
    members[member] = dataclasses.replace(sample, **changes)
    return dataclasses.replace(unit, members=tuple(members))


def test_the_trainer_dead_letters_undecodable_units_and_trains_a_step(
        kafka_bootstrap, namespace, tmp_path):
    create_unit_topics(kafka_bootstrap, namespace)
    topic = declarations.units(namespace, "trainable")
    hostile = draw_once(st.lists(raw_message(RolloutUnit, rollout_unit(0)), min_size=6,
                                 max_size=12))
    untrainable = list(draw_once(st.tuples(*(untrainable_unit(100 + k) for k in range(4)))))
    valid = [rollout_unit(i) for i in range(4)]  # units_per_step is 4
    items = [(topic, r) for r in hostile[:3] + untrainable[:2] + valid[:2] + hostile[3:]
             + untrainable[2:] + valid[2:]]
    landed = produce(kafka_bootstrap, items, key_of=lambda unit: unit.unit_id.encode(),
                     one_by_one=True)  # in this order of broker time: the trainer's order
    hostile_at = {landed[i] for i, (_, item) in enumerate(items) if isinstance(item, RawMessage)}
    untrainable_at = {landed[i]: item.unit_id for i, (_, item) in enumerate(items)
                      if item in untrainable}

    trainer = Trainer(load_recipe("tests.recipes.trainable"), bootstrap=kafka_bootstrap,
                      namespace=namespace, group="doors", checkpoints=str(tmp_path / "ckpt"),
                      max_steps=1, idle_exit=10, settings=load_settings())
    summary = trainer.run()

    assert (summary.steps, summary.units_trained, summary.invalid) == \
        (1, 4, len(hostile) + len(untrainable))
    (event,) = consume_events(kafka_bootstrap, declarations.checkpoints(namespace), 1, Checkpoint)
    assert event.step == 1
    letters = letters_at(kafka_bootstrap, namespace, "trainer")
    assert set(letters) == hostile_at | set(untrainable_at)
    assert all("unit cannot be trained" in letters[at][0].reason for at in hostile_at)
    for at, unit_id in untrainable_at.items():
        (letter,) = letters[at]
        assert letter.error_type == "UntrainableUnit", letter
        assert letter.reason.startswith(f"unit {unit_id} cannot be trained: "), letter.reason


# --------------------------------------------------------------------------- evaluator


def test_the_evaluator_dead_letters_undecodable_checkpoints_and_decides_every_candidate(
        kafka_bootstrap, namespace, tmp_path):
    create_topics(kafka_bootstrap, namespace)
    topic = declarations.checkpoints(namespace)
    first = write_checkpoint(tmp_path / "ckpt", 1, 0.5)
    last = write_checkpoint(tmp_path / "ckpt", 5, 0.9)
    unopenable = [dataclasses.replace(first, checkpoint_id=f"bad-{v}", step=v, policy_version=v,
                                      uri=uri)
                  for v, uri in ((2, "s3://no-such-bucket/ckpt"), (3, "reference://"),
                                 (4, first.uri + "\x00"))]
    hostile = draw_once(st.lists(raw_message(Checkpoint, first), min_size=5, max_size=10))
    items = [(topic, r) for r in [first, *hostile[:2], *unopenable, *hostile[2:], last]]
    landed = produce(kafka_bootstrap, items, key_of=lambda c: c.trainer_group.encode())
    hostile_at = {landed[i] for i, (_, item) in enumerate(items) if isinstance(item, RawMessage)}
    settings_ = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                               "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})

    # Each candidate decided on its own (not superseded by the newest waiting): the
    # unopenable ones are rejected for what is wrong with them.
    summary = run_evaluator("promoting", settings_, fleet=None, idle_exit=3, supersede=False)

    assert (summary.promoted, summary.rejected, summary.undecodable) == (2, 3, len(hostile))
    decisions = consume_events(kafka_bootstrap, declarations.publications(namespace), 5,
                               Publication)
    by_version = {p.policy_version: p for p in decisions}
    assert [by_version[v].decision for v in (1, 2, 3, 4, 5)] == [
        Decision.PROMOTED, Decision.REJECTED, Decision.REJECTED, Decision.REJECTED,
        Decision.PROMOTED]
    assert all("failed verification" in by_version[v].reason for v in (2, 3, 4))
    letters = letters_at(kafka_bootstrap, namespace, "evaluator")
    assert set(letters) == hostile_at
    assert all("undecodable checkpoint event" in v[0].reason for v in letters.values())


# --------------------------------------------------------------------------- follower


class Refusals:
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def __call__(self, publication, error) -> None:
        self.seen.append((publication.policy_version, str(error)))


def test_the_follower_skips_hostile_publications_and_loads_the_next_valid_version(
        kafka_bootstrap, namespace, tmp_path, caplog):
    create_topics(kafka_bootstrap, namespace)
    topic = declarations.publications(namespace)
    v1 = write_checkpoint(tmp_path / "ckpt", 1, 0.3)
    v2 = write_checkpoint(tmp_path / "ckpt", 2, 0.6)
    hostile = draw_once(st.lists(raw_message(Publication, promoted(v1)), min_size=5,
                                 max_size=10))
    settings_ = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                               "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})
    landed = produce(kafka_bootstrap, [(topic, m) for m in hostile[:2]] +
                     [(topic, promoted(v1, uri="s3://no-such-bucket/v1"))],
                     key_of=lambda p: p.model.encode())[:2]
    loads, refusals = Loads(), Refusals()
    caplog.set_level(logging.WARNING, logger="reef_stream.serving.follower")
    with Follower("tiny", on_version=loads, on_refused=refusals, settings=settings_, fleet=None,
                  heartbeat_s=1, retry_s=60) as replica:
        assert replica.wait_ready(30) is None  # v1 cannot be opened: refused, nothing served
        assert [v for v, _ in refusals.seen] == [1] and "s3://" in refusals.seen[0][1]
        landed += produce(kafka_bootstrap, [(topic, m) for m in hostile[2:]] +
                          [(topic, promoted(v2))], key_of=lambda p: p.model.encode())[:-1]
        assert replica.wait_for_version(2, 30) == 2
        undecodable = replica.undecodable
    assert loads.versions == [2]
    # Tombstones are compaction deletes, skipped silently; everything else is counted, once.
    bad_at = {where for where, m in zip(landed, hostile) if m.value is not None}
    assert undecodable == len(bad_at)
    skipped = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(skipped) == len(bad_at)
    assert {where for where in bad_at for message in skipped
            if f"{where[0]}[{where[1]}]@{where[2]}" in message} == bad_at
    assert letters_at(kafka_bootstrap, namespace, "follower") == {}  # replicas write none

    # The topic's owner letters each of them, keyed by where it is.
    summary = run_evaluator("promoting", settings_, fleet=None, idle_exit=3)
    assert summary.undecodable_publications == len(bad_at)
    keyed = {}
    for message in consume_all(kafka_bootstrap, declarations.dead_letters(namespace),
                               len(bad_at)):
        letter = registry.decode(message.value(), message.headers(), DeadLetter)
        keyed.setdefault((letter.source_topic, letter.source_partition, letter.source_offset),
                         []).append((message.key(), letter))
    assert set(keyed) == bad_at
    for where, pairs in keyed.items():
        ((key, letter),) = pairs
        assert key == coordinates_key(*where) and letter.stage == "evaluator"
        assert letter.reason.startswith("undecodable publication: ") and letter.error_type


# --------------------------------------------------------------------------- processor side read


def test_the_processor_counts_hostile_checkpoint_events_and_sees_the_valid_one(
        kafka_bootstrap, namespace):
    create_processor_topics(kafka_bootstrap, namespace)
    topic = declarations.checkpoints(namespace)
    valid = Checkpoint(checkpoint_id="ckpt-5", recipe=RECIPE.name, trainer_group="trainers",
                       step=5, model="tiny", policy_version=5, uri="file:///tmp/ckpt",
                       sha256="00" * 32, offsets=(), trained_unit_count=40,
                       created_at=1_795_000_000_000)
    hostile = draw_once(st.lists(raw_message(Checkpoint, valid), min_size=3, max_size=8))
    landed = produce(kafka_bootstrap, [(topic, m) for m in hostile] + [(topic, valid)])
    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace,
                               instance="side-read", log_every_s=60, metrics_every_s=0.5)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(runtime.run, errors), daemon=True)
    thread.start()
    try:
        wait_for(lambda: runtime.newest_checkpoint == 5 or errors, 60, "the valid checkpoint")
    finally:
        runtime.stop()
        thread.join(30)
    assert not errors, errors
    # Tombstones included: none of them is a checkpoint event.
    assert runtime.counts["checkpoints.undecodable"] == len(hostile)
    written = [m for m in consume_events(kafka_bootstrap, declarations.metrics(namespace), 1)
               if m.stage == metric_names.STAGE_PROCESSOR
               and m.name == metric_names.PROCESSOR_CHECKPOINTS_UNDECODABLE
               and m.labels.get("instance") == "side-read"]
    assert [m.value for m in written] == list(range(1, len(hostile) + 1))
    # The evaluator dead-letters them (see the evaluator's test above); the processor does not.
    hostile_at = set(landed[:-1])
    assert not hostile_at & set(letters_at(kafka_bootstrap, namespace, "processor"))
