"""A bounded, append-only, checksummed on-disk queue of records not yet acknowledged.

The producer writes a record here when the broker is unreachable or its
in-memory queue is full, and replays the spool in order once the broker
answers again, or when a new producer starts on the same directory after a
crash. A record leaves the spool only when the broker acknowledged it.

On disk:

- ``seg-<first seq>.log``: segments of frames, each
  ``[u32 length][u32 crc32][payload]`` (little-endian), where the payload is
  one ``SpoolEntry`` encoded as Avro (no pickle). A frame with a bad checksum
  or cut short by a crash ends the readable part of its segment; what follows
  is reported, never silently dropped.
- ``acked``: the sequence numbers acknowledged so far, as a contiguous prefix
  (``acked_through``) plus the sparse ones above it, written atomically.

Sequence numbers are the spool's own: one per record, increasing. A segment
is deleted once every record in it is acknowledged.

``fsync`` policy: ``always`` (every append reaches the disk before it
returns: a spooled record survives a power cut), ``batch`` (the file is
flushed to the OS at once and fsynced at least every ``fsync_interval``
seconds: survives a crash of the process), ``never`` (the OS decides).

Thread-safety: every public method takes the spool's lock, except ``empty``
(one atomic read, asked for every record a producer sends); callers may use
it from several threads.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from reef_stream.core.errors import ConfigurationError, RetryableError

FsyncPolicy = Literal["always", "batch", "never"]

_FRAME = struct.Struct("<II")  # length, crc32
_SEGMENT_BYTES = 64 * 1024 * 1024

_ENTRY_SCHEMA = parse_schema({
    "type": "record", "name": "SpoolEntry", "namespace": "reef.spool",
    "fields": [
        {"name": "seq", "type": "long"},
        {"name": "topic", "type": "string"},
        {"name": "key", "type": ["null", "bytes"]},
        {"name": "value", "type": "bytes"},
        {"name": "headers", "type": {"type": "array", "items": {
            "type": "record", "name": "Header",
            "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": "bytes"}]}}},
    ],
})


class SpoolFull(RetryableError):
    """The spool reached its bound and no room was freed in time.

    Nothing was written: the record is still the caller's. Retry later, once
    the broker is reachable again, or give the spool a larger bound.

    From ``RecordProducer.send_many``: ``handles`` are those of the batch's
    records accepted before this one (the first ``len(handles)``); this record
    and the ones after it were not, and are the caller's to send again.
    """

    handles: tuple = ()


@dataclass(frozen=True)
class SpoolEntry:
    seq: int
    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]

    @property
    def size(self) -> int:
        return len(self.value) + len(self.key or b"") + sum(len(k) + len(v) for k, v in self.headers)


class Spool:
    """See the module docstring. ``max_bytes`` bounds the bytes of unacknowledged records."""

    def __init__(self, directory: Path, *, max_bytes: int = 1 << 30,
                 fsync: FsyncPolicy = "batch", fsync_interval: float = 0.2):
        if fsync not in ("always", "batch", "never"):
            raise ConfigurationError(f"spool fsync policy must be always, batch or never, not {fsync!r}")
        if max_bytes <= 0:
            raise ConfigurationError(f"spool max_bytes must be positive, not {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self._lock = threading.Condition()
        self._acked_through, self._acked_above = self._load_acked()
        #: seq -> (segment's first seq, size, byte offset) of every unacknowledged record on disk.
        self._pending: dict[int, tuple[int, int, int]] = {}
        self._pending_bytes = 0
        self._attachments: dict[int, object] = {}
        #: Damaged tails found when opening: (segment, byte offset, reason).
        self.damaged: list[tuple[str, int, str]] = []
        self._next_seq = self._acked_through + 1
        self._writer: io.BufferedWriter | None = None
        self._writer_first = 0
        self._writer_bytes = 0
        self._last_fsync = time.monotonic()
        self._scan()

    # ----------------------------------------------------------------- state

    def _load_acked(self) -> tuple[int, set[int]]:
        path = self.directory / "acked"
        if not path.exists():
            return 0, set()
        state = json.loads(path.read_text())
        return int(state["through"]), set(state["above"])

    def _save_acked(self) -> None:
        tmp = self.directory / "acked.tmp"
        with open(tmp, "w") as out:
            json.dump({"through": self._acked_through, "above": sorted(self._acked_above)}, out)
        os.replace(tmp, self.directory / "acked")

    def _segments(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.glob("seg-*.log"):
            found.append((int(path.stem.split("-", 1)[1]), path))
        return sorted(found)

    def _scan(self) -> None:
        """Index the unacknowledged records on disk; note damaged tails."""
        for first, path in self._segments():
            for entry, position in self._read_segment(path):
                self._next_seq = max(self._next_seq, entry.seq + 1)
                if not self._is_acked(entry.seq):
                    self._pending[entry.seq] = (first, entry.size, position)
                    self._pending_bytes += entry.size
        self._drop_finished_segments()

    def _read_segment(self, path: Path, start: int = 0) -> Iterator[tuple[SpoolEntry, int]]:
        """The entries of one segment from byte ``start``, with their byte offsets.

        Stops at the first damaged frame and records it in ``damaged``.
        """
        with open(path, "rb") as segment:
            segment.seek(start)
            position = start
            while header := segment.read(_FRAME.size):
                if len(header) < _FRAME.size:
                    self._note_damage(path, position, "frame header cut short (crash while writing)")
                    return
                length, crc = _FRAME.unpack(header)
                payload = segment.read(length)
                if len(payload) < length:
                    self._note_damage(path, position, "frame cut short (crash while writing)")
                    return
                if zlib.crc32(payload) != crc:
                    self._note_damage(path, position, "checksum mismatch")
                    return
                record = schemaless_reader(io.BytesIO(payload), _ENTRY_SCHEMA, None)
                yield SpoolEntry(record["seq"], record["topic"], record["key"], record["value"],
                                 tuple((h["key"], h["value"]) for h in record["headers"])), position
                position += _FRAME.size + length

    def _note_damage(self, path: Path, position: int, reason: str) -> None:
        if (path.name, position, reason) not in self.damaged:
            self.damaged.append((path.name, position, reason))

    def _is_acked(self, seq: int) -> bool:
        return seq <= self._acked_through or seq in self._acked_above

    # ----------------------------------------------------------------- public

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def empty(self) -> bool:
        """True when no record awaits acknowledgement. Lock-free (one read of a dict's size,
        atomic in CPython): as with ``len``, a concurrent append or ack may change it at once."""
        return not self._pending

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def append(self, topic: str, key: bytes | None, value: bytes,
               headers: list[tuple[str, bytes]] | tuple = (), timeout: float = 30.0,
               attachment: object = None, bounded: bool = True) -> int:
        """Write one record; return its sequence number. Blocks while the spool is full.

        ``attachment`` is kept in memory only (never written) and handed back
        by the ``ack`` that acknowledges this record, so a caller can tie a
        record to its own bookkeeping without racing a concurrent ack.
        Raises SpoolFull after ``timeout`` seconds without room; a record
        larger than the whole bound raises at once. Nothing is written then.
        ``bounded=False`` writes the record at once even past the bound: for a
        record its caller accepted earlier and must not lose now (the bound
        then holds back new records until the spool drains below it).
        """
        headers = tuple((k, v if isinstance(v, bytes) else bytes(v or b"")) for k, v in headers)
        with self._lock:
            entry = SpoolEntry(self._next_seq, topic, key, value, headers)
            if bounded and entry.size > self.max_bytes:
                raise SpoolFull(f"a record of {entry.size} bytes can never fit in a spool bounded "
                                f"at {self.max_bytes} bytes")
            deadline = time.monotonic() + timeout
            while bounded and self._pending_bytes + entry.size > self.max_bytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SpoolFull(
                        f"the spool in {self.directory} is full ({self._pending_bytes} of "
                        f"{self.max_bytes} bytes, {len(self._pending)} records awaiting the broker) "
                        f"and no record was acknowledged for {timeout:.1f}s. The record was not "
                        "written; retry once the broker is reachable, or raise the spool's bound."
                    )
                self._lock.wait(remaining)
            self._write(entry)
            if attachment is not None:
                self._attachments[entry.seq] = attachment
            self._next_seq += 1
            return entry.seq

    def _write(self, entry: SpoolEntry) -> None:
        buffer = io.BytesIO()
        schemaless_writer(buffer, _ENTRY_SCHEMA, {
            "seq": entry.seq, "topic": entry.topic, "key": entry.key, "value": entry.value,
            "headers": [{"key": k, "value": v} for k, v in entry.headers]})
        payload = buffer.getvalue()
        if self._writer is None or self._writer_bytes >= _SEGMENT_BYTES:
            self._roll(entry.seq)
        position = self._writer_bytes
        self._writer.write(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
        self._writer.flush()
        self._writer_bytes += _FRAME.size + len(payload)
        now = time.monotonic()
        if self.fsync == "always" or (self.fsync == "batch" and now - self._last_fsync >= self.fsync_interval):
            os.fsync(self._writer.fileno())
            self._last_fsync = now
        self._pending[entry.seq] = (self._writer_first, entry.size, position)
        self._pending_bytes += entry.size

    def _roll(self, first_seq: int) -> None:
        if self._writer is not None:
            self._close_writer()
        path = self.directory / f"seg-{first_seq:020d}.log"
        self._writer = open(path, "ab")
        self._writer_first = first_seq
        self._writer_bytes = path.stat().st_size

    def _close_writer(self) -> None:
        if self.fsync != "never":
            os.fsync(self._writer.fileno())
        self._writer.close()
        self._writer = None

    def sync(self) -> None:
        """Force every appended record to disk (whatever the fsync policy)."""
        with self._lock:
            if self._writer is not None:
                self._writer.flush()
                os.fsync(self._writer.fileno())
                self._last_fsync = time.monotonic()

    def unacked(self, after: int = 0, limit: int | None = None) -> Iterator[SpoolEntry]:
        """Up to ``limit`` unacknowledged records with seq > ``after``, in order, read from disk.

        Reading starts at the first such record's byte offset, so replaying a
        large spool batch by batch reads each record about once.
        """
        with self._lock:
            if self._writer is not None:
                self._writer.flush()
            wanted = []
            for seq, (first, _, position) in self._pending.items():  # in seq order
                if seq > after:
                    wanted.append((seq, first, position))
                    if limit is not None and len(wanted) >= limit:
                        break
            segments = dict(self._segments())
        if not wanted:
            return
        wanted_seqs = {seq for seq, _, _ in wanted}
        starts: dict[int, int] = {}
        for _, first, position in wanted:
            starts.setdefault(first, position)
        for first in sorted(starts):
            try:
                for entry, _ in self._read_segment(segments[first], starts[first]):
                    if entry.seq in wanted_seqs:
                        yield entry
            except (FileNotFoundError, KeyError):  # acknowledged and deleted meanwhile
                continue

    def ack(self, seqs: list[int]) -> dict[int, object]:
        """Mark records acknowledged by the broker; frees their room (idempotent).

        Returns the attachments of the records it acknowledged, by seq. The
        acknowledgement file is not fsynced: if a crash loses it, the records
        are replayed once more (a duplicate, never a loss).
        """
        with self._lock:
            attachments = {seq: self._attachments.pop(seq) for seq in seqs
                           if seq in self._attachments}
            for seq in seqs:
                if seq in self._pending:
                    self._pending_bytes -= self._pending.pop(seq)[1]
                if seq > self._acked_through:
                    self._acked_above.add(seq)
            while self._acked_through + 1 in self._acked_above:
                self._acked_through += 1
                self._acked_above.discard(self._acked_through)
            if not self._pending:  # everything written so far is acknowledged
                self._acked_through = max(self._acked_through, self._next_seq - 1)
                self._acked_above.clear()
            self._save_acked()
            self._drop_finished_segments()
            self._lock.notify_all()
        return attachments

    def _drop_finished_segments(self) -> None:
        """Delete segments whose every record is acknowledged (not the one being written)."""
        live = {first for first, _, _ in self._pending.values()}
        for first, path in self._segments():
            if first in live or (self._writer is not None and first == self._writer_first):
                continue
            path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._close_writer()
            self._drop_finished_segments()
