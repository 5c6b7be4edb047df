"""Compiled Avro readers: the events fastavro and ``from_avro`` give, in a fraction of the time.

The reference decoding of an event is fastavro's ``schemaless_reader`` (a
dict, timestamps as ``datetime``) handed to ``from_avro`` (the dataclass,
arrays unpacked, timestamps back to integer milliseconds; the figures:
``docs/design-notes.md``, "Avro encoding"). ``compile_reader`` compiles, once per
event type, a reader of records written with the type's *current* schema:
the source of one Python function (``CompiledReader.source`` shows it) that
walks the bytes inline (zig-zag varints, length-prefixed strings and bytes,
little-endian doubles, map and array blocks, ``[null, X]`` unions, enums,
nested records) and builds the dataclass directly, without a dict, a
``datetime`` or a call per field.

The contract, kept by ``SchemaRegistry.decode`` (the only caller): a compiled
reader either returns exactly the event the reference path returns for the
same bytes, or raises, and then the reference path decodes the record (or
raises the error that says what is wrong with it). It returns only on what it
is sure of: every byte used, lengths inside the value, varints of at most 63
bits, union and enum indices in range, timestamps a ``datetime`` can hold,
packed arrays of whole items, map and array blocks of positive counts.
Records written with another version of the schema (resolution, defaults)
are the reference path's; so are schemas and classes holding anything this
module does not compile (other unions, logical types other than
timestamp-millis on an ``EpochMillis`` field, named-type references, floats).
``tests/unit/test_avro_reader.py`` compares the two paths on random events of
every type, edge values, every schema version in ``schemas/history`` and
corrupted bytes.

Nothing here parses a schema per record. Thread-safe: compiled readers hold
no state.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import types
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from reef_stream.core.codegen import Source
from reef_stream.core.events import EpochMillis

__all__ = ["CompiledReader", "compile_reader"]

#: The timestamp-millis values fastavro reads as a datetime (years 1 to 9999); beyond, it raises.
_MIN_MILLIS = -62_135_596_800_000
_MAX_MILLIS = 253_402_300_799_999


class _Unsupported(Exception):
    """A schema construct this module does not compile; the reference path reads it."""


class _Unsure(Exception):
    """Bytes the compiled reader does not read; the reference path does, or says what is wrong."""


def _long(v: bytes, p: int, b: int) -> tuple[int, int]:
    """The zig-zag number of a varint whose first byte ``b`` (high bit set) was at ``p - 1``,
    and the position after it. At most 9 bytes (63 bits): a longer one is the reference's."""
    z = b & 0x7F
    shift = 7
    while True:
        b = v[p]
        p += 1
        z |= (b & 0x7F) << shift
        if b < 0x80:
            return z, p
        shift += 7
        if shift > 56:
            raise _Unsure


#: The names generated code refers to.
_GLOBALS = {
    "Unsure": _Unsure, "LONG": _long, "D": struct.Struct("<d").unpack_from,
    "frombuffer": np.frombuffer, "MIN_MS": _MIN_MILLIS, "MAX_MS": _MAX_MILLIS,
}


def _emit_zigzag(src: Source, depth: int, z: str) -> None:
    """``z`` = the zig-zag number of the varint at ``p``; ``p`` moves past it."""
    src.emit(depth, f"{z} = v[p]")
    src.emit(depth, "p += 1")
    src.emit(depth, f"if {z} > 127:")
    src.emit(depth + 1, f"{z}, p = LONG(v, p, {z})")


def _emit_long(src: Source, depth: int, out: str) -> None:
    z = src.local()
    _emit_zigzag(src, depth, z)
    src.emit(depth, f"{out} = ({z} >> 1) ^ -({z} & 1)")


def _emit_sized(src: Source, depth: int, out: str) -> str:
    """Set ``out`` to the end of the length-prefixed bytes at ``p`` (checked against the value's
    length); ``p`` is then their start. Returns the name of the end."""
    z = src.local()
    _emit_zigzag(src, depth, z)
    src.emit(depth, f"if {z} & 1:")  # a negative length
    src.emit(depth + 1, "raise Unsure")
    src.emit(depth, f"{out} = p + ({z} >> 1)")
    src.emit(depth, f"if {out} > n:")
    src.emit(depth + 1, "raise Unsure")
    return out


def _emit_blocks(src: Source, depth: int) -> int:
    """Open the loops over the blocks of an array or a map and over the items of each; returns
    the depth of the item's code."""
    z = src.local()
    src.emit(depth, "while True:")
    _emit_zigzag(src, depth + 1, z)
    src.emit(depth + 1, f"if not {z}:")
    src.emit(depth + 2, "break")
    src.emit(depth + 1, f"if {z} & 1:")  # a negative count, followed by a block size
    src.emit(depth + 2, "raise Unsure")
    src.emit(depth + 1, f"for _ in range({z} >> 1):")
    return depth + 2


def _unwrap_optional(hint: Any) -> Any:
    """``X`` of ``X | None``; None when ``hint`` is not optional."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _emit(src: Source, depth: int, out: str, schema: Any, hint: Any, field: Any) -> None:
    """Code setting ``out`` to the value ``from_avro`` makes of a field of Avro type ``schema``
    and Python type ``hint`` (``field``: the dataclass field, for a packed array's dtype);
    raises _Unsupported for a construct this module does not compile."""
    if isinstance(schema, list):
        inner = _unwrap_optional(hint)
        if len(schema) != 2 or schema[0] != "null" or inner is None:
            raise _Unsupported
        b = src.local()
        src.emit(depth, f"{b} = v[p]")
        src.emit(depth, "p += 1")
        src.emit(depth, f"if {b} == 0:")
        src.emit(depth + 1, f"{out} = None")
        src.emit(depth, f"elif {b} == 2:")
        _emit(src, depth + 1, out, schema[1], inner, field)
        src.emit(depth, "else:")
        src.emit(depth + 1, "raise Unsure")
        return
    if isinstance(schema, dict):
        kind = schema.get("type")
        logical = schema.get("logicalType")
        if kind == "long" and logical == "timestamp-millis":
            if hint is not EpochMillis:
                raise _Unsupported  # from_avro leaves the datetime: the reference's
            _emit_long(src, depth, out)
            src.emit(depth, f"if not MIN_MS <= {out} <= MAX_MS:")
            src.emit(depth + 1, "raise Unsure")  # fastavro's datetime overflows
            return
        if logical is not None:
            raise _Unsupported
        if kind == "enum":
            if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
                raise _Unsupported
            members = {member.value: member for member in hint}
            if any(symbol not in members for symbol in schema["symbols"]):
                raise _Unsupported  # from_avro raises on it: the reference's
            symbols = src.constant(tuple(members[symbol] for symbol in schema["symbols"]))
            index = src.local()
            _emit_zigzag(src, depth, index)
            src.emit(depth, f"if {index} & 1 or {index} >> 1 >= {len(schema['symbols'])}:")
            src.emit(depth + 1, "raise Unsure")
            src.emit(depth, f"{out} = {symbols}[{index} >> 1]")
            return
        if kind == "record":
            _emit_record(src, depth, out, schema, hint)
            return
        if kind == "map":
            if typing.get_origin(hint) is not dict or schema["values"] not in ("string", "double"):
                raise _Unsupported
            value_hint = typing.get_args(hint)[1]
            key, item = src.local(), src.local()
            src.emit(depth, f"{out} = {{}}")
            inner = _emit_blocks(src, depth)
            _emit(src, inner, key, "string", str, None)
            _emit(src, inner, item, schema["values"], value_hint, None)
            src.emit(inner, f"{out}[{key}] = {item}")
            return
        if kind == "array":
            args = typing.get_args(hint)
            if typing.get_origin(hint) is not tuple or len(args) != 2 or args[1] is not Ellipsis:
                raise _Unsupported
            item = src.local()
            items = src.local()
            src.emit(depth, f"{items} = []")
            inner = _emit_blocks(src, depth)
            _emit(src, inner, item, schema["items"], args[0], None)
            src.emit(inner, f"{items}.append({item})")
            src.emit(depth, f"{out} = tuple({items})")
            return
        if kind in ("string", "bytes", "long", "int", "double", "boolean"):
            schema = kind
        else:
            raise _Unsupported
    if schema == "bytes" and hint is np.ndarray:
        dtype = None if field is None else field.metadata.get("dtype")
        if dtype is None:
            raise _Unsupported
        dtype = np.dtype(dtype)
        end = _emit_sized(src, depth, src.local())
        src.emit(depth, f"if ({end} - p) % {dtype.itemsize}:")
        src.emit(depth + 1, "raise Unsure")  # from_avro's CorruptRecordError
        src.emit(depth, f"{out} = frombuffer(v[p:{end}], dtype={src.constant(dtype)})")
        src.emit(depth, f"p = {end}")
    elif schema == "string" and hint is str:
        end = _emit_sized(src, depth, src.local())
        src.emit(depth, f"{out} = v[p:{end}].decode()")  # invalid UTF-8 raises
        src.emit(depth, f"p = {end}")
    elif schema == "bytes" and hint is bytes:
        end = _emit_sized(src, depth, src.local())
        src.emit(depth, f"{out} = v[p:{end}]")
        src.emit(depth, f"p = {end}")
    elif schema in ("long", "int") and hint in (int, EpochMillis):
        _emit_long(src, depth, out)
    elif schema == "double" and hint is float:
        src.emit(depth, f"{out}, = D(v, p)")  # short: struct.error
        src.emit(depth, "p += 8")
    elif schema == "boolean" and hint is bool:
        src.emit(depth, f"{out} = v[p] != 0")  # fastavro's: any byte but 0 is True
        src.emit(depth, "p += 1")
    else:
        raise _Unsupported


def _emit_record(src: Source, depth: int, out: str, schema: dict, cls: Any) -> None:
    """A record of the dataclass ``cls``, whose fields are exactly the schema's."""
    if not dataclasses.is_dataclass(cls):
        raise _Unsupported
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if sorted(fields) != sorted(f["name"] for f in schema["fields"]):
        raise _Unsupported  # from_avro fails or fills in: the reference's
    hints = typing.get_type_hints(cls)
    values = []
    for f in schema["fields"]:
        value = src.local()
        _emit(src, depth, value, f["type"], hints[f["name"]], fields[f["name"]])
        values.append(f"{f['name']}={value}")
    src.emit(depth, f"{out} = {src.constant(cls)}({', '.join(values)})")


@dataclasses.dataclass(frozen=True)
class CompiledReader:
    """The reader compiled for one event type and its current schema.

    ``read(value)`` is the ``cls`` event of ``value`` (``bytes``, written with
    that schema), or raises on anything it is not sure of: the caller then
    decodes the value the reference way. ``source`` is its Python source.
    """

    cls: type
    read: Callable[[bytes], Any] = dataclasses.field(repr=False)
    source: str = dataclasses.field(repr=False)


def compile_reader(schema: dict, cls: type) -> CompiledReader | None:
    """The reader of ``cls`` events written with the parsed ``schema`` (their current schema),
    or None when the schema or the class holds something this module does not compile."""
    src = Source()
    try:
        _emit_record(src, 1, "event", schema, cls)
    except _Unsupported:
        return None
    name = f"read_{cls.__name__}"
    source = "\n".join([
        f"def {name}(v):",
        "    n = len(v)",
        "    p = 0",
        *src.lines,
        "    if p != n:",
        "        raise Unsure",  # bytes left over: the reference's CorruptRecordError
        "    return event",
    ]) + "\n"
    namespace = {**_GLOBALS, **src.constants}
    exec(compile(source, f"<reef_stream.core.avro_reader: {cls.__name__}>", "exec"), namespace)
    return CompiledReader(cls, namespace[name], source)
