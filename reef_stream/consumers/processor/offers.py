"""The processor's offers: the records a partition pair lets through, decoded and validated.

``decode_offers`` turns what ``PartitionPair.ready`` hands over into the
``(record, at, origin, encoded)`` tuples ``ProcessorState.offer_all`` takes, keeping the
bytes read for the records' snapshots (``snapshots.Encoded``), and sets aside each record
that does not decode or fails ``intake.validation`` (written past the SDK: NaN logprobs,
negative versions), which the runtime dead-letters in the same transaction. Validation
checks the batch's arrays at once (``validate_many``); each record in turn only when the
batch holds a bad one, so the outcome is the same as validating record by record.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reef_stream.api.processor import Origin
from reef_stream.core.errors import FatalError, InvalidRecord
from reef_stream.core.events import Feedback, Generation
from reef_stream.core.serde import FINGERPRINT_HEADER, SchemaRegistry
from reef_stream.engine.snapshots import Encoded
from reef_stream.intake.validation import validate, validate_many

Offer = tuple[Generation | Feedback, int, Origin, Encoded]


def decode_offers(registry: SchemaRegistry, generations: str, partition: int,
                  ready: Iterable[tuple[str, Any, int]], positions: dict[tuple[str, int], int],
                  bad: list[tuple[Any, InvalidRecord]]) -> list[Offer]:
    """The offers of ``ready``'s ``(topic, message, at)`` records of ``partition``, decoded
    (a Generation from the topic ``generations``, else a Feedback) and valid, in order. Each
    record that does not decode or validate goes to ``bad`` as ``(message, why)``, in order;
    every record read moves ``positions[(topic, partition)]`` past it."""
    read = []  # (message, its record or why it is invalid, at, origin, encoded)
    undecodable = False
    for topic, message, at in ready:
        offset = message.offset()
        positions[(topic, partition)] = offset + 1
        value, headers = message.value(), message.headers()
        try:
            record = registry.decode(value, headers,
                                     Generation if topic == generations else Feedback,
                                     topic=topic, partition=partition, offset=offset)
        except InvalidRecord as error:
            read.append((message, error, at, None, None))
            undecodable = True
            continue
        # the bytes read go into the record's snapshots as they are (snapshots.Encoded)
        read.append((message, record, at, Origin(topic, partition, offset),
                     Encoded(value, _fingerprint(headers))))
    try:
        if undecodable:
            raise InvalidRecord("a record did not decode")
        validate_many([entry[1] for entry in read])
    except InvalidRecord:
        read = [(message, _invalid(record), *rest) for message, record, *rest in read]
    offers = []
    for message, record, at, origin, encoded in read:
        if isinstance(record, InvalidRecord):
            bad.append((message, record))
        else:
            offers.append((record, at, origin, encoded))
    return offers


def _invalid(record: Any) -> Any:
    """``record`` if it is valid, else why not (an ``InvalidRecord``, as it already is for a
    record that did not decode)."""
    if isinstance(record, InvalidRecord):
        return record
    try:
        validate(record)
    except InvalidRecord as error:
        return error
    return record


def _fingerprint(headers: list[tuple[str, bytes]]) -> bytes:
    """The writer-schema fingerprint header of a record that decoded (so it has one)."""
    for name, value in headers:
        if name == FINGERPRINT_HEADER:
            return value
    raise FatalError(f"a record decoded without a {FINGERPRINT_HEADER} header")
