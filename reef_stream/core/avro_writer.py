"""Compiled Avro writers: the bytes fastavro's ``schemaless_writer`` writes, in less time.

The reference encoding of an event is ``to_avro`` (a fastavro dict) handed to
fastavro's ``schemaless_writer``, which walks the schema for every record
(the figures: ``docs/design-notes.md``, "Avro encoding"). ``compile_writer``
compiles, once per event type, a writer from the type's current schema and its dataclass: the source
of one Python function (``CompiledWriter.source`` shows it) that reads the
event's attributes and emits the Avro binary encoding inline (zig-zag
varints, length-prefixed strings and bytes, little-endian doubles, one block
per non-empty map or array, ``[null, X]`` unions, nested records), without
building a dict or calling a function per field.

The contract, kept by ``SchemaRegistry.encode`` (the only caller): a compiled
writer either writes exactly the reference's bytes or raises, and then the
reference path writes the event (or raises ``InvalidRecord`` saying what is
wrong). It accepts only values whose encoding it is sure of (a ``str``, an
``int`` in range, an array of the field's own dtype, a member of the field's
enum, a tuple of the nested record's own class, ...); an event type or schema
construct it does not compile (other unions, named-type references, logical
types other than timestamp-millis) is not compiled at all.
``tests/unit/test_avro_writer.py`` checks the equality on every field kind,
edge values and random events of every type.

Nothing here parses a schema per record. Thread-safe: compiled writers hold
no state.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from reef_stream.core.codegen import Source

__all__ = ["CompiledWriter", "compile_writer"]

#: A compiled writer: appends the encoded parts of one event through its second argument.
_Write = Callable[[Any, Callable[[bytes], None]], None]

#: Zig-zag varints of 0 .. _TABLE - 1 (values -8192 .. 8191, lengths up to 8 KiB), prebuilt;
#: a larger number is written 14 bits at a time from the same table (a timestamp: 3 lookups).
_BITS = 14
_TABLE = 1 << _BITS
_INT64 = 1 << 63
_INT32 = 1 << 31


class _Unsupported(Exception):
    """A schema construct or value this writer does not encode; the reference path does."""


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


def _checked_varint(value: int, zigzag: int, bound: int) -> bytes:
    """The varint of ``value`` (zig-zag: ``zigzag``) if it is in [-bound, bound); beyond,
    fastavro decides."""
    if not -bound <= value < bound:
        raise _Unsupported
    return _large_varint(zigzag)


#: The names generated code refers to.
_GLOBALS = {
    "Unsupported": _Unsupported, "V": _VARINTS, "T": _TABLE, "L": _checked_varint,
    "I64": _INT64, "I32": _INT32, "D": struct.Struct("<d").pack, "F": struct.Struct("<f").pack,
    "ndarray": np.ndarray,
}


class _Source(Source):
    """The lines of a writer being generated, and the constants they refer to."""

    def refuse_unless(self, depth: int, condition: str) -> None:
        self.emit(depth, f"if not ({condition}):")
        self.emit(depth + 1, "raise Unsupported")


def _emit_varint(src: _Source, depth: int, value: str, bound: str) -> None:
    """``value`` names an ``int``."""
    zigzag = src.local()
    src.emit(depth, f"{zigzag} = {value} << 1 if {value} >= 0 else ((~{value}) << 1) | 1")
    src.emit(depth, f"a(V[{zigzag}] if {zigzag} < T else L({value}, {zigzag}, {bound}))")


def _emit_sized(src: _Source, depth: int, data: str) -> None:
    """Length-prefixed bytes (``data`` names a bytes object)."""
    size = src.local()
    src.emit(depth, f"{size} = len({data}) << 1")  # a zig-zag length: never negative
    src.emit(depth, f"a(V[{size}] if {size} < T else L({size} >> 1, {size}, I64))")
    src.emit(depth, f"a({data})")


def _emit(src: _Source, depth: int, value: str, schema: Any, hint: Any, field: dict) -> None:
    """Code writing ``value`` (a local name) of Avro type ``schema`` and Python type ``hint``;
    raises _Unsupported for a construct this module does not compile."""
    if isinstance(schema, list):
        if len(schema) != 2 or schema[0] != "null":
            raise _Unsupported
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        src.emit(depth, f"if {value} is None:")
        src.emit(depth + 1, r'a(b"\x00")')
        src.emit(depth, "else:")
        src.emit(depth + 1, r'a(b"\x02")')
        _emit(src, depth + 1, value, schema[1], args[0] if len(args) == 1 else hint, field)
        return
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "long" and schema.get("logicalType") == "timestamp-millis":
            schema = "long"  # an EpochMillis; a datetime is the registry's
        elif kind == "enum":
            if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
                raise _Unsupported
            symbols = schema["symbols"]
            indices = {member: _large_varint(symbols.index(member.value) << 1)
                       for member in hint if member.value in symbols}
            src.emit(depth, f"a({src.constant(indices)}[{value}])")  # KeyError: not a member
            return
        elif kind == "record":
            _emit_record(src, depth, value, schema, hint)
            return
        elif kind == "map" and schema["values"] in ("string", "double"):
            size, key, item = src.local(), src.local(), src.local()
            src.refuse_unless(depth, f"type({value}) is dict")
            src.emit(depth, f"if {value}:")
            src.emit(depth + 1, f"{size} = len({value})")
            _emit_varint(src, depth + 1, size, "I64")
            src.emit(depth + 1, f"for {key}, {item} in {value}.items():")
            _emit(src, depth + 2, key, "string", str, {})
            _emit(src, depth + 2, item, schema["values"], Any, {})
            src.emit(depth, r'a(b"\x00")')
            return
        elif kind == "array" and typing.get_origin(hint) is tuple:
            args = typing.get_args(hint)
            if len(args) != 2 or args[1] is not Ellipsis:
                raise _Unsupported
            size, item = src.local(), src.local()
            src.refuse_unless(depth, f"type({value}) is tuple")  # a list: to_avro decides
            src.emit(depth, f"if {value}:")
            src.emit(depth + 1, f"{size} = len({value})")
            _emit_varint(src, depth + 1, size, "I64")
            src.emit(depth + 1, f"for {item} in {value}:")
            _emit(src, depth + 2, item, schema["items"], args[0], {})
            src.emit(depth, r'a(b"\x00")')
            return
        elif isinstance(kind, str) and "logicalType" not in schema:
            schema = kind
        else:
            raise _Unsupported
    if schema == "bytes" and hint is np.ndarray:
        if "reef.dtype" not in field:
            raise _Unsupported
        dtype = src.constant(np.dtype(field["reef.dtype"]))
        # another dtype or shape: to_avro converts it, or names the field at fault
        src.refuse_unless(depth, f"type({value}) is ndarray and {value}.ndim == 1 and "
                                 f"({value}.dtype is {dtype} or {value}.dtype == {dtype})")
        data = src.local()
        src.emit(depth, f"{data} = {value}.tobytes()")
        _emit_sized(src, depth, data)
    elif schema == "string":
        data = src.local()
        src.refuse_unless(depth, f"type({value}) is str")
        src.emit(depth, f"{data} = {value}.encode()")  # a lone surrogate raises
        _emit_sized(src, depth, data)
    elif schema == "bytes":
        src.refuse_unless(depth, f"type({value}) is bytes")
        _emit_sized(src, depth, value)
    elif schema == "boolean":
        src.refuse_unless(depth, f"type({value}) is bool")
        src.emit(depth, rf'a(b"\x01" if {value} else b"\x00")')
    elif schema in ("long", "int"):
        src.refuse_unless(depth, f"type({value}) is int")
        _emit_varint(src, depth, value, "I64" if schema == "long" else "I32")
    elif schema in ("double", "float"):
        src.refuse_unless(depth, f"type({value}) is float or type({value}) is int")
        # past float32's range struct raises: fastavro decides
        src.emit(depth, f"a({'D' if schema == 'double' else 'F'}({value}))")
    else:
        raise _Unsupported


def _emit_record(src: _Source, depth: int, value: str, schema: dict, cls: Any) -> None:
    """A record of the dataclass ``cls``: its attributes named as the schema's fields, in the
    schema's order."""
    if not dataclasses.is_dataclass(cls):
        raise _Unsupported
    hints = typing.get_type_hints(cls)
    if any(f["name"] not in hints for f in schema["fields"]):
        raise _Unsupported  # the registry fills in what the class lacks
    src.refuse_unless(depth, f"type({value}) is {src.constant(cls)}")
    for f in schema["fields"]:
        item = src.local()
        src.emit(depth, f"{item} = {value}.{f['name']}")
        _emit(src, depth, item, f["type"], hints[f["name"]], f)


@dataclasses.dataclass(frozen=True)
class CompiledWriter:
    """The writer compiled for one event type.

    ``write(event, append)`` appends the encoded parts of ``event`` through
    ``append`` (``b"".join`` them), or raises on any value it is not sure of:
    the caller then encodes the event the reference way. ``source`` is its
    Python source.
    """

    cls: type
    write: _Write = dataclasses.field(repr=False)
    source: str = dataclasses.field(repr=False)


def compile_writer(schema: dict, cls: type) -> CompiledWriter | None:
    """The writer of ``cls`` events for the parsed ``schema`` (their current schema), or None
    when the schema or the class holds something this module does not compile."""
    src = _Source()
    try:
        _emit_record(src, 1, "event", schema, cls)
    except _Unsupported:
        return None
    name = f"write_{cls.__name__}"
    source = "\n".join([f"def {name}(event, a):", *src.lines]) + "\n"
    namespace = {**_GLOBALS, **src.constants}
    exec(compile(source, f"<reef_stream.core.avro_writer: {cls.__name__}>", "exec"), namespace)
    return CompiledWriter(cls, namespace[name], source)
