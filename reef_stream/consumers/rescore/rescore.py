"""Re-scoring the log: a (fixed) reward over logged generations, emitted as a new feedback source.

    rescorer = Rescorer(recipe, source="exact_match_v2", start=Earliest(), to_ms=None)
    summary = rescorer.run()      # blocks until the range is scored, or stop()

When a reward bug is found, the generations are still in the log. A ``Rescorer``
runs a recipe's reward function over the generations of a range of the log and
emits ``Feedback`` under ``source`` (id ``<generation id>:<source>``), through a
``RewardWorker`` of the consumer group ``<ns>.rescore.<source>``. A recipe whose
processor waits for ``source``, processed and trained by fresh groups, then
learns from the corrected rewards; the old feedback stays in the log beside the
new (``reef trace`` shows both).

1. The range, fixed per partition when a run starts: from ``start`` (the
   earliest record still in the log, or the first at or after a time) to the
   first record at or after ``to_ms``, exclusive, or without it the end of the
   log when the run starts.
2. The group: on a partition where it never committed, its offset is first
   moved to the range's start (``topics.cursors.replay``, refused while the
   group has live members); elsewhere it resumes from its committed offset. So
   a killed rescore, restarted, goes on where it stopped, and a generation is
   scored once under ``source``: only the uncommitted tail a kill leaves is
   scored again, re-sent with the same feedback id (the processor drops it as a
   duplicate). Running it again over a range already scored scores nothing.
3. The worker takes no record at or past the range's end
   (``RewardOptions.until``); the rescorer watches the group's committed
   offsets and stops the worker once every partition reached its end, logging
   progress meanwhile. Failed calls are dead letters, as in ``reef reward``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from reef_stream.api.recipe import NamedReward, Recipe
from reef_stream.consumers.reward.worker import RewardOptions, RewardSummary, RewardWorker
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.settings import Settings, load_settings
from reef_stream.topics import declarations
from reef_stream.topics.connect import bootstrap_servers
from reef_stream.topics.cursors import (
    AtTime, Earliest, Latest, TopicInfo, committed_offsets, offsets_at, replay, resolve_topic,
)

log = logging.getLogger(__name__)

#: Seconds between two looks at the group's committed offsets (and progress lines).
WATCH_EVERY_S = 1.0
PROGRESS_EVERY_S = 10.0
#: The session timeout of the rescorer's consumer (the processor's): a killed rescore's member
#: holds the group's partitions until it runs out, and a restarted rescore waits that long to
#: join (librdkafka's default, 45 s, made every resume after a kill wait 45 s).
SESSION_TIMEOUT_MS = 10_000


def rescore_group(namespace: str, source: str) -> str:
    """The consumer group that rescores under ``source``: one per source, so it resumes."""
    return f"{namespace}.rescore.{source}"


@dataclasses.dataclass(frozen=True)
class RescoreRange:
    """Per partition, where this run starts (the group's position) and the end it stops before."""

    starts: dict[int, int]
    ends: dict[int, int]

    @property
    def total(self) -> int:
        return sum(max(0, self.ends[p] - self.starts[p]) for p in self.ends)

    def done(self, committed: dict[int, int | None]) -> int:
        return sum(min(max(0, (committed.get(p) or 0) - self.starts[p]),
                       max(0, self.ends[p] - self.starts[p])) for p in self.ends)


class Rescorer:
    """One run of a rescore; see the module docstring. ``options``: the reward worker's
    (concurrency, timeout, retries...; its ``group`` and ``until`` are set here). Raises
    ``ConfigurationError`` for a recipe without a reward function or a missing topic."""

    def __init__(self, recipe: Recipe, *, source: str, start: Earliest | AtTime,
                 to_ms: int | None = None, options: RewardOptions = RewardOptions(),
                 settings: Settings | None = None, bootstrap: str | None = None):
        if recipe.reward is None:
            raise ConfigurationError(f"recipe {recipe.name!r} has no reward function to "
                                     "rescore with (Recipe(reward=...))")
        if not source:
            raise ConfigurationError("--source must name the new feedback source")
        if recipe.reward.source != source:
            recipe = dataclasses.replace(recipe, reward=NamedReward(source, recipe.reward))
        self.recipe, self.source, self.start, self.to_ms = recipe, source, start, to_ms
        self.settings = settings or load_settings()
        self.namespace = self.settings.namespace
        self.bootstrap = bootstrap or bootstrap_servers(self.settings)
        self.group = rescore_group(self.namespace, source)
        self.options = dataclasses.replace(options, group=self.group)
        self.summary = RewardSummary(group=self.group)
        self.range: RescoreRange | None = None
        self._worker: RewardWorker | None = None
        self._stop = threading.Event()

    def stop(self, *, now: bool = False) -> None:
        """Stop the run cleanly (``now``: without waiting for running calls). Any thread."""
        self._stop.set()
        if self._worker is not None:
            self._worker.stop(now=now)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> RewardSummary:
        """Position the group, score the range, stop at its end; returns the worker's counters.
        Blocks."""
        topic = resolve_topic(self.bootstrap, self.namespace,
                              declarations.generations(self.namespace))
        self.range = self._position(topic)
        log.info("rescore %s: %d generations to score in %s (start %s, end %s per partition)",
                 self.source, self.range.total, topic.name, self.range.starts, self.range.ends)
        if self.range.total == 0 or self._stop.is_set():
            return self.summary
        self._worker = RewardWorker(self.recipe, settings=self.settings, bootstrap=self.bootstrap,
                                    options=dataclasses.replace(self.options,
                                                                until=self.range.ends),
                                    consumer_config={"session.timeout.ms": SESSION_TIMEOUT_MS})
        self.summary = self._worker.summary
        if self._stop.is_set():
            return self.summary
        watcher = threading.Thread(target=self._watch, args=(topic,), name="reef-rescore-watch",
                                   daemon=True)
        watcher.start()
        try:
            return self._worker.run()
        finally:
            self._stop.set()
            watcher.join(5)

    def _position(self, topic: TopicInfo) -> RescoreRange:
        """Move the group to the range's start where it never committed; the range."""
        committed = committed_offsets(self.bootstrap, self.group, topic)
        fresh = [p for p, offset in committed.items() if offset is None]
        if fresh:
            replay(self.bootstrap, self.group, topic, self.start, fresh)
            committed = committed_offsets(self.bootstrap, self.group, topic)
        end = Latest() if self.to_ms is None else AtTime(self.to_ms)
        ends = offsets_at(self.bootstrap, topic, end)
        starts = {p: int(committed[p] or 0) for p in topic.partitions}
        return RescoreRange(starts, {p: max(ends[p], starts[p]) for p in topic.partitions})

    def _watch(self, topic: TopicInfo) -> None:
        """Watcher thread: stop the worker once the group committed every partition's end."""
        shown = time.monotonic()
        while not self._stop.wait(WATCH_EVERY_S):
            try:
                committed = committed_offsets(self.bootstrap, self.group, topic)
            except Exception as error:  # the cluster may blink; the worker reports real faults
                log.warning("rescore %s: reading the group's offsets failed: %s", self.source,
                            error)
                continue
            done = self.range.done(committed)
            if done >= self.range.total:
                log.info("rescore %s: all %d generations of the range scored", self.source,
                         self.range.total)
                self._worker.stop()
                return
            if time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                log.info("rescore %s: %d of %d generations scored (%.0f %%)", self.source, done,
                         self.range.total, 100.0 * done / self.range.total)
