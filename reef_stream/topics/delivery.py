"""One record produced and acknowledged: ``deliver``, for writes that must be durable before
the caller goes on (a dead letter before its offset is committed, a decision before it is
reported)."""

from __future__ import annotations

import time
from typing import Any

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.topics.kafka import KafkaError, Producer

#: How long ``deliver`` waits for the broker's acknowledgement of one record.
DELIVERY_TIMEOUT_S = 60.0


def deliver(producer: Producer, topic: str, key: bytes | None, value: bytes | None,
            headers: Any, what: str, timeout: float = DELIVERY_TIMEOUT_S) -> None:
    """Produce one record and block until the broker acknowledged it. Raises
    ``ConfigurationError`` for a missing topic and ``FatalError`` for anything else that
    stops it being acknowledged: nothing after it may be committed."""
    outcome: list[KafkaError | None] = []
    try:
        producer.produce(topic, key=key, value=value, headers=headers,
                         on_delivery=lambda error, _: outcome.append(error))
    except Exception as error:  # noqa: BLE001 - BufferError, a record too large, ...
        raise FatalError(f"{what} could not be sent: {error}; its offset stays "
                         "uncommitted") from error
    deadline = time.monotonic() + timeout
    while not outcome:
        producer.poll(0.1)
        if time.monotonic() > deadline:
            raise FatalError(f"{what} was not acknowledged within {timeout:.0f} s; "
                             "its offset stays uncommitted")
    if outcome[0] is not None:
        error = outcome[0]
        if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            raise ConfigurationError(f"topic {topic} does not exist: run `reef topics create`")
        raise FatalError(f"{what} was refused by the broker: {error.str()}; its offset stays "
                         "uncommitted")
