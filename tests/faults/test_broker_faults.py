"""Broker faults under the demo's load (``reef_stream.demo.faults``), short: one fault of each
kind on a three-node cluster while every stage runs as a process, then every promise checked
from the log. ``bench/broker_faults.py`` is the long run (target 0.9)."""

from __future__ import annotations

from reef_stream.demo.faults import Timeline, run_broker_faults
from reef_stream.demo.run import DemoOptions


def test_the_loop_survives_a_killed_a_paused_and_a_controller_broker(settings, tmp_path):
    options = DemoOptions(target=0.5, time_limit=420, drain_s=120, run_dir=tmp_path / "run",
                          namespace="faults")
    run = run_broker_faults(options, settings=settings, workdir=tmp_path,
                            timeline=Timeline(first_s=45, gap_s=10, down_s=5, pause_s=12))
    print(run.result.line())
    print(run.verdict())
    kinds = [(f.kind, f.undone_at is not None) for f in run.injected]
    assert kinds == [("SIGKILL broker", True), ("SIGSTOP broker", True),
                     ("SIGKILL controller", True)], run.verdict()
    assert run.passed, run.verdict()
    outcomes = run.result.outcomes
    assert outcomes["generations"] > 1000 and outcomes["in_units"] > 0, outcomes
