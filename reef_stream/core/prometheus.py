"""Prometheus ``/metrics`` for a stage: the process's ``Metric`` events as gauges.

    server = serve(port=9400)          # 127.0.0.1:9400/metrics; port=0 picks a free one
    print(server.url)
    ...
    server.stop()

Every ``MetricsWriter.write`` (``reef_stream.topics.metrics``) also sets a gauge in
this process's ``Exposition`` (``exposition()``), whether or not a server
serves it; ``serve`` starts an HTTP server on a daemon thread that answers
``GET /metrics`` from it, with the client's process and GC collectors beside.

The mapping, one way:

- name: ``reef_<stage>_<name>``, every character Prometheus does not allow in
  a metric name (anything but letters, digits, ``_`` and ``:``; e.g. the ``.``
  of ``logprob_gap.older``) turned into ``_``;
- labels: the event's labels (the writer's and the call's), names mapped the
  same way (``:`` too; a leading ``__``, reserved, becomes ``_``);
- value: the last value written. Always a gauge, never a Prometheus counter:
  reef's counters are running totals since the process started, emitted as
  values, so a gauge holds them exactly and ``increase()``/``rate()`` on
  it still read a restart's drop as a reset.

One metric name always has one label set, as Prometheus expects: when a name
is written with different label keys (``decisions{decision}`` and, later,
``decisions`` without labels), every series of that name carries the union of
the keys, with ``""`` for keys a write did not give; Prometheus reads an empty
label as an absent one, so queries see each series as written. Two reef names
that map to the same Prometheus name share one family the same way.

Nothing here raises into the pipeline: ``MetricsWriter`` logs and ignores a
failure to set a gauge. ``serve`` raises ``ConfigurationError`` naming the
address when the port cannot be bound (taken, or not allowed).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric as PrometheusMetric

from reef_stream.core.errors import ConfigurationError

__all__ = ["Exposition", "MetricsServer", "exposition", "label_name", "metric_name", "serve"]

log = logging.getLogger(__name__)

#: Where a stage's ``/metrics`` listens: this host only (a ``--metrics-port`` is never public).
DEFAULT_HOST = "127.0.0.1"
PREFIX = "reef"

_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_:]")
_NOT_ALLOWED_IN_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(stage: str, name: str) -> str:
    """The Prometheus name of a reef metric: ``reef_<stage>_<name>``, ``.`` and the like → ``_``."""
    return _NOT_ALLOWED.sub("_", f"{PREFIX}_{stage}_{name}")


def label_name(key: str) -> str:
    """A Prometheus label name for a reef label key (``[a-zA-Z_][a-zA-Z0-9_]*``, not ``__...``)."""
    name = _NOT_ALLOWED_IN_LABEL.sub("_", key) or "_"
    if name[0].isdigit():
        name = "_" + name
    if name.startswith("__"):
        name = "_" + name.lstrip("_")
    return name


class Exposition:
    """The latest value of every (metric, label set) written in this process; a Prometheus
    collector (``collect``). ``set`` and ``collect`` are thread-safe and never block on I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Prometheus name -> {sorted (label, value) pairs: value}; documentation by name.
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._help: dict[str, str] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)

    def set(self, stage: str, name: str, value: float, labels: Mapping[str, str]) -> None:
        """Set the gauge of ``(stage, name, labels)`` to ``value``. Idempotent."""
        prometheus = metric_name(stage, name)
        key = tuple(sorted((label_name(k), str(v)) for k, v in labels.items()))
        with self._lock:
            self._values.setdefault(prometheus, {})[key] = float(value)
            self._help.setdefault(prometheus, f"reef {stage} metric {name!r} (reef_stream.core.metric_names)")

    def value(self, stage: str, name: str, **labels: str) -> float | None:
        """The value last set for exactly these labels, or None (for tests and checks)."""
        key = tuple(sorted((label_name(k), str(v)) for k, v in labels.items()))
        with self._lock:
            return self._values.get(metric_name(stage, name), {}).get(key)

    def collect(self) -> Iterator[PrometheusMetric]:
        """One gauge family per name; every series has the union of the name's label keys."""
        with self._lock:
            snapshot = {name: dict(series) for name, series in self._values.items()}
            helps = dict(self._help)
        for name in sorted(snapshot):
            family = PrometheusMetric(name, helps[name], "gauge")
            keys = sorted({label for labels in snapshot[name] for label, _ in labels})
            for labels, value in snapshot[name].items():
                given = dict(labels)
                family.add_sample(name, {key: given.get(key, "") for key in keys}, value)
            yield family

    def describe(self) -> list:
        return []  # names are known only once written: collected at every scrape


_exposition = Exposition()


def exposition() -> Exposition:
    """This process's exposition, which every ``MetricsWriter`` sets its gauges in."""
    return _exposition


@dataclass
class MetricsServer:
    """A running ``/metrics`` server; ``port`` is the bound one (useful after ``port=0``)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket. Blocks until the server thread ends; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(port: int, host: str = DEFAULT_HOST, source: Exposition | None = None) -> MetricsServer:
    """Serve ``source`` (default: this process's exposition) at ``http://host:port/metrics`` on a
    daemon thread; ``port=0`` binds a free port (see ``MetricsServer.port``). Returns at once.

    Raises ``ConfigurationError`` naming the address if the port cannot be bound.
    """
    registry = (source or _exposition).registry
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise ConfigurationError(
            f"cannot serve metrics on {host}:{port} ({error.strerror or error}): the port is "
            "taken or not allowed; choose another --metrics-port") from error
    bound = MetricsServer(host, server.server_port, server, thread)
    log.info("serving Prometheus metrics at %s", bound.url)
    return bound
