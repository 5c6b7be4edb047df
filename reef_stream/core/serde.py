"""Encode and decode events as schemaless Avro, with the writer schema's fingerprint in headers.

A message's value is the event in its type's *current* schema (``schemas/<event>.avsc``);
its headers name the writer schema: ``reef-schema-fp`` (8 bytes, big-endian CRC-64-AVRO
fingerprint of its Parsing Canonical Form) and ``reef-schema`` (its full name). ``decode``
finds the fingerprint among every known version (``schemas/history/`` too) and resolves
writer to reader, so older and newer versions read as the current one::

    value, headers = encode(generation)
    event = decode(msg.value(), msg.headers(), Generation,
                   topic=msg.topic(), partition=msg.partition(), offset=msg.offset())

Errors (each with topic, partition and offset when given): ``UnknownSchemaError`` (no or
unknown fingerprint, or unresolvable: dead-letter it, or deploy the schema version);
``CorruptRecordError`` (the bytes do not decode: dead-letter it); ``InvalidRecord`` from
``encode`` (the event does not fit its schema: fix the producer). Schemas are parsed once,
per ``SchemaRegistry``. The per-type compiled writer and reader (``core.avro_writer``,
``core.avro_reader``) fall back to fastavro, the reference, whenever unsure;
``SchemaRegistry(compiled=False)`` always takes the reference. The long form, with the
speed of each path: ``docs/design-notes.md`` ("Avro encoding").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from io import BytesIO
from pathlib import Path
from typing import Any, TypeVar, overload

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.schema import fingerprint, to_parsing_canonical_form

from reef_stream.core.avro_reader import CompiledReader, compile_reader
from reef_stream.core.avro_writer import CompiledWriter, compile_writer
from reef_stream.core.errors import (
    ConfigurationError, CorruptRecordError, InvalidRecord, UnknownSchemaError,
)
from reef_stream.core.events import EVENT_TYPES, Event, from_avro, to_avro
from reef_stream.core.settings import SCHEMAS_DIR

FINGERPRINT_HEADER = "reef-schema-fp"
SCHEMA_NAME_HEADER = "reef-schema"

#: Headers as ``encode`` returns them and confluent-kafka's ``produce`` takes them.
Headers = list[tuple[str, bytes]]
#: Headers as a consumed message has them (``Message.headers()``), or as a dict.
HeadersIn = Sequence[tuple[str, bytes | None]] | Mapping[str, bytes | None] | None

EventT = TypeVar("EventT")


def schema_fingerprint(schema: Mapping[str, Any]) -> bytes:
    """The CRC-64-AVRO (Rabin) fingerprint of a schema's Parsing Canonical Form, 8 bytes big-endian.

    fastavro's hex string holds the little-endian bytes (the order of Avro's
    single-object encoding); reef-stream's header is big-endian, so its hex
    reads as the 64-bit number itself.
    """
    little_endian = bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))
    return little_endian[::-1]


@dataclass(frozen=True, eq=False)
class KnownSchema:
    """One version of one schema, parsed once.

    ``current`` is True for the version in ``schemas/<event>.avsc``, which is
    what ``encode`` writes and ``decode`` reads as.
    """

    name: str
    fingerprint: bytes
    parsed: dict[str, Any] = field(repr=False)
    path: Path
    current: bool
    headers: tuple[tuple[str, bytes], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        headers = ((FINGERPRINT_HEADER, self.fingerprint), (SCHEMA_NAME_HEADER, self.name.encode()))
        object.__setattr__(self, "headers", headers)

    def describe(self) -> str:
        """``name (fingerprint hex, file)``, for error messages."""
        return f"{self.name} ({self.fingerprint.hex()}, {self.path})"


class SchemaRegistry:
    """Every schema version this process can read, indexed by fingerprint.

    Loads the current schemas from ``schemas_dir`` (its ``*.avsc`` files), the
    old versions under ``schemas_dir/history`` (recursively), and any
    ``dirs`` given (recursively, also as old versions, e.g. a test's older
    schema). Raises one ``ConfigurationError`` listing every file that does
    not load. A registry does not change once built.

    ``compiled``: encode and decode with the writers and readers compiled for
    the event types (see the module docstring); False: always the reference
    paths (fastavro).
    """

    def __init__(self, dirs: Iterable[str | Path] = (), *, schemas_dir: Path = SCHEMAS_DIR,
                 compiled: bool = True):
        self._by_fingerprint: dict[bytes, KnownSchema] = {}
        self._current: dict[str, KnownSchema] = {}
        #: event type -> (its compiled writer, its current schema); types without one are absent.
        self._writers: dict[type, tuple[CompiledWriter, KnownSchema]] = {}
        #: event type -> (its compiled reader, the schema it reads); types without one are absent.
        self._readers: dict[type, tuple[CompiledReader, KnownSchema]] = {}
        problems: list[str] = []
        current_files = sorted(Path(schemas_dir).glob("*.avsc"))
        if not current_files:
            problems.append(f"no schemas found: {schemas_dir} has no *.avsc files")
        for path in current_files:
            self._load(path, current=True, problems=problems)
        old_files = sorted((Path(schemas_dir) / "history").rglob("*.avsc"))
        for directory in map(Path, dirs):
            if not directory.is_dir():
                problems.append(f"{directory} is not a directory of schemas")
            old_files += sorted(directory.rglob("*.avsc"))
        for path in old_files:
            self._load(path, current=False, problems=problems)
        if problems:
            raise ConfigurationError(problems)
        if compiled:
            for name, cls in EVENT_TYPES.items():
                known = self._current.get(name)
                writer = None if known is None else compile_writer(known.parsed, cls)
                if writer is not None:
                    self._writers[cls] = (writer, known)
                reader = None if known is None else compile_reader(known.parsed, cls)
                if reader is not None:
                    self._readers[cls] = (reader, known)

    @classmethod
    def default(cls) -> SchemaRegistry:
        """The registry of the project's ``schemas/``, loaded once per process."""
        return _default_registry()

    def _load(self, path: Path, *, current: bool, problems: list[str]) -> None:
        try:
            raw = json.loads(path.read_text())
            parsed = parse_schema(raw)
            known = KnownSchema(
                name=parsed["name"],
                fingerprint=schema_fingerprint(raw),
                parsed=parsed,
                path=path,
                current=current,
            )
        except Exception as error:  # noqa: BLE001 - every problem is reported, not just the first
            problems.append(f"{path}: not a valid Avro schema: {type(error).__name__}: {error}")
            return
        if current:
            if known.name in self._current:
                problems.append(
                    f"{path} and {self._current[known.name].path} both define {known.name}; "
                    "keep one current file per schema and move old versions to schemas/history/"
                )
                return
            self._current[known.name] = known
        # A version whose canonical form did not change (only docs or defaults
        # did) has the same fingerprint; the first one loaded (current) wins.
        self._by_fingerprint.setdefault(known.fingerprint, known)

    def current(self, name: str) -> KnownSchema:
        """The current version of the schema named ``name`` (e.g. ``reef.events.Generation``)."""
        try:
            return self._current[name]
        except KeyError:
            raise ConfigurationError(
                f"no current schema named {name!r}; known: {sorted(self._current)}. "
                "Add its .avsc file to schemas/"
            ) from None

    def by_fingerprint(self, fingerprint: bytes) -> KnownSchema:
        """The schema version with this 8-byte fingerprint; UnknownSchemaError if none."""
        try:
            return self._by_fingerprint[fingerprint]
        except KeyError:
            raise UnknownSchemaError(
                f"no known schema has fingerprint {fingerprint.hex()}: deploy its .avsc "
                "to schemas/history/"
            ) from None

    def schemas(self) -> list[KnownSchema]:
        """Every known schema version, current ones first."""
        return sorted(self._by_fingerprint.values(), key=lambda known: not known.current)

    def writer_source(self, cls: type) -> str | None:
        """The Python source of the writer compiled for ``cls`` events (None: fastavro writes
        them)."""
        compiled = self._writers.get(cls)
        return None if compiled is None else compiled[0].source

    def reader_source(self, cls: type) -> str | None:
        """The Python source of the reader compiled for ``cls`` events written with their current
        schema (None: fastavro reads them)."""
        compiled = self._readers.get(cls)
        return None if compiled is None else compiled[0].source

    # --- encoding -------------------------------------------------------------------

    def encode(self, event: Event) -> tuple[bytes, Headers]:
        """The Avro bytes of ``event`` (with its type's current schema) and the headers naming it.

        Raises ``InvalidRecord`` if a value does not fit its schema field: fix the producer.
        """
        compiled = self._writers.get(type(event))
        if compiled is not None:
            writer, known = compiled
            parts: list[bytes] = []
            try:
                writer.write(event, parts.append)
            except Exception:  # noqa: BLE001 - a value it is not sure of, or one that does not
                pass           # fit: the reference path writes it, or says what is wrong
            else:
                return b"".join(parts), list(known.headers)
        schema_name = getattr(type(event), "SCHEMA", None)
        if schema_name is None:
            raise TypeError(f"{type(event).__name__} is not an event of reef_stream.core.events")
        known = self.current(schema_name)
        return self._write(known, to_avro(event), strict=False), list(known.headers)

    def encode_record(
        self, schema: str | KnownSchema, record: Mapping[str, Any]
    ) -> tuple[bytes, Headers]:
        """Like ``encode``, for a plain fastavro dict and a schema name (its current
        version) or a given version.

        Unlike ``encode``, rejects fields the schema does not have (typos).
        """
        known = self.current(schema) if isinstance(schema, str) else schema
        return self._write(known, record, strict=True), list(known.headers)

    def _write(self, known: KnownSchema, record: Mapping[str, Any], *, strict: bool) -> bytes:
        buffer = BytesIO()
        try:
            schemaless_writer(
                buffer, known.parsed, record, strict=strict, strict_allow_default=strict
            )
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:
            raise InvalidRecord(f"does not fit {known.name}: {error}") from error
        return buffer.getvalue()

    # --- decoding -------------------------------------------------------------------

    @overload
    def decode(
        self, value: bytes | None, headers: HeadersIn, reader: type[EventT], *,
        topic: str | None = None, partition: int | None = None, offset: int | None = None,
    ) -> EventT: ...

    @overload
    def decode(
        self, value: bytes | None, headers: HeadersIn, reader: None = None, *,
        topic: str | None = None, partition: int | None = None, offset: int | None = None,
    ) -> Event: ...

    def decode(self, value, headers, reader=None, *, topic=None, partition=None, offset=None):
        """The event in a message, read as the current schema of ``reader``.

        With ``reader=None`` the type is the one the writer schema names (read
        as its current version). ``topic``, ``partition`` and ``offset`` say
        where the message came from; every error carries them. Raises
        ``UnknownSchemaError`` or ``CorruptRecordError`` (see the module
        docstring); nothing else escapes for bad input.
        """
        where = {"topic": topic, "partition": partition, "offset": offset}
        writer = self._writer_of(headers, where)
        if reader is None:
            reader = self._event_type(writer, where)
        compiled = self._readers.get(reader)
        if compiled is not None and compiled[1] is writer and type(value) is bytes:
            try:
                return compiled[0].read(value)
            except Exception:  # noqa: BLE001 - bytes it is not sure of: the reference path
                pass           # reads them, or raises the error that says what is wrong
        record = self._read(value, writer, self.current(reader.SCHEMA), where)
        try:
            return from_avro(reader, record)
        except InvalidRecord as error:
            raise type(error)(error.reason, field=error.field, **where) from error

    def decode_record(
        self,
        value: bytes | None,
        headers: HeadersIn,
        reader: str | KnownSchema | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> dict[str, Any]:
        """Like ``decode``, returning the fastavro dict.

        ``reader`` is a schema name (its current version), a given version, or
        None to read with the writer schema itself (the record as written).
        """
        where = {"topic": topic, "partition": partition, "offset": offset}
        writer = self._writer_of(headers, where)
        if reader is None:
            reader = writer
        elif isinstance(reader, str):
            reader = self.current(reader)
        return self._read(value, writer, reader, where)

    def _writer_of(self, headers: HeadersIn, where: dict[str, Any]) -> KnownSchema:
        fingerprint = _header(headers, FINGERPRINT_HEADER)
        if fingerprint is None:
            raise UnknownSchemaError(
                f"no {FINGERPRINT_HEADER!r} header, so the writer schema is unknown: the message "
                "was not written with reef_stream.core.serde; dead-letter it and fix its producer",
                **where,
            )
        known = self._by_fingerprint.get(fingerprint) if isinstance(fingerprint, bytes) else None
        if known is None:
            name = _header(headers, SCHEMA_NAME_HEADER)
            raise UnknownSchemaError(
                f"unknown schema fingerprint {_show(fingerprint)} (the writer names schema "
                f"{_show(name)}): this process does not know that version; deploy its .avsc "
                "to schemas/history/ and replay, dead-letter it meanwhile",
                **where,
            )
        return known

    def _event_type(self, writer: KnownSchema, where: dict[str, Any]) -> type:
        try:
            return EVENT_TYPES[writer.name]
        except KeyError:
            raise UnknownSchemaError(
                f"{writer.describe()} is not an event type of reef_stream.core.events; "
                "read it with decode_record",
                **where,
            ) from None

    def _read(
        self, value: bytes | None, writer: KnownSchema, reader: KnownSchema, where: dict[str, Any]
    ) -> dict[str, Any]:
        """Read one record, resolving ``writer`` to ``reader``; the whole value must be used."""
        if value is None:
            raise CorruptRecordError(
                "the message has no value (a tombstone); skip tombstones before decoding", **where
            )
        buffer = BytesIO(value)
        try:
            record = schemaless_reader(
                buffer, writer.parsed, None if reader is writer else reader.parsed
            )
        except SchemaResolutionError as error:
            raise UnknownSchemaError(
                f"written with {writer.describe()}, which cannot be read as "
                f"{reader.describe()}: {error}. Read it with a compatible schema, or dead-letter it",
                **where,
            ) from error
        except Exception as error:  # noqa: BLE001 - bad bytes raise anything from EOFError to IndexError
            raise CorruptRecordError(
                f"{len(value)} bytes do not decode as {writer.describe()}: "
                f"{type(error).__name__}: {error}",
                **where,
            ) from error
        if buffer.tell() != len(value):
            raise CorruptRecordError(
                f"{len(value) - buffer.tell()} bytes left over after a {writer.name} record of "
                f"{buffer.tell()} bytes: the value is not one record of the schema it names",
                **where,
            )
        return record


@cache
def _default_registry() -> SchemaRegistry:
    return SchemaRegistry()


def _header(headers: HeadersIn, name: str) -> Any:
    """The first value of header ``name``, or None."""
    if headers is None:
        return None
    if isinstance(headers, Mapping):
        return headers.get(name)
    for key, value in headers:
        if key == name:
            return value
    return None


def _show(value: Any) -> str:
    """A header value for an error message."""
    if isinstance(value, bytes):
        return value.hex() if len(value) == 8 else repr(value)
    return repr(value)


# --- the same, with the default registry ------------------------------------------------


def encode(event: Event) -> tuple[bytes, Headers]:
    """``SchemaRegistry.default().encode(event)``."""
    return _default_registry().encode(event)


def encode_record(schema_name: str, record: Mapping[str, Any]) -> tuple[bytes, Headers]:
    """``SchemaRegistry.default().encode_record(schema_name, record)``."""
    return _default_registry().encode_record(schema_name, record)


@overload
def decode(
    value: bytes | None, headers: HeadersIn, reader: type[EventT], *,
    topic: str | None = None, partition: int | None = None, offset: int | None = None,
) -> EventT: ...


@overload
def decode(
    value: bytes | None, headers: HeadersIn, reader: None = None, *,
    topic: str | None = None, partition: int | None = None, offset: int | None = None,
) -> Event: ...


def decode(value, headers, reader=None, *, topic=None, partition=None, offset=None):
    """``SchemaRegistry.default().decode(...)``."""
    return _default_registry().decode(
        value, headers, reader, topic=topic, partition=partition, offset=offset
    )
