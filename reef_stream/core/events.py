"""Typed events: one frozen dataclass per Avro schema in ``schemas/``.

Every record that travels through reef-stream's topics is one of these
events. Each class mirrors its schema field for field (same names, same order,
same nullability, same defaults) and names it in the ``SCHEMA`` class
variable. ``tests/unit/test_schema_evolution.py`` checks the two agree.

Conventions:

- Token ids and logprobs are 1-D ``numpy.ndarray``\\ s (int32 ids, float32
  logprobs). In Avro they are packed little-endian ``bytes``; the dtype is the
  field's ``metadata["dtype"]``. Arrays decoded from a message are read-only
  views of the message bytes (no copy); call ``.copy()`` to modify one.
- Timestamps are ``EpochMillis``: integer milliseconds since the Unix epoch,
  UTC (``now_ms()``).
- Events are built with keyword arguments only.
- Events holding arrays compare by identity (``==`` on arrays is elementwise,
  so a field-by-field ``==`` would be ambiguous); compare their contents with
  ``events_equal``.

``to_avro`` and ``from_avro`` convert any event to and from the plain dict
fastavro reads and writes, driven by the dataclass fields and their type
hints. They check only what packing needs (1-D arrays of a compatible dtype,
whole items in packed bytes); business rules such as NaN rewards or length
mismatches are the producer SDK's job.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import time
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import cache, partial
from typing import Any, ClassVar, NewType, TypeVar

import numpy as np

from reef_stream.core.errors import CorruptRecordError, InvalidRecord

#: Milliseconds since the Unix epoch, UTC (Avro ``timestamp-millis``).
EpochMillis = NewType("EpochMillis", int)

#: numpy notation of the packed dtypes: little-endian int32 and float32, and uint8 (masks).
INT32 = "<i4"
FLOAT32 = "<f4"
UINT8 = "|u1"

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)


def now_ms() -> EpochMillis:
    """The current time as an ``EpochMillis``."""
    return EpochMillis(time.time_ns() // 1_000_000)


def _packed(dtype: str) -> Any:
    """A required field holding a 1-D array, stored in Avro as packed ``dtype`` bytes."""
    return field(metadata={"dtype": dtype})


_event = dataclass(frozen=True, slots=True, kw_only=True)
#: For events holding arrays: ``==`` is identity, use ``events_equal``.
_event_with_arrays = dataclass(frozen=True, slots=True, kw_only=True, eq=False)


class FinishReason(enum.Enum):
    """Why sampling stopped (schema enum ``reef.events.FinishReason``).

    ``UNKNOWN`` is the schema's enum default: a reader gets it for a reason
    added to the schema after the reader was built.
    """

    STOP = "STOP"
    LENGTH = "LENGTH"
    ABORT = "ABORT"
    ERROR = "ERROR"
    UNKNOWN = "UNKNOWN"


class SegmentSource(enum.Enum):
    """Who produced a segment of a trajectory (schema enum ``reef.events.SegmentSource``).

    ``ENVIRONMENT`` is the schema's enum default: a source added later reads as masked, never
    as trained.
    """

    POLICY = "POLICY"
    ENVIRONMENT = "ENVIRONMENT"


class Decision(enum.Enum):
    """The stage a decision puts a version in (schema enum ``reef.events.Decision``; its
    default, for a symbol a reader does not know, is ``REJECTED``: never served).

    ``CANARY``: served by the share of replicas that takes it while it waits for a decision;
    ``ROLLED_BACK``: taken out of service, replicas serve ``rolled_back_to`` again."""

    PROMOTED = "PROMOTED"
    REJECTED = "REJECTED"
    CANARY = "CANARY"
    ROLLED_BACK = "ROLLED_BACK"


@_event
class SamplingParams:
    """Sampling parameters of one request (nested record ``reef.events.SamplingParams``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    #: -1 disables the top-k cut-off.
    top_k: int = -1
    max_tokens: int
    seed: int | None = None


@_event
class Segment:
    """One turn of a multi-turn trajectory (nested record ``reef.events.Segment``): ``length``
    consecutive completion tokens from one ``source``; ``role`` says what produced them, for
    people (``assistant``, ``tool``, ``tool:add``, ``user``; empty when unknown)."""

    source: SegmentSource
    length: int
    role: str = ""


@_event_with_arrays
class Turn:
    """A segment with its tokens, as ``Generation.turns`` gives it: ``token_ids: int32[length]``
    and, for a POLICY segment, ``logprobs: float32[length]`` (None for ENVIRONMENT: it has
    none). Views of the generation's arrays, not copies. Not an event."""

    source: SegmentSource
    role: str
    start: int
    token_ids: np.ndarray
    logprobs: np.ndarray | None


#: ``Generation.metadata[POLICY_VERSION_KEY] == UNKNOWN_POLICY_VERSION``: the producer could
#: not tell which version sampled the generation (``reef intake proxy`` during a reload); its
#: ``policy_version`` (0: the schema has no null) then names no version.
POLICY_VERSION_KEY = "reef.policy_version"
UNKNOWN_POLICY_VERSION = "unknown"


@_event_with_arrays
class Generation:
    """One completion sampled by a serving replica.

    Shapes: ``prompt_token_ids: int32[prompt_len]``,
    ``completion_token_ids: int32[completion_len]``,
    ``completion_logprobs: float32[completion_len]`` (behaviour-policy
    log-probability of each completion token).

    ``policy_version`` is the version of the weights that produced it, so the
    staleness of every sample is measurable. ``group_id`` and ``group_size``
    describe grouped sampling (e.g. n completions per prompt); an ungrouped
    generation has ``group_id=None`` and ``group_size=1``.

    A multi-turn trajectory (tool calls, environment turns) keeps its completion flattened in
    ``completion_token_ids`` -- every turn's tokens in order, exactly as sampled or received,
    never re-tokenised -- and says in ``segments`` which runs of them the policy generated
    (trained, with their behaviour logprobs) and which came from the environment or a tool
    (masked out of the loss; their ``completion_logprobs`` are 0). ``segments=()`` (single-turn,
    and every generation written before the field): the whole completion is the policy's.
    ``turns()`` splits the completion by segment; ``policy_mask()`` is the per-token mask a
    ``Sample`` carries. ``policy_version_known`` is False when the producer marked the version
    unknown (``POLICY_VERSION_KEY``); the recipe's ``Schedule.unknown_version`` decides.
    """

    SCHEMA: ClassVar[str] = "reef.events.Generation"

    generation_id: str
    request_id: str
    prompt_id: str
    group_id: str | None = None
    group_size: int = 1
    model: str
    policy_version: int
    replica_id: str
    prompt_token_ids: np.ndarray = _packed(INT32)
    completion_token_ids: np.ndarray = _packed(INT32)
    completion_logprobs: np.ndarray = _packed(FLOAT32)
    finish_reason: FinishReason
    sampling: SamplingParams
    created_at: EpochMillis
    metadata: dict[str, str] = field(default_factory=dict)
    segments: tuple[Segment, ...] = ()

    @property
    def policy_version_known(self) -> bool:
        """False when ``metadata`` marks the policy version unknown (``POLICY_VERSION_KEY``)."""
        return self.metadata.get(POLICY_VERSION_KEY) != UNKNOWN_POLICY_VERSION

    def policy_mask(self) -> np.ndarray:
        """``uint8[completion_len]``: 1 on the tokens the policy generated, 0 on environment
        tokens; empty when every completion token is the policy's (no segments, or only POLICY
        ones). Raises ``InvalidRecord`` (field ``segments``) when the segments do not add up to
        the completion."""
        if not self.segments or all(s.source is SegmentSource.POLICY for s in self.segments):
            self._segment_lengths()
            return empty_mask()
        lengths = self._segment_lengths()
        return np.repeat(np.array([s.source is SegmentSource.POLICY for s in self.segments],
                                  dtype=np.uint8), lengths)

    def turns(self) -> tuple[Turn, ...]:
        """The completion split by segment, in order (one POLICY turn for a single-turn
        generation). Raises ``InvalidRecord`` when the segments do not add up to it."""
        if not self.segments:
            return (Turn(source=SegmentSource.POLICY, role="", start=0,
                         token_ids=self.completion_token_ids, logprobs=self.completion_logprobs),)
        turns, start = [], 0
        for segment, length in zip(self.segments, self._segment_lengths()):
            end = start + int(length)
            policy = segment.source is SegmentSource.POLICY
            turns.append(Turn(source=segment.source, role=segment.role, start=start,
                              token_ids=self.completion_token_ids[start:end],
                              logprobs=self.completion_logprobs[start:end] if policy else None))
            start = end
        return tuple(turns)

    def _segment_lengths(self) -> np.ndarray:
        lengths = np.array([s.length for s in self.segments], dtype=np.int64)
        total = int(lengths.sum()) if self.segments else len(self.completion_token_ids)
        if (lengths < 1).any() or total != len(self.completion_token_ids):
            raise InvalidRecord(
                f"segment lengths {lengths.tolist()} do not split the "
                f"{len(self.completion_token_ids)} completion tokens (each at least 1, adding "
                "up to the completion's length)", field="segments")
        return lengths


def empty_mask() -> np.ndarray:
    """The empty ``policy_mask``: every completion token is the policy's."""
    return np.zeros(0, dtype=np.uint8)


def mask_problem(mask: np.ndarray, completion_len: int) -> str | None:
    """Why ``mask`` (a ``Sample.policy_mask``) does not fit a completion of ``completion_len``
    tokens, or None: it is empty, or one 0/1 value per completion token, at least one of them 1
    (a sample with no policy token has nothing to train)."""
    if not mask.size:
        return None
    if mask.size != completion_len:
        return (f"its policy_mask has {mask.size} values for {completion_len} completion tokens "
                "(one per token, or none)")
    if mask.max() > 1:
        return "its policy_mask holds values other than 0 and 1"
    if not mask.any():
        return "its policy_mask marks no completion token as the policy's: nothing to train"
    return None


@_event
class Feedback:
    """A reward for one generation, with named parts in ``components``."""

    SCHEMA: ClassVar[str] = "reef.events.Feedback"

    feedback_id: str
    generation_id: str
    group_id: str | None = None
    #: Who scored it, e.g. "exact_match", "human", "judge:gpt".
    source: str
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    created_at: EpochMillis


@_event_with_arrays
class Sample:
    """One generation joined with its combined reward (nested record ``reef.events.Sample``).

    Shapes: ``prompt_token_ids: int32[prompt_len]``,
    ``completion_token_ids: int32[completion_len]``,
    ``completion_logprobs: float32[completion_len]``.

    ``finish_reason`` and ``temperature`` are the generation's (its ``finish_reason`` and
    ``sampling.temperature``), so an objective can mask truncated completions (``LENGTH``) or
    correct for the temperature the behaviour logprobs were sampled at.

    ``created_at`` is the generation's ``created_at``: with the unit's ``created_at`` and the
    step that trains it, it splits the sample's age into its parts. 0 means unknown (units
    written before the field, or built without it).

    ``policy_mask: uint8[completion_len]`` marks the completion tokens the policy generated (1,
    trained) and those from the environment or a tool (0, masked out of the loss; their
    ``completion_logprobs`` are 0): a multi-turn generation's ``policy_mask()``. Empty (the
    default, single-turn samples, units written before the field): all are the policy's.
    ``mask_problem`` says when one does not fit its tokens.

    ``policy_version_known`` is False for a generation whose producer could not tell its version
    (``Generation.policy_version_known``), trained under ``schedule.unknown_version`` ``stalest``:
    its ``policy_version`` is then 0, the stalest it can be, and staleness metrics leave it out.
    """

    generation_id: str
    prompt_id: str
    policy_version: int
    prompt_token_ids: np.ndarray = _packed(INT32)
    completion_token_ids: np.ndarray = _packed(INT32)
    completion_logprobs: np.ndarray = _packed(FLOAT32)
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: FinishReason = FinishReason.UNKNOWN
    temperature: float = 1.0
    created_at: EpochMillis = EpochMillis(0)
    policy_mask: np.ndarray = field(default_factory=empty_mask, metadata={"dtype": UINT8})
    policy_version_known: bool = True


@_event_with_arrays
class RolloutUnit:
    """The default training unit: the scored samples of one group, in a deterministic order."""

    SCHEMA: ClassVar[str] = "reef.events.RolloutUnit"

    unit_id: str
    recipe: str
    group_key: str
    members: tuple[Sample, ...]
    created_at: EpochMillis


@_event
class TopicOffset:
    """A log position (nested record ``reef.events.TopicOffset``).

    ``offset`` is the NEXT offset to consume (last consumed + 1), as Kafka commits it.
    """

    topic: str
    partition: int
    offset: int


@_event
class Checkpoint:
    """A durable trainer checkpoint and the next offset to consume on each partition."""

    SCHEMA: ClassVar[str] = "reef.events.Checkpoint"

    checkpoint_id: str
    recipe: str
    trainer_group: str
    step: int
    model: str
    policy_version: int
    uri: str
    sha256: str
    offsets: tuple[TopicOffset, ...]
    trained_unit_count: int
    metrics: dict[str, float] = field(default_factory=dict)
    created_at: EpochMillis
    #: A rollback: the promoted version whose weights this checkpoint holds again (None: a step).
    rolled_back_to: int | None = None


@_event
class Publication:
    """A candidate evaluator's decision on a checkpoint; replicas follow PROMOTED ones.

    ``evaluated`` is False when the accept-everything default evaluator decided.
    """

    SCHEMA: ClassVar[str] = "reef.events.Publication"

    model: str
    policy_version: int
    checkpoint_id: str
    uri: str
    sha256: str
    decision: Decision
    reason: str
    evaluator: str
    evaluated: bool
    measurement: dict[str, float] = field(default_factory=dict)
    incumbent_version: int | None = None
    created_at: EpochMillis
    #: When the trainer created the checkpoint (None in publications written before the field).
    checkpoint_created_at: EpochMillis | None = None
    #: The serving artifact of a PROMOTED Hugging Face model (``reef_stream.engine.artifacts``):
    #: where, its manifest's sha256, its kind ("full" or "lora"); None otherwise.
    artifact_uri: str | None = None
    artifact_sha256: str | None = None
    artifact_kind: str | None = None
    #: CANARY: the fraction of replicas serving it (``reef_stream.consumers.evaluator.canary``); on the
    #: REJECTED / ROLLED_BACK decision ending a canary, the share it had. None otherwise.
    share: float | None = None
    #: CANARY: what it waits for, ``"canary"`` (live feedback) or ``"approval"`` (a person).
    awaiting: str | None = None
    #: The person who decided (``reef approve`` / ``reject`` / ``rollback``); None: an evaluator.
    decided_by: str | None = None
    #: ROLLED_BACK: the version served again (``uri`` and ``sha256`` name its published copy).
    rolled_back_to: int | None = None
    #: The recipe whose evaluator wrote it (a person's decision too: that evaluator applies it);
    #: it decides the model's requests and canaries. None in publications written before the field.
    recipe: str | None = None


class DecisionKind(enum.Enum):
    """What a person asks of the evaluator (schema enum ``reef.events.DecisionKind``)."""

    APPROVE = "APPROVE"
    REJECT = "REJECT"
    ROLLBACK = "ROLLBACK"


@_event
class DecisionRequest:
    """A person's decision asked for (``reef approve`` / ``reject`` / ``rollback``); the
    recipe's fenced evaluator applies it against its own ledger, or refuses it
    (``DecisionOutcome``). ``version``: the version decided on as the person saw it (the one
    waiting, or the one a rollback takes out of service)."""

    SCHEMA: ClassVar[str] = "reef.events.DecisionRequest"

    request_id: str
    kind: DecisionKind
    model: str
    version: int
    #: ROLLBACK: the promoted version served again. None otherwise.
    rolled_back_to: int | None = None
    decided_by: str
    #: Why, in the person's words (required for REJECT).
    reason: str | None = None
    created_at: EpochMillis


@_event
class DecisionOutcome:
    """What the evaluator did with one ``DecisionRequest``: ``applied`` (``text`` is the
    decision's line) or refused (``text`` says why), in the transaction of the decision."""

    SCHEMA: ClassVar[str] = "reef.events.DecisionOutcome"

    request_id: str
    model: str
    applied: bool
    text: str
    #: Applied: the publication's version. None when refused.
    policy_version: int | None = None
    evaluator_group: str
    created_at: EpochMillis


@_event
class Metric:
    """One measurement from one stage of the pipeline."""

    SCHEMA: ClassVar[str] = "reef.events.Metric"

    stage: str
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    created_at: EpochMillis


@_event
class MessageHeader:
    """One Kafka message header (nested record ``reef.events.MessageHeader``)."""

    key: str
    value: bytes | None


@_event
class DeadLetter:
    """A record that could not be processed, kept whole (raw key, value, headers) with the reason.

    ``source_partition`` and ``source_offset`` are None when the record never
    reached Kafka (rejected at intake); ``value`` is None for a tombstone.
    """

    SCHEMA: ClassVar[str] = "reef.events.DeadLetter"

    reason: str
    error_type: str
    source_topic: str
    source_partition: int | None = None
    source_offset: int | None = None
    key: bytes | None = None
    value: bytes | None
    headers: tuple[MessageHeader, ...]
    stage: str
    created_at: EpochMillis


#: Every top-level event type, by its Avro schema's full name.
EVENT_TYPES: Mapping[str, type] = types.MappingProxyType(
    {
        cls.SCHEMA: cls
        for cls in (Generation, Feedback, RolloutUnit, Checkpoint, Publication, Metric, DeadLetter,
                    DecisionRequest, DecisionOutcome)
    }
)

Event = (Generation | Feedback | RolloutUnit | Checkpoint | Publication | Metric | DeadLetter
         | DecisionRequest | DecisionOutcome)
EventT = TypeVar("EventT")


# --- conversion to and from fastavro dicts -----------------------------------------

Convert = Callable[[Any], Any]


def to_avro(event: Any) -> dict[str, Any]:
    """The fastavro record of ``event`` (any event or nested record class above).

    Arrays become packed little-endian bytes, enums their symbol, nested
    records dicts. Raises ``InvalidRecord`` naming the field when an array is
    not 1-D or its dtype cannot be stored as the field's dtype (e.g. floats
    as token ids): fix the producer.
    """
    return _writer(type(event))(event)


def from_avro(cls: type[EventT], record: Mapping[str, Any]) -> EventT:
    """The ``cls`` event of a record fastavro read with ``cls``'s current schema.

    Packed arrays are decoded without copying. Raises ``CorruptRecordError``
    naming the field when a packed field's length is not a whole number of
    items: the record is corrupt; send it to dead letters.
    """
    kwargs = {}
    for name, _, convert in _plan(cls):
        value = record[name]
        kwargs[name] = value if convert is None else convert(value)
    return cls(**kwargs)


def events_equal(a: Any, b: Any) -> bool:
    """Whether two events (or nested records) have the same type and field values.

    Arrays are equal when they have the same dtype and elements.
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(events_equal, a, b))
    if dataclasses.is_dataclass(a):
        return all(
            events_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    return a == b


@cache
def _writer(cls: type) -> Callable[[Any], dict[str, Any]]:
    """``to_avro`` for one class: all fields read in one attrgetter call, then only the
    fields that need it converted (this runs for every record sent)."""
    plan = _plan(cls)
    names = tuple(name for name, _, _ in plan)
    read = operator.attrgetter(*names) if len(names) > 1 else (lambda e: (getattr(e, names[0]),))
    conversions = tuple((name, convert) for name, convert, _ in plan if convert is not None)

    def write(event: Any) -> dict[str, Any]:
        record = dict(zip(names, read(event)))
        for name, convert in conversions:
            record[name] = convert(record[name])
        return record

    return write


@cache
def _plan(cls: type) -> tuple[tuple[str, Convert | None, Convert | None], ...]:
    """Per field of ``cls``: (name, to-Avro converter, from-Avro converter); None means as is."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, *_converters(hints[f.name], f.name, f.metadata.get("dtype")))
        for f in dataclasses.fields(cls)
    )


def _converters(hint: Any, name: str, dtype: str | None) -> tuple[Convert | None, Convert | None]:
    """The (to-Avro, from-Avro) converters of a field with type ``hint``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is np.ndarray:
        if dtype is None:
            raise TypeError(f"array field {name!r} needs field(metadata={{'dtype': ...}})")
        return partial(_pack, dtype=np.dtype(dtype), name=name), partial(
            _unpack, dtype=np.dtype(dtype), name=name
        )
    if hint is EpochMillis:
        return None, _to_millis
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return tuple(_nullable(c) for c in _converters(inner, name, dtype))  # type: ignore[return-value]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = {member.value: member for member in hint}  # cheaper than hint(symbol) per record
        return partial(_enum_symbol, hint, name), members.__getitem__
    if dataclasses.is_dataclass(hint):
        return to_avro, partial(from_avro, hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        to_item, from_item = _converters(args[0], name, dtype)
        return partial(_each_to_list, to_item), partial(_each_to_tuple, from_item)
    if origin is dict and args[1] in (str, float):
        return None, dict  # a copy: fastavro shares one default {} between records
    if hint in (str, int, float, bool, bytes):
        return None, None
    raise TypeError(f"field {name!r}: events cannot hold {hint!r}")


def _pack(value: Any, *, dtype: np.dtype, name: str) -> bytes:
    array = np.asarray(value)
    if array.ndim != 1:
        raise InvalidRecord(f"expected a 1-D array, got shape {array.shape}", field=name)
    if array.dtype != dtype:
        if array.size and not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise InvalidRecord(f"cannot store {array.dtype} values as {dtype.name}", field=name)
        array = array.astype(dtype)
    return array.tobytes()


def _unpack(raw: bytes | str, *, dtype: np.dtype, name: str) -> np.ndarray:
    if isinstance(raw, str):  # a bytes field's schema default, as fastavro fills it in (JSON text:
        raw = raw.encode("latin-1")  # code points 0-255 are the bytes, per the Avro spec)
    if len(raw) % dtype.itemsize:
        raise CorruptRecordError(
            f"{len(raw)} bytes is not a whole number of {dtype.name} items "
            f"({dtype.itemsize} bytes each)",
            field=name,
        )
    return np.frombuffer(raw, dtype=dtype)


def _to_millis(value: datetime | int) -> EpochMillis:
    """fastavro reads timestamp-millis as an aware datetime; events keep integer milliseconds."""
    if isinstance(value, datetime):
        return EpochMillis((value - _EPOCH) // _ONE_MS)
    return EpochMillis(value)


def _enum_symbol(enum_type: type[enum.Enum], name: str, value: Any) -> str:
    if not isinstance(value, enum_type):
        raise InvalidRecord(f"expected a {enum_type.__name__}, got {value!r}", field=name)
    return value.value


def _nullable(convert: Convert | None) -> Convert | None:
    if convert is None:
        return None
    return lambda value: None if value is None else convert(value)


def _each_to_list(convert: Convert | None, values: Any) -> list[Any]:
    return list(values) if convert is None else [convert(value) for value in values]


def _each_to_tuple(convert: Convert | None, values: Any) -> tuple[Any, ...]:
    return tuple(values) if convert is None else tuple(convert(value) for value in values)
