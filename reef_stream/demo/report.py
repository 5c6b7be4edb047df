"""``report.html`` of a demo run: the scorecard, then PNG plots, in the run directory.

    write_report(demo, seconds, ledger, scorecard)    # -> <run dir>/report.html

Plots: held-out accuracy per published version, the reward over time, the staleness of the
trained samples (from the trainer's checkpoints and the units topic) and the throughput per
stage (from the demo's own samples of the topics).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reef_stream.core.events import Decision, Publication, RolloutUnit
from reef_stream.topics.reading import read_to_end

if TYPE_CHECKING:
    from reef_stream.demo.run import Demo


def measured_accuracy(publication: Publication) -> float | None:
    """A publication's held-out accuracy (its ``accuracy``, else its first measured value)."""
    values = dict(publication.measurement)
    if "accuracy" in values:
        return values["accuracy"]
    return next(iter(values.values()), None)


def write_report(demo: Demo, seconds: float, ledger: dict[str, int],
                 scorecard: Any = None) -> Path:
    """``report.html`` with PNG plots in the run directory; returns its path. ``scorecard``: the
    run's ``reef_stream.ops.scorecard.Scorecard``, shown first as a table (None: none)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = demo.run_dir
    plots = []

    def save(name: str, figure) -> None:
        figure.tight_layout()
        figure.savefig(out / name, dpi=90)
        plt.close(figure)
        plots.append(name)

    figure, axis = plt.subplots(figsize=(6, 3.5))
    promoted = [(p.policy_version, measured_accuracy(p)) for _, p in demo.publications
                if p.decision is Decision.PROMOTED]
    rejected = [(p.policy_version, measured_accuracy(p)) for _, p in demo.publications
                if p.decision is Decision.REJECTED]
    if promoted:
        axis.plot(*zip(*promoted), "o-", label="promoted")
    if rejected:
        axis.plot(*zip(*rejected), "x", color="red", label="rejected")
    axis.axhline(demo.options.target, ls="--", color="grey", label="target")
    axis.set(xlabel="policy version", ylabel="held-out accuracy", ylim=(0, 1.02),
             title="held-out accuracy per published version")
    axis.legend()
    save("accuracy.png", figure)

    canaries = canary_decisions(demo.publications)
    if canaries:
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for x, (_, canary, incumbent, decision) in enumerate(canaries):
            color = "green" if decision is Decision.PROMOTED else "red"
            axis.plot([x, x], [incumbent, canary], "-", color=color, alpha=0.5)
            axis.plot(x, incumbent, "o", color="grey")
            axis.plot(x, canary, "^" if decision is Decision.PROMOTED else "v", color=color)
        axis.set_xticks(range(len(canaries)), [f"v{c[0]}" for c in canaries], rotation=90,
                        fontsize=7)
        axis.set(xlabel="canary version (grey: incumbent; green: promoted, red: rolled back)",
                 ylabel="online mean reward", title="canary vs incumbent on live feedback")
        save("canary.png", figure)

    figure, axis = plt.subplots(figsize=(6, 3.5))
    if demo.rewards:
        axis.plot(*zip(*demo.rewards))
    axis.set(xlabel="seconds", ylabel="mean reward of a step", title="reward over time")
    save("reward.png", figure)

    figure, axis = plt.subplots(figsize=(6, 3.5))
    staleness = training_staleness(demo)
    if staleness:
        axis.hist(staleness, bins=range(0, max(staleness) + 2), align="left")
    axis.set(xlabel="trainer version - behaviour version", ylabel="samples",
             title="staleness of trained samples")
    save("staleness.png", figure)

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name in ("generations", "feedback", "units"):
        points = [(b.at, (b.offsets[name] - a.offsets[name]) / max(b.at - a.at, 1e-6))
                  for a, b in zip(demo.samples[::5], demo.samples[5::5])]
        if points:
            axis.plot(*zip(*points), label=f"{name}/s")
    axis.set(xlabel="seconds", ylabel="records/s", title="throughput per stage")
    axis.legend()
    save("throughput.png", figure)

    accuracy, version = demo.accuracy()
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in [("recipe", demo.options.recipe), ("namespace", demo.ns),
                                ("seconds", f"{seconds:.0f}"), ("published version", version),
                                ("held-out accuracy", accuracy),
                                ("chaos kills", dict(demo.kills)), ("unit ledger", ledger)])
    images = "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in plots)
    report = out / "report.html"
    report.write_text(f"<!doctype html><title>reef demo {html.escape(demo.ns)}</title>"
                      f"<h1>reef demo: {html.escape(demo.options.recipe)}</h1>"
                      f"{scorecard_table(scorecard)}<h2>run</h2>"
                      f"<table>{rows}</table>{images}"
                      f"<pre>{html.escape(json.dumps(demo.last_status, default=str, indent=1))}</pre>")
    return report


def canary_decisions(publications: list[tuple[float, Publication]]
                     ) -> list[tuple[int, float, float, Decision]]:
    """(version, canary mean, incumbent mean, decision) of every canary decided on live
    feedback (``reef_stream.consumers.evaluator.canary``), in log order."""
    return [(p.policy_version, p.measurement["canary_mean"], p.measurement["incumbent_mean"],
             p.decision) for _, p in publications
            if p.decision in (Decision.PROMOTED, Decision.ROLLED_BACK)
            and "canary_mean" in p.measurement and "incumbent_mean" in p.measurement]


def scorecard_table(scorecard: Any) -> str:
    """The scorecard as an HTML table, one row per line of ``scorecard.lines()`` (the figure,
    then its value), its first line the caption; "" without one."""
    if scorecard is None:
        return ""
    caption, *figures = scorecard.lines()
    rows = []
    for line in figures:
        name, _, value = line.strip().partition(": ")
        indent = "&nbsp;" * 4 * ((len(line) - len(line.lstrip())) // 2 - 1)
        rows.append(f"<tr><th style='text-align:left'>{indent}{html.escape(name)}</th>"
                    f"<td>{html.escape(value)}</td></tr>")
    return (f"<h2>scorecard</h2><table class='scorecard'><caption>{html.escape(caption)}"
            f"</caption>{''.join(rows)}</table>")


def training_staleness(demo: Demo) -> list[int]:
    """Per trained sample: the step that trained it minus one, less its behaviour version."""
    from reef_stream.engine.checkpoints import CheckpointStore, load

    step_of: dict[str, int] = {}
    for stored in CheckpointStore(demo.store).steps():
        for unit_id in load(stored.uri, stored.sha256).step_units:
            step_of[unit_id] = stored.step
    found = []
    for message in read_to_end(demo.bootstrap, demo.topics["units"]):
        unit = demo.registry.decode(message.value(), message.headers(), RolloutUnit)
        if unit.unit_id in step_of:
            found += [step_of[unit.unit_id] - 1 - m.policy_version for m in unit.members]
    return [max(s, 0) for s in found]
