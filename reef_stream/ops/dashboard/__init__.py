"""``reef dashboard``: live charts of a namespace's metrics on a local web page.

Every stage writes ``Metric`` events to ``<ns>.metrics`` (``reef_stream.core.metric_names``); this
package charts them while a run goes on, the live counterpart of the demo's ``report.html``.
The page opens on the scorecard row, then each stage's charts:

- ``store``: per-series points in bounded memory (``SeriesStore``);
- ``rates``: the arithmetic, pure: counters as rates per second, instances added up (a restart
  a new run), gauges of several instances averaged or added up (``chart_series``);
- ``card``: the scorecard row, pure (``first_row``: measurement per version, reward, staleness,
  goodput, records/s per stage, lag, checkpoint -> serving, dead letters);
- ``server``: the consumer that fills the store (it commits nothing) and the aiohttp server of
  the page, ``/api/series`` and ``/api/dashboard`` (``serve``);
- ``static/``: the page (``index.html``, ``dashboard.js``: which charts, grouped by stage) and
  the vendored chart library, uPlot 1.6.32 (MIT), so the page needs no network.
"""
