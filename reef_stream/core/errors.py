"""Every exception reef-stream raises, under one root.

Each class tells the caller what to do about it:

- ``ConfigurationError``: fix the configuration or the environment, then start
  again. It lists every problem found, not just the first.
- ``InvalidRecord``: this record will never be accepted as it is; send it to
  dead letters (with topic, partition, offset and reason) or report it to its
  producer. The pipeline goes on.
- ``RetryableError``: a transient condition (broker unreachable, queue full);
  retrying later can succeed.
- ``FatalError``: the process cannot go on safely and should stop.
"""

from __future__ import annotations


class ReefError(Exception):
    """Root of every exception raised by reef-stream."""


class ConfigurationError(ReefError):
    """The configuration or the environment is wrong; nothing was started.

    ``problems`` lists every problem found, so one run reports them all.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:\n" + "\n".join(
                f"  - {problem}" for problem in self.problems
            )
        super().__init__(message)


class RetryableError(ReefError):
    """A transient failure: the same call may succeed later."""


class FatalError(ReefError):
    """The process cannot continue safely."""


class InvalidRecord(ReefError):
    """A record that can never be accepted as it is.

    ``field`` names the offending field where one is to blame; ``reason`` says
    what is wrong with it. ``topic``, ``partition`` and ``offset`` say where
    the record was read from, when it was read from Kafka (None otherwise).
    """

    def __init__(
        self,
        reason: str,
        *,
        field: str | None = None,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ):
        self.reason = reason
        self.field = field
        self.topic = topic
        self.partition = partition
        self.offset = offset
        super().__init__(self._describe())

    def _describe(self) -> str:
        parts = []
        if self.field:
            parts.append(f"field {self.field!r}: ")
        parts.append(self.reason)
        if self.topic is not None:
            parts.append(f" (at {self.topic}[{self.partition}]@{self.offset})")
        return "".join(parts)


class UnknownSchemaError(InvalidRecord):
    """A message whose schema fingerprint no known schema has."""


class CorruptRecordError(InvalidRecord):
    """A message whose bytes do not decode with the schema it names."""


class TopicMismatchError(ConfigurationError):
    """Topics exist with settings that differ from their declaration."""
