"""The dashboard's web server and the consumer that feeds it.

    serve(bootstrap, namespace, host="127.0.0.1", port=8050, announce=print)   # blocks

``MetricsFollower`` reads, on a thread of its own, into a ``SeriesStore``:

- ``<ns>.metrics``: every stage's ``Metric`` events;
- ``<ns>.publications``: each ``Publication`` (kept for the scorecard row), and its
  measurement as the series ``evaluator / measurement.<key>`` labelled with its model and
  decision (the evaluator writes no measurement as a metric);
- ``<ns>.dead-letters``: each ``DeadLetter`` counted, as the counter series
  ``<its stage> / dead_letters`` labelled with its ``kind`` (``error_type``): the count so
  far, stamped with the newest ``created_at`` seen for that series, so its points stay in
  order of time and count though the topic's partitions interleave (and a 0 before the first:
  ``rates.DEAD_LETTERS``);

and, every ``GENERATED_EVERY_S``, how many records ``<ns>.generations`` holds (the sum over
partitions of high minus low watermark, as ``reef scorecard`` counts them; nothing of it is
read). It assigns every partition itself, from the beginning or from now, and commits nothing:
a dashboard is a reader, never a member of a pipeline's consumer group. A topic that does not
exist yet (a dashboard started before the pipeline) is looked for again every few seconds.

Endpoints: ``GET /`` the page, ``GET /static/...`` its script, styles and the vendored uPlot
(no network needed), ``GET /api/series`` the store as written (one series per process and
label set), as JSON::

    {"namespace": "reef", "topics": ["reef.metrics", "reef.publications", "reef.dead-letters"],
     "waiting": [], "events": 1234, "undecodable": 0, "dropped_series": 0, "max_points": 1000,
     "series": [{"stage": "trainer", "name": "loss", "labels": {"group": "g", ...},
                 "points": [[1767000000.25, 0.69], ...]}, ...]}

and ``GET /api/dashboard[?per_instance=1]`` what the page draws: the same status fields,
``"scorecard"``: the first row's tiles (``card.first_row``), and ``"series"``: the stage
sections' series, counters as rates and instances combined unless ``per_instance``
(``rates.chart_series``). Times are seconds since the epoch (a metric's ``created_at``).
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

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import DeadLetter, Metric, Publication
from reef_stream.core.metric_names import STAGE_EVALUATOR
from reef_stream.core.serde import SchemaRegistry
from reef_stream.ops.dashboard.card import first_row
from reef_stream.ops.dashboard.rates import DEAD_LETTERS, RATE_WINDOW_S, chart_series
from reef_stream.ops.dashboard.store import SeriesStore
from reef_stream.topics import declarations
from reef_stream.topics.connect import new_consumer
from reef_stream.topics.kafka import OFFSET_BEGINNING, TopicPartition
from reef_stream.topics.metrics import metric

__all__ = ["STATIC_DIR", "MetricsFollower", "make_app", "serve"]

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
#: Seconds between looks for a followed topic that does not exist yet.
TOPIC_RETRY_S = 3.0
#: Seconds between two counts of the generations topic's records (for the goodput).
GENERATED_EVERY_S = 5.0
#: Counts of the generations topic kept (the older half is thinned out when full).
MAX_GENERATED = 1000


class MetricsFollower:
    """Reads the namespace's metrics, publications and dead letters into ``store`` on a daemon
    thread, and counts its generations.

    ``start`` once, ``stop`` once (joins the thread and closes the consumer; idempotent).
    The counters (``events``, ``undecodable``), ``waiting`` (topics not found yet),
    ``publications`` and ``generated`` are read by other threads without a lock: each is one
    reference, replaced whole (``publications`` and ``generated`` are copied before a change).
    """

    def __init__(self, bootstrap: str, namespace: str, store: SeriesStore, *,
                 from_beginning: bool = True) -> None:
        self.store = store
        self.topics = [declarations.metrics(namespace), declarations.publications(namespace),
                       declarations.dead_letters(namespace)]
        self.waiting = list(self.topics)
        self.events = self.undecodable = 0
        self.from_beginning = from_beginning
        #: Every publication read, the last of each (model, version, decision).
        self.publications: dict[tuple[str, int, str], Publication] = {}
        #: ``(seconds, records)`` of ``<ns>.generations``, each time it was counted.
        self.generated: list[tuple[float, int]] = []
        self._generations = declarations.generations(namespace)
        self._dead: dict[tuple[str, str], tuple[int, int]] = {}  # (stage, kind) -> count, ms
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
        looked = counted = 0.0
        while not self._stop.is_set():
            if self.waiting and time.monotonic() - looked >= TOPIC_RETRY_S:
                looked = time.monotonic()
                self._assign_new()
            if time.monotonic() - counted >= GENERATED_EVERY_S:
                counted = time.monotonic()
                self._count_generations()
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

    def _count_generations(self) -> None:
        """Add ``(now, records in <ns>.generations)`` to ``generated`` (nothing when the topic
        does not exist or cannot be read now: looked at again later)."""
        try:
            found = self._consumer.list_topics(self._generations, timeout=5).topics
            topic = found.get(self._generations)
            if topic is None or topic.error is not None:
                return
            records = 0
            for p in topic.partitions:
                low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(self._generations, p), timeout=5)
                records += max(high - max(low, 0), 0)
        except Exception as error:  # noqa: BLE001 - the broker may come later; count again
            log.warning("dashboard: cannot count %s: %s", self._generations, error)
            return
        generated = [*self.generated, (time.time(), records)]
        if len(generated) > MAX_GENERATED:   # every second one, counted back from the newest
            generated = generated[(len(generated) - 1) % 2::2]
        self.generated = generated

    def _start(self, topic: str, partition: int) -> int:
        """From the beginning, or from the partition's end now (its high watermark, not
        ``OFFSET_END``, which would be resolved later and could skip what arrives meanwhile)."""
        if self.from_beginning:
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
            self.publications = {**self.publications, (
                event.model, event.policy_version, event.decision.value): event}
            for key, value in event.measurement.items():
                self.store.add(metric(STAGE_EVALUATOR, f"measurement.{key}", value,
                                      {"model": event.model, "decision": event.decision.value},
                                      created_at=event.created_at))
        elif isinstance(event, DeadLetter):
            key = (event.stage or "unknown", event.error_type)
            labels = {"kind": key[1]}
            if key not in self._dead:   # none before: a 0, a rate window earlier
                self.store.add(metric(key[0], DEAD_LETTERS, 0, labels, created_at=(
                    event.created_at - int(RATE_WINDOW_S * 1000))))
            count, at = self._dead.get(key, (0, event.created_at))
            count, at = count + 1, max(at, event.created_at)
            self._dead[key] = (count, at)
            self.store.add(metric(key[0], DEAD_LETTERS, count, labels, created_at=at))


def make_app(follower: MetricsFollower, namespace: str) -> web.Application:
    """The aiohttp application of the endpoints above, over ``follower`` and its store."""

    async def index(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    def status() -> dict:
        store = follower.store
        return {"namespace": namespace, "topics": follower.topics, "waiting": follower.waiting,
                "events": follower.events, "undecodable": follower.undecodable,
                "dropped_series": store.dropped_series, "max_points": store.max_points}

    async def series(_: web.Request) -> web.Response:
        return web.json_response({**status(), "series": follower.store.snapshot()})

    def charted(per_instance: bool) -> dict:
        series = follower.store.series()
        from_zero = follower.from_beginning
        combined = chart_series(series, from_zero=from_zero)
        return {**status(), "per_instance": per_instance,
                "scorecard": first_row(series, follower.publications.values(),
                                       generated=follower.generated, namespace=namespace,
                                       from_zero=from_zero, charted=combined),
                "series": chart_series(series, per_instance=True, from_zero=from_zero)
                if per_instance else combined}

    async def dashboard(request: web.Request) -> web.Response:
        per_instance = request.query.get("per_instance", "0") not in ("", "0", "false")
        return web.json_response(await asyncio.to_thread(charted, per_instance))

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/api/series", series)
    app.router.add_get("/api/dashboard", dashboard)
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
