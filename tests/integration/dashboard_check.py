"""Run `reef dashboard` on a namespace and check in headless Chromium that its charts draw data.

    result = check_dashboard(cli_env, namespace, "dashboard-grpo")   # after a real run
    result["charts"]["trainer/loss"]   # {"series": 1, "points": 212, "canvas": True,
                                       #  "yticks": ["0.2", "0.4", "0.6"]}
    result["tiles"]["staleness"]       # {"series": 1, "points": 40, "canvas": True,
                                       #  "value": "mean 1.4 · p50 1 · p99 3 (n=1200)"}
    result["order"][0]                 # "tile:measurement": the scorecard row comes first
    result["screenshot"]               # test-artifacts/dashboard-grpo.png

Used by tests/integration/test_dashboard.py on a hand-written metrics log and by the demo
tests on a real run's metrics. The dashboard runs as a real `reef dashboard` process on a free
port; the page is rendered by Debian's Chromium (`/usr/bin/chromium`, installed by
scripts/test.sh), whose `--dump-dom` gives the DOM after the page's scripts ran: each chart's
<figure> says how many series it has, how many points uPlot drew and the y axis's tick labels
(see the dashboard's dashboard.js), and each scorecard tile's its headline too; each stage's
<section> whether it is shown. A test that needs Chromium fails,
saying so, where it is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from reef_stream.core.processes import free_ports

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
#: Tall enough for every chart of a demo run, three charts a row.
WINDOW = "1600,8000"
#: The top of the page: the scorecard row and the first stage.
TOP_WINDOW = "1600,1200"

#: Charts a demo run (`reef demo`, either recipe) fills: every stage's main ones.
DEMO_CHARTS = (
    "reward/mean reward sent, per source",
    "reward/records scored, per second",
    "processor/generation outcomes, per second",
    "processor/units and transactions, per second",
    "trainer/reward of trained samples (objective)",
    "trainer/loss",
    "trainer/staleness: trainer − behaviour version",
    "trainer/logprob gap |current − behaviour| per token",
    "trainer/KL(behaviour ‖ current) per token",
    "trainer/gradient norm (before clipping)",
    "trainer/update ratio ‖Δθ‖ / ‖θ‖",
    "evaluator/measurements of candidates",
    "evaluator/decisions, per second",
    "follower/policy version per replica",
)
#: Scorecard tiles a demo run fills (card.py's ids).
DEMO_TILES = ("measurement", "reward", "staleness", "goodput", "throughput", "lag")


def require_chromium() -> None:
    """Fail (never skip: a test that cannot run must not pass for one that did) without it."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is not installed, so the dashboard page cannot be rendered: "
                    "bash scripts/test.sh installs Debian's chromium (apt-get install chromium)",
                    pytrace=False)


@contextmanager
def running_dashboard(env: dict[str, str], namespace: str, *options: str,
                      port: int | None = None) -> Iterator[str]:
    """A `reef dashboard` process on ``namespace``, on a free port (or ``port``); yields its URL
    once it answers, and stops it (SIGTERM) on exit. Fails showing its output if it exits."""
    port = port or free_ports(1)[0]
    process = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "dashboard", "--port", str(port), *options],
        env={**env, "REEF_NAMESPACE": namespace, "COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise AssertionError(f"reef dashboard exited {process.returncode}:\n"
                                     f"{process.stdout.read()}")
            try:
                urllib.request.urlopen(url + "api/series", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "reef dashboard did not answer within 60 s"
                time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            output = process.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0]
        print(f"reef dashboard ({url}):\n{output}")


def api(url: str, path: str = "api/dashboard") -> dict:
    """The dashboard's answer at ``path`` (e.g. ``api/dashboard?per_instance=1``)."""
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.load(response)


def settled_series(url: str, *, events: int | None = None, timeout: float = 120) -> dict:
    """``/api/series`` once the dashboard has found its topics and read them: ``events``
    events if given, else once its count has stayed the same (and above 0) for 3 s."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while True:
        with urllib.request.urlopen(url + "api/series", timeout=10) as response:
            answer = json.load(response)
        count = answer["events"] + answer["undecodable"]
        if count != last:
            last, since = count, time.monotonic()
        if not answer["waiting"] and (
                count == events if events is not None
                else count > 0 and time.monotonic() - since >= 3):
            return answer
        assert time.monotonic() < deadline, (f"the dashboard read {count} events of "
                                             f"{events or 'a settled log'}: {answer['waiting']}")
        time.sleep(0.5)


class _Charts(HTMLParser):
    """The chart and tile <figure>s of a dumped page (their data attributes, the y axis's tick
    labels, the legend's labels, and whether a <canvas> is inside), their order on the page
    (``tile:<id>`` or the chart's id), its stage sections (shown or hidden) and <body>'s data
    attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, Any]] = {}
        self.tiles: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.stages: dict[str, bool] = {}
        self.body: dict[str, str] = {}
        self._open: dict[str, Any] | None = None
        self._label: list[str] | None = None   # the text of a legend's label, while in it

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in found.items()}
        elif tag == "section" and "data-stage" in found:
            self.stages[found["data-stage"] or ""] = "hidden" not in found
        elif tag == "figure" and ("data-chart" in found or "data-tile" in found):
            self._open = {"series": int(found.get("data-series") or 0),
                          "points": int(found.get("data-points") or 0), "canvas": False,
                          "yticks": json.loads(found.get("data-yticks") or "[]"),
                          "legend": []}
            if "data-tile" in found:
                self._open["value"] = found.get("data-value") or ""
                self.tiles[found["data-tile"] or ""] = self._open
                self.order.append(f"tile:{found['data-tile']}")
            else:
                self.charts[found["data-chart"] or ""] = self._open
                self.order.append(found["data-chart"] or "")
        elif tag == "canvas" and self._open is not None:
            self._open["canvas"] = True
        elif self._open is not None and "u-label" in (found.get("class") or "").split():
            self._label = []

    def handle_data(self, data: str) -> None:
        if self._label is not None:
            self._label.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._open = None
        elif tag == "div" and self._label is not None and self._open is not None:
            self._open["legend"].append("".join(self._label).strip())
            self._label = None


def _chromium(url: str, *arguments: str, window: str = WINDOW) -> str:
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={window}",
         "--virtual-time-budget=8000", *arguments, url],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rendered_page(url: str) -> _Charts:
    """The page as headless Chromium renders it: its ``charts``, ``tiles``, ``order``,
    ``stages`` and ``body`` attributes."""
    parser = _Charts()
    parser.feed(_chromium(url, "--dump-dom"))
    return parser


def screenshot(url: str, name: str, window: str = WINDOW) -> Path:
    """The page as a PNG in test-artifacts/NAME.png, in a ``window`` ("width,height") of
    Chromium's; prints and returns the path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    _chromium(url, f"--screenshot={path}", window=window)
    assert path.stat().st_size > 0, path
    print(f"dashboard screenshot: {path}")
    return path


def check_dashboard(env: dict[str, str], namespace: str, artifact_name: str = "dashboard", *,
                    require: Iterable[str] = DEMO_CHARTS,
                    require_tiles: Iterable[str] = DEMO_TILES, events: int | None = None,
                    query: str = "") -> dict:
    """Serve ``namespace``'s metrics with `reef dashboard` (``env``: a `reef` environment such
    as the ``cli_env`` fixture, whose REEF_NAMESPACE is replaced by ``namespace``), render the
    page in headless Chromium and check that it drew them:

    - the page polled the API and shows every chart and scorecard tile it counts, the
      scorecard row first, each tile's headline as the API gave it;
    - every chart or tile with series has a canvas and drew points; every series of
      /api/dashboard is in a chart; no chart is on the page without a series (the charts of
      features the run does not use are left out), no stage section without a chart;
    - the y axis of every chart and tile drawn reads a distinct label at each tick, and its
      legend a distinct label for each line;
    - each chart of ``require`` (ids "stage/title") and tile of ``require_tiles`` drew points.

    ``events``: wait until the dashboard read exactly that many records (else until its count
    settles). ``query``: the page's address ends with it (e.g. "?per_instance=1"). Saves
    test-artifacts/ARTIFACT_NAME.png (the whole page) and ARTIFACT_NAME-top.png (what a
    screen shows on opening it: the scorecard row first). Returns ``{"url", "api" (the
    /api/series answer), "dashboard" (the /api/dashboard answer), "charts" ({id: {"series",
    "points", "canvas", "yticks", "legend"}}), "tiles" (the same and "value", by tile id),
    "order", "stages" ({stage: shown}), "screenshot"}``. Fails the calling test where Chromium
    is not installed.
    """
    require_chromium()
    per_instance = "per_instance=1" in query
    with running_dashboard(env, namespace) as url:
        raw = settled_series(url, events=events)
        page = rendered_page(url + query)
        answer = api(url, f"api/dashboard?per_instance={int(per_instance)}")
        shot = screenshot(url + query, artifact_name)
        screenshot(url + query, f"{artifact_name}-top", TOP_WINDOW)
    charts, tiles, body = page.charts, page.tiles, page.body
    assert int(body.get("data-polls", 0)) >= 1, body
    assert body.get("data-per-instance") == str(int(per_instance)), body
    assert int(body.get("data-charts", -1)) == len(charts) > 0, (body, list(charts))
    assert int(body.get("data-tiles", -1)) == len(tiles) == len(answer["scorecard"]), body
    assert page.order[:len(tiles)] == [f"tile:{t['id']}" for t in answer["scorecard"]], \
        page.order
    for tile in answer["scorecard"]:
        assert tiles[tile["id"]]["value"] == tile["value"], (tile, tiles[tile["id"]])
    for name, drawn in [*charts.items(), *tiles.items()]:
        if drawn["series"]:
            assert drawn["canvas"] and drawn["points"] > 0, (name, drawn)
    assert sum(drawn["series"] for drawn in charts.values()) == len(answer["series"]), charts
    unused = [name for name, drawn in charts.items() if not drawn["series"]]
    assert not unused, f"charts of metrics never written: {unused}"
    shown = {stage for stage, visible in page.stages.items() if visible}
    assert shown == {name.partition("/")[0] for name in charts}, (page.stages, list(charts))
    for name, drawn in [*charts.items(), *tiles.items()]:
        ticks = drawn["yticks"]
        if drawn["points"]:
            assert ticks and len(set(ticks)) == len(ticks), (name, ticks)
        assert len(set(drawn["legend"])) == len(drawn["legend"]), (name, drawn["legend"])
    empty = [chart for chart in require if charts.get(chart, {}).get("points", 0) == 0]
    empty += [f"tile:{t}" for t in require_tiles if tiles.get(t, {}).get("points", 0) == 0]
    assert not empty, f"charts without data: {empty}; drawn: {charts}; tiles: {tiles}"
    return {"url": url, "api": raw, "dashboard": answer, "charts": charts, "tiles": tiles,
            "order": page.order, "stages": page.stages, "screenshot": shot}
