"""The one way a ``DeadLetter`` is built.

Every stage that cannot process a record (an undecodable message, a reward that
failed, a generation that expired, an intake line that is not JSON) keeps the
record whole with the reason, through ``dead_letter``. The rules live here once:

- where the record came from: a consumed Kafka ``message`` gives its topic,
  partition and offset; otherwise ``topic`` (and, when the record has a position,
  ``partition`` and ``offset``) say it. A record rejected before it reached Kafka
  has no partition; an intake line keeps its line number as the offset;
- what is kept: the message's own key, value and headers unless the caller
  passes them (the processor keeps the re-encoded event it holds, not bytes it
  no longer has); ``value`` None is a tombstone or a record too large to keep;
- headers are ``MessageHeader`` records, whether given as confluent-kafka's
  ``(key, value)`` pairs or already as ``MessageHeader``;
- ``created_at`` is now unless the caller pins it.

Pure: nothing here produces; the stage sends the letter with its own durability
rule (synchronously, or inside its transaction).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reef_stream.core.events import DeadLetter, MessageHeader, now_ms

#: "take it from the message" (None is a meaningful key or value: absent, a tombstone).
_FROM_MESSAGE: Any = object()


def headers_of(headers: Iterable[Any] | None) -> tuple[MessageHeader, ...]:
    """``headers`` (confluent-kafka ``(key, value)`` pairs, ``MessageHeader`` records, or None)
    as the tuple of ``MessageHeader`` a ``DeadLetter`` carries."""
    return tuple(h if isinstance(h, MessageHeader) else MessageHeader(key=h[0], value=h[1])
                 for h in (headers or ()))


def dead_letter(reason: str, error_type: str, *, stage: str, message: Any = None,
                topic: str | None = None, partition: int | None = None,
                offset: int | None = None, key: Any = _FROM_MESSAGE,
                value: Any = _FROM_MESSAGE, headers: Any = _FROM_MESSAGE,
                created_at: int | None = None) -> DeadLetter:
    """The ``DeadLetter`` of one record that ``stage`` could not process, with ``reason`` and
    ``error_type`` (an exception's class name, or a ``<stage>.<outcome>`` category).

    The record is ``message`` (anything with confluent-kafka's ``topic()``, ``partition()``,
    ``offset()``, ``key()``, ``value()`` and ``headers()``), or else the one at ``topic`` /
    ``partition`` / ``offset``. ``key``, ``value`` and ``headers`` override the message's own
    (without a message they default to None, None and no headers). Raises ``ValueError`` when
    neither a message nor a topic says where the record came from.
    """
    if message is not None:
        topic = message.topic() if topic is None else topic
        partition = message.partition() if partition is None else partition
        offset = message.offset() if offset is None else offset
        key = message.key() if key is _FROM_MESSAGE else key
        value = message.value() if value is _FROM_MESSAGE else value
        headers = message.headers() if headers is _FROM_MESSAGE else headers
    if topic is None:
        raise ValueError("a dead letter needs the record's source: a message or a topic")
    return DeadLetter(
        reason=reason, error_type=error_type, source_topic=topic, source_partition=partition,
        source_offset=offset, key=None if key is _FROM_MESSAGE else key,
        value=None if value is _FROM_MESSAGE else value,
        headers=() if headers is _FROM_MESSAGE else headers_of(headers), stage=stage,
        created_at=now_ms() if created_at is None else created_at)
