"""The dashboard's web server and the consumer that feeds it.

    serve(bootstrap, namespace, host="127.0.0.1", port=8050, announce=print)   # blocks

``MetricsFollower`` reads ``<ns>.metrics`` (every stage's ``Metric`` events) and
``<ns>.publications`` (each ``Publication``'s measurement, as the series
``evaluator / measurement.<key>`` labelled with its model and decision: the evaluator writes
no measurement as a metric) on a thread of its own, into a ``SeriesStore``. It assigns every
partition itself, from the beginning or from now, and commits nothing: a dashboard is a
reader, never a member of a pipeline's consumer group. A topic that does not exist yet (a
dashboard started before the pipeline) is looked for again every few seconds.

Endpoints: ``GET /`` the page, ``GET /static/...`` its script, styles and the vendored uPlot
(no network needed), ``GET /api/series`` the store as JSON::

    {"namespace": "reef", "topics": ["reef.metrics", "reef.publications"], "waiting": [],
     "events": 1234, "undecodable": 0, "dropped_series": 0, "max_points": 1000,
     "series": [{"stage": "trainer", "name": "loss", "labels": {"group": "g", ...},
                 "points": [[1767000000.25, 0.69], ...]}, ...]}

Times are seconds since the epoch (a metric's ``created_at``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from reef_stream.topics.connect import new_consumer
from reef_stream.ops.dashboard.store import SeriesStore
from reef_stream.errors import ConfigurationError
from reef_stream.topics.events import Metric, Publication
from reef_stream.ops.metrics import STAGE_EVALUATOR, metric
from reef_stream.topics import declarations
from reef_stream.topics.kafka import OFFSET_BEGINNING, TopicPartition
from reef_stream.topics.serde import SchemaRegistry

__all__ = ["STATIC_DIR", "MetricsFollower", "make_app", "serve"]

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
#: Seconds between looks for a followed topic that does not exist yet.
TOPIC_RETRY_S = 3.0


class MetricsFollower:
    """Reads the namespace's metrics and publications into ``store`` on a daemon thread.

    ``start`` once, ``stop`` once (joins the thread and closes the consumer; idempotent).
    The counters (``events``, ``undecodable``) and ``waiting`` (topics not found yet) are read
    by other threads without a lock: each is one reference, replaced whole.
    """

    def __init__(self, bootstrap: str, namespace: str, store: SeriesStore, *,
                 from_beginning: bool = True) -> None:
        self.store = store
        self.topics = [declarations.metrics(namespace), declarations.publications(namespace)]
        self.waiting = list(self.topics)
        self.events = self.undecodable = 0
        self._from_beginning = from_beginning
        self._registry = SchemaRegistry.default()
        self._consumer = new_consumer(bootstrap, f"{namespace}.dashboard")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._consumer.close()

    def _run(self) -> None:
        looked = 0.0
        while not self._stop.is_set():
            if self.waiting and time.monotonic() - looked >= TOPIC_RETRY_S:
                looked = time.monotonic()
                self._assign_new()
            if len(self.waiting) == len(self.topics):
                self._stop.wait(0.5)
                continue
            for message in self._consumer.consume(1000, timeout=0.5):
                if message.error() is None and message.value() is not None:
                    self._take(message)

    def _assign_new(self) -> None:
        """Add the partitions of followed topics that exist now to the assignment."""
        try:
            found = self._consumer.list_topics(timeout=5).topics
            ready = [t for t in self.waiting if t in found and found[t].error is None]
            partitions = [TopicPartition(t, p, self._start(t, p))
                          for t in ready for p in found[t].partitions]
        except Exception as error:  # noqa: BLE001 - the broker may come later; look again
            log.warning("dashboard: cannot read the topics' metadata: %s", error)
            return
        if ready:
            self._consumer.incremental_assign(partitions)
            self.waiting = [t for t in self.waiting if t not in ready]

    def _start(self, topic: str, partition: int) -> int:
        """From the beginning, or from the partition's end now (its high watermark, not
        ``OFFSET_END``, which would be resolved later and could skip what arrives meanwhile)."""
        if self._from_beginning:
            return OFFSET_BEGINNING
        return self._consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                    timeout=10)[1]

    def _take(self, message) -> None:
        try:
            event = self._registry.decode(message.value(), message.headers())
        except Exception:  # noqa: BLE001 - not the dashboard's to judge: counted, skipped
            self.undecodable += 1
            return
        self.events += 1
        if isinstance(event, Metric):
            self.store.add(event)
        elif isinstance(event, Publication):
            for key, value in event.measurement.items():
                self.store.add(metric(STAGE_EVALUATOR, f"measurement.{key}", value,
                                      {"model": event.model, "decision": event.decision.value},
                                      created_at=event.created_at))


def make_app(follower: MetricsFollower, namespace: str) -> web.Application:
    """The aiohttp application of the endpoints above, over ``follower`` and its store."""

    async def index(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def series(_: web.Request) -> web.Response:
        store = follower.store
        return web.json_response({
            "namespace": namespace, "topics": follower.topics, "waiting": follower.waiting,
            "events": follower.events, "undecodable": follower.undecodable,
            "dropped_series": store.dropped_series, "max_points": store.max_points,
            "series": store.snapshot()})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/api/series", series)
    app.router.add_static("/static", STATIC_DIR)
    return app


def serve(bootstrap: str, namespace: str, *, host: str, port: int, from_beginning: bool = True,
          announce: Callable[[str], None]) -> None:
    """Follow the namespace's metrics and serve the dashboard until SIGINT or SIGTERM.

    ``announce(url)`` is called once the port is bound. Blocks. Raises ``ConfigurationError``
    when the port is taken or the address cannot be bound.
    """
    follower = MetricsFollower(bootstrap, namespace, SeriesStore(), from_beginning=from_beginning)

    async def run() -> None:
        runner = web.AppRunner(make_app(follower, namespace), access_log=None)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as error:
                taken = error.errno == errno.EADDRINUSE
                raise ConfigurationError(
                    f"port {port} on {host} is taken (another dashboard?): choose another with "
                    f"--port" if taken else f"cannot listen on {host}:{port}: {error}") from error
            follower.start()
            announce(f"http://{f'[{host}]' if ':' in host else host}:{port}/")
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopped.set)
            await stopped.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(run())
    finally:
        follower.stop()
