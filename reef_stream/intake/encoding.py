"""The producer SDK's Avro writer: the bytes ``SchemaRegistry.encode`` writes, in a fraction of the time.

``SchemaRegistry.encode`` builds a fastavro dict of the event (``to_avro``)
and hands it to fastavro's ``schemaless_writer``, which walks the schema for
every record: about 15 µs for a Generation, the largest part of the SDK's
per-record cost. ``EventEncoder`` compiles, once per event type, a writer
from the type's current schema and its dataclass, which reads the event's
attributes directly and emits the Avro binary encoding (zig-zag varints,
length-prefixed strings and bytes, little-endian doubles, one block per
non-empty map, ``[null, X]`` unions) without building a dict.

The contract: ``encode(event)`` returns exactly what
``registry.encode(event)`` returns, byte for byte, or it *is*
``registry.encode(event)``. The compiled writer accepts only values whose
encoding it is sure of (a ``str``, an ``int`` in range, an array of the
field's own dtype, a member of the field's enum, ...); on anything else, and
for any event type or schema construct it does not compile (arrays, other
unions, DeadLetter's headers), it hands the event to the registry, whose
encoding is the reference and whose ``InvalidRecord`` says what is wrong.
``tests/unit/test_intake_encoding.py`` checks the equality on every field
kind, edge values and random events.

Schemas are the registry's (parsed once); nothing here parses a schema per
record. Thread-safe: compiled writers hold no state.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import struct
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from reef_stream.topics.serde import Headers, KnownSchema, SchemaRegistry

__all__ = ["EventEncoder"]

#: Writes one value: appends its encoded parts to the list through ``append``.
_Write = Callable[[Any, Callable[[bytes], None]], None]

#: Zig-zag varints of 0 .. _TABLE - 1 (values -8192 .. 8191, lengths up to 8 KiB), prebuilt;
#: a larger number is written 14 bits at a time from the same table (a timestamp: 3 lookups).
_BITS = 14
_TABLE = 1 << _BITS
_INT64 = 1 << 63
_INT32 = 1 << 31


class _Unsupported(Exception):
    """A schema construct or value this writer does not encode; the registry does."""


def _varint(zigzag: int) -> bytes:
    """The Avro varint of a zig-zag encoded (non-negative) number: 7 bits a byte, low first,
    the high bit set on every byte but the last."""
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


_VARINTS = [_varint(z) for z in range(_TABLE)]
#: The same 14 bits as the two bytes of a varint that goes on (both high bits set).
_CONTINUED = [bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(_TABLE)]


def _large_varint(zigzag: int) -> bytes:
    if zigzag < _TABLE:
        return _VARINTS[zigzag]
    return _CONTINUED[zigzag & (_TABLE - 1)] + _large_varint(zigzag >> _BITS)


def _long(value: Any, bound: int = _INT64) -> bytes:
    """The zig-zag varint of an integer in [-bound, bound); anything else is _Unsupported
    (fastavro decides: it converts numpy integers, refuses floats and overflows)."""
    if type(value) is not int:
        raise _Unsupported
    zigzag = value << 1 if value >= 0 else ((~value) << 1) | 1
    if zigzag < _TABLE:
        return _VARINTS[zigzag]
    if not -bound <= value < bound:
        raise _Unsupported
    return _large_varint(zigzag)


def _int(value: Any) -> bytes:
    return _long(value, _INT32)


def _write_long(value: Any, append: Callable[[bytes], None]) -> None:
    append(_long(value))


def _write_int(value: Any, append: Callable[[bytes], None]) -> None:
    append(_long(value, _INT32))


def _write_string(value: Any, append: Callable[[bytes], None]) -> None:
    if type(value) is not str:
        raise _Unsupported
    data = value.encode()  # a lone surrogate raises: the registry names the field
    append(_VARINTS[len(data) << 1] if len(data) < _TABLE >> 1 else _long(len(data)))
    append(data)


def _write_bytes(value: Any, append: Callable[[bytes], None]) -> None:
    if type(value) is not bytes:
        raise _Unsupported
    append(_VARINTS[len(value) << 1] if len(value) < _TABLE >> 1 else _long(len(value)))
    append(value)


_DOUBLE = struct.Struct("<d").pack
_FLOAT = struct.Struct("<f").pack


def _write_double(value: Any, append: Callable[[bytes], None]) -> None:
    if type(value) is not float and type(value) is not int:
        raise _Unsupported
    append(_DOUBLE(value))


def _write_float(value: Any, append: Callable[[bytes], None]) -> None:
    if type(value) is not float and type(value) is not int:
        raise _Unsupported
    append(_FLOAT(value))  # out of float32 range raises: fastavro decides


def _write_boolean(value: Any, append: Callable[[bytes], None]) -> None:
    if type(value) is not bool:
        raise _Unsupported
    append(b"\x01" if value else b"\x00")


def _packed(dtype: np.dtype) -> _Write:
    """A packed-array ``bytes`` field: a 1-D array of exactly ``dtype``, written as its bytes."""
    def write(value: Any, append: Callable[[bytes], None]) -> None:
        if type(value) is not np.ndarray or value.ndim != 1 or (
                value.dtype is not dtype and value.dtype != dtype):
            raise _Unsupported  # to_avro converts, or names the field at fault
        data = value.tobytes()
        append(_VARINTS[len(data) << 1] if len(data) < _TABLE >> 1 else _long(len(data)))
        append(data)
    return write


def _enum(schema: dict, hint: Any) -> _Write:
    if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        raise _Unsupported
    symbols = schema["symbols"]
    indices = {member: _long(symbols.index(member.value)) for member in hint
               if member.value in symbols}

    def write(value: Any, append: Callable[[bytes], None]) -> None:
        try:
            append(indices[value])
        except (KeyError, TypeError):
            raise _Unsupported from None
    return write


def _nullable(inner: _Write) -> _Write:
    def write(value: Any, append: Callable[[bytes], None]) -> None:
        if value is None:
            append(b"\x00")
        else:
            append(b"\x02")
            inner(value, append)
    return write


def _map(values: _Write) -> _Write:
    def write(value: Any, append: Callable[[bytes], None]) -> None:
        if type(value) is not dict:
            raise _Unsupported
        if value:
            append(_long(len(value)))
            for key, item in value.items():
                _write_string(key, append)
                values(item, append)
        append(b"\x00")
    return write


_PRIMITIVES: dict[str, _Write] = {
    "string": _write_string, "long": _write_long, "int": _write_int, "bytes": _write_bytes,
    "double": _write_double, "float": _write_float, "boolean": _write_boolean,
}


def _writer(schema: Any, hint: Any, field: dict) -> _Write:
    """The writer of one field value with Avro type ``schema`` and Python type hint ``hint``;
    raises _Unsupported for a construct this module does not compile."""
    if isinstance(schema, list):
        if len(schema) == 2 and schema[0] == "null":
            args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            return _nullable(_writer(schema[1], args[0] if len(args) == 1 else hint, field))
        raise _Unsupported
    if isinstance(schema, str):
        if schema == "bytes" and hint is np.ndarray:
            dtype = field.get("reef.dtype")
            if dtype is None:
                raise _Unsupported
            return _packed(np.dtype(dtype))
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        raise _Unsupported
    kind = schema.get("type")
    if kind == "long" and schema.get("logicalType") == "timestamp-millis":
        return _write_long  # an EpochMillis; a datetime is the registry's
    if kind == "enum":
        return _enum(schema, hint)
    if kind == "record":
        return _record(schema, hint)
    if kind == "map":
        if schema["values"] not in ("string", "double"):
            raise _Unsupported
        return _map(_PRIMITIVES[schema["values"]])
    if isinstance(kind, str) and kind in _PRIMITIVES and "logicalType" not in schema:
        return _PRIMITIVES[kind]
    raise _Unsupported


def _record(schema: dict, cls: Any) -> _Write:
    """A record of the dataclass ``cls``: its attributes named as the schema's fields, in the
    schema's order."""
    if not dataclasses.is_dataclass(cls):
        raise _Unsupported
    hints = typing.get_type_hints(cls)
    names = [f["name"] for f in schema["fields"]]
    if any(name not in hints for name in names):
        raise _Unsupported  # the registry fills in what the class lacks
    writers = tuple(_writer(f["type"], hints[f["name"]], f) for f in schema["fields"])
    read = operator.attrgetter(*names) if len(names) > 1 else (lambda e: (getattr(e, names[0]),))

    def write(value: Any, append: Callable[[bytes], None]) -> None:
        if type(value) is not cls:
            raise _Unsupported
        for field_writer, item in zip(writers, read(value)):
            field_writer(item, append)
    return write


class EventEncoder:
    """``encode(event)`` equals ``registry.encode(event)``; see the module docstring."""

    def __init__(self, registry: SchemaRegistry, types: tuple[type, ...]) -> None:
        self._registry = registry
        #: type -> (writer, headers); a type without a compiled writer is absent.
        self._compiled: dict[type, tuple[_Write, KnownSchema]] = {}
        for cls in types:
            known = registry.current(cls.SCHEMA)
            try:
                self._compiled[cls] = (_record(known.parsed, cls), known)
            except _Unsupported:
                pass

    def compiled(self, cls: type) -> bool:
        """Whether ``cls`` events are written by a compiled writer (else by the registry)."""
        return cls in self._compiled

    def encode(self, event: Any) -> tuple[bytes, Headers]:
        """The Avro bytes of ``event`` and the headers naming its schema (``SchemaRegistry.encode``).

        Raises ``InvalidRecord`` if the event does not fit its schema (the registry's error).
        """
        compiled = self._compiled.get(type(event))
        if compiled is not None:
            write, known = compiled
            parts: list[bytes] = []
            try:
                write(event, parts.append)
            except Exception:  # noqa: BLE001 - _Unsupported, or a value that does not fit:
                pass           # the registry writes it, or says what is wrong
            else:
                return b"".join(parts), list(known.headers)
        return self._registry.encode(event)
