"""The import loop behind ``reef produce``: JSONL lines in, events and dead letters out.

    with RecordProducer(settings=settings, spool_dir=spool) as producer:
        summary = import_jsonl(open(path, "rb"), kind="generations", producer=producer,
                               source="import:logs.jsonl")

Each non-blank line is one JSON object in a form of
``reef_stream.intake.formats`` (a native generation or feedback, an
OpenAI-style response that yields one generation per choice, or a multi-turn
chat log with tool calls that yields one generation with its segments). Valid events
are sent with ``RecordProducer.send``. A line that is not JSON, or not a
valid record, becomes a ``DeadLetter`` in ``<ns>.dead-letters``:

- ``reason``: ``"line <n>: <what is wrong, naming the field>"``;
- ``error_type``: the exception's class (``JSONDecodeError``, ``InvalidRecord``);
- ``source_topic``: the ``source`` given (``import:<path>`` or ``import:stdin``);
  ``source_offset``: the line number (from 1); ``source_partition``: null;
- ``value``: the line's bytes without its line ending; ``stage``: ``import``.

and the import goes on. Rejections are counted by field (the group of a
reason), not by line, so a summary reads "completion_logprobs: 120 lines".

An OpenAI line whose choices all parse is sent choice by choice; if the
broker's size limit refuses a later choice, the earlier ones are already
sent and the whole line is dead-lettered too. Ids are deterministic
(``<response id>:<index>``), so importing the fixed line again yields
duplicates that readers drop by id.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from reef_stream.core.errors import InvalidRecord
from reef_stream.intake.formats import NO_DEFAULTS, Kind, OpenAIDefaults, parse_record
from reef_stream.intake.producer import DeliveryState, RecordProducer, SendHandle
from reef_stream.intake.spool import SpoolFull
from reef_stream.topics.dead_letters import dead_letter

__all__ = ["ImportSummary", "import_jsonl", "reason_group"]

#: Delivery errors kept for the summary (the first ones; the rest are counted).
MAX_ERRORS_KEPT = 5


@dataclass
class ImportSummary:
    """What an import did. ``records`` are events sent; one OpenAI line may send several.

    ``outstanding`` records were sent but not acknowledged when the import
    flushed: they are spooled on disk (or still in flight) and the next
    producer on the same spool directory replays them.
    """

    source: str
    lines_read: int = 0
    records_sent: int = 0
    acknowledged: int = 0
    failed: int = 0
    dead_letters_sent: int = 0
    dead_letters_acknowledged: int = 0
    dead_letters_failed: int = 0
    #: Rejected lines by reason group (see ``reason_group``).
    rejected: Counter[str] = field(default_factory=Counter)
    #: The first rejection of each group, as its dead letter's reason says it.
    first_rejection: dict[str, str] = field(default_factory=dict)
    #: The first delivery errors (records or dead letters the broker refused for good).
    errors: list[str] = field(default_factory=list)

    @property
    def lines_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def outstanding(self) -> int:
        return self.records_sent - self.acknowledged - self.failed

    @property
    def dead_letters_outstanding(self) -> int:
        return self.dead_letters_sent - self.dead_letters_acknowledged - self.dead_letters_failed


def import_jsonl(lines: Iterable[bytes], *, kind: Kind, producer: RecordProducer, source: str,
                 defaults: OpenAIDefaults = NO_DEFAULTS,
                 advance: Callable[[int], None] | None = None,
                 flush_timeout: float = 60.0) -> ImportSummary:
    """Send the events of every line, dead-letter every invalid line, flush, and count.

    ``lines`` are raw lines (a file opened ``"rb"`` or ``sys.stdin.buffer``);
    ``advance(n)`` is called with each line's byte count (for a progress bar).
    Blocks until every record is acknowledged, failed or spooled, or
    ``flush_timeout`` seconds. Leaves ``producer`` open.

    Raises ``SpoolFull`` naming the line to resume from when the broker is
    unreachable and the spool has no room: every earlier line is sent or
    spooled.
    """
    summary = ImportSummary(source=source)
    deliveries = _Deliveries(summary)
    for number, raw in enumerate(lines, start=1):
        if advance is not None:
            advance(len(raw))
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        summary.lines_read += 1
        try:
            _import_line(line, number, kind, producer, defaults, summary, deliveries)
        except SpoolFull as full:
            raise SpoolFull(
                f"{full} Stopped at line {number} of {source}: the lines before it are sent or "
                f"spooled. Once the broker is reachable, resume with `tail -n +{number} FILE | "
                "reef produce ... -`") from full
    producer.flush(flush_timeout)
    deliveries.close()
    return summary


def reason_group(error: Exception) -> str:
    """The group a rejection is counted in: the field at fault (list indexes dropped), or a kind."""
    if isinstance(error, InvalidRecord) and error.field:
        # backslashreplace: an unknown field may be named with a lone surrogate ("\ud800"),
        # which no terminal or file can print
        return re.sub(r"\[\d+\]", "[]", error.field).encode(
            "utf-8", "backslashreplace").decode("utf-8")
    if isinstance(error, InvalidRecord):
        return "the record as a whole"
    return "not JSON"


def _import_line(line: bytes, number: int, kind: Kind, producer: RecordProducer,
                 defaults: OpenAIDefaults, summary: ImportSummary,
                 deliveries: _Deliveries) -> None:
    """Send one line's events, or its dead letter."""
    try:
        events = parse_record(kind, json.loads(line), defaults)
    except (ValueError, RecursionError, InvalidRecord) as error:
        _reject(line, number, error, producer, summary, deliveries)
        return
    for event in events:
        try:
            handle = producer.send(event)
        except InvalidRecord as error:  # over the topic's size limit
            _reject(line, number, error, producer, summary, deliveries)
            return
        summary.records_sent += 1
        deliveries.track(handle, dead_letter=False)


def _reject(line: bytes, number: int, error: Exception, producer: RecordProducer,
            summary: ImportSummary, deliveries: _Deliveries) -> None:
    """Count the rejection of line ``number`` and send its dead letter."""
    reason = f"line {number}: {error}" if isinstance(error, InvalidRecord) else \
        f"line {number}: not JSON: {error}"
    group = reason_group(error)
    summary.rejected[group] += 1
    summary.first_rejection.setdefault(group, reason)
    letter = dead_letter(reason, type(error).__name__, stage="import", topic=summary.source,
                         offset=number, value=line)
    try:
        handle = producer.send(letter)
    except InvalidRecord:  # the line itself is over the dead-letter topic's size limit
        handle = producer.send(dead_letter(
            f"{reason} (the line, {len(line)} bytes, is too large to keep here; it is "
            f"line {number} of {summary.source})", letter.error_type, stage="import",
            topic=letter.source_topic, offset=number, created_at=letter.created_at))
    summary.dead_letters_sent += 1
    deliveries.track(handle, dead_letter=True)


class _Deliveries:
    """Counts into a summary how sent records end, from handle callbacks.

    Callbacks run on the producer's thread; ``close`` stops counting, so the
    summary no longer changes after ``import_jsonl`` returns.
    """

    def __init__(self, summary: ImportSummary):
        self._summary = summary
        self._lock = threading.Lock()
        self._open = True

    def track(self, handle: SendHandle, *, dead_letter: bool) -> None:
        handle.add_done_callback(lambda done: self._done(done, dead_letter))

    def close(self) -> None:
        with self._lock:
            self._open = False

    def _done(self, handle: SendHandle, dead_letter: bool) -> None:
        summary = self._summary
        acknowledged = handle.state is DeliveryState.ACKNOWLEDGED
        with self._lock:
            if not self._open:
                return
            if dead_letter and acknowledged:
                summary.dead_letters_acknowledged += 1
            elif dead_letter:
                summary.dead_letters_failed += 1
            elif acknowledged:
                summary.acknowledged += 1
            else:
                summary.failed += 1
            if not acknowledged and len(summary.errors) < MAX_ERRORS_KEPT:
                summary.errors.append(str(handle.error))
