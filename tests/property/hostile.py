"""Hypothesis strategies for the door tests: valid records, hostile values, and raw messages.

- ``native_generation()`` / ``native_feedback()``: valid records in the JSON form of
  ``reef_stream.intake.formats``; ``mutated_generation()`` / ``mutated_feedback()`` break one
  field of one (a wrong type, a missing field, NaN or an infinity, a negative version, a lone
  surrogate, an unknown field, ...) and say which field the error must name.
- ``hostile_json()``: any JSON value, with the awkward corners weighted up.
- ``hostile_generation_event()`` / ``hostile_feedback_event()``: SDK events whose fields hold
  hostile Python values (lists for arrays, 2-D arrays, float token ids, ints past int32, ...).
- ``raw_message()``: what a broken or foreign producer can put on a topic a consumer reads:
  random bytes, valid Avro of another schema, an unknown fingerprint, no headers, a
  tombstone, a truncated record, a record with bytes left over.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import (
    Checkpoint, Feedback, FinishReason, Generation, Metric, SamplingParams,
)
from reef_stream.core.serde import FINGERPRINT_HEADER, SCHEMA_NAME_HEADER, SchemaRegistry
from tests import factories

INT32_MAX = 2**31 - 1
#: The last millisecond of the year 9999: a timestamp-millis a reader can still decode.
MAX_MILLIS = 253_402_300_799_999

# ----------------------------------------------------------------------------- text

#: Strings that have broken parsers, terminals and encoders before.
AWKWARD_TEXT = [
    "\x00", "a\x00b", "\u202egnp.exe", "\u200f\u05e9\u05dc\u05d5\u05dd", "\ufeffbom", "e\u0301",
    "\U0001F600\u200d\U0001F4BB", "\u2028\u2029", "\r\n", "\t", "'; DROP TABLE x; --",
    "%s%n%x", "{}", "null", "\\u0000", "\uffff", "\U0010ffff", "Ω" * 300,
]
#: Lone surrogates: valid in a Python str and in JSON (``"\ud800"``), never valid UTF-8.
SURROGATES = ["\ud800", "x\udfff", "\udbff\udbff", "ok\ud834"]

lone_surrogate = st.one_of(
    st.sampled_from(SURROGATES),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
              st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.text(max_size=5)))

#: Text a reader must take as it is: awkward, but valid (non-empty after strip).
awkward_valid_text = st.one_of(
    st.sampled_from([t for t in AWKWARD_TEXT if t.strip()]),
    st.text(min_size=1, max_size=40).filter(lambda t: t.strip()),
    st.integers(1_000, 20_000).map(lambda n: "x" * n),
)

blank_text = st.sampled_from(["", " ", "\t\n", "\u3000", "\u2028"])

# ----------------------------------------------------------------------------- JSON

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([-1, 0, 2**31, 2**63, -(2**63) - 1, 2**200]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(AWKWARD_TEXT + SURROGATES),
)


def hostile_json(max_leaves: int = 25) -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and infinities included, as Python's json reads them)."""
    return st.recursive(json_scalars, lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=12), st.sampled_from(SURROGATES)), children,
                        max_size=6)), max_leaves=max_leaves)


def json_roundtrip(value: Any) -> Any:
    """``value`` as the intake sees it: through ``json.dumps`` and ``json.loads``."""
    return json.loads(json.dumps(value))


# ----------------------------------------------------------------------------- valid records

ids = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12)
token_lists = st.lists(st.integers(0, INT32_MAX), max_size=12)
logprob = st.floats(-30.0, 0.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def native_generation(draw, generation_id: str | None = None) -> dict[str, Any]:
    completion = draw(token_lists)
    record = {
        "generation_id": generation_id or draw(ids),
        "request_id": draw(ids), "prompt_id": draw(ids), "model": draw(ids),
        "policy_version": draw(st.integers(0, 1000)), "replica_id": draw(ids),
        "prompt_token_ids": draw(st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=12)),
        "completion_token_ids": completion,
        "completion_logprobs": draw(st.lists(logprob, min_size=len(completion),
                                             max_size=len(completion))),
        "finish_reason": draw(st.sampled_from(["stop", "length", "ABORT", "error", "unknown"])),
        "sampling": {"temperature": draw(st.floats(0, 2)), "max_tokens": draw(st.integers(0, 4096))},
        "created_at": draw(st.integers(0, MAX_MILLIS)),
        "metadata": draw(st.dictionaries(ids, st.text(max_size=10), max_size=3)),
    }
    if draw(st.booleans()):
        record["group_id"] = draw(ids)
        record["group_size"] = draw(st.integers(1, 8))
    return record


@st.composite
def native_feedback(draw, generation_id: str | None = None) -> dict[str, Any]:
    record = {"generation_id": generation_id or draw(ids), "source": draw(ids),
              "reward": draw(st.floats(-1e6, 1e6)),
              "components": draw(st.dictionaries(ids, st.floats(-10, 10), max_size=3))}
    if draw(st.booleans()):
        record["feedback_id"] = draw(ids)
    if draw(st.booleans()):
        record["created_at"] = draw(st.integers(0, MAX_MILLIS))
    return record


# ----------------------------------------------------------------------------- mutations

not_a_string = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.lists(st.text(max_size=3), max_size=2), st.just({"a": "b"}))
not_an_integer = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=5),
                           st.just([1]), st.just({"v": 1}))
not_a_list = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                       st.text(max_size=5), st.just({"0": 1}))
bad_token = st.one_of(st.integers(max_value=-1), st.integers(min_value=INT32_MAX + 1),
                      st.floats(), st.booleans(), st.none(), st.text(max_size=3))
bad_logprob = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300]),
                        st.floats(0.01, 1e30), st.booleans(), st.none(), st.text(max_size=3))
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
bad_text = st.one_of(not_a_string, blank_text, lone_surrogate)


@dataclass(frozen=True)
class Mutation:
    """A record with one field broken; the error must name ``field`` (or a field under it)."""

    record: dict[str, Any]
    field: str
    what: str

    def names_the_field(self, named: str | None) -> bool:
        return named is not None and (named == self.field or named.startswith(self.field + ".")
                                      or named.startswith(self.field + "["))


def _generation_breakage(name: str, record: dict[str, Any]) -> st.SearchStrategy[Any]:
    if name in ("generation_id", "request_id", "prompt_id", "model", "replica_id"):
        return bad_text
    if name == "policy_version":
        return st.one_of(not_an_integer, st.integers(max_value=-1),
                         st.integers(min_value=2**63), not_finite)
    if name == "group_size":
        return st.one_of(not_an_integer, st.integers(max_value=0),
                         st.integers(min_value=INT32_MAX + 1))
    if name == "created_at":
        return st.one_of(not_an_integer, st.integers(max_value=-1),
                         st.integers(min_value=MAX_MILLIS + 1))
    if name == "prompt_token_ids":
        return st.one_of(not_a_list, st.just([]),
                         st.lists(bad_token, min_size=1, max_size=3).map(lambda bad: [1, *bad]))
    if name == "completion_token_ids":
        return st.one_of(not_a_list,
                         st.lists(bad_token, min_size=1, max_size=3).map(lambda bad: [1, *bad]))
    if name == "completion_logprobs":
        n = len(record["completion_token_ids"])
        wrong_length = st.lists(logprob, max_size=n + 3).filter(lambda values: len(values) != n)
        return st.one_of(not_a_list, wrong_length,
                         st.lists(bad_logprob, min_size=1, max_size=1).map(
                             lambda bad: [-0.5] * (n - 1) + bad if n else bad))
    if name == "finish_reason":
        return st.one_of(not_a_string, st.text(max_size=8).filter(
            lambda s: s.upper() not in FinishReason.__members__))
    if name == "metadata":
        return st.one_of(st.none(), st.integers(), st.just([]), st.just({"k": 1}),
                         st.just({"k": None}), lone_surrogate.map(lambda s: {"k": s}))
    if name == "sampling":
        return st.one_of(
            not_a_list.filter(lambda v: not isinstance(v, dict)), st.just({}),
            st.just({"temperature": 1.0}), st.just({"max_tokens": 4, "top_q": 1.0}),
            st.builds(lambda t: {"max_tokens": 4, "temperature": t},
                      st.one_of(not_finite, st.floats(max_value=-1e-9), st.just("hot"))),
            st.builds(lambda m: {"max_tokens": m},
                      st.one_of(st.integers(max_value=-1), st.integers(min_value=INT32_MAX + 1),
                                st.floats(), st.none())),
            st.builds(lambda k: {"max_tokens": 4, "top_k": k}, st.integers(max_value=-2)))
    raise AssertionError(name)


GENERATION_FIELDS = ("generation_id", "request_id", "prompt_id", "model", "replica_id",
                     "policy_version", "group_size", "created_at", "prompt_token_ids",
                     "completion_token_ids", "completion_logprobs", "finish_reason", "metadata",
                     "sampling")
REQUIRED_GENERATION_FIELDS = ("generation_id", "request_id", "prompt_id", "model",
                              "policy_version", "replica_id", "prompt_token_ids",
                              "completion_token_ids", "completion_logprobs", "finish_reason",
                              "sampling")


@st.composite
def mutated_generation(draw) -> Mutation:
    record = draw(native_generation())
    how = draw(st.sampled_from(["break", "break", "break", "missing", "unknown"]))
    if how == "missing":
        name = draw(st.sampled_from(REQUIRED_GENERATION_FIELDS))
        del record[name]
        return Mutation(record, name, "missing")
    if how == "unknown":
        name = draw(st.one_of(st.sampled_from(["policy_versoin", "Generation_id", "", "reward"]),
                              lone_surrogate, st.text(min_size=1, max_size=8)).filter(
            lambda n: n not in GENERATION_FIELDS and n != "group_id"
            and n not in ("object", "response")))
        record[name] = draw(json_scalars)
        return Mutation(record, name, "unknown field")
    name = draw(st.sampled_from(GENERATION_FIELDS))
    if name == "group_size":
        record["group_id"] = "grp"
    record[name] = draw(_generation_breakage(name, record))
    return Mutation(record, name, f"{name}={record[name]!r:.60}")


FEEDBACK_FIELDS = ("feedback_id", "generation_id", "group_id", "source", "reward", "components",
                   "created_at")


@st.composite
def mutated_feedback(draw) -> Mutation:
    record = draw(native_feedback())
    how = draw(st.sampled_from(["break", "break", "break", "missing", "unknown"]))
    if how == "missing":
        name = draw(st.sampled_from(("generation_id", "source", "reward")))
        del record[name]
        return Mutation(record, name, "missing")
    if how == "unknown":
        name = draw(st.one_of(st.sampled_from(["rewards", "policy_version"]), lone_surrogate)
                    .filter(lambda n: n not in FEEDBACK_FIELDS))
        record[name] = 1
        return Mutation(record, name, "unknown field")
    name = draw(st.sampled_from(FEEDBACK_FIELDS))
    breakage = {
        "feedback_id": bad_text, "generation_id": bad_text, "source": bad_text,
        "group_id": st.one_of(not_a_string.filter(lambda v: v is not None), blank_text,
                              lone_surrogate),
        "reward": st.one_of(not_finite, st.none(), st.booleans(), st.text(max_size=4),
                            st.just([1.0])),
        "components": st.one_of(st.none(), st.just([1.0]), st.just({"c": "1"}),
                                not_finite.map(lambda v: {"c": v}), st.just({"": 1.0}),
                                lone_surrogate.map(lambda s: {s: 1.0})),
        "created_at": st.one_of(not_an_integer, st.integers(max_value=-1),
                                st.integers(min_value=MAX_MILLIS + 1)),
    }[name]
    record[name] = draw(breakage)
    return Mutation(record, name, f"{name}={record[name]!r:.60}")


# ----------------------------------------------------------------------------- SDK events


#: a valid generation (tests/factories.py), the base every hostile generation breaks one field of
generation_event = factories.generation


def feedback_event(generation_id: str = "g-1", **overrides: Any) -> Feedback:
    """A valid feedback (tests/factories.py) whose id stays ``<generation_id>:judge`` whatever
    source a hostile draw gives it."""
    return factories.feedback(generation_id, **{"feedback_id": f"{generation_id}:judge",
                                                **overrides})


python_junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
                        st.just([1, 2]), st.just((1,)), st.just({"a": 1}), st.just(b"bytes"),
                        st.just(np.float64(1.5)), st.just(np.int64(7)), st.just(object()))
arrays = st.one_of(
    st.just(np.array([], dtype=np.int32)), st.just(np.array([[1, 2]], dtype=np.int32)),
    st.just(np.array([1.5, 2.0])), st.just(np.array([1, 2], dtype=np.int64)),
    st.just(np.array([-1, 2], dtype=np.int32)), st.just(np.array([2**40], dtype=np.int64)),
    st.just(np.array([1, 2], dtype=np.uint8)), st.just(np.array(["a", "b"])),
    st.just(np.array([True, False])), st.just(np.array([np.nan, -1.0], dtype=np.float32)),
    st.just(np.array([-np.inf, -1.0], dtype=np.float32)),
    st.just(np.array([0.5, -1.0], dtype=np.float32)), st.just(np.array([-1.0, -2.0])),
    st.just(np.array([1 + 2j, 3j])), st.just([1, 2]), st.just(np.zeros((2, 2), np.float32)),
    st.integers(50_000, 300_000).map(lambda n: np.ones(n, dtype=np.int32)),
)


@st.composite
def hostile_generation_event(draw) -> tuple[Generation, str]:
    """A Generation with one field replaced by a hostile Python value, and that field's name."""
    name = draw(st.sampled_from([f.name for f in dataclasses.fields(Generation)]))
    current = getattr(generation_event(), name)
    if isinstance(current, np.ndarray):
        value = draw(st.one_of(arrays, python_junk))
    elif name == "sampling":
        value = draw(st.one_of(python_junk, st.builds(
            SamplingParams, temperature=st.one_of(st.floats(), python_junk),
            top_p=st.one_of(st.floats(), python_junk),
            top_k=st.one_of(st.integers(), python_junk),
            max_tokens=st.one_of(st.integers(), python_junk),
            seed=st.one_of(st.none(), st.integers(), python_junk))))
    elif name == "metadata":
        value = draw(st.one_of(python_junk, st.dictionaries(
            st.one_of(st.text(max_size=4), lone_surrogate, st.integers()),
            st.one_of(st.text(max_size=4), lone_surrogate, python_junk), max_size=3)))
    elif name == "finish_reason":
        value = draw(st.one_of(python_junk, st.sampled_from(["STOP", FinishReason])))
    elif name in ("policy_version", "group_size", "created_at"):
        value = draw(st.one_of(st.integers(), st.sampled_from(
            [-1, 2**31, 2**63, MAX_MILLIS + 1, np.int64(3), np.uint64(2**63)]), python_junk))
    else:
        value = draw(st.one_of(python_junk, bad_text, awkward_valid_text))
    overrides = {"generation_id": draw(ids), name: value}
    if name == "group_size":
        overrides["group_id"] = "grp"
    return generation_event(**overrides), name


@st.composite
def hostile_feedback_event(draw) -> tuple[Feedback, str]:
    name = draw(st.sampled_from([f.name for f in dataclasses.fields(Feedback)]))
    if name == "reward":
        value = draw(st.one_of(not_finite, python_junk, st.floats()))
    elif name == "components":
        value = draw(st.one_of(python_junk, st.dictionaries(
            st.one_of(st.text(max_size=4), lone_surrogate, st.integers()),
            st.one_of(st.floats(), python_junk), max_size=3)))
    elif name == "created_at":
        value = draw(st.one_of(st.integers(), st.sampled_from([-1, MAX_MILLIS + 1]), python_junk))
    else:
        value = draw(st.one_of(python_junk, bad_text, awkward_valid_text))
    return feedback_event(**{"generation_id": draw(ids), name: value}), name


# ----------------------------------------------------------------------------- raw messages


@dataclass(frozen=True)
class RawMessage:
    """One message as a broken or foreign producer writes it."""

    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    what: str
    key: bytes = b"hostile"


def _headers_of(event: Any) -> list[tuple[str, bytes]]:
    return SchemaRegistry.default().encode(event)[1]


def raw_message(reader: Any, sample: Any) -> st.SearchStrategy[RawMessage]:
    """Hostile messages for a topic read as ``reader`` (an event class); ``sample`` is a valid
    event of that class, for truncated and padded copies. None of them decodes as ``reader``."""
    registry = SchemaRegistry.default()
    own_headers = _headers_of(sample)
    valid, _ = registry.encode(sample)
    foreign = [event for event in (
        generation_event(), feedback_event(),
        Metric(stage="x", name="y", value=1.0, created_at=1),
        Checkpoint(checkpoint_id="c", recipe="r", trainer_group="t", step=1, model="m",
                   policy_version=1, uri="file:///nowhere", sha256="0" * 64, offsets=(),
                   trained_unit_count=0, created_at=1)) if type(event) is not reader]
    return st.one_of(
        st.binary(max_size=300).map(lambda b: RawMessage(b, own_headers, "random bytes")),
        st.binary(max_size=64).map(lambda b: RawMessage(b, None, "no headers")),
        st.sampled_from(foreign).map(lambda e: RawMessage(
            registry.encode(e)[0], registry.encode(e)[1], f"valid Avro of {type(e).__name__}")),
        st.binary(min_size=8, max_size=8).filter(
            lambda fp: fp not in {k.fingerprint for k in registry.schemas()}).map(
            lambda fp: RawMessage(valid, [(FINGERPRINT_HEADER, fp),
                                          (SCHEMA_NAME_HEADER, b"reef.events.Imposter")],
                                  "unknown fingerprint")),
        st.sampled_from([b"", b"\x00", b"\xff" * 7, b"reef"]).map(
            lambda fp: RawMessage(valid, [(FINGERPRINT_HEADER, fp)], "malformed fingerprint")),
        st.integers(0, len(valid) - 1).map(
            lambda n: RawMessage(valid[:n], own_headers, f"truncated to {n} bytes")),
        st.binary(min_size=1, max_size=16).map(
            lambda extra: RawMessage(valid + extra, own_headers, "bytes left over")),
        st.just(RawMessage(None, own_headers, "tombstone")),
        st.just(RawMessage(valid, [(SCHEMA_NAME_HEADER, b"reef.events.Generation")],
                           "a schema name and no fingerprint")),
    ).filter(lambda message: not decodes(message, reader))


def decodes(message: RawMessage, reader: Any) -> bool:
    """Whether ``message`` decodes as ``reader`` (random bytes rarely do). Anything but
    ``InvalidRecord`` escaping the decoder fails the test that draws it."""
    try:
        SchemaRegistry.default().decode(message.value, message.headers, reader)
    except InvalidRecord:
        return False
    return True
