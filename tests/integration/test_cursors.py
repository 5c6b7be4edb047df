"""Replay cursors against the real broker: `reef replay`, `reef tail` and `reef lag`.

Every test runs the real commands. Once they are registered on the `reef`
group (cli.py) they run as a subprocess, `python -m reef_stream.cli ...`;
until then in-process through click's CliRunner, on a group of the same
class as `reef` (so errors become the same one-line messages and exit
statuses). Records, commits and consumer-group members are real.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import click
import pytest
from click.testing import CliRunner
from confluent_kafka import (
    Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, Producer, TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from reef_stream.cli.cursors import COMMANDS
from reef_stream.cli.main import main
from reef_stream.core.events import Feedback, Generation, SamplingParams, now_ms
from reef_stream.core.serde import encode
from reef_stream.core.settings import load_settings
from reef_stream.topics import cursors
from reef_stream.topics.connect import client_config
from tests import factories
from tests.helpers import reef, wait_until

PARTITIONS = 2
#: What a fresh broker answers while it creates its consumer-offsets topic.
COORDINATOR_STARTING = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                        KafkaError.COORDINATOR_NOT_AVAILABLE}


# --------------------------------------------------------------------------- running `reef`


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def error(self) -> str:
        """stderr on one line (rich wraps long messages)."""
        return " ".join(self.stderr.split())


def _wired() -> bool:
    return all(command.name in main.commands for command in COMMANDS)


def _in_process_group() -> click.Group:
    """`reef` with just the cursor commands, for before they are wired into cli.py."""

    @click.group(cls=type(main), commands=COMMANDS)
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.obj = load_settings()

    return group


def run(env: dict[str, str], *args: str) -> Outcome:
    """`reef ARGS...` against the session's broker, in the test's namespace."""
    if _wired():
        result = reef(*args, env=env, timeout=120, check=False)
        return Outcome(result.returncode, result.stdout, result.stderr)
    result = CliRunner().invoke(_in_process_group(), list(args), env={**env, "COLUMNS": "200"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Outcome(result.exit_code, result.stdout, result.stderr)


def table_rows(output: str) -> dict[str, list[str]]:
    """The rows of a rich table in ``output``, by their first cell (wrapped lines skipped)."""
    rows = {}
    for line in output.splitlines():
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            if cells[0]:
                rows.setdefault(cells[0], cells)
    return rows


# --------------------------------------------------------------------------- the cluster


@pytest.fixture
def admin(kafka_bootstrap):
    return AdminClient(client_config(kafka_bootstrap))


@pytest.fixture
def topic(admin, namespace) -> str:
    """`<namespace>.events`, two partitions, empty."""
    name = f"{namespace}.events"
    admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)],
                        operation_timeout=30)[name].result()

    def led() -> bool:
        partitions = admin.list_topics(name, timeout=10).topics[name].partitions
        return len(partitions) == PARTITIONS and all(p.leader >= 0 for p in partitions.values())

    wait_until(led, 30, f"{name}'s partitions to have leaders")
    return name


def produce(bootstrap: str, topic: str, partition: int, count: int,
            timestamps: list[int] | None = None) -> None:
    """``count`` records ``p<partition>-<i>`` on one partition, acknowledged by the broker."""
    producer = Producer(client_config(bootstrap, {"acks": "all"}))
    for i in range(count):
        extra = {"timestamp": timestamps[i]} if timestamps else {}
        producer.produce(topic, value=f"p{partition}-{i}".encode(), key=f"k{i}".encode(),
                         partition=partition, **extra)
    assert producer.flush(30) == 0


def retrying(request):
    """``request()``, asked again (for up to 30 s) while the group coordinator is starting."""
    def answered() -> tuple | None:
        try:
            return (request(),)  # in a tuple: a false answer is an answer too
        except KafkaException as exc:
            if exc.args[0].code() not in COORDINATOR_STARTING:
                raise
            return None

    return wait_until(answered, 30, "the group coordinator to start", poll_s=0.2)[0]


def commit(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit ``offsets`` for ``group`` as a consumer of it does."""
    consumer = Consumer(client_config(bootstrap, {"group.id": group, "enable.auto.commit": False}))
    try:
        retrying(lambda: consumer.commit(
            offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False))
    finally:
        consumer.close()


def committed(admin: AdminClient, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (-1001 where it has none)."""
    request = ConsumerGroupTopicPartitions(
        group, [TopicPartition(topic, p) for p in range(PARTITIONS)])
    answer = retrying(lambda: admin.list_consumer_group_offsets([request])[group].result())
    return {tp.partition: tp.offset for tp in answer.topic_partitions}


def join(bootstrap: str, group: str, topic: str) -> tuple[Consumer, list]:
    """A live member of ``group``, subscribed to ``topic`` and holding its partitions,
    and the records it received while joining."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "latest"}))
    consumer.subscribe([topic])
    received: list = []
    wait_until(lambda: consumer.assignment() or received.extend(consume(consumer, 1, timeout=0.2)),
               30, f"an assignment in {group}", poll_s=0)
    return consumer, received


def consume(consumer: Consumer, count: int, timeout: float = 30) -> list:
    """At least ``count`` records, or what arrives in ``timeout`` seconds."""
    messages: list = []
    deadline = time.monotonic() + timeout
    while len(messages) < count and time.monotonic() < deadline:
        messages += [m for m in consumer.consume(num_messages=100, timeout=0.2) if not m.error()]
    return messages


def iso_utc(ms: int) -> str:
    """``ms`` as a naive ISO 8601 time (which `reef` reads as UTC)."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc).replace(tzinfo=None)
    return moment.isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------- reef replay


def test_replay_to_offset_makes_the_group_reread_from_there(kafka_bootstrap, topic, cli_env,
                                                            admin):
    produce(kafka_bootstrap, topic, 0, 10)
    produce(kafka_bootstrap, topic, 1, 4)
    commit(kafka_bootstrap, "trainer", topic, {0: 10, 1: 4})  # it had read everything

    out = run(cli_env, "replay", "--group", "trainer", "--topic", "events",
              "--to-offset", "3", "--partition", "0")

    assert out.exit_code == 0, out
    rows = table_rows(out.stdout)
    assert rows["0"][:6] == ["0", "10", "3", "0", "10", "7"]  # partition, before, after, low, high, lag
    assert "1" not in rows  # --partition 0 leaves partition 1 alone
    assert committed(admin, "trainer", topic) == {0: 3, 1: 4}

    consumer, messages = join(kafka_bootstrap, "trainer", topic)
    try:
        messages += consume(consumer, 7 - len(messages))
    finally:
        consumer.close()
    assert [(m.partition(), m.offset(), m.value()) for m in messages] == [
        (0, offset, f"p0-{offset}".encode()) for offset in range(3, 10)]


def test_replay_is_refused_while_the_group_has_a_live_member(kafka_bootstrap, topic, cli_env,
                                                              admin):
    produce(kafka_bootstrap, topic, 0, 5)
    member, _ = join(kafka_bootstrap, "live", topic)
    try:
        retrying(lambda: member.commit(offsets=[TopicPartition(topic, 0, 5)], asynchronous=False))
        before = committed(admin, "live", topic)

        out = run(cli_env, "replay", "--group", "live", "--topic", topic, "--to-earliest")

        assert out.exit_code == 1, out
        assert "consumer group 'live' is STABLE with 1 active member" in out.error
        assert "stop its consumers first" in out.error
        assert committed(admin, "live", topic) == before == {0: 5, 1: -1001}

        dry = run(cli_env, "replay", "--group", "live", "--topic", topic, "--to-earliest",
                  "--dry-run")
        assert dry.exit_code == 0, dry
        assert "A real run would be refused now" in dry.stdout
        assert committed(admin, "live", topic) == before
    finally:
        member.close()


def test_replay_to_earliest_latest_and_time(kafka_bootstrap, topic, cli_env, admin):
    base = now_ms() - 60_000  # recent: retention must not delete them
    produce(kafka_bootstrap, topic, 0, 5, timestamps=[base + i * 1000 for i in range(5)])
    produce(kafka_bootstrap, topic, 1, 2, timestamps=[base, base + 1000])

    latest = run(cli_env, "replay", "-g", "fresh", "-t", "events", "--to-latest")
    assert latest.exit_code == 0, latest
    rows = table_rows(latest.stdout)
    assert rows["0"][:6] == ["0", "-", "5", "0", "5", "0"]  # never committed: before is "-"
    assert rows["1"][:6] == ["1", "-", "2", "0", "2", "0"]
    assert committed(admin, "fresh", topic) == {0: 5, 1: 2}

    earliest = run(cli_env, "replay", "-g", "fresh", "-t", "events", "--to-earliest")
    assert earliest.exit_code == 0, earliest
    assert table_rows(earliest.stdout)["0"][:6] == ["0", "5", "0", "0", "5", "5"]
    assert committed(admin, "fresh", topic) == {0: 0, 1: 0}

    # Between the records at base+1000 and base+2000; naive means UTC.
    at_time = run(cli_env, "replay", "-g", "fresh", "-t", "events", "--to-time",
                  iso_utc(base + 1500))
    assert at_time.exit_code == 0, at_time
    rows = table_rows(at_time.stdout)
    assert rows["0"][:6] == ["0", "0", "2", "0", "5", "3"]
    assert rows["1"][:6] == ["1", "0", "2", "0", "2", "0"]
    assert "no record at or after" in rows["1"][6]  # partition 1 ends before that time
    assert committed(admin, "fresh", topic) == {0: 2, 1: 2}

    # The same instant with an explicit timezone.
    moment = datetime.fromtimestamp((base + 500) / 1000, tz=timezone(timedelta(hours=2)))
    zoned = run(cli_env, "replay", "-g", "fresh", "-t", "events", "--to-time",
                moment.isoformat(timespec="milliseconds"))
    assert zoned.exit_code == 0, zoned
    assert committed(admin, "fresh", topic) == {0: 1, 1: 1}


def test_replay_dry_run_changes_nothing(kafka_bootstrap, topic, cli_env, admin):
    produce(kafka_bootstrap, topic, 0, 6)
    commit(kafka_bootstrap, "g", topic, {0: 6})

    out = run(cli_env, "replay", "-g", "g", "-t", "events", "--to-earliest", "--dry-run")

    assert out.exit_code == 0, out
    assert table_rows(out.stdout)["0"][:6] == ["0", "6", "0", "0", "6", "6"]
    assert "Dry run: nothing was changed" in out.stdout
    assert committed(admin, "g", topic) == {0: 6, 1: -1001}


def test_replay_refuses_an_offset_outside_the_log(kafka_bootstrap, topic, cli_env, admin):
    produce(kafka_bootstrap, topic, 0, 10)
    produce(kafka_bootstrap, topic, 1, 4)
    commit(kafka_bootstrap, "g", topic, {0: 10, 1: 4})

    out = run(cli_env, "replay", "-g", "g", "-t", "events", "--to-offset", "7")

    assert out.exit_code == 2, out
    assert f"--to-offset 7 is outside the log of {topic} on partition 1" in out.error
    assert "partition 1: 0..4" in out.error
    assert committed(admin, "g", topic) == {0: 10, 1: 4}  # not even partition 0 moved


def test_replay_usage_errors(topic, cli_env, namespace):
    none = run(cli_env, "replay", "-g", "g", "-t", "events")
    assert none.exit_code == 2
    assert "give exactly one of --to-offset, --to-time, --to-earliest, --to-latest" in none.error

    two = run(cli_env, "replay", "-g", "g", "-t", "events", "--to-earliest", "--to-offset", "1")
    assert two.exit_code == 2
    assert "(got --to-offset and --to-earliest)" in two.error

    missing = run(cli_env, "replay", "-g", "g", "-t", "nope", "--to-latest")
    assert missing.exit_code == 2
    assert f"topic 'nope' does not exist (looked for {namespace}.nope and nope)" in missing.error
    assert f"the topics of namespace '{namespace}' are: {topic}" in missing.error

    partition = run(cli_env, "replay", "-g", "g", "-t", "events", "--to-latest", "-p", "5")
    assert partition.exit_code == 2
    assert f"{topic} has no partition 5: its partitions are 0..1" in partition.error

    bad_time = run(cli_env, "replay", "-g", "g", "-t", "events", "--to-time", "yesterday")
    assert bad_time.exit_code == 2
    assert "--to-time 'yesterday' is not an ISO 8601 time" in bad_time.error


# --------------------------------------------------------------------------- reef tail


def _generation(i: int) -> Generation:
    return factories.generation(
        f"gen-{i}", request_id=f"req-{i}", prompt_id="prompt-0", policy_version=3,
        completion_token_ids=factories.ids([7, 8]),
        completion_logprobs=factories.logprobs([-0.5, -0.25]), created_at=factories.T0 + i,
        sampling=SamplingParams(max_tokens=256))


@pytest.fixture
def events_on_topic(kafka_bootstrap, topic) -> tuple[int, bytes]:
    """In time order: p0@0 generation, p0@1 feedback, p1@0 feedback, p0@2 corrupt, p0@3 generation.

    Returns the first record's timestamp and the corrupt record's bytes.
    """
    base = now_ms() - 60_000
    feedback = Feedback(feedback_id="fb-1", generation_id="gen-0", source="exact_match",
                        reward=1.0, components={"format": 0.5}, created_at=1_795_000_000_001)
    generation, headers = encode(_generation(0))
    corrupt = generation[:-3]
    records = [  # partition, key, value, headers, timestamp
        (0, b"gen-0", generation, headers, base),
        (0, b"gen-0", *encode(feedback), base + 1000),
        (1, b"gen-9", *encode(feedback), base + 1500),
        (0, b"\xff\x00", corrupt, headers, base + 2000),
        (0, b"gen-1", *encode(_generation(1)), base + 3000),
    ]
    producer = Producer(client_config(kafka_bootstrap, {"acks": "all"}))
    for partition, key, value, record_headers, timestamp in records:
        producer.produce(topic, value=value, key=key, headers=record_headers,
                         partition=partition, timestamp=timestamp)
    assert producer.flush(30) == 0
    return base, corrupt


def _lines(out: Outcome) -> list[dict]:
    assert out.exit_code == 0, out
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_tail_prints_decoded_events_and_corrupt_records_as_json_lines(
        events_on_topic, cli_env, topic):
    base, corrupt = events_on_topic

    lines = _lines(run(cli_env, "tail", "events", "--from", "earliest"))

    assert [(line["partition"], line["offset"]) for line in lines] == [
        (0, 0), (0, 1), (1, 0), (0, 2), (0, 3)]
    first = lines[0]
    assert first["topic"] == topic and first["timestamp"] == base and first["key"] == "gen-0"
    assert first["schema"] == "reef.events.Generation" and "error" not in first
    assert first["value"]["generation_id"] == "gen-0"
    assert first["value"]["completion_token_ids"] == [7, 8]
    assert first["value"]["completion_logprobs"] == [-0.5, -0.25]
    assert first["value"]["finish_reason"] == "STOP"
    assert first["value"]["sampling"]["max_tokens"] == 256
    assert lines[1]["schema"] == "reef.events.Feedback"
    assert lines[1]["value"]["components"] == {"format": 0.5}

    bad = lines[3]
    assert "do not decode as reef.events.Generation" in bad["error"]
    assert f"{topic}[0]@2" in bad["error"]
    assert bad["value"] == {"base64": base64.b64encode(corrupt).decode()}
    assert bad["key"] == {"base64": base64.b64encode(b"\xff\x00").decode()}
    assert lines[4]["value"]["generation_id"] == "gen-1"  # reading went on after it


def test_tail_honours_count_from_and_partition(events_on_topic, cli_env):
    base, _ = events_on_topic

    def where(*args: str) -> list[tuple[int, int]]:
        return [(line["partition"], line["offset"]) for line in _lines(run(cli_env, *args))]

    assert where("tail", "events", "-n", "2") == [(0, 2), (0, 3)]  # the last two
    assert where("tail", "events", "--from", "1", "-n", "2") == [(0, 1), (0, 2)]
    assert where("tail", "events", "--from", iso_utc(base + 1200)) == [(1, 0), (0, 2), (0, 3)]
    assert where("tail", "events", "-p", "1") == [(1, 0)]
    assert where("tail", "events", "--from", "latest") == []


def test_tail_follow_prints_new_records(kafka_bootstrap, topic, namespace):
    produce(kafka_bootstrap, topic, 0, 3)
    info = cursors.resolve_topic(kafka_bootstrap, namespace, "events")
    records = cursors.tail(kafka_bootstrap, info, start=cursors.Latest(), follow=True)
    try:
        produce(kafka_bootstrap, topic, 1, 1)  # after tail began: it follows
        record = next(records)
    finally:
        records.close()
    assert (record.partition, record.offset, record.key) == (1, 0, "k0")
    assert "no 'reef-schema-fp' header" in record.error  # plain bytes: shown, not fatal


# --------------------------------------------------------------------------- reef lag


def test_lag_of_a_group_that_committed_part_of_a_topic(kafka_bootstrap, topic, cli_env):
    produce(kafka_bootstrap, topic, 0, 10)
    produce(kafka_bootstrap, topic, 1, 3)
    commit(kafka_bootstrap, "half", topic, {0: 4})

    out = run(cli_env, "lag", "--group", "half")

    assert out.exit_code == 0, out
    rows = [line.strip("│").split("│") for line in out.stdout.splitlines() if line.startswith("│")]
    cells = [[cell.strip() for cell in row] for row in rows]
    assert cells == [["half", "EMPTY", topic, "0", "4", "10", "6"],
                     ["half", "", "total", "", "", "", "6"]]

    everyone = run(cli_env, "lag")
    assert everyone.exit_code == 0, everyone
    assert "│ half " in everyone.stdout

    nobody = run(cli_env, "lag", "-g", "nobody")
    assert nobody.exit_code == 0, nobody
    assert "no committed offsets" in nobody.stdout


@pytest.mark.parametrize("command", ["replay", "tail", "lag"])
def test_help_explains_each_command(command, cli_env):
    out = run(cli_env, command, "--help")
    assert out.exit_code == 0
    assert out.stdout.startswith("Usage: ")
    assert len(out.stdout.splitlines()) > 4
