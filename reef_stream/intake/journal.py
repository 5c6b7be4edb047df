"""The recording proxy's journal of held trajectories: what lets a proxy killed outright
(SIGKILL) and started again on the same spool directory lose none of the tool-calling
trajectories it held (docs/proxy.md, "Multi-turn tool calls").

One file, ``trajectories.journal`` in the proxy's spool directory, of frames
``[u32 length][u32 crc32][payload]`` (little-endian, as the spool's), each payload one
``JournalEntry`` in Avro (no pickle):

- ``HELD``: the trajectory a conversation holds, as one Generation so far
  (``Trajectories.held``; the Generation in ``core.serde``'s Avro with its schema's
  fingerprint), named by its first turn's id, with the wall-clock time of its last turn. One is
  written after each turn that leaves a trajectory held; it supersedes the trajectory's
  entries before it;
- ``ENDED``: the trajectory was given back to be recorded, as the Generation to record (written
  before it is handed to the producer, so a kill in between records it again: a duplicate of
  one generation id, never a loss);
- ``DONE``: the trajectory was handed to the producer (which spools what the broker has not
  acknowledged): its entries are dead.

Opening reads the file: a frame cut short or with a bad checksum (a crash mid-append) ends
what is read, with a warning, and never raises; an entry that does not decode is skipped the
same way. The trajectories held or ended and not done are ``restored``, in the order of their
last entry;
the file is rewritten with only their entries (compaction). While running, the file is
rewritten so once its dead bytes pass both its live bytes and ``COMPACT_BYTES``: it stays
within about twice what is held, plus ``COMPACT_BYTES``.

Each entry reaches the OS before ``hold``, ``end`` or ``done`` returns (a killed process loses
none); ``fsync``: ``batch`` (the default, as the spool's) fsyncs when an entry is written at
least ``fsync_interval`` seconds after the last fsync, and at ``sync`` (the proxy calls it about
every second); ``always`` at every entry (survives a power cut too); ``never``: the OS decides.
Blocking (a write, an fsync now and then); not thread-safe: one event loop calls it. Raises
``OSError`` when the file cannot be written; the caller decides (the proxy logs and serves on).
"""

from __future__ import annotations

import io
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from reef_stream.core.errors import ConfigurationError, ReefError
from reef_stream.core.events import Generation
from reef_stream.core.serde import decode, encode
from reef_stream.intake.spool import FsyncPolicy

__all__ = ["COMPACT_BYTES", "FILE_NAME", "Restored", "TrajectoryJournal"]

log = logging.getLogger(__name__)

#: The journal's file in the proxy's spool directory.
FILE_NAME = "trajectories.journal"
#: Dead bytes (superseded or done entries) the file may hold before it is rewritten, whatever
#: its live bytes.
COMPACT_BYTES = 1 << 20

_FRAME = struct.Struct("<II")  # length, crc32
_ENTRY_SCHEMA = parse_schema({
    "type": "record", "name": "JournalEntry", "namespace": "reef.proxy",
    "fields": [
        {"name": "kind", "type": {"type": "enum", "name": "JournalEntryKind",
                                  "symbols": ["HELD", "ENDED", "DONE"]}},
        {"name": "trajectory", "type": "string"},
        {"name": "conversation", "type": "string"},
        {"name": "held_at", "type": "double"},
        {"name": "generation", "type": "bytes"},
        {"name": "headers", "type": {"type": "array", "items": {
            "type": "record", "name": "Header",
            "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": "bytes"}]}}},
    ],
})


@dataclass(frozen=True)
class Restored:
    """A trajectory the journal holds: its conversation, its first turn's id, the trajectory
    so far as one Generation, and when its last entry was written (wall-clock seconds).
    ``ended``: it was given back to be recorded (record it), else it is held (hold it again)."""

    conversation: str
    trajectory: str
    generation: Generation
    held_at: float
    ended: bool = False


class TrajectoryJournal:
    """See the module docstring. ``restored``: what the file held when the journal opened;
    ``damaged``: what opening skipped, each as ``"<byte offset>: <reason>"``."""

    def __init__(self, directory: Path, *, fsync: FsyncPolicy = "batch",
                 fsync_interval: float = 0.2, compact_bytes: int = COMPACT_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        if fsync not in ("always", "batch", "never"):
            raise ConfigurationError(f"journal fsync policy must be always, batch or never, "
                                     f"not {fsync!r}")
        self.path = Path(directory) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync, self.fsync_interval = fsync, fsync_interval
        self.compact_bytes, self.clock = compact_bytes, clock
        self.damaged: list[str] = []
        #: trajectory -> (conversation, its latest HELD or ENDED frame), in the order written.
        self._live: dict[str, tuple[str, bytes]] = {}
        self._live_bytes = 0
        self._file_bytes = 0
        self._last_fsync = time.monotonic()
        self._unsynced = False
        self.restored = self._read()
        self._rewrite()

    # ----------------------------------------------------------------- public

    def hold(self, conversation: str, trajectory: str, so_far: Generation) -> None:
        """Write that ``conversation`` holds ``trajectory`` (its first turn's id) as
        ``so_far`` now. Raises ``InvalidRecord`` when ``so_far`` does not fit its schema."""
        self._write("HELD", conversation, trajectory, so_far)

    def end(self, trajectory: str, generation: Generation) -> None:
        """Write that ``trajectory`` was given back to be recorded as ``generation``; call it
        before handing ``generation`` to the producer. Raises ``InvalidRecord`` as ``hold``."""
        self._write("ENDED", "", trajectory, generation)

    def _write(self, kind: str, conversation: str, trajectory: str,
               generation: Generation) -> None:
        value, headers = encode(generation)
        frame = _frame({"kind": kind, "trajectory": trajectory, "conversation": conversation,
                        "held_at": self.clock(), "generation": value,
                        "headers": [{"key": k, "value": v} for k, v in headers]})
        self._append(frame)
        self._forget(trajectory)
        self._live[trajectory] = (conversation, frame)
        self._live_bytes += len(frame)
        self._compact_if_due()

    def done(self, trajectory: str) -> None:
        """Write that ``trajectory`` was handed to the producer; nothing when it is not held
        here (idempotent)."""
        if trajectory not in self._live:
            return
        self._append(_frame({"kind": "DONE", "trajectory": trajectory, "conversation": "",
                             "held_at": self.clock(), "generation": b"", "headers": []}))
        self._forget(trajectory)
        self._compact_if_due()

    def sync(self) -> None:
        """Force every entry written to the disk; nothing when every one is (cheap to call
        often: the proxy calls it about every second)."""
        if self._unsynced and not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._last_fsync, self._unsynced = time.monotonic(), False

    def close(self) -> None:
        """Rewrite the file with the trajectories still held (none after a clean stop), fsync
        it and close it. Idempotent."""
        if self._file.closed:
            return
        self._file.close()
        self._rewrite(reopen=False)

    def __len__(self) -> int:
        """Trajectories held here (not done)."""
        return len(self._live)

    @property
    def file_bytes(self) -> int:
        return self._file_bytes

    # ----------------------------------------------------------------- the file

    def _read(self) -> list[Restored]:
        if not self.path.exists():
            return []
        entries: dict[str, Restored] = {}
        for entry, frame, position in self._frames():
            trajectory = entry["trajectory"]
            if entry["kind"] != "DONE":
                try:
                    generation = decode(entry["generation"],
                                        [(h["key"], h["value"]) for h in entry["headers"]],
                                        Generation)
                except ReefError as error:   # its entry before, if any, stands
                    self._damage(position, f"trajectory {trajectory} does not decode "
                                           f"({error}): the entry is skipped")
                    continue
            self._forget(trajectory)
            entries.pop(trajectory, None)
            if entry["kind"] == "DONE":
                continue
            entries[trajectory] = Restored(entry["conversation"], trajectory, generation,
                                           entry["held_at"], ended=entry["kind"] == "ENDED")
            self._live[trajectory] = (entry["conversation"], frame)
            self._live_bytes += len(frame)
        return list(entries.values())

    def _frames(self) -> Iterator[tuple[dict, bytes, int]]:
        """The entries of the file in order, each with its frame and byte offset; stops at
        the first damaged frame (noted in ``damaged``)."""
        data = self.path.read_bytes()
        position = 0
        while position < len(data):
            if len(data) - position < _FRAME.size:
                self._damage(position, "frame header cut short (a crash while writing): "
                                       "the rest is skipped")
                return
            length, crc = _FRAME.unpack_from(data, position)
            payload = data[position + _FRAME.size:position + _FRAME.size + length]
            if len(payload) < length:
                self._damage(position, "frame cut short (a crash while writing): the rest "
                                       "is skipped")
                return
            if zlib.crc32(payload) != crc:
                self._damage(position, "checksum mismatch: the rest is skipped")
                return
            try:
                entry = schemaless_reader(io.BytesIO(payload), _ENTRY_SCHEMA, None)
            except Exception as error:  # noqa: BLE001 - a damaged journal never stops the proxy
                self._damage(position, f"entry does not decode ({error}): the rest is "
                                       "skipped")
                return
            end = position + _FRAME.size + length
            yield entry, data[position:end], position
            position = end

    def _damage(self, position: int, reason: str) -> None:
        self.damaged.append(f"{position}: {reason}")
        log.warning("trajectory journal %s at byte %d: %s; a trajectory held then is restored "
                    "as its entry before said, if any", self.path, position, reason)

    def _forget(self, trajectory: str) -> None:
        dead = self._live.pop(trajectory, None)
        if dead is not None:
            self._live_bytes -= len(dead[1])

    def _append(self, frame: bytes) -> None:
        self._file.write(frame)
        self._file.flush()
        self._file_bytes += len(frame)
        self._unsynced = True
        if self.fsync == "always" or (self.fsync == "batch" and time.monotonic()
                                      - self._last_fsync >= self.fsync_interval):
            self.sync()

    def _compact_if_due(self) -> None:
        dead = self._file_bytes - self._live_bytes
        if dead > self._live_bytes and dead > self.compact_bytes:
            self._file.close()
            self._rewrite()

    def _rewrite(self, reopen: bool = True) -> None:
        """Replace the file by one holding only the live entries (fsynced, then renamed)."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "wb") as out:
            for _, frame in self._live.values():
                out.write(frame)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file_bytes = self._live_bytes
        self._unsynced = False
        if reopen:
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close
            self._last_fsync = time.monotonic()


def _frame(entry: dict) -> bytes:
    buffer = io.BytesIO()
    schemaless_writer(buffer, _ENTRY_SCHEMA, entry)
    payload = buffer.getvalue()
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
