// reef dashboard: polls /api/dashboard every 2 s and draws it with uPlot.
//
// The page opens on the scorecard row (the API's "scorecard": one tile per figure, a headline
// over a small chart; reef_stream/ops/dashboard/card.py says what each is and leaves out the
// figures of features the namespace does not use), then the stages. The server does every sum
// and rate (reef_stream/ops/dashboard/rates.py): this script only lays out and draws what it
// answers. A counter's series arrive as a rate per second with its instances added up (kind
// "rate"); "per instance" (the checkbox, or ?per_instance=1 in the address) asks for every
// process's series apart.
//
// STAGES declares the charts, grouped by stage in the order data flows through the pipeline;
// each chart lists metric names (reef_stream/core/metric_names.py) or a name prefix, and draws one
// line per series that matches. A metric no declared chart claims gets a chart of its own at
// the end of its stage, so nothing a stage writes is hidden (a recipe's objective.* and loss
// metrics, for instance). A chart, and a stage's section, appears once its first series
// arrives, in its declared place, and stays: a run without a sandbox shows no sandbox charts.
// Axis ticks are labelled with as many decimals as tell them apart (tickLabels).
//
// For tests and scripts each chart's <figure> carries data-chart ("stage/title"),
// data-series (series it has), data-points (points uPlot drew, set by its draw hook; 0 for
// a chart without data) and data-yticks (the y axis's tick labels as drawn, JSON); each tile's
// <figure> carries data-tile (its id), data-series, data-points, data-yticks and data-value
// (its headline); <body> carries data-polls (answers drawn), data-charts (charts on the page),
// data-tiles and data-per-instance.

"use strict";

const POLL_MS = 2000;
const PER_S = ", per second";

const LAG = {title: "consumer lag per topic", names: ["consumer_lag"]};
const CPU = {title: "CPU in use, cores", names: ["process_cpu_seconds"]};
const DEAD = {title: "dead letters by kind" + PER_S, names: ["dead_letters"]};

const STAGES = [
  {stage: "intake", charts: [
    {title: "records" + PER_S, names: ["sent", "acknowledged", "failed", "rejected"]},
    {title: "records in the spool", names: ["spooled"]},
    DEAD,
  ]},
  {stage: "reward", charts: [
    {title: "mean reward sent, per source", names: ["reward_mean"]},
    {title: "records scored" + PER_S, names: ["records", "rewarded"]},
    {title: "failed and retried" + PER_S,
     names: ["failed", "invalid", "undecodable", "timed_out", "retried", "dropped"]},
    {title: "reward call seconds, p50 and p99", names: ["call_seconds_p50", "call_seconds_p99"]},
    {title: "slots busy past their p99, the slow lane, and timed-out calls still running",
     names: ["saturated_slots", "slow_lane", "abandoned_calls"]},
    {title: "the circuit: open 1/0, and the generations it holds",
     names: ["circuit_open", "held"]},
    {title: "sandbox workers (pool, live; network isolated 1/0)",
     names: ["sandbox_pool_size", "sandbox_live", "sandbox_network_isolated"]},
    {title: "sandbox starts, restarts and failures by category" + PER_S,
     names: ["sandbox_warm_starts", "sandbox_cold_starts", "sandbox_restarts",
             "sandbox_failures"]},
    {title: "sandbox seconds: worker start and call, p50 and p99",
     names: ["sandbox_start_seconds_p50", "sandbox_start_seconds_p99",
             "sandbox_call_seconds_p50", "sandbox_call_seconds_p99"]},
    LAG, CPU, DEAD,
  ]},
  {stage: "processor", charts: [
    {title: "generation outcomes" + PER_S, names: ["generations"]},
    {title: "units and transactions" + PER_S,
     names: ["units", "transactions", "aborted_transactions"]},
    {title: "feedback by fate" + PER_S, names: ["feedback"]},
    {title: "duplicate, invalid and undecodable records" + PER_S,
     names: ["duplicate_generations", "invalid_records", "checkpoints_undecodable"]},
    {title: "units the newest checkpoint has not passed (trainer backlog)",
     names: ["trainer_backlog"]},
    {title: "mean reward of used feedback", names: ["reward.mean"]},
    {title: "mean response tokens", names: ["response_tokens.mean"]},
    {title: "share of responses truncated", names: ["truncation_rate"]},
    LAG, CPU, DEAD,
  ]},
  {stage: "trainer", charts: [
    {title: "reward of trained samples (objective)", names: ["objective.reward_mean"]},
    {title: "loss", names: ["loss"]},
    {title: "staleness: trainer − behaviour version", names: ["staleness_mean", "staleness_max"]},
    {title: "trained samples by staleness" + PER_S, names: ["staleness_samples"]},
    {title: "logprob gap |current − behaviour| per token",
     names: ["logprob_gap.same_version", "logprob_gap.older"]},
    {title: "KL(behaviour ‖ current) per token", names: ["kl_behaviour"]},
    {title: "gradient norm (before clipping)", names: ["grad_norm"]},
    {title: "update ratio ‖Δθ‖ / ‖θ‖", names: ["update_ratio"]},
    {title: "steps", names: ["steps"]},
    {title: "units" + PER_S,
     names: ["units_trained", "units_stale", "units_duplicate", "units_invalid"]},
    {title: "seconds per step", names: ["step_seconds", "data_seconds"]},
    LAG, CPU, DEAD,
  ]},
  {stage: "evaluator", charts: [
    {title: "measurements of candidates", prefix: "measurement."},
    {title: "decisions" + PER_S, names: ["decisions"]},
    {title: "candidate version by decision", names: ["candidate_version"]},
    {title: "candidates skipped" + PER_S, names: ["candidates_skipped"]},
    {title: "seconds per measurement", names: ["measure_seconds"]},
    LAG, CPU, DEAD,
  ]},
  {stage: "follower", charts: [
    {title: "policy version per replica", names: ["policy_version"]},
    {title: "versions loaded and refused, publications undecodable" + PER_S,
     names: ["versions_loaded", "versions_refused", "publications_undecodable"]},
    {title: "seconds to load a version", names: ["load_seconds"]},
    {title: "seconds from checkpoint / decision to serving",
     names: ["checkpoint_to_serving_seconds", "publication_to_serving_seconds"]},
    DEAD,
  ]},
];

// Charts with more series (one per policy version, say) draw without a legend.
const MAX_LEGEND = 12;
// Steps between the ticks of a version axis.
const VERSION_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
const drawn = new Map();  // chart or tile id -> {plot, keys}

function perInstance() {
  return new URLSearchParams(location.search).get("per_instance") === "1";
}

function claims(chart, name) {
  return chart.prefix ? name.startsWith(chart.prefix) : chart.names.includes(name);
}

// The charts of the page for these series: declared ones, then one per unclaimed metric name.
function layout(series) {
  const stages = STAGES.map(s => ({
    stage: s.stage, charts: s.charts.map(c => ({...c, series: []})),
  }));
  for (const one of series) {
    let stage = stages.find(s => s.stage === one.stage);
    if (!stage) {
      stage = {stage: one.stage, charts: []};
      stages.push(stage);
    }
    let chart = stage.charts.find(c => claims(c, one.name));
    if (!chart) {
      const title = one.name + (one.kind === "rate" ? PER_S : "");
      chart = {title: title, names: [one.name], series: []};
      stage.charts.push(chart);
    }
    chart.series.push(one);
  }
  return stages;
}

// A legend label: the metric name where the chart has several, and the labels that tell its
// series apart (topic names without the namespace's prefix; a trainer group or recipe where
// several write the metric, never a label all its series share).
function seriesLabel(chart, one, namespace) {
  const names = new Set(chart.series.map(s => s.name));
  const parts = names.size > 1 || chart.prefix ? [one.name.replace(chart.prefix || "", "")] : [];
  for (const [key, value] of Object.entries(one.labels)) {
    const values = new Set(chart.series.map(s => s.labels[key]));
    if (values.size > 1) {
      parts.push(`${key}=${value.replace(namespace + ".", "")}`);
    }
  }
  return parts.join(" ") || one.name;
}

function seriesKey(one) {
  return (one.stage || "") + "/" + (one.name || "") + JSON.stringify(one.labels || one.label);
}

// The figure ``id``, made (placed right after ``after``, or first in ``container``) if it is not
// on the page yet.
function figureFor(container, after, id, title, kind) {
  let figure = document.getElementById(id);
  if (!figure) {
    figure = document.createElement("figure");
    figure.className = kind;
    figure.id = id;
    figure.dataset[kind === "tile" ? "tile" : "chart"] = id.replace(/^tile:/, "");
    figure.innerHTML = kind === "tile"
      ? `<figcaption></figcaption><div class="value"></div><div class="plot"></div>`
      : `<figcaption></figcaption><div class="plot"></div>`;
    figure.querySelector("figcaption").textContent = title;
    container.insertBefore(figure, after ? after.nextSibling : container.firstChild);
  }
  return figure;
}

function sectionFor(stage) {
  let section = document.querySelector(`section[data-stage="${stage}"]`);
  if (!section) {
    section = document.createElement("section");
    section.className = "stage";
    section.dataset.stage = stage;
    section.innerHTML = `<h2></h2><div class="charts"></div>`;
    section.querySelector("h2").textContent = stage;
    section.hidden = true;   // until a chart of it has a series
    document.getElementById("stages").appendChild(section);
  }
  return section;
}

// Labels for axis ticks at ``splits`` (uPlot's values): the fewest decimals (up to 12) that put
// every label within 1% of the ticks' step of its value, so that distinct ticks read
// differently (0.0025, 0.0030, 0.0035 s, where a fixed 3 decimals would print 0.003 twice);
// 0 as "0", values of ten thousand and more in k, M or G, those below 0.001 in exponent
// notation.
function tickLabels(splits) {
  const finite = splits.filter(v => v != null && Number.isFinite(v));
  const top = Math.max(0, ...finite.map(Math.abs));
  const gaps = finite.slice(1).map((v, i) => Math.abs(v - finite[i])).filter(g => g > 0);
  const step = gaps.length ? Math.min(...gaps) : top || 1;
  const [scale, suffix] = top >= 1e10 ? [1e9, "G"] : top >= 1e7 ? [1e6, "M"]
    : top >= 1e4 ? [1e3, "k"] : [1, ""];
  const tiny = top > 0 && top < 1e-3;
  // a split a rounding error away from 0 (uPlot's 0.1 + 0.2 arithmetic) is 0, never "-0.00"
  const clean = v => Math.abs(v) < step * 1e-6 ? 0 : v;
  const format = (v, decimals) => v === 0 ? "0" : tiny ? v.toExponential(decimals)
    : (v / scale).toFixed(decimals) + suffix;
  const read = label => tiny || label === "0" ? Number(label)
    : Number(label.slice(0, label.length - suffix.length)) * scale;
  for (let decimals = 0; decimals <= 12; decimals++) {
    const labels = finite.map(v => format(clean(v), decimals));
    if (finite.every((v, i) => Math.abs(read(labels[i]) - v) <= step / 100)) {
      return splits.map(v => v == null || !Number.isFinite(v) ? "" : format(clean(v), decimals));
    }
  }
  return splits.map(v => (v == null ? "" : String(v)));
}

// The y axis's width for its tick labels (uPlot's size: values are null before the first).
function axisSize(self, values) {
  const longest = Math.max(0, ...(values || []).map(v => String(v).length));
  return Math.max(50, 24 + 7 * longest);
}

// The x scale's range: the data's, but a minute (two versions) around one instant (version)
// alone, where uPlot would span 86,400,000 seconds.
function xRange(byVersion) {
  const pad = byVersion ? 1 : 30;
  return (self, min, max) => {
    const xs = self.data[0];
    return xs.length === 1 ? [xs[0] - pad, xs[0] + pad] : [min, max];
  };
}

// Draws ``lines`` ([{label, points}]) in the figure's plot box; ``byVersion``: x is a policy
// version, not a time.
function plot(figure, lines, {width, height, byVersion = false}) {
  const id = figure.id;
  const box = figure.querySelector(".plot");
  figure.dataset.series = lines.length;
  if (lines.every(l => l.points.length === 0)) {
    figure.dataset.points = 0;
    const previous = drawn.get(id);
    if (previous) previous.plot.destroy();
    drawn.delete(id);
    // a tile's headline says what there is ("none"); a chart is only on the page with data
    box.innerHTML = figure.classList.contains("tile") ? "" : `<div class="empty">no data yet</div>`;
    return;
  }
  const tables = lines.map(l => [l.points.map(p => p[0]), l.points.map(p => p[1])]);
  const data = uPlot.join(tables);
  const keys = lines.map(l => l.key + "=" + l.label).join("|");
  const previous = drawn.get(id);
  if (previous && previous.keys === keys) {
    previous.plot.setData(data);
    return;
  }
  if (previous) previous.plot.destroy();
  box.innerHTML = "";
  const options = {
    width: width, height: height,
    scales: {x: {time: !byVersion, range: xRange(byVersion)}},
    series: [{label: byVersion ? "version" : "time"}, ...lines.map((l, i) => ({
      label: l.label, stroke: COLOURS[i % COLOURS.length],
      width: 1.5, spanGaps: true, points: {show: byVersion || l.points.length < 60},
    }))],
    // a version axis ticks whole versions only
    axes: [byVersion ? {incrs: VERSION_STEPS} : {}, {size: axisSize, values: (self, splits) => {
      const labels = tickLabels(splits);
      figure.dataset.yticks = JSON.stringify(labels);
      return labels;
    }}],
    legend: {show: lines.length <= MAX_LEGEND, live: false},
    hooks: {draw: [p => { figure.dataset.points = drawnPoints(p); }]},
  };
  drawn.set(id, {plot: new uPlot(options, data, box), keys});
}

// The points uPlot drew: the non-null values of its series.
function drawnPoints(p) {
  return p.data.slice(1).reduce((sum, ys) => sum + ys.filter(y => y != null).length, 0);
}

function renderScorecard(tiles) {
  const row = document.getElementById("scorecard-tiles");
  let previous = null;
  for (const tile of tiles) {
    const figure = figureFor(row, previous, "tile:" + tile.id, tile.title, "tile");
    previous = figure;
    figure.dataset.value = tile.value;
    figure.querySelector(".value").textContent = tile.value;
    plot(figure, tile.series.map(l => ({...l, key: l.label})),
         {width: 340, height: 150, byVersion: tile.x === "version"});
  }
  document.body.dataset.tiles = row.querySelectorAll("figure.tile").length;
}

function render(answer) {
  renderScorecard(answer.scorecard);
  let charts = 0;
  for (const stage of layout(answer.series)) {
    const section = sectionFor(stage.stage);
    let previous = null;   // the chart before, on the page: a new one goes in its declared place
    for (const chart of stage.charts) {
      const id = `${stage.stage}/${chart.title}`;
      if (!chart.series.length && !document.getElementById(id)) continue;  // nothing written
      const figure = figureFor(section.querySelector(".charts"), previous, id, chart.title,
                               "chart");
      plot(figure, chart.series.map(s => ({
        key: seriesKey(s), label: seriesLabel(chart, s, answer.namespace), points: s.points,
      })), {width: 480, height: 220});
      previous = figure;
      charts += 1;
    }
    section.hidden = previous === null;
  }
  const waiting = answer.waiting.length ? `; waiting for ${answer.waiting.join(", ")}` : "";
  const series = answer.series.length;
  const view = answer.per_instance ? "per instance" : "instances added up";
  document.getElementById("status").textContent =
    `namespace ${answer.namespace}: ${answer.events} events read from ${answer.topics.join(", ")}` +
    `, ${series} series (${view})${waiting}; updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.charts = charts;
  document.body.dataset.perInstance = answer.per_instance ? "1" : "0";
  document.body.dataset.polls = Number(document.body.dataset.polls) + 1;
}

let timer = null;

async function poll() {
  clearTimeout(timer);
  try {
    const response = await fetch(`/api/dashboard?per_instance=${perInstance() ? 1 : 0}`);
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    render(await response.json());
  } catch (error) {
    document.getElementById("status").textContent = `cannot read /api/dashboard: ${error.message}`;
  }
  timer = setTimeout(poll, POLL_MS);
}

const toggle = document.getElementById("per-instance");
toggle.checked = perInstance();
toggle.addEventListener("change", () => {
  const url = new URL(location.href);
  if (toggle.checked) url.searchParams.set("per_instance", "1");
  else url.searchParams.delete("per_instance");
  history.replaceState(null, "", url);
  poll();
});

poll();
