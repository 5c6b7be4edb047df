"""Run `reef dashboard` on a namespace and check in headless Chromium that its charts draw data.

    result = check_dashboard(cli_env, namespace, "dashboard-grpo")   # after a real run
    result["charts"]["trainer/loss"]   # {"series": 1, "points": 212, "canvas": True}
    result["screenshot"]               # test-artifacts/dashboard-grpo.png

Used by tests/integration/test_dashboard.py on a hand-written metrics log and by the demo
tests on a real run's metrics. The dashboard runs as a real `reef dashboard` process on a free
port; the page is rendered by Debian's Chromium (`/usr/bin/chromium`, installed by
scripts/test.sh), whose `--dump-dom` gives the DOM after the page's scripts ran: each chart's
<figure> says how many series it has and how many points uPlot drew (see the dashboard's
dashboard.js). A test that needs Chromium skips, saying so, where it is not installed.
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

from reef_stream.ops.processes import free_ports

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
#: Tall enough for every chart of a demo run, three charts a row.
WINDOW = "1600,8000"

#: Charts a demo run (`reef demo`, either recipe) fills: every stage's main ones.
DEMO_CHARTS = (
    "reward/mean reward sent, per source",
    "reward/records scored (running totals)",
    "processor/generation outcomes (running totals)",
    "processor/units and transactions (running totals)",
    "trainer/reward of trained samples (objective)",
    "trainer/loss",
    "trainer/staleness: trainer − behaviour version",
    "trainer/logprob gap |current − behaviour| per token",
    "trainer/KL(behaviour ‖ current) per token",
    "trainer/gradient norm (before clipping)",
    "trainer/update ratio ‖Δθ‖ / ‖θ‖",
    "evaluator/measurements of candidates",
    "evaluator/decisions (running totals)",
    "follower/policy version per replica",
)


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
    """The chart <figure>s of a dumped page (their data attributes, and whether a <canvas> is
    inside) and <body>'s data attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, Any]] = {}
        self.body: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in found.items()}
        elif tag == "figure" and "data-chart" in found:
            self._open = found["data-chart"]
            self.charts[self._open] = {"series": int(found.get("data-series") or 0),
                                       "points": int(found.get("data-points") or 0),
                                       "canvas": False}
        elif tag == "canvas" and self._open is not None:
            self.charts[self._open]["canvas"] = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._open = None


def _chromium(url: str, *arguments: str) -> str:
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW}",
         "--virtual-time-budget=8000", *arguments, url],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rendered_charts(url: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The page as headless Chromium renders it: ``(charts, body attributes)``."""
    parser = _Charts()
    parser.feed(_chromium(url, "--dump-dom"))
    return parser.charts, parser.body


def screenshot(url: str, name: str) -> Path:
    """The page as a PNG in test-artifacts/NAME.png; prints and returns the path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    _chromium(url, f"--screenshot={path}")
    assert path.stat().st_size > 0, path
    print(f"dashboard screenshot: {path}")
    return path


def check_dashboard(env: dict[str, str], namespace: str, artifact_name: str = "dashboard", *,
                    require: Iterable[str] = DEMO_CHARTS, events: int | None = None) -> dict:
    """Serve ``namespace``'s metrics with `reef dashboard` (``env``: a `reef` environment such
    as the ``cli_env`` fixture, whose REEF_NAMESPACE is replaced by ``namespace``), render the
    page in headless Chromium and check that it drew them:

    - the page polled the API and shows every chart it counts;
    - every chart with series has a canvas and drew points; every series is in a chart;
    - each chart of ``require`` (ids "stage/title") drew points.

    ``events``: wait until the dashboard read exactly that many records (else until its count
    settles). Saves test-artifacts/ARTIFACT_NAME.png. Returns ``{"url", "api" (the
    /api/series answer), "charts" ({id: {"series", "points", "canvas"}}), "screenshot"}``.
    Fails the calling test where Chromium is not installed.
    """
    require_chromium()
    with running_dashboard(env, namespace) as url:
        api = settled_series(url, events=events)
        charts, body = rendered_charts(url)
        shot = screenshot(url, artifact_name)
    assert int(body.get("data-polls", 0)) >= 1, body
    assert int(body.get("data-charts", -1)) == len(charts) > 0, (body, list(charts))
    for chart, drawn in charts.items():
        if drawn["series"]:
            assert drawn["canvas"] and drawn["points"] > 0, (chart, drawn)
    assert sum(drawn["series"] for drawn in charts.values()) == len(api["series"]), charts
    empty = [chart for chart in require if charts.get(chart, {}).get("points", 0) == 0]
    assert not empty, f"charts without data: {empty}; drawn: {charts}"
    return {"url": url, "api": api, "charts": charts, "screenshot": shot}
