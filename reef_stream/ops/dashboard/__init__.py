"""``reef dashboard``: live charts of a namespace's metrics on a local web page.

Every stage writes ``Metric`` events to ``<ns>.metrics`` (``reef_stream.ops.metrics``); this
package charts them while a run goes on, the live counterpart of the demo's ``report.html``:

- ``store``: per-series points in bounded memory (``SeriesStore``);
- ``server``: the consumer that fills the store (it commits nothing) and the aiohttp server of
  the page and ``/api/series`` (``serve``);
- ``static/``: the page (``index.html``, ``dashboard.js``: which charts, grouped by stage) and
  the vendored chart library, uPlot 1.6.32 (MIT), so the page needs no network.
"""
