"""``reef demo --help`` states the rates the command uses when ``--rate`` is left out. No
broker: only the help is printed."""

from __future__ import annotations

from click.testing import CliRunner

from reef_stream.cli.demo import SANDBOX_RATE, VLLM_RATE, demo
from reef_stream.demo.run import DEFAULT_RATE, DemoOptions


def test_the_help_gives_the_rates_the_demo_defaults_to():
    text = " ".join(CliRunner().invoke(demo, ["--help"]).output.split())
    assert DemoOptions().rate == DEFAULT_RATE
    assert f"[default: {DEFAULT_RATE:g}; with --engine vllm or --sandbox process " \
           f"{VLLM_RATE:g}]." in text
    assert VLLM_RATE == SANDBOX_RATE   # the help names one figure for both
