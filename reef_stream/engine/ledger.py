"""What the processor's state remembers of generations that concluded and groups that closed.

``ProcessorState`` (``reef_stream.engine.join``) must recognise, for ``retention_ms`` after
it ended, a generation id it has seen (a duplicate), feedback for it (LATE, then DUPLICATE)
and a generation for a closed group (INVALID or EXPIRED). A ``Ledger`` keeps exactly that and
no payloads: per concluded generation a 64-bit BLAKE2b digest of its id, when it concluded
and a shared ``Concluded`` tuple; per closed group (unless a generation's own group of one)
the digest of its key, when it closed and a ``Closed`` tuple. A digest collision (2**-64
per pair) would drop a new generation as a duplicate, counted.

Entries are grouped into segments by the ``SEGMENT_MS`` of their conclusion; each segment is
one changelog key (``segment_key``, which no record id can be). Every change returns the
segment keys it changed; ``snapshot`` / ``snapshot_bytes`` give a segment as the changelog
stores it (the newest ``RENDERED_SEGMENTS`` keep each entry's rendered text), ``restore``
loads one back, ``expire`` forgets what is ``retention_ms`` old. Pure, not thread-safe,
non-blocking. The memory figures and collision odds: ``docs/design-notes.md`` ("The ledger").
"""

from __future__ import annotations

import hashlib
import heapq
import json
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _string
from typing import Any, NamedTuple

from reef_stream.core.errors import FatalError

#: Conclusion times are grouped into segments of this many ms (one changelog key each).
SEGMENT_MS = 1_000
#: The newest segments whose entries keep their rendered JSON text (see "Rendering").
RENDERED_SEGMENTS = 2
_KEY_PREFIX = "\udc80ended."
_GENERATION, _GROUP = b"reef.generation", b"reef.group"  # BLAKE2b personalisation


class Concluded(NamedTuple):
    """What is remembered of a concluded generation (one tuple shared per segment and value)."""

    outcome: str  # an Outcome's name
    sources: tuple[str, ...]  # sorted: every feedback source received for it
    own_group: bool  # it was the only member of a group whose key is its id, now closed
    segment: int


class Closed(NamedTuple):
    """What is remembered of a closed group: ``how`` ("emitted", "resolved", "shed", "invalid"),
    why."""

    how: str
    detail: str
    segment: int


@dataclass(slots=True, eq=False)
class _Segment:
    """The entries that concluded in one ``SEGMENT_MS``, in the order they were added."""

    digests: array = field(default_factory=lambda: array("Q"))
    at: array = field(default_factory=lambda: array("q"))
    shared: dict[Concluded, Concluded] = field(default_factory=dict)


def segment_key(segment: int) -> str:
    """The changelog key of a segment."""
    return f"{_KEY_PREFIX}{segment}"


def segment_of(key: str) -> int | None:
    """The segment whose changelog key is ``key``; None for any other key."""
    if not key.startswith(_KEY_PREFIX):
        return None
    try:
        return int(key[len(_KEY_PREFIX):])
    except ValueError:
        return None


def _digest(kind: bytes, name: str) -> int:
    data = name.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=kind).digest(), "little")


class Ledger:
    """Concluded generations and closed groups, each remembered for ``retention_ms`` after it
    ended; see the module docstring."""

    def __init__(self, retention_ms: int, implied: Callable[[str, str], tuple[str, str]]):
        """``implied(key, outcome)``: how and why a group of one closed whose only member,
        generation ``key``, concluded as ``outcome``."""
        self.retention_ms, self._implied = retention_ms, implied
        self._entries: dict[int, Concluded | Closed] = {}  # digest -> what is remembered
        self._segments: dict[int, _Segment] = {}
        self._order: list[int] = []  # heap of segment numbers (stale ones skipped)
        #: segment -> the JSON text of its first entries (None: an entry ``snapshot`` skips),
        #: for the newest ``RENDERED_SEGMENTS`` segments rendered (see "Rendering").
        self._rendered: dict[int, list[tuple[bool, str] | None]] = {}

    # ------------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self._entries)

    def concluded(self, generation_id: str) -> Concluded | None:
        """What is remembered of generation ``generation_id``; None if nothing."""
        entry = self._entries.get(_digest(_GENERATION, generation_id))
        return entry if isinstance(entry, Concluded) else None

    def closure(self, key: str) -> tuple[str, str] | None:
        """How and why group ``key`` closed; None if it is not remembered closed."""
        entry = self._entries.get(_digest(_GROUP, key))
        if isinstance(entry, Closed):
            return entry.how, entry.detail
        own = self.concluded(key)
        return self._implied(key, own.outcome) if own is not None and own.own_group else None

    def keys(self) -> list[str]:
        """The changelog key of every segment holding entries."""
        return [segment_key(n) for n in sorted(self._segments)]

    def next_expiry(self) -> int | None:
        """The earliest time at which ``expire`` forgets something; None if nothing is held."""
        while self._order and self._order[0] not in self._segments:
            heapq.heappop(self._order)
        if not self._order:
            return None
        return min(self._segments[self._order[0]].at) + self.retention_ms

    # ------------------------------------------------------------------- changing

    def conclude(self, generation_id: str, outcome: str, sources: tuple[str, ...],
                 at: int) -> str:
        """Remember that ``generation_id`` concluded at ``at``; the segment key changed."""
        segment = at // SEGMENT_MS
        self._add(_digest(_GENERATION, generation_id), at,
                  Concluded(outcome, tuple(sorted(sources)), False, segment))
        return segment_key(segment)

    def close(self, key: str, how: str, detail: str, at: int, *,
              only_member: str | None = None) -> str:
        """Remember that group ``key`` closed at ``at`` (``only_member``: the id of its only
        member, if it had one); the segment key changed. A group of one whose key is its
        member's id, closed as ``implied``, is remembered as part of that member's entry."""
        own = self.concluded(key) if only_member == key else None
        if own is not None and self._implied(key, own.outcome) == (how, detail):
            return self.update(key, own._replace(own_group=True))
        segment = at // SEGMENT_MS
        self._add(_digest(_GROUP, key), at, Closed(how, detail, segment))
        return segment_key(segment)

    def update(self, generation_id: str, entry: Concluded) -> str:
        """Replace what is remembered of a concluded ``generation_id`` by ``entry`` (same
        segment: a source received late, or its own group closed); the segment key changed."""
        digest = _digest(_GENERATION, generation_id)
        self._entries[digest] = self._shared(entry)
        self._changed(entry.segment, digest)
        return segment_key(entry.segment)

    def expire(self, now: int) -> list[str]:
        """Forget every entry that ended ``retention_ms`` or longer before ``now``; the keys of
        the segments changed (a segment left empty is dropped: its snapshot is None)."""
        changed = []
        while self._order:
            number = self._order[0]
            if (segment := self._segments.get(number)) is None:
                heapq.heappop(self._order)
                continue
            if number * SEGMENT_MS + self.retention_ms > now:
                break  # all of it is younger, and every later segment too
            expired = {i for i, at in enumerate(segment.at) if at + self.retention_ms <= now}
            if not expired:
                break
            for i in expired:
                digest = segment.digests[i]
                entry = self._entries.get(digest)
                if entry is not None and entry.segment == number:
                    del self._entries[digest]
            changed.append(segment_key(number))
            if len(expired) < len(segment.at):
                keep = [i for i in range(len(segment.at)) if i not in expired]
                segment.digests = array("Q", [segment.digests[i] for i in keep])
                segment.at = array("q", [segment.at[i] for i in keep])
                if (rendered := self._rendered.get(number)) is not None:
                    self._rendered[number] = [rendered[i] for i in keep if i < len(rendered)]
                break
            del self._segments[number]
            self._rendered.pop(number, None)
            heapq.heappop(self._order)
        return changed

    # ------------------------------------------------------------------- snapshot / restore

    def snapshot(self, key: str) -> dict[str, Any] | None:
        """Segment ``key`` as JSON-ready data, or None when it holds nothing."""
        number = segment_of(key)
        segment = self._segments.get(number) if number is not None else None
        generations, groups = [], []
        for digest, at in zip(segment.digests, segment.at) if segment else ():
            entry = self._entries.get(digest)
            if entry is None or entry.segment != number:
                continue  # a digest shared with a later entry (see the module docstring)
            if isinstance(entry, Concluded):
                generations.append([digest, at, entry.outcome, list(entry.sources),
                                    entry.own_group])
            else:
                groups.append([digest, at, entry.how, entry.detail])
        if not (generations or groups):
            return None
        return {"version": 2, "segment": number, "generations": generations, "groups": groups}

    def snapshot_bytes(self, key: str) -> bytes | None:
        """``dumps_snapshot(snapshot(key))``, byte for byte, from the entries' kept JSON text
        (see "Rendering"); None when the segment holds nothing."""
        number = segment_of(key)
        segment = self._segments.get(number) if number is not None else None
        if segment is None:
            return None
        if number not in self._rendered:
            if self._rendered and number < max(self._rendered):
                return _dumps(self.snapshot(key))  # an old segment: nothing kept for it
            self._rendered[number] = []
            for old in sorted(self._rendered)[:-RENDERED_SEGMENTS]:
                del self._rendered[old]
        rendered = self._rendered[number]
        for i in range(len(rendered), len(segment.digests)):
            rendered.append(self._render(number, segment.digests[i], segment.at[i]))
        generations = ",".join(text for kind, text in filter(None, rendered) if kind)
        groups = ",".join(text for kind, text in filter(None, rendered) if not kind)
        if not (generations or groups):
            return None
        return (f'{{"version":2,"segment":{number},"generations":[{generations}],'
                f'"groups":[{groups}]}}').encode()

    def _render(self, number: int, digest: int, at: int) -> tuple[bool, str] | None:
        """(is a generation, its JSON text) of one entry of segment ``number``, as ``snapshot``
        lists it; None where ``snapshot`` skips it."""
        entry = self._entries.get(digest)
        if entry is None or entry.segment != number:
            return None
        # the text json.dumps makes of the same list (ints, ASCII-escaped strings, a bool)
        if isinstance(entry, Concluded):
            sources = ",".join(map(_string, entry.sources))
            own = "true" if entry.own_group else "false"
            return True, f"[{digest},{at},{_string(entry.outcome)},[{sources}],{own}]"
        return False, f"[{digest},{at},{_string(entry.how)},{_string(entry.detail)}]"

    def _changed(self, number: int, digest: int) -> None:
        """The entry ``digest`` of segment ``number`` changed: render its kept text again."""
        rendered = self._rendered.get(number)
        if rendered is None:
            return
        segment, i = self._segments[number], -1
        while True:
            try:
                i = segment.digests.index(digest, i + 1)
            except ValueError:
                return
            if i >= len(rendered):
                return
            rendered[i] = self._render(number, digest, segment.at[i])

    def restore(self, key: str, snapshot: Mapping[str, Any]) -> None:
        """Add the entries of segment ``key``'s snapshot (what the segment held is kept:
        sources received are merged). Idempotent."""
        number = segment_of(key)
        if number is None or snapshot.get("segment") != number:
            raise FatalError(f"snapshot of {key!r} is not that of segment "
                             f"{snapshot.get('segment')!r}")
        for digest, at, outcome, sources, own_group in snapshot["generations"]:
            self._add(digest, at, Concluded(outcome, tuple(sources), own_group, number))
        for digest, at, how, detail in snapshot["groups"]:
            self._add(digest, at, Closed(how, detail, number))

    def migrate(self, key: str, snapshot: Mapping[str, Any]) -> set[str]:
        """Add the closed group and concluded generations of a version-1 snapshot of state key
        ``key`` (written before the ledger); the segment keys changed."""
        changed = {self.conclude(c["generation_id"], c["outcome"], tuple(c["sources"]), c["at"])
                   for c in snapshot["concluded"]}
        if (closed := snapshot["closed"]) is not None:
            changed.add(self.close(key, closed["how"], closed["detail"], closed["at"]))
        return changed

    # ------------------------------------------------------------------- internals

    def _add(self, digest: int, at: int, entry: Concluded | Closed) -> None:
        old = self._entries.get(digest)
        if old is not None and old.segment == entry.segment:  # a restore again: merge
            if isinstance(old, Concluded) and isinstance(entry, Concluded):
                entry = entry._replace(sources=tuple(sorted({*old.sources, *entry.sources})),
                                       own_group=old.own_group or entry.own_group)
            self._entries[digest] = self._shared(entry)
            self._changed(entry.segment, digest)
            return
        if old is not None:  # the digest moves to a later segment: the old one skips it now
            self._entries[digest] = entry
            self._changed(old.segment, digest)
        if (segment := self._segments.get(entry.segment)) is None:
            segment = self._segments[entry.segment] = _Segment()
            heapq.heappush(self._order, entry.segment)
        segment.digests.append(digest)
        segment.at.append(at)
        self._entries[digest] = self._shared(entry)

    def _shared(self, entry: Concluded | Closed) -> Concluded | Closed:
        """``entry``, or the equal tuple its segment already holds (a closure is kept as is)."""
        if isinstance(entry, Closed):
            return entry
        return self._segments[entry.segment].shared.setdefault(entry, entry)


def _dumps(value: Any) -> bytes:
    """As ``snapshots.dumps_snapshot`` writes JSON (compact, UTF-8, no NaN)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
