"""Parse one JSON object into Generation or Feedback events: the intake's wire formats.

``reef produce`` (one object per JSONL line) and the HTTP intake (one object, or an array
of them, per request) accept exactly these shapes, each described field by field in
``docs/intake.md`` ("Wire formats"):

- generations, native: the fields of ``reef_stream.core.events.Generation`` by name; any
  other field is an error (a misspelt optional field would otherwise take its default);
- generations, OpenAI-style: a complete ``/v1/completions`` or ``/v1/chat/completions``
  response (``OPENAI_OBJECTS``), bare or in a ``{"reef": ..., "response": ...}`` envelope
  that adds what a response lacks (``policy_version``, ``replica_id``, ``sampling``, ...);
  each of its n choices becomes one Generation, ``"<response id>:<choice index>"``. Token
  ids are required (vLLM ``return_token_ids``, or ``TOKEN_ID_PREFIX`` token strings);
- generations, multi-turn chat logs: OpenAI chat messages each with its ``token_ids``;
  assistant turns are POLICY segments, later turns of other roles ENVIRONMENT segments,
  trained as given, never re-tokenised;
- feedback: the fields of ``reef_stream.core.events.Feedback``; ``feedback_id`` defaults
  to ``"<generation_id>:<source>"``, so a second import yields the same ids.

Anything else raises ``InvalidRecord`` naming the field at fault (``choices[0].index``,
``sampling.max_tokens``); every event built is then checked by
``reef_stream.intake.validation.validate``, the rules the producer SDK applies.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar

import numpy as np

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import (
    EpochMillis, Feedback, FinishReason, Generation, SamplingParams, Segment, SegmentSource, now_ms,
)
from reef_stream.intake.validation import validate

__all__ = ["KINDS", "Kind", "OpenAIDefaults", "parse_feedback", "parse_generations",
           "parse_record", "parse_sampling"]

Kind = Literal["generations", "feedback"]
KINDS: tuple[Kind, ...] = ("generations", "feedback")

#: The ``object`` of the OpenAI responses accepted.
OPENAI_OBJECTS = ("text_completion", "chat.completion")
#: vLLM's ``return_tokens_as_token_ids`` writes each token as this prefix and its id.
TOKEN_ID_PREFIX = "token_id:"

_OPENAI_FINISH = {
    "stop": FinishReason.STOP, "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP, "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT, "content_filter": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}
_INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT_MAX = sys.float_info.max

_GENERATION_FIELDS = frozenset({
    "generation_id", "request_id", "prompt_id", "group_id", "group_size", "model",
    "policy_version", "replica_id", "prompt_token_ids", "completion_token_ids",
    "completion_logprobs", "finish_reason", "sampling", "created_at", "metadata"})
_FEEDBACK_FIELDS = frozenset({
    "feedback_id", "generation_id", "group_id", "source", "reward", "components", "created_at"})
_SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "seed"})
_ENVELOPE_FIELDS = frozenset({
    "policy_version", "replica_id", "model", "sampling", "prompt_id", "request_id",
    "group_id", "group_size", "prompt_token_ids", "metadata"})

T = TypeVar("T")
_MISSING: Any = object()


@dataclass(frozen=True)
class OpenAIDefaults:
    """What an OpenAI response lacks, for lines whose envelope does not say it.

    Set from ``reef produce --policy-version --replica-id --model --sampling``;
    the HTTP intake has none (senders use the envelope).
    """

    policy_version: int | None = None
    replica_id: str | None = None
    model: str | None = None
    sampling: SamplingParams | None = None


NO_DEFAULTS = OpenAIDefaults()


def parse_record(kind: Kind, value: Any,
                 defaults: OpenAIDefaults = NO_DEFAULTS) -> list[Generation] | list[Feedback]:
    """The events of one JSON value of ``kind``: one or more generations, or one feedback.

    Raises InvalidRecord naming the field when ``value`` is not one of the
    shapes in the module docstring or the event fails validation.
    """
    if kind == "generations":
        return parse_generations(value, defaults)
    if kind == "feedback":
        return [parse_feedback(value)]
    raise ValueError(f"kind is {kind!r}; use one of {', '.join(KINDS)}")


def parse_generations(value: Any, defaults: OpenAIDefaults = NO_DEFAULTS) -> list[Generation]:
    """The generations of one JSON value: native (one), or an OpenAI response (one per choice)."""
    record = _object(value, "")
    if "response" in record:
        _reject_unknown(record, frozenset({"reef", "response"}), "")
        envelope = _object(record.get("reef", {}), "reef")
        return _openai_generations(_object(record["response"], "response"), "response.",
                                   envelope, defaults)
    if "object" in record:
        return _openai_generations(record, "", {}, defaults)
    if "messages" in record:
        return [_chat_log_generation(record, defaults)]
    return [_native_generation(record)]


def parse_feedback(value: Any) -> Feedback:
    """The Feedback of one JSON object in the native form."""
    record = _object(value, "")
    _reject_unknown(record, _FEEDBACK_FIELDS, "")
    generation_id = _required(record, "generation_id", "", _string)
    source = _required(record, "source", "", _string)
    feedback = Feedback(
        feedback_id=_optional(record, "feedback_id", "", _string, f"{generation_id}:{source}"),
        generation_id=generation_id,
        group_id=_optional(record, "group_id", "", _nullable(_string), None),
        source=source,
        reward=_required(record, "reward", "", _number),
        components=_optional(record, "components", "", _number_map, {}),
        created_at=_or_now(_optional(record, "created_at", "", _millis, None)),
    )
    validate(feedback)
    return feedback


def parse_sampling(value: Any, field: str = "sampling") -> SamplingParams:
    """The SamplingParams of a JSON object (``max_tokens`` required); ``field`` names it in errors."""
    record = _object(value, field)
    prefix = f"{field}."
    _reject_unknown(record, _SAMPLING_FIELDS, prefix)
    return SamplingParams(
        temperature=_optional(record, "temperature", prefix, _number, 1.0),
        top_p=_optional(record, "top_p", prefix, _number, 1.0),
        top_k=_optional(record, "top_k", prefix, _integer, -1),
        max_tokens=_required(record, "max_tokens", prefix, _integer),
        seed=_optional(record, "seed", prefix, _nullable(_integer), None),
    )


# --------------------------------------------------------------------------- native generations


def _native_generation(record: dict[str, Any]) -> Generation:
    _reject_unknown(record, _GENERATION_FIELDS, "")
    generation = Generation(
        generation_id=_required(record, "generation_id", "", _string),
        request_id=_required(record, "request_id", "", _string),
        prompt_id=_required(record, "prompt_id", "", _string),
        group_id=_optional(record, "group_id", "", _nullable(_string), None),
        group_size=_optional(record, "group_size", "", _integer, 1),
        model=_required(record, "model", "", _string),
        policy_version=_required(record, "policy_version", "", _integer),
        replica_id=_required(record, "replica_id", "", _string),
        prompt_token_ids=_required(record, "prompt_token_ids", "", _token_ids),
        completion_token_ids=_required(record, "completion_token_ids", "", _token_ids),
        completion_logprobs=_required(record, "completion_logprobs", "", _logprobs),
        finish_reason=_required(record, "finish_reason", "", _finish_reason),
        sampling=_required(record, "sampling", "", parse_sampling),
        created_at=_or_now(_optional(record, "created_at", "", _millis, None)),
        metadata=_optional(record, "metadata", "", _string_map, {}),
    )
    validate(generation)
    return generation


def _finish_reason(value: Any, field: str) -> FinishReason:
    name = _string(value, field)
    try:
        return FinishReason[name.upper()]
    except KeyError:
        raise InvalidRecord(f"is {name!r}; use one of stop, length, abort, error, unknown",
                            field=field) from None


# --------------------------------------------------------------------------- OpenAI responses


@dataclass(frozen=True)
class _Choice:
    """What one choice of a response contributes to its Generation."""

    index: int
    prompt_token_ids: np.ndarray | None
    completion_token_ids: np.ndarray
    completion_logprobs: np.ndarray
    finish_reason: FinishReason


def _openai_generations(response: dict[str, Any], prefix: str, envelope: dict[str, Any],
                        defaults: OpenAIDefaults) -> list[Generation]:
    """One Generation per choice of ``response`` (fields at ``prefix``), completed by the envelope."""
    kind = _required(response, "object", prefix, _string)
    if kind not in OPENAI_OBJECTS:
        raise InvalidRecord(f"is {kind!r}; accepted: {' or '.join(OPENAI_OBJECTS)} "
                            "(complete responses, not stream chunks)", field=f"{prefix}object")
    _reject_unknown(envelope, _ENVELOPE_FIELDS, "reef.")
    response_id = _required(response, "id", prefix, _string)
    choices = _required(response, "choices", prefix, _list)
    if not choices:
        raise InvalidRecord("is empty; a response has at least one choice", field=f"{prefix}choices")
    parsed = [_openai_choice(choice, f"{prefix}choices[{i}]", chat=kind == "chat.completion")
              for i, choice in enumerate(choices)]
    _check_distinct_indexes(parsed, prefix)

    envelope_prompt = _optional(envelope, "prompt_token_ids", "reef.", _token_ids, None)
    response_prompt = _optional(response, "prompt_token_ids", prefix, _nullable(_token_ids), None)
    group_id = _optional(envelope, "group_id", "reef.", _string,
                         response_id if len(parsed) > 1 else None)
    common = dict(
        request_id=_optional(envelope, "request_id", "reef.", _string, response_id),
        group_id=group_id,
        group_size=_optional(envelope, "group_size", "reef.", _integer, len(parsed)),
        model=_optional(envelope, "model", "reef.", _string, None) or defaults.model
        or _required(response, "model", prefix, _string),
        policy_version=_from_envelope_or_default(envelope, "policy_version", _integer,
                                                 defaults.policy_version, "--policy-version"),
        replica_id=_from_envelope_or_default(envelope, "replica_id", _string,
                                             defaults.replica_id, "--replica-id"),
        sampling=_from_envelope_or_default(envelope, "sampling", parse_sampling,
                                           defaults.sampling, "--sampling"),
        created_at=_or_now(_optional(response, "created", prefix, _seconds_to_millis, None)),
        metadata=_optional(envelope, "metadata", "reef.", _string_map, {}),
    )
    prompt_id = _optional(envelope, "prompt_id", "reef.", _string, None)
    generations = []
    for i, choice in enumerate(parsed):
        prompt = _first_present(envelope_prompt, choice.prompt_token_ids, response_prompt)
        if prompt is None:
            raise InvalidRecord(
                "prompt token ids are required: ask the server for them (vLLM: "
                "return_token_ids=true) or give reef.prompt_token_ids in the envelope",
                field=f"{prefix}choices[{i}].prompt_token_ids")
        generation = Generation(
            generation_id=f"{response_id}:{choice.index}",
            prompt_id=prompt_id or _prompt_digest(prompt),
            prompt_token_ids=prompt,
            completion_token_ids=choice.completion_token_ids,
            completion_logprobs=choice.completion_logprobs,
            finish_reason=choice.finish_reason,
            **common,
        )
        validate(generation)
        generations.append(generation)
    return generations


_CHAT_LOG_FIELDS = frozenset({"reef", "id", "model", "created", "finish_reason", "messages",
                               "tools"})


def _chat_log_generation(record: dict[str, Any], defaults: OpenAIDefaults) -> Generation:
    """The Generation of one multi-turn chat log (module docstring)."""
    _reject_unknown(record, _CHAT_LOG_FIELDS, "")
    envelope = _object(record.get("reef", {}), "reef")
    _reject_unknown(envelope, _ENVELOPE_FIELDS, "reef.")
    conversation_id = _required(record, "id", "", _string)
    messages = [_object(m, f"messages[{i}]")
                for i, m in enumerate(_required(record, "messages", "", _list))]
    roles = [_required(m, "role", f"messages[{i}].", _string) for i, m in enumerate(messages)]
    if "assistant" not in roles:
        raise InvalidRecord("has no assistant message: nothing the policy generated",
                            field="messages")
    first = roles.index("assistant")
    prompt = _optional(envelope, "prompt_token_ids", "reef.", _token_ids, None)
    if prompt is None:
        if not first:
            raise InvalidRecord("the conversation opens with the assistant, so it has no prompt "
                                "tokens: give them in reef.prompt_token_ids",
                                field="messages[0]")
        prompt = np.concatenate([_required(messages[i], "token_ids", f"messages[{i}].",
                                           _token_ids) for i in range(first)])
    ids, values, segments = [], [], []
    for i in range(first, len(messages)):
        message, path = messages[i], f"messages[{i}]."
        if roles[i] == "assistant":
            tokens, logprobs = _assistant_turn(message, path)
            source, role = SegmentSource.POLICY, "assistant"
        else:
            tokens = _required(message, "token_ids", path, _token_ids)
            logprobs = np.zeros(tokens.size, dtype=np.float32)
            source, role = SegmentSource.ENVIRONMENT, roles[i]
            if roles[i] == "tool" and isinstance(message.get("name"), str):
                role = f"tool:{message['name']}"
        if tokens.size:
            ids.append(tokens)
            values.append(logprobs)
            segments.append(Segment(source=source, length=int(tokens.size), role=role))
    if len(segments) == 1:
        segments = []     # one assistant turn: an ordinary single-turn generation
    generation = Generation(
        generation_id=conversation_id,
        request_id=_optional(envelope, "request_id", "reef.", _string, conversation_id),
        prompt_id=_optional(envelope, "prompt_id", "reef.", _string, None)
        or _prompt_digest(prompt),
        group_id=_optional(envelope, "group_id", "reef.", _string, None),
        group_size=_optional(envelope, "group_size", "reef.", _integer, 1),
        model=_optional(envelope, "model", "reef.", _string, None) or defaults.model
        or _required(record, "model", "", _string),
        policy_version=_from_envelope_or_default(envelope, "policy_version", _integer,
                                                 defaults.policy_version, "--policy-version"),
        replica_id=_from_envelope_or_default(envelope, "replica_id", _string,
                                             defaults.replica_id, "--replica-id"),
        prompt_token_ids=prompt,
        completion_token_ids=np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32),
        completion_logprobs=np.concatenate(values) if values else np.zeros(0, np.float32),
        finish_reason=_optional(record, "finish_reason", "", _chat_finish_reason,
                                FinishReason.STOP),
        sampling=_from_envelope_or_default(envelope, "sampling", parse_sampling,
                                           defaults.sampling, "--sampling"),
        created_at=_or_now(_optional(record, "created", "", _seconds_to_millis, None)),
        metadata=_optional(envelope, "metadata", "reef.", _string_map, {}),
        segments=tuple(segments),
    )
    validate(generation)
    return generation


def _assistant_turn(message: dict[str, Any], path: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, behaviour logprobs) of one assistant message of a chat log."""
    logprobs = message.get("logprobs")
    if logprobs is None:
        raise InvalidRecord("is required on every assistant message: the behaviour logprob of "
                            "each token it sampled (chat: logprobs=true)", field=f"{path}logprobs")
    token_strings, where = None, f"{path}logprobs"
    if isinstance(logprobs, list):
        values = _logprobs(logprobs, f"{path}logprobs")
    else:
        values, token_strings, where = _chat_logprobs(_object(logprobs, f"{path}logprobs"),
                                                      f"{path}logprobs.")
    tokens = _optional(message, "token_ids", path, _nullable(_token_ids), None)
    if tokens is None:
        tokens = _ids_from_token_strings(token_strings, where if token_strings is not None
                                         else f"{path}token_ids")
    if tokens.size != values.size:
        raise InvalidRecord(f"has {values.size} logprobs for {tokens.size} token ids; there "
                            "must be one logprob per token", field=f"{path}logprobs")
    if not tokens.size:
        raise InvalidRecord("is empty: an assistant turn has at least one token",
                            field=f"{path}token_ids")
    if values.max() > 1e-3:
        raise InvalidRecord(f"holds a positive value ({float(values.max())}); log-probabilities "
                            "are at most 0", field=f"{path}logprobs")
    return tokens, values


def _chat_finish_reason(value: Any, field: str) -> FinishReason:
    name = _string(value, field)
    if name.upper() in FinishReason.__members__:
        return FinishReason[name.upper()]
    return _openai_finish_reason(name, field)


def _openai_choice(value: Any, path: str, *, chat: bool) -> _Choice:
    choice = _object(value, path)
    prefix = f"{path}."
    logprobs = choice.get("logprobs")
    if logprobs is None:
        raise InvalidRecord("logprobs are required: request them (completions: logprobs=1; "
                            "chat: logprobs=true)", field=f"{prefix}logprobs")
    logprobs = _object(logprobs, f"{prefix}logprobs")
    if chat:
        values, token_strings, where = _chat_logprobs(logprobs, f"{prefix}logprobs.")
    else:
        values = _required(logprobs, "token_logprobs", f"{prefix}logprobs.", _logprobs)
        token_strings = _optional(logprobs, "tokens", f"{prefix}logprobs.", _list, None)
        where = f"{prefix}logprobs.tokens"
    token_ids = _optional(choice, "token_ids", prefix, _nullable(_token_ids), None)
    if token_ids is None:
        token_ids = _ids_from_token_strings(token_strings, where)
    if token_ids.size != values.size:
        raise InvalidRecord(f"has {values.size} logprobs for {token_ids.size} completion token "
                            "ids; there must be one logprob per completion token",
                            field=f"{prefix}logprobs")
    return _Choice(
        index=_required(choice, "index", prefix, _integer),
        prompt_token_ids=_optional(choice, "prompt_token_ids", prefix, _nullable(_token_ids), None),
        completion_token_ids=token_ids,
        completion_logprobs=values,
        finish_reason=_required(choice, "finish_reason", prefix, _openai_finish_reason),
    )


def _chat_logprobs(logprobs: dict[str, Any], prefix: str) -> tuple[np.ndarray, list[Any], str]:
    """(logprob values, token strings, where the strings are) of a chat choice's ``logprobs``."""
    content = _required(logprobs, "content", prefix, _list)
    entries = [_object(entry, f"{prefix}content[{j}]") for j, entry in enumerate(content)]
    values = [_required(entry, "logprob", f"{prefix}content[{j}].", _number)
              for j, entry in enumerate(entries)]
    tokens = [entry.get("token") for entry in entries]
    return np.array(values, dtype=np.float32), tokens, f"{prefix}content[].token"


_ENABLE_IDS = ("token ids are required: enable return_tokens_as_token_ids (vLLM) or "
               "return_token_ids (vLLM >= 0.10.2) on the server")


def _ids_from_token_strings(tokens: list[Any] | None, field: str) -> np.ndarray:
    """Token ids from vLLM's ``"token_id:1234"`` strings; InvalidRecord for plain strings."""
    if tokens is None:
        raise InvalidRecord(f"is missing and so is token_ids; {_ENABLE_IDS}", field=field)
    ids = []
    for token in tokens:
        if not (isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX)
                and token[len(TOKEN_ID_PREFIX):].isdigit()):
            raise InvalidRecord(f"holds token strings such as {token!r}, not ids; {_ENABLE_IDS}",
                                field=field)
        ids.append(int(token[len(TOKEN_ID_PREFIX):]))
    return _token_ids(ids, field)


def _openai_finish_reason(value: Any, field: str) -> FinishReason:
    if value is None:
        raise InvalidRecord("is null: the response is a stream chunk or unfinished; import "
                            "complete responses", field=field)
    name = _string(value, field)
    try:
        return _OPENAI_FINISH[name.lower()]
    except KeyError:
        raise InvalidRecord(f"is {name!r}; accepted: {', '.join(_OPENAI_FINISH)}",
                            field=field) from None


def _check_distinct_indexes(choices: list[_Choice], prefix: str) -> None:
    seen: set[int] = set()
    for i, choice in enumerate(choices):
        if choice.index in seen:
            raise InvalidRecord(f"is {choice.index}, which an earlier choice has too; each "
                                "choice needs its own index", field=f"{prefix}choices[{i}].index")
        seen.add(choice.index)


def _from_envelope_or_default(envelope: dict[str, Any], name: str,
                              convert: Callable[[Any, str], T], default: T | None,
                              option: str) -> T:
    value = _optional(envelope, name, "reef.", convert, None)
    if value is not None:
        return value
    if default is not None:
        return default
    raise InvalidRecord(f"is required for an OpenAI response, which does not carry it: give it "
                        f"in the line's envelope ({{\"reef\": {{\"{name}\": ...}}, \"response\": "
                        f"...}}) or, when importing, with {option}", field=f"reef.{name}")


def _prompt_digest(prompt_token_ids: np.ndarray) -> str:
    """A prompt id for identical prompt tokens: the sha256 of their packed int32 bytes."""
    digest = hashlib.sha256(prompt_token_ids.astype("<i4").tobytes()).hexdigest()
    return f"sha256:{digest[:16]}"


def _first_present(*values: np.ndarray | None) -> np.ndarray | None:
    return next((value for value in values if value is not None), None)


def _or_now(millis: EpochMillis | None) -> EpochMillis:
    return now_ms() if millis is None else millis


# --------------------------------------------------------------------------- field readers


def _field(prefix: str, name: str) -> str:
    return f"{prefix}{name}"


def _required(record: dict[str, Any], name: str, prefix: str,
              convert: Callable[[Any, str], T]) -> T:
    """``convert(record[name])``; InvalidRecord naming ``prefix + name`` when it is missing."""
    value = record.get(name, _MISSING)
    if value is _MISSING:
        raise InvalidRecord("is missing; it is required", field=_field(prefix, name))
    return convert(value, _field(prefix, name))


def _optional(record: dict[str, Any], name: str, prefix: str,
              convert: Callable[[Any, str], T], default: T) -> T:
    """``convert(record[name])``, or ``default`` when the field is absent."""
    value = record.get(name, _MISSING)
    if value is _MISSING:
        return default
    return convert(value, _field(prefix, name))


def _reject_unknown(record: dict[str, Any], known: frozenset[str], prefix: str) -> None:
    unknown = sorted(set(record) - known)
    if unknown:
        raise InvalidRecord(f"is not a field here; the fields are {', '.join(sorted(known))}",
                            field=_field(prefix, unknown[0]))


def _nullable(convert: Callable[[Any, str], T]) -> Callable[[Any, str], T | None]:
    return lambda value, field: None if value is None else convert(value, field)


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRecord(f"must be a JSON object, not {_json_type(value)}", field=field or None)
    return value


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRecord(f"must be a JSON list, not {_json_type(value)}", field=field)
    return value


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidRecord(f"must be a string, not {_json_type(value)}", field=field)
    return value


def _integer(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecord(f"must be an integer, not {_json_type(value)}", field=field)
    return value


def _number(value: Any, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRecord(f"must be a number, not {_json_type(value)}", field=field)
    return float(value)


def _millis(value: Any, field: str) -> EpochMillis:
    return EpochMillis(_integer(value, field))


def _seconds_to_millis(value: Any, field: str) -> EpochMillis:
    return EpochMillis(_integer(value, field) * 1000)


def _token_ids(value: Any, field: str) -> np.ndarray:
    """A list of integer token ids as int32; InvalidRecord naming the first bad item."""
    items = _list(value, field)
    ids = _array_of(items, {int}, np.int64)
    if ids is None or (ids.size and (ids.min() < 0 or ids.max() > _INT32_MAX)):
        _reject_first(items, field, _is_token_id, f"token ids are integers from 0 to {_INT32_MAX}")
    return ids.astype(np.int32)


def _logprobs(value: Any, field: str) -> np.ndarray:
    """A list of finite numbers as float32; InvalidRecord naming the first bad item (null included)."""
    items = _list(value, field)
    values = _array_of(items, {int, float}, np.float64)
    if values is None or not np.isfinite(values).all():
        _reject_first(items, field, _is_finite_number, "logprobs are finite numbers")
    return values.astype(np.float32)


def _array_of(items: list[Any], types: set[type], dtype: type) -> np.ndarray | None:
    """``items`` as a ``dtype`` array when each is exactly one of ``types`` and fits; else None.

    The fast path (checks run in C): the slow one, item by item, only finds the
    first bad item for the error message.
    """
    if not set(map(type, items)) <= types:  # exact types: a bool is not an int here
        return None
    try:
        return np.array(items, dtype=dtype)
    except OverflowError:
        return None


def _reject_first(items: list[Any], field: str, ok: Callable[[Any], bool],
                  rule: str) -> NoReturn:
    index = next(i for i, item in enumerate(items) if not ok(item))
    raise InvalidRecord(f"item {index} is {items[index]!r}; {rule}", field=field)


def _is_token_id(item: Any) -> bool:
    return type(item) is int and 0 <= item <= _INT32_MAX


def _is_finite_number(item: Any) -> bool:
    # Comparisons are exact for ints of any size and false for NaN.
    return type(item) in (int, float) and -_FLOAT_MAX <= item <= _FLOAT_MAX


def _string_map(value: Any, field: str) -> dict[str, str]:
    for key, item in _object(value, field).items():
        _string(item, f"{field}.{key}")
    return dict(value)


def _number_map(value: Any, field: str) -> dict[str, float]:
    return {key: _number(item, f"{field}.{key}") for key, item in _object(value, field).items()}


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
