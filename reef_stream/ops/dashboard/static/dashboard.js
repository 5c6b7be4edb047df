// reef dashboard: polls /api/series every 2 s and draws the charts with uPlot.
//
// STAGES declares the charts, grouped by stage in the order data flows through the pipeline;
// each chart lists metric names (reef_stream/metrics.py) or a name prefix, and draws one line
// per series (a metric name with its labels) that matches. A metric no declared chart claims
// gets a chart of its own at the end of its stage, so nothing a stage writes is hidden (a
// recipe's objective.* and loss metrics, for instance). A declared chart without data yet says
// so.
//
// For tests and scripts each chart's <figure> carries data-chart ("stage/title"),
// data-series (series it has) and data-points (points uPlot drew, set by its draw hook; 0 for
// a chart without data), and <body> carries data-polls (answers drawn) and data-charts
// (charts on the page).

"use strict";

const POLL_MS = 2000;
const TOTALS = " (running totals)";

const LAG = {title: "consumer lag per partition", names: ["consumer_lag"]};

const STAGES = [
  {stage: "intake", charts: [
    {title: "records" + TOTALS, names: ["sent", "acknowledged", "failed", "rejected"]},
    {title: "records in the spool", names: ["spooled"]},
  ]},
  {stage: "reward", charts: [
    {title: "mean reward sent, per source", names: ["reward_mean"]},
    {title: "records scored" + TOTALS, names: ["records", "rewarded"]},
    {title: "failed and retried" + TOTALS,
     names: ["failed", "invalid", "undecodable", "timed_out", "retried", "dropped"]},
    LAG,
  ]},
  {stage: "processor", charts: [
    {title: "generation outcomes" + TOTALS, names: ["generations"]},
    {title: "units and transactions" + TOTALS,
     names: ["units", "transactions", "aborted_transactions"]},
    {title: "feedback by fate" + TOTALS, names: ["feedback"]},
    {title: "duplicate, invalid and undecodable records" + TOTALS,
     names: ["duplicate_generations", "invalid_records", "checkpoints_undecodable"]},
    {title: "units the newest checkpoint has not passed (trainer backlog)",
     names: ["trainer_backlog"]},
    {title: "mean reward of used feedback", names: ["reward.mean"]},
    {title: "mean response tokens", names: ["response_tokens.mean"]},
    {title: "share of responses truncated", names: ["truncation_rate"]},
    LAG,
  ]},
  {stage: "trainer", charts: [
    {title: "reward of trained samples (objective)", names: ["objective.reward_mean"]},
    {title: "loss", names: ["loss"]},
    {title: "staleness: trainer − behaviour version", names: ["staleness_mean", "staleness_max"]},
    {title: "trained samples by staleness" + TOTALS, names: ["staleness_samples"]},
    {title: "logprob gap |current − behaviour| per token",
     names: ["logprob_gap.same_version", "logprob_gap.older"]},
    {title: "KL(behaviour ‖ current) per token", names: ["kl_behaviour"]},
    {title: "gradient norm (before clipping)", names: ["grad_norm"]},
    {title: "update ratio ‖Δθ‖ / ‖θ‖", names: ["update_ratio"]},
    {title: "steps", names: ["steps"]},
    {title: "units" + TOTALS,
     names: ["units_trained", "units_stale", "units_duplicate", "units_invalid"]},
    {title: "seconds per step", names: ["step_seconds", "data_seconds"]},
    LAG,
  ]},
  {stage: "evaluator", charts: [
    {title: "measurements of candidates", prefix: "measurement."},
    {title: "decisions" + TOTALS, names: ["decisions"]},
    {title: "candidate version by decision", names: ["candidate_version"]},
    {title: "candidates skipped" + TOTALS, names: ["candidates_skipped"]},
    {title: "seconds per measurement", names: ["measure_seconds"]},
    LAG,
  ]},
  {stage: "follower", charts: [
    {title: "policy version per replica", names: ["policy_version"]},
    {title: "versions loaded and refused, publications undecodable" + TOTALS,
     names: ["versions_loaded", "versions_refused", "publications_undecodable"]},
    {title: "seconds to load a version", names: ["load_seconds"]},
    {title: "seconds from checkpoint / decision to serving",
     names: ["checkpoint_to_serving_seconds", "publication_to_serving_seconds"]},
  ]},
];

// Labels every series of a stage carries, the same throughout a run: not worth a legend entry.
const QUIET_LABELS = new Set(["recipe", "group"]);
// Charts with more series (one per policy version, say) draw without a legend.
const MAX_LEGEND = 12;
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
const drawn = new Map();  // chart id -> {plot, keys}

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
      chart = {title: one.name, names: [one.name], series: []};
      stage.charts.push(chart);
    }
    chart.series.push(one);
  }
  return stages;
}

// A legend label: the metric name where the chart has several, and the labels that tell its
// series apart (topic names without the namespace's prefix).
function seriesLabel(chart, one, namespace) {
  const names = new Set(chart.series.map(s => s.name));
  const parts = names.size > 1 || chart.prefix ? [one.name.replace(chart.prefix || "", "")] : [];
  for (const [key, value] of Object.entries(one.labels)) {
    const values = new Set(chart.series.map(s => s.labels[key]));
    if (values.size > 1 && !QUIET_LABELS.has(key)) {
      parts.push(`${key}=${value.replace(namespace + ".", "")}`);
    }
  }
  return parts.join(" ") || one.name;
}

function seriesKey(one) {
  return one.stage + "/" + one.name + JSON.stringify(one.labels);
}

function figureFor(section, id, title) {
  let figure = document.getElementById(id);
  if (!figure) {
    figure = document.createElement("figure");
    figure.className = "chart";
    figure.id = id;
    figure.dataset.chart = id;
    figure.innerHTML = `<figcaption></figcaption><div class="plot"></div>`;
    figure.querySelector("figcaption").textContent = title;
    section.querySelector(".charts").appendChild(figure);
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
    document.getElementById("stages").appendChild(section);
  }
  return section;
}

function draw(figure, chart, namespace) {
  const id = figure.dataset.chart;
  const box = figure.querySelector(".plot");
  figure.dataset.series = chart.series.length;
  if (chart.series.every(s => s.points.length === 0)) {
    figure.dataset.points = 0;
    box.innerHTML = `<div class="empty">no data yet</div>`;
    return;
  }
  const tables = chart.series.map(s => [s.points.map(p => p[0]), s.points.map(p => p[1])]);
  const data = uPlot.join(tables);
  const keys = chart.series.map(seriesKey).join("|");
  const previous = drawn.get(id);
  if (previous && previous.keys === keys) {
    previous.plot.setData(data);
    return;
  }
  if (previous) previous.plot.destroy();
  box.innerHTML = "";
  const options = {
    width: 480, height: 220,
    series: [{}, ...chart.series.map((s, i) => ({
      label: seriesLabel(chart, s, namespace), stroke: COLOURS[i % COLOURS.length],
      width: 1.5, spanGaps: true, points: {show: s.points.length < 60},
    }))],
    axes: [{}, {size: 60}],
    legend: {show: chart.series.length <= MAX_LEGEND, live: false},
    hooks: {draw: [plot => { figure.dataset.points = drawnPoints(plot); }]},
  };
  drawn.set(id, {plot: new uPlot(options, data, box), keys});
}

// The points uPlot drew: the non-null values of its series.
function drawnPoints(plot) {
  return plot.data.slice(1).reduce((sum, ys) => sum + ys.filter(y => y != null).length, 0);
}

function render(answer) {
  let charts = 0;
  for (const stage of layout(answer.series)) {
    const section = sectionFor(stage.stage);
    for (const chart of stage.charts) {
      const figure = figureFor(section, `${stage.stage}/${chart.title}`, chart.title);
      draw(figure, chart, answer.namespace);
      charts += 1;
    }
  }
  const waiting = answer.waiting.length ? `; waiting for ${answer.waiting.join(", ")}` : "";
  document.getElementById("status").textContent =
    `namespace ${answer.namespace}: ${answer.events} events read from ${answer.topics.join(", ")}` +
    `, ${answer.series.length} series${waiting}; updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.charts = charts;
  document.body.dataset.polls = Number(document.body.dataset.polls) + 1;
}

async function poll() {
  try {
    const response = await fetch("/api/series");
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    render(await response.json());
  } catch (error) {
    document.getElementById("status").textContent = `cannot read /api/series: ${error.message}`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
