"""Validation at the edge: a record that is wrong never reaches Kafka.

``validate(event)`` raises ``InvalidRecord`` naming the field and the
problem: a missing or empty identifier, a wrong type, a negative version, a
NaN or infinite reward or logprob, token and logprob arrays whose lengths
disagree, multi-turn ``segments`` that do not split the completion (or have no
policy turn, or give an environment token a logprob other than 0), token ids outside int32, an Avro ``int`` field (``group_size``,
``sampling.max_tokens``, ``sampling.top_k``) outside int32, a ``created_at`` past the year
9999 (no reader could decode it), text with a lone surrogate (not UTF-8). The size limit of the destination topic
is checked by the producer after encoding (``check_size``).

``validate_many(events)`` applies the same rules to a batch (the producer's
``send_many``), with the array checks of its Generations done once over the
whole batch; a bad record raises ``InvalidRecordInBatch``, which adds the
record's index to the message ``validate`` gives for it.

These are the rules every method can rely on; a method's processor may add
its own.

Cost: this runs for every record sent, so the common case (a valid record) is
the fast one: numpy reductions are called as ufuncs (no method wrapper), two
per array at most, and a failing fast check is re-examined to name the problem.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import (
    DeadLetter, Feedback, FinishReason, Generation, SamplingParams, Segment, SegmentSource,
)

#: Header bytes Kafka adds per record beyond key, value and headers (generous).
RECORD_OVERHEAD = 128
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = 2**63 - 1
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
#: Up to this many int32 token ids, their signs are checked on the bytes (see _token_range).
_SIGN_SCAN_MAX = 512
#: The byte of a native int32 that holds its sign bit.
_SIGN_BYTE = 3 if sys.byteorder == "little" else 0
#: The last millisecond of the year 9999: readers decode timestamp-millis as a datetime.
_MAX_MILLIS = 253_402_300_799_999


def validate(event: Generation | Feedback | DeadLetter) -> None:
    """Raise InvalidRecord for the first problem found in ``event``; return None if it is valid."""
    if isinstance(event, Generation):
        _generation(event)
    elif isinstance(event, Feedback):
        _feedback(event)
    elif isinstance(event, DeadLetter):
        _text(event, "reason", "source_topic", "stage")
    else:
        raise InvalidRecord(f"intake takes Generation, Feedback or DeadLetter, not {type(event).__name__}")


class InvalidRecordInBatch(InvalidRecord):
    """Record ``index`` of a batch is invalid (``field`` and ``reason`` are its own); nothing of
    the batch was sent. Fix or drop that record and send the batch again."""

    def __init__(self, index: int, error: InvalidRecord):
        self.index = index
        #: What ``validate`` (or the producer) raised for the record itself.
        self.error = error
        super().__init__(f"record {index} of the batch: {error.reason}", field=error.field,
                         topic=error.topic, partition=error.partition, offset=error.offset)


def validate_many(events: Sequence[Generation | Feedback | DeadLetter]) -> None:
    """``validate`` every event of a batch; raise ``InvalidRecordInBatch`` for the first invalid one.

    The token-range and logprob checks of the batch's Generations are done
    once over all of them (one concatenation and one reduction per check); if
    that finds a problem, each record is validated in turn to name it.
    """
    if _batch_is_valid(events):
        return
    for index, event in enumerate(events):
        try:
            validate(event)
        except InvalidRecord as error:
            raise InvalidRecordInBatch(index, error) from None


def _batch_is_valid(events: Sequence[Generation | Feedback | DeadLetter]) -> bool:
    """True only if every event is valid; False if any check failed (``validate`` each to say
    which and why)."""
    tokens: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    try:
        for event in events:
            if type(event) is not Generation:
                validate(event)
                continue
            prompt, completion, values = _generation(event, reductions=False)
            for array in (prompt, completion):
                if array.dtype == np.int32:
                    tokens.append(array)
                else:
                    _token_range(array, "token ids")
            if values.dtype == np.float32:
                logprobs.append(values)
            else:
                _logprobs(values)
    except InvalidRecord:
        return False
    if tokens and _MIN(np.concatenate(tokens)) < 0:
        return False
    if logprobs:
        values = np.concatenate(logprobs)
        if values.size and not (_MAX(values) <= 1e-3 and _MIN(values) != -np.inf):
            return False
    return True


class RecordTooLarge(InvalidRecord):
    """The encoded record is over its topic's ``max.message.bytes`` (``check_size``)."""


def check_size(topic: str, key: bytes | None, value: bytes,
               headers: list[tuple[str, bytes]], limit: int) -> None:
    """Raise RecordTooLarge (an InvalidRecord) if the encoded record is over the topic's
    ``max.message.bytes``."""
    size = len(value) + RECORD_OVERHEAD
    if key:
        size += len(key)
    for name, header in headers:
        size += len(name) + len(header)
    if size > limit:
        raise RecordTooLarge(f"the record is {size} bytes encoded; topic {topic} accepts at most "
                            f"{limit} bytes (max.message.bytes)")


def _generation(g: Generation, reductions: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate ``g``; return its prompt, completion and logprob arrays. ``reductions=False``
    leaves out the checks of the arrays' values (``validate_many`` does them for a batch)."""
    _text(g, "generation_id", "request_id", "prompt_id", "model", "replica_id")
    _integer(g, "policy_version", minimum=0)
    _integer(g, "group_size", minimum=1, maximum=_INT32_MAX)
    if g.group_size > 1 and not g.group_id:
        raise InvalidRecord(f"group_size is {g.group_size} but there is no group_id; grouped "
                            "samples need the id their group shares", field="group_id")
    if g.group_id is not None:
        _text(g, "group_id")
    _integer(g, "created_at", minimum=0, maximum=_MAX_MILLIS)
    prompt = _tokens(g, "prompt_token_ids", reductions)
    completion = _tokens(g, "completion_token_ids", reductions)
    if prompt.size == 0:
        raise InvalidRecord("is empty; a generation has at least one prompt token",
                            field="prompt_token_ids")
    logprobs = _array(g, "completion_logprobs", "f")
    if logprobs.size != completion.size:
        raise InvalidRecord(
            f"has {logprobs.size} values for {completion.size} completion tokens; "
            "there must be exactly one behaviour logprob per completion token",
            field="completion_logprobs")
    if reductions:
        _logprobs(logprobs)
    if type(g.segments) is not tuple or g.segments:
        _segments(g.segments, completion, logprobs)
    if not isinstance(g.finish_reason, FinishReason):
        raise InvalidRecord(f"must be a FinishReason, not {g.finish_reason!r}", field="finish_reason")
    if not isinstance(g.sampling, SamplingParams):
        raise InvalidRecord("must be a SamplingParams", field="sampling")
    _sampling(g.sampling)
    if not isinstance(g.metadata, dict):
        raise InvalidRecord(f"must be a dict of strings, not {type(g.metadata).__name__}",
                            field="metadata")
    for key, value in g.metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRecord(f"entry {key!r} must map a string to a string", field="metadata")
        _utf8(key, "metadata")
        _utf8(value, f"metadata.{key}")
    return prompt, completion, logprobs


def _segments(segments, completion: np.ndarray, logprobs: np.ndarray) -> None:
    """A multi-turn generation's segments: Segments of a known source, at least one token each,
    adding up to the completion, at least one of the policy; environment tokens' logprobs 0.
    Errors name the field ``segments`` and say which segment."""
    if type(segments) is not tuple:
        raise InvalidRecord(f"must be a tuple of Segment, not {type(segments).__name__}",
                            field="segments")
    start, policy = 0, False
    for i, segment in enumerate(segments):
        if not isinstance(segment, Segment):
            raise InvalidRecord(f"segment {i} is a {type(segment).__name__}, not a Segment",
                                field="segments")
        if not isinstance(segment.source, SegmentSource):
            raise InvalidRecord(f"segment {i}'s source must be a SegmentSource, not "
                                f"{segment.source!r}", field="segments")
        length = segment.length
        if type(length) is not int or not 1 <= length <= _INT32_MAX:
            raise InvalidRecord(f"segment {i}'s length is {length!r}; it must be an integer "
                                f"from 1 to {_INT32_MAX}", field="segments")
        if not isinstance(segment.role, str):
            raise InvalidRecord(f"segment {i}'s role must be a string, not "
                                f"{type(segment.role).__name__}", field="segments")
        _utf8(segment.role, "segments")
        end = start + length
        if segment.source is SegmentSource.POLICY:
            policy = True
        elif end <= logprobs.size and logprobs[start:end].any():
            at = start + int(np.flatnonzero(logprobs[start:end])[0])
            raise InvalidRecord(
                f"is {float(logprobs[at])} at index {at}, a token of environment segment {i}; "
                "environment and tool tokens carry no logprob: give 0", field="completion_logprobs")
        start = end
    if start != completion.size:
        raise InvalidRecord(f"lengths add up to {start} tokens, but the completion has "
                            f"{completion.size}; the segments split the completion exactly",
                            field="segments")
    if not policy:
        raise InvalidRecord("has no POLICY segment: a trajectory has at least one turn the "
                            "policy generated (nothing else is trained)", field="segments")


def _sampling(s: SamplingParams) -> None:
    for name in ("temperature", "top_p"):
        value = getattr(s, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise InvalidRecord(f"must be a finite number >= 0, not {value!r}", field=f"sampling.{name}")
    _integer(s, "max_tokens", minimum=0, maximum=_INT32_MAX, prefix="sampling.")
    _integer(s, "top_k", minimum=-1, maximum=_INT32_MAX, prefix="sampling.")
    if s.seed is not None:
        _integer(s, "seed", minimum=-(2**63), prefix="sampling.")


def _feedback(f: Feedback) -> None:
    _text(f, "generation_id", "source", "feedback_id")  # feedback_id defaults to both
    if f.group_id is not None:
        _text(f, "group_id")
    _integer(f, "created_at", minimum=0, maximum=_MAX_MILLIS)
    _finite(f.reward, "reward")
    if not isinstance(f.components, dict):
        raise InvalidRecord(f"must be a dict of numbers, not {type(f.components).__name__}",
                            field="components")
    for name, value in f.components.items():
        if not isinstance(name, str) or not name:
            raise InvalidRecord(f"has a component named {name!r}; names are non-empty strings",
                                field="components")
        _utf8(name, "components")
        _finite(value, f"components.{name}")


def _text(event, *names: str) -> None:
    for name in names:
        value = getattr(event, name)
        if not isinstance(value, str):
            raise InvalidRecord(f"must be a string, not {type(value).__name__}", field=name)
        if not value.strip():
            raise InvalidRecord("is empty", field=name)
        _utf8(value, name)


def _utf8(value: str, name: str) -> None:
    """Raise InvalidRecord for a str that UTF-8 cannot encode (a lone surrogate, as JSON's
    ``"\\ud800"`` gives): Avro strings are UTF-8."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRecord(f"holds the lone surrogate {value[error.start]!r} at index "
                            f"{error.start}; text must be valid Unicode (UTF-8)",
                            field=name) from None


def _integer(event, name: str, minimum: int, prefix: str = "", maximum: int | None = None) -> None:
    value = getattr(event, name)
    if type(value) is int and minimum <= value <= (_INT64_MAX if maximum is None else maximum):
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise InvalidRecord(f"must be an integer, not {type(value).__name__}", field=prefix + name)
    if value < minimum:
        raise InvalidRecord(f"is {value}; it must be at least {minimum}", field=prefix + name)
    if value >= 2**63:
        raise InvalidRecord(f"is {value}, beyond a 64-bit integer", field=prefix + name)
    if maximum is not None and value > maximum:
        raise InvalidRecord(f"is {value}; it must be at most {maximum}", field=prefix + name)


def _finite(value, name: str) -> None:
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise InvalidRecord(f"must be a number, not {type(value).__name__}", field=name)
    if not math.isfinite(value):
        raise InvalidRecord(f"is {value}; rewards must be finite numbers", field=name)


def _array(event, name: str, kind: str) -> np.ndarray:
    value = getattr(event, name)
    if not isinstance(value, np.ndarray):
        raise InvalidRecord(f"must be a numpy array, not {type(value).__name__}", field=name)
    if value.ndim != 1:
        raise InvalidRecord(f"must be one-dimensional, not of shape {value.shape}", field=name)
    if value.size and value.dtype.kind not in (kind + ("iu" if kind == "f" else "u")):
        raise InvalidRecord(f"has dtype {value.dtype}; expected {'integers' if kind == 'i' else 'floats'}",
                            field=name)
    return value


def _tokens(event, name: str, reductions: bool = True) -> np.ndarray:
    tokens = _array(event, name, "i")
    if reductions:
        _token_range(tokens, name)
    return tokens


def _token_range(tokens: np.ndarray, name: str) -> None:
    if not tokens.size:
        return
    if tokens.dtype == np.int32:  # the wire type: only the sign can be wrong
        # A short array: one C scan of the bytes holding the sign bits (no byte >= 0x80) costs
        # a fifth of a ufunc reduction's set-up; a long one: the reduction is cheaper.
        if tokens.size <= _SIGN_SCAN_MAX:
            if tokens.tobytes()[_SIGN_BYTE::4].isascii():
                return
        elif _MIN(tokens) >= 0:
            return
    elif _MIN(tokens) >= 0 and _MAX(tokens) <= _INT32_MAX:
        return
    raise InvalidRecord(f"holds {int(tokens.min())}..{int(tokens.max())}; token ids are "
                        f"between 0 and {_INT32_MAX}", field=name)


def _logprobs(logprobs: np.ndarray) -> None:
    """Finite and at most 0 (1e-3 allowed for rounding). Two reductions, as this runs for
    every record.

    A NaN or +inf makes the max fail ``<= 1e-3``; a -inf is the min.
    """
    if not logprobs.size:
        return
    top = _MAX(logprobs)
    if top <= 1e-3 and _MIN(logprobs) != -np.inf:
        return
    bad = np.flatnonzero(~np.isfinite(logprobs))
    if bad.size:
        raise InvalidRecord(f"holds NaN or infinite values (first at index {int(bad[0])})",
                            field="completion_logprobs")
    raise InvalidRecord(f"holds a positive value ({float(top)}); log-probabilities are at most 0",
                        field="completion_logprobs")
