"""The Kafka client's types and constants that the other layers use, from one place.

Only modules of ``reef_stream.topics`` import confluent_kafka (tests/unit/test_architecture.py
checks): a stage, a command or the intake takes the client's names from here and builds its
clients with the factories of ``reef_stream.topics.connect``. So one place knows the client
library, and a version bump or a replacement of it touches ``topics/`` only.

``AdminClient`` is imported on first use (PEP 562): its module (``confluent_kafka.admin``)
stays unloaded for a process that only produces or consumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

__all__ = [
    "OFFSET_BEGINNING",
    "TIMESTAMP_NOT_AVAILABLE",
    "AdminClient",
    "Consumer",
    "KafkaError",
    "KafkaException",
    "Message",
    "Producer",
    "TopicPartition",
]


def __getattr__(name: str) -> Any:
    """``AdminClient``, imported when it is first asked for."""
    if name == "AdminClient":
        from confluent_kafka.admin import AdminClient

        globals()[name] = AdminClient
        return AdminClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
