"""Replay cursors: moving a consumer group's committed offsets, reading records, measuring lag.

A consumer group's committed offset on a partition is its replay cursor: the
offset its members start from when they next run (a trainer acknowledges a
step by committing, see DESIGN.md). This module

- moves a group's cursors on one topic (``replay``) to an offset, a time or
  either end of the log. It refuses while the group has live members, whose
  own commits would overwrite the move;
- reads records for people to inspect (``tail``), decoding each with the
  schema that wrote it and never stopping on one that does not decode;
- measures how far each group is behind the end of the log (``lag``).

Offsets follow Kafka's convention: a committed offset is the NEXT offset to
read; the low watermark is the first offset still in the log and the high
watermark the offset the next produced record will get. So a group's lag on a
partition is ``high - committed``.

Every function takes the cluster's bootstrap address, blocks for a few round
trips to it, and returns frozen dataclasses. Nothing here prints: the
``reef replay | tail | lag`` commands (``reef_stream.cli.cursors``) do.
A cluster that refuses the client's login or TLS handshake (``REEF_KAFKA_*``)
is a ConfigurationError saying what to check, within seconds, from every
function here (``reef_stream.topics.connect.await_answer``), not a request that
times out saying only "broker transport failure".
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import enum
import heapq
import json
import math
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

import numpy as np
from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE, Consumer, ConsumerGroupState, ConsumerGroupTopicPartitions, KafkaError,
    KafkaException, Message, TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConsumerGroupDescription, OffsetSpec

from reef_stream.core.errors import ConfigurationError, InvalidRecord, RetryableError
from reef_stream.core.serde import SCHEMA_NAME_HEADER, decode
from reef_stream.topics.connect import (
    await_answer, check_refused, list_topics, new_admin, new_consumer,
)

#: Seconds to wait for one answer from the cluster.
TIMEOUT_S = 30.0

#: JSON data: None, bool, int, float, str, or lists and str-keyed dicts of these.
Json = Any

T = TypeVar("T")

#: Answers meaning "the group coordinator is moving or starting; ask again".
_COORDINATOR_BUSY = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
}
#: Group states in which members are (re)joining even if none is listed yet.
_REBALANCING = {ConsumerGroupState.PREPARING_REBALANCING, ConsumerGroupState.COMPLETING_REBALANCING}


# --------------------------------------------------------------------------- positions


@dataclass(frozen=True)
class Earliest:
    """The first record still in the log (the low watermark)."""


@dataclass(frozen=True)
class Latest:
    """The end of the log (the high watermark): only records produced from now on."""


@dataclass(frozen=True)
class AtOffset:
    """One offset, the same on every partition."""

    offset: int


@dataclass(frozen=True)
class AtTime:
    """The first record whose timestamp is at or after ``ms`` (milliseconds since the epoch, UTC)."""

    ms: int


#: Where to move a cursor to, or where to start reading.
Position = Earliest | Latest | AtOffset | AtTime


def parse_time(text: str, option: str) -> int:
    """ISO 8601 ``text`` as milliseconds since the epoch; no timezone means UTC.

    ``option`` names the command-line option, for the error message.
    """
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigurationError(
            f"{option} {text!r} is not an ISO 8601 time: write e.g. 2025-06-01T12:00:00Z, "
            "2025-06-01T14:00:00+02:00 or 2025-06-01 (no timezone means UTC)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def parse_position(text: str, option: str) -> Position:
    """``earliest``, ``latest``, an offset (digits) or an ISO 8601 time."""
    word = text.strip().lower()
    if word == "earliest":
        return Earliest()
    if word == "latest":
        return Latest()
    if word.isdigit():
        return AtOffset(int(word))
    return AtTime(parse_time(text, option))


def describe_position(position: Position) -> str:
    """``position`` in words, e.g. ``offset 3`` or ``2025-06-01T12:00:00.000Z``."""
    match position:
        case Earliest():
            return "the earliest offset"
        case Latest():
            return "the latest offset"
        case AtOffset(offset):
            return f"offset {offset}"
        case AtTime(ms):
            return _iso(ms)


def _iso(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- topics


@dataclass(frozen=True)
class TopicInfo:
    """A topic that exists, with its partition numbers."""

    name: str
    partitions: tuple[int, ...]


@dataclass(frozen=True)
class Watermarks:
    """The first offset still in a partition's log and the offset its next record will get."""

    low: int
    high: int


def resolve_topic(bootstrap: str, namespace: str, name: str) -> TopicInfo:
    """The topic ``name`` names: in full (``reef.generations``) or short for ``<namespace>.<name>``.

    Raises ConfigurationError naming it and listing the namespace's topics
    when neither exists.
    """
    admin = new_admin(bootstrap)
    metadata = list_topics(admin, "listing the topics")
    prefix = f"{namespace}."
    candidates = [name] if name.startswith(prefix) else [prefix + name, name]
    for candidate in candidates:
        if candidate in metadata.topics:
            return TopicInfo(candidate, tuple(sorted(metadata.topics[candidate].partitions)))
    ours = sorted(topic for topic in metadata.topics if topic.startswith(prefix))
    raise ConfigurationError(
        f"topic {name!r} does not exist (looked for {' and '.join(candidates)}); "
        f"the topics of namespace {namespace!r} are: "
        f"{', '.join(ours) or 'none (run `reef topics create`)'}"
    )


def select_partitions(topic: TopicInfo, requested: Iterable[int] = ()) -> tuple[int, ...]:
    """The ``requested`` partitions of ``topic`` (all when none are); ConfigurationError for unknown ones."""
    requested = tuple(sorted(set(requested)))
    unknown = [p for p in requested if p not in topic.partitions]
    if unknown:
        raise ConfigurationError(
            f"{topic.name} has no partition {', '.join(map(str, unknown))}: "
            f"its partitions are {_ranges(topic.partitions)}"
        )
    return requested or topic.partitions


def _ranges(partitions: tuple[int, ...]) -> str:
    if partitions == tuple(range(len(partitions))):
        return f"0..{len(partitions) - 1}"
    return ", ".join(map(str, partitions))


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class PartitionMove:
    """One partition's cursor: committed before and after a replay, and the watermarks."""

    partition: int
    #: None: the group had never committed an offset on this partition.
    before: int | None
    after: int
    low: int
    high: int
    #: Why ``after`` is what it is, where that is not obvious (else "").
    note: str = ""

    @property
    def lag_after(self) -> int:
        """Records the group will read on this partition before it catches up."""
        return self.high - self.after


@dataclass(frozen=True)
class ReplayResult:
    """What ``replay`` did (``applied``) or would do (a dry run)."""

    group: str
    topic: str
    target: Position
    moves: tuple[PartitionMove, ...]
    applied: bool
    #: Dry runs only: why a real run would be refused right now, or None.
    refusal: str | None = None


def replay(
    bootstrap: str,
    group: str,
    topic: TopicInfo,
    target: Position,
    partitions: Iterable[int] = (),
    *,
    dry_run: bool = False,
) -> ReplayResult:
    """Move ``group``'s committed offsets on ``topic`` to ``target``, so its next run reads from there.

    The steps, in order:

    1. Refuse (RetryableError) if the group has live members: they would
       overwrite the move with their own commits. A dry run reports this in
       ``refusal`` instead.
    2. Read the watermarks and the group's committed offsets of the chosen
       partitions (all, or ``partitions``).
    3. Compute the new offsets. An ``AtOffset`` outside ``low..high`` on any
       partition is refused (ConfigurationError listing the valid ranges),
       never clamped; an ``AtTime`` after a partition's last record moves
       that partition to its high watermark.
    4. Unless ``dry_run``, commit them with ``alter_consumer_group_offsets``.

    A group that never committed is fine. Running it again with the same
    target moves to the same offsets (``Latest`` follows the log's end).
    """
    admin = new_admin(bootstrap)
    refusal = _live_members(admin, group)
    if refusal and not dry_run:
        raise RetryableError(refusal)
    chosen = select_partitions(topic, partitions)
    marks = _watermarks(admin, topic.name, chosen)
    before = _committed(admin, group, topic.name, chosen)
    if isinstance(target, AtOffset):
        _check_in_range(topic.name, target.offset, marks)
    with closing(_reader(bootstrap)) as consumer:
        targets = _resolve(consumer, topic.name, target, marks)
    moves = tuple(
        PartitionMove(p, before[p], targets[p][0], marks[p].low, marks[p].high, targets[p][1])
        for p in chosen
    )
    if not dry_run:
        _alter(admin, group, topic.name, moves)
    return ReplayResult(group, topic.name, target, moves, applied=not dry_run,
                        refusal=refusal if dry_run else None)


def offsets_at(bootstrap: str, topic: TopicInfo, position: Position) -> dict[int, int]:
    """Per partition of ``topic``, the offset ``position`` means there now (an ``AtTime`` after
    a partition's last record: its high watermark). Blocks on the cluster (seconds)."""
    marks = _watermarks(new_admin(bootstrap), topic.name, topic.partitions)
    with closing(_reader(bootstrap)) as consumer:
        return {p: offset for p, (offset, _) in
                _resolve(consumer, topic.name, position, marks).items()}


def committed_offsets(bootstrap: str, group: str, topic: TopicInfo) -> dict[int, int | None]:
    """``group``'s committed offset on each partition of ``topic``; None where it never
    committed. Blocks on the cluster (seconds)."""
    return _committed(new_admin(bootstrap), group, topic.name, topic.partitions)


def _live_members(admin: AdminClient, group: str) -> str | None:
    """Why the group's offsets cannot be moved now (it has live members), or None."""
    description = _describe_group(admin, group)
    members = len(description.members)
    if not members and description.state not in _REBALANCING:
        return None
    return (
        f"consumer group {group!r} is {description.state.name} with {members} active "
        f"member{'' if members == 1 else 's'}: stop its consumers first (they would overwrite "
        "the moved offsets with their own commits), then run `reef replay` again"
    )


def _check_in_range(topic: str, offset: int, marks: dict[int, Watermarks]) -> None:
    outside = {p: m for p, m in marks.items() if not m.low <= offset <= m.high}
    if outside:
        ranges = "; ".join(f"partition {p}: {m.low}..{m.high}" for p, m in outside.items())
        raise ConfigurationError(
            f"--to-offset {offset} is outside the log of {topic} on "
            f"partition{'' if len(outside) == 1 else 's'} {', '.join(map(str, outside))}. Valid offsets (low..high watermark): {ranges}. "
            "Choose an offset in range, limit the move with --partition, "
            "or use --to-earliest / --to-latest"
        )


def _resolve(
    consumer: Consumer, topic: str, position: Position, marks: dict[int, Watermarks]
) -> dict[int, tuple[int, str]]:
    """Per partition: the offset ``position`` means there, and a note when it needs one."""
    match position:
        case Earliest():
            return {p: (m.low, "") for p, m in marks.items()}
        case Latest():
            return {p: (m.high, "") for p, m in marks.items()}
        case AtOffset(offset):
            return {p: (offset, "") for p in marks}
        case AtTime(ms):
            return _offsets_for_time(consumer, topic, ms, marks)


def _offsets_for_time(
    consumer: Consumer, topic: str, ms: int, marks: dict[int, Watermarks]
) -> dict[int, tuple[int, str]]:
    answers = _ask(
        f"looking up offsets by time in {topic}", consumer,
        lambda: consumer.offsets_for_times(
            [TopicPartition(topic, p, ms) for p in marks], timeout=TIMEOUT_S),
    )
    found = {}
    for answer in answers:
        _raise_partition_error(answer, f"looking up offsets by time in {topic}")
        if answer.offset < 0:  # no record at or after that time
            found[answer.partition] = (marks[answer.partition].high,
                                       f"no record at or after {_iso(ms)}: high watermark")
        else:
            found[answer.partition] = (answer.offset, "")
    return found


def _alter(admin: AdminClient, group: str, topic: str, moves: tuple[PartitionMove, ...]) -> None:
    request = ConsumerGroupTopicPartitions(
        group, [TopicPartition(topic, move.partition, move.after) for move in moves])
    what = f"moving the offsets of consumer group {group!r}"
    answer = _ask(what, admin, lambda: admin.alter_consumer_group_offsets(
        [request], request_timeout=TIMEOUT_S)[group])
    for partition in answer.topic_partitions:
        if partition.error and partition.error.code() == KafkaError.UNKNOWN_MEMBER_ID:
            raise RetryableError(
                f"consumer group {group!r} got a member while its offsets were being moved: "
                "stop its consumers first, then run `reef replay` again")
        _raise_partition_error(partition, what)


# --------------------------------------------------------------------------- tail


@dataclass(frozen=True)
class TailRecord:
    """One record as ``reef tail`` shows it: where it is, and its key and value as JSON data.

    ``value`` is the decoded event (objects for records, lists for arrays,
    names for enums, ``{"base64": ...}`` for bytes), None for a tombstone, or,
    when it does not decode, the raw bytes as ``{"base64": ...}`` with the
    reason in ``error``. ``key`` is text when it is UTF-8, else
    ``{"base64": ...}``.
    """

    topic: str
    partition: int
    offset: int
    #: Milliseconds since the epoch, or None when the record has none.
    timestamp: int | None
    key: Json
    #: The full name of the schema that wrote the value, where known.
    schema: str | None
    value: Json
    error: str | None = None

    def to_json(self) -> str:
        """One JSON line; ``error`` appears only for a record that does not decode."""
        fields = dataclasses.asdict(self)
        if self.error is None:
            del fields["error"]
        return json.dumps(fields, ensure_ascii=False)


def tail(
    bootstrap: str,
    topic: TopicInfo,
    *,
    start: Position | None = None,
    count: int = 10,
    partitions: Iterable[int] = (),
    follow: bool = False,
) -> Generator[TailRecord, None, None]:
    """Records of ``topic`` for inspection, decoded, ``count`` in all, in time order.

    With ``start=None``: the last ``count`` records of the chosen partitions
    (all, or ``partitions``). Otherwise the first ``count`` at or after
    ``start`` (an offset or time outside a partition's log starts at its
    nearest end). With ``follow``, then every record produced after this
    call, as it arrives, until the caller closes the generator.

    Where to read is settled by this call; the returned generator reads with
    ``assign()`` and a throwaway group id, and commits nothing. A record that
    does not decode is yielded with its ``error``; it never stops the reading.
    """
    chosen = select_partitions(topic, partitions)
    marks = _watermarks(new_admin(bootstrap), topic.name, chosen)
    if start is None:
        starts = {p: max(m.low, m.high - count) for p, m in marks.items()}
    else:
        with closing(_reader(bootstrap)) as consumer:
            resolved = _resolve(consumer, topic.name, start, marks)
        starts = {p: min(max(resolved[p][0], m.low), m.high) for p, m in marks.items()}
    ranges = {p: (s, min(marks[p].high, s + count)) for p, s in starts.items()}
    follow_from = {p: m.high for p, m in marks.items()} if follow else None
    return _tail_records(bootstrap, topic.name, ranges, count, newest=start is None,
                         follow_from=follow_from)


def _tail_records(
    bootstrap: str,
    topic: str,
    ranges: dict[int, tuple[int, int]],
    count: int,
    *,
    newest: bool,
    follow_from: dict[int, int] | None,
) -> Generator[TailRecord, None, None]:
    """The ``count`` newest (or oldest) records in ``ranges``, then, with ``follow_from``, the rest."""
    with closing(_reader(bootstrap)) as consumer:
        per_partition = _read_ranges(consumer, topic, ranges)
        in_time_order = list(heapq.merge(*per_partition, key=_timestamp))
        shown = in_time_order[-count:] if newest else in_time_order[:count]
        yield from map(tail_record, shown)
        if follow_from is not None:
            yield from _follow(consumer, topic, follow_from)


def _read_ranges(
    consumer: Consumer, topic: str, ranges: dict[int, tuple[int, int]]
) -> list[list[Message]]:
    """The messages at offsets ``start <= offset < end`` of each partition, in offset order."""
    pending = {p: end for p, (start, end) in ranges.items() if start < end}
    if not pending:
        return []
    consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in pending])
    read: dict[int, list[Message]] = {p: [] for p in pending}
    deadline = time.monotonic() + TIMEOUT_S
    while pending:
        message = consumer.poll(0.5)
        if message is None:
            if time.monotonic() > deadline:
                raise RetryableError(
                    f"no records arrived from {topic} partitions {sorted(pending)} in "
                    f"{TIMEOUT_S:.0f} s although the watermarks say they exist: "
                    "check that the cluster is reachable, then try again")
            continue
        partition = message.partition()
        if partition not in pending:
            continue
        error = message.error()
        # End of the log: the rest of the range is gaps (compaction, transaction markers).
        at_end = error is not None and error.code() == KafkaError._PARTITION_EOF
        if error is not None and not at_end:
            raise RetryableError(f"reading {topic}[{partition}]: {error.str()}; try again")
        if not at_end:
            deadline = time.monotonic() + TIMEOUT_S
            if message.offset() < pending[partition]:
                read[partition].append(message)
        if at_end or message.offset() >= pending[partition] - 1:
            del pending[partition]
            consumer.pause([TopicPartition(topic, partition)])
    return list(read.values())


def _follow(consumer: Consumer, topic: str, starts: dict[int, int]) -> Iterator[TailRecord]:
    """Every record from ``starts`` on, as it arrives, forever."""
    positions = [TopicPartition(topic, p, offset) for p, offset in starts.items()]
    consumer.assign(positions)
    consumer.resume(positions)
    while True:
        message = consumer.poll(0.5)
        if message is None:
            continue
        error = message.error()
        if error is None:
            yield tail_record(message)
        elif error.code() != KafkaError._PARTITION_EOF:
            raise RetryableError(f"reading {topic}[{message.partition()}]: {error.str()}")


def _timestamp(message: Message) -> int:
    return message.timestamp()[1]


def tail_record(message: Message) -> TailRecord:
    """A consumed message as a ``TailRecord``; never raises for bad bytes."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    kind, ms = message.timestamp()
    where = {"topic": topic, "partition": partition, "offset": offset}
    common = {**where, "timestamp": None if kind == TIMESTAMP_NOT_AVAILABLE else ms,
              "key": _text_or_base64(message.key())}
    value = message.value()
    if value is None:
        return TailRecord(**common, schema=None, value=None)
    try:
        event = decode(value, message.headers(), None, **where)
    except InvalidRecord as exc:  # UnknownSchemaError, CorruptRecordError
        return TailRecord(**common, schema=_schema_header(message), value=_base64(value),
                          error=str(exc))
    return TailRecord(**common, schema=event.SCHEMA, value=jsonable(event))


def jsonable(value: Any) -> Json:
    """``value`` as JSON data: records become objects, arrays lists, enums their names,
    bytes ``{"base64": ...}``, and NaN or infinite floats the strings ``nan``/``inf``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes):
        return _base64(value)
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _base64(raw: bytes) -> dict[str, str]:
    return {"base64": base64.b64encode(raw).decode("ascii")}


def _text_or_base64(raw: bytes | None) -> Json:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return _base64(raw)


def _schema_header(message: Message) -> str | None:
    for name, value in message.headers() or []:
        if name == SCHEMA_NAME_HEADER and value is not None:
            return value.decode("utf-8", errors="replace")
    return None


# --------------------------------------------------------------------------- lag


@dataclass(frozen=True)
class PartitionLag:
    """A group's committed offset on one partition against the partition's high watermark."""

    topic: str
    partition: int
    committed: int
    #: None: the topic or partition no longer exists.
    high: int | None

    @property
    def lag(self) -> int | None:
        """Records produced but not yet read past the committed offset (None when unknown)."""
        return None if self.high is None else self.high - self.committed


@dataclass(frozen=True)
class GroupLag:
    """One consumer group: its state and, per partition it committed on, its lag."""

    group: str
    #: The group's state as the cluster reports it, e.g. STABLE, EMPTY, DEAD (unknown group).
    state: str
    #: Empty: the group has no committed offsets.
    partitions: tuple[PartitionLag, ...]

    @property
    def total(self) -> int:
        """The sum of the known lags."""
        return sum(p.lag for p in self.partitions if p.lag is not None)


def lag(bootstrap: str, group: str | None = None) -> tuple[GroupLag, ...]:
    """The lag of every consumer group of the cluster (or of ``group`` alone), by group name."""
    admin = new_admin(bootstrap)
    if group is None:
        started = time.monotonic()
        listing = _ask("listing the consumer groups", admin,
                       lambda: admin.list_consumer_groups(request_timeout=TIMEOUT_S))
        if listing.errors:
            check_refused(admin, started)
            raise RetryableError(
                "listing the consumer groups: some brokers did not answer "
                f"({'; '.join(map(str, listing.errors))}); try again")
        states = {g.group_id: g.state.name for g in listing.valid}
    else:
        states = {group: _describe_group(admin, group).state.name}
    committed = {name: _all_committed(admin, name) for name in sorted(states)}
    everywhere = {key for offsets in committed.values() for key in offsets}
    highs = _list_offsets(admin, everywhere, OffsetSpec.latest(), gone_ok=True)
    return tuple(
        GroupLag(name, states[name], tuple(
            PartitionLag(topic, partition, offset, highs[(topic, partition)])
            for (topic, partition), offset in sorted(committed[name].items())))
        for name in sorted(states)
    )


def _all_committed(admin: AdminClient, group: str) -> dict[tuple[str, int], int]:
    """Every (topic, partition) → committed offset of ``group``."""
    request = ConsumerGroupTopicPartitions(group)
    what = f"reading the offsets of consumer group {group!r}"
    answer = _ask(what, admin, lambda: admin.list_consumer_group_offsets(
        [request], request_timeout=TIMEOUT_S)[group])
    return {(tp.topic, tp.partition): tp.offset for tp in answer.topic_partitions or []
            if tp.offset >= 0}


# --------------------------------------------------------------------------- the cluster


def _reader(bootstrap: str) -> Consumer:
    """A consumer that only reads assigned partitions: a throwaway group id, no commits."""
    return new_consumer(bootstrap, f"reef-cursors-{uuid.uuid4().hex}", {
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
    })


def _ask(what: str, client: Any, request: Callable[[], T | concurrent.futures.Future[T]]) -> T:
    """The answer to ``request()``, a request of ``client`` that answers at once or returns a
    future of its answer (an admin client's); asked again while the group coordinator is
    moving or starting.

    A refused login or TLS handshake is a ConfigurationError saying what to
    check, raised within seconds of ``client`` reporting it
    (``connect.await_answer``). Any other failure, or one that lasts
    ``TIMEOUT_S``, is a RetryableError saying ``what`` was being done.
    """
    started = time.monotonic()
    deadline = started + TIMEOUT_S
    while True:
        try:
            answer = request()
            if isinstance(answer, concurrent.futures.Future):
                answer = await_answer(client, answer)
            return answer
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in _COORDINATOR_BUSY and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            check_refused(client, started)
            raise RetryableError(
                f"{what}: the Kafka cluster answered {error.str()}; check that it is "
                "reachable and try again") from exc


def _describe_group(admin: AdminClient, group: str) -> ConsumerGroupDescription:
    """The group's state and members (state DEAD, no members, for a group that does not exist)."""
    return _ask(f"describing consumer group {group!r}", admin,
                lambda: admin.describe_consumer_groups([group], request_timeout=TIMEOUT_S)[group])


def _raise_partition_error(partition: TopicPartition, what: str) -> None:
    if partition.error is not None:
        raise RetryableError(
            f"{what}: partition {partition.partition}: {partition.error.str()}; try again")


def _watermarks(admin: AdminClient, topic: str, partitions: tuple[int, ...]) -> dict[int, Watermarks]:
    keys = [(topic, p) for p in partitions]
    lows = _list_offsets(admin, keys, OffsetSpec.earliest())
    highs = _list_offsets(admin, keys, OffsetSpec.latest())
    return {p: Watermarks(lows[(topic, p)], highs[(topic, p)]) for p in partitions}


def _list_offsets(
    admin: AdminClient, keys: Iterable[tuple[str, int]], spec: OffsetSpec, *, gone_ok: bool = False
) -> dict[tuple[str, int], int | None]:
    """The offset ``spec`` names on each (topic, partition); None for a gone one if ``gone_ok``."""
    keys = list(keys)
    if not keys:
        return {}
    started = time.monotonic()
    futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in keys},
                                 request_timeout=TIMEOUT_S)
    found: dict[tuple[str, int], int | None] = {}
    for tp, future in futures.items():
        try:
            found[(tp.topic, tp.partition)] = await_answer(admin, future).offset
        except KafkaException as exc:
            if gone_ok and exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                found[(tp.topic, tp.partition)] = None
                continue
            check_refused(admin, started)
            raise RetryableError(
                f"reading the watermarks of {tp.topic}[{tp.partition}]: the Kafka cluster "
                f"answered {exc.args[0].str()}; try again") from exc
    return found


def _committed(
    admin: AdminClient, group: str, topic: str, partitions: tuple[int, ...]
) -> dict[int, int | None]:
    """The group's committed offset per partition; None where it never committed."""
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in partitions])
    what = f"reading the offsets of consumer group {group!r}"
    answer = _ask(what, admin, lambda: admin.list_consumer_group_offsets(
        [request], request_timeout=TIMEOUT_S)[group])
    committed = {}
    for tp in answer.topic_partitions:
        _raise_partition_error(tp, what)
        committed[tp.partition] = tp.offset if tp.offset >= 0 else None
    return committed
