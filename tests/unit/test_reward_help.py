"""``reef reward --help`` states the fast lane's deadlines as the code has them (the help
once said 3 x the p99 after the code had moved to 1.5 x)."""

from __future__ import annotations

from click.testing import CliRunner

from reef_stream.cli.reward import reward
from reef_stream.consumers.reward.calls import ADAPT_FACTOR, ADAPT_FLOOR_S, RewardOptions


def test_the_help_names_the_fast_lanes_deadline_the_code_uses():
    result = CliRunner().invoke(reward, ["--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"past {ADAPT_FACTOR:g} x that p99 (at least --fast-lane-floor)" in text
    assert f"[default: {ADAPT_FLOOR_S:g};" in text.split("--fast-lane-floor SECONDS", 1)[1]
    assert RewardOptions().fast_lane_floor == ADAPT_FLOOR_S
    assert f"past {ADAPT_FACTOR:g} x the p99 moves to the slow lane" in text


def test_the_help_names_the_circuit_and_abandoned_limits_the_code_uses():
    from reef_stream.consumers.reward import circuit

    result = CliRunner().invoke(reward, ["--help"], terminal_width=400)
    text = " ".join(result.output.split())
    shares = {0.8: "4 in 5"}
    assert f"when {shares[circuit.OPEN_FRACTION]} of the last {circuit.WINDOW} generations'" in text
    assert "one is tried again each second" in text and circuit.PROBE_EVERY_S == 1.0
    assert f"[default: {RewardOptions().abandoned_limit};" in text.split("--abandoned-limit", 1)[1]
