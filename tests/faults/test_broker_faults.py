"""Broker faults under the demo's load (``reef_stream.demo.faults``), short: one fault of each
kind on a three-node cluster while every stage runs as a process, then every promise checked
from the log. ``bench/broker_faults.py`` is the long run (target 0.9).

What it asserts: every fault was injected and undone, every acknowledged generation is in its
topic, every generation has exactly one outcome, no unit was trained twice or lost, and the
loop went on: it stops once 10 versions were promoted after the last fault was undone. The
accuracy is printed, not asserted: on two cores, three brokers beside seven stage processes
leave the trainer a fraction of a core, too little to learn the task in a CI-sized run (the
same holds without faults: ``bench/broker_faults.py --no-faults``); the bench run reports it.
"""

from __future__ import annotations

import dataclasses

import pytest

from reef_stream.demo.faults import Timeline, run_broker_faults
from reef_stream.demo.run import DemoOptions


@pytest.mark.timeout(1020)
def test_the_loop_survives_a_killed_a_paused_and_a_controller_broker(settings, tmp_path,
                                                                       namespace):
    # Target 0: the run stops on versions_after, 10 versions promoted after the last fault.
    # A writer stuck in a transaction on a dead coordinator (the processor is, in some runs,
    # after the controller's kill) exits for a restart once stuck_commit_s passed, 40 s here
    # (REEF_STUCK_COMMIT_S; at the default 120 s a stuck run took 285 s in CI, one that was
    # not stuck 138 s); a healthy commit through the 12-s pause takes seconds. The drain
    # outlasts the watchdog: a writer stuck just before it still settles it all. The time
    # limit leaves room for a restart and ten promotions after it; a healthy run stops at
    # its tenth.
    stuck_commit_s = 40.0
    options = DemoOptions(target=0.0, rate=75.0, time_limit=480, drain_s=300,
                          run_dir=tmp_path / "run", namespace=namespace)
    run = run_broker_faults(options, settings=dataclasses.replace(
                                settings, stuck_commit_s=stuck_commit_s), workdir=tmp_path,
                            timeline=Timeline(first_s=45, gap_s=10, down_s=5, pause_s=12),
                            versions_after=10)
    print(run.result.line())
    print(run.verdict())
    checks = {what: held for what, held, _ in run.checks()}
    kinds = [(f.kind, f.undone_at is not None) for f in run.injected]
    assert kinds == [("SIGKILL broker", True), ("SIGSTOP broker", True),
                     ("SIGKILL controller", True)], run.verdict()
    for promise in ("every fault injected and undone",
                    "every acknowledged generation is in its topic",
                    "every generation has exactly one outcome",
                    "no unit trained twice, none lost"):
        assert checks[promise], run.verdict()
    outcomes = run.result.outcomes
    assert outcomes["generations"] > 1000 and outcomes["in_units"] > 0, outcomes
    # The loop went on: the trainer and the evaluator kept publishing after the last fault.
    assert checks["the loop went on after the faults"], run.verdict() + _stage_logs(run)
    assert run.promoted_after_faults >= 10 and run.result.reached, run.verdict() + _stage_logs(run)


def _stage_logs(run, lines: int = 12) -> str:
    """The last ``lines`` of every stage's log: what a stalled loop's stages were doing (a CI
    run keeps nothing else of them)."""
    tails = []
    for log in sorted((run.result.report.parent / "logs").glob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"\n--- {log.name} ends:\n" + "\n".join(text))
    return "".join(tails)
