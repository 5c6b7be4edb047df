"""Reward faults you can dial in (``reef_stream.demo.reward_faults``), without a broker: the
spec and its errors, draws that are the same in every process, the share of failing ids,
the outage's window, and the wrapper (sync and async, its source kept, in the sandbox's
form too)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reef_stream.api.rewards import NamedReward, Reward, is_transient
from reef_stream.consumers.reward.calls import is_coroutine_function
from reef_stream.consumers.reward.sandbox.reference import worker_target
from reef_stream.consumers.reward.sandbox.worker import resolve
from reef_stream.core.errors import ConfigurationError
from reef_stream.demo.reward_faults import (
    HANG, OUTAGE, RAISE, InjectedFault, RewardFaults, draw, sandbox_target, with_faults,
)
from tests.faults.records import generation

_ROOT = Path(__file__).resolve().parents[2]
IDS = [f"gen-{i:07d}" for i in range(20_000)]


def _score(g) -> Reward:
    return Reward(reward=1.0, components={"ok": 1.0})


async def _ascore(g) -> Reward:
    await asyncio.sleep(0)
    return Reward(reward=1.0)


def test_the_spec_parses_and_prints_back():
    faults = RewardFaults.parse("raise=0.05, hang=0.01,hang_s=12.5,outage=120:60")
    assert (faults.raise_p, faults.hang_p, faults.hang_s) == (0.05, 0.01, 12.5)
    assert (faults.outage_start, faults.outage_s, faults.outage_at) == (120.0, 60.0, None)
    assert RewardFaults.parse(faults.text()) == faults
    anchored = faults.anchored(1_795_000_000.25)
    assert anchored.outage_at == 1_795_000_120.25 and anchored.outage_start is None
    assert "outage_at=1795000120.25:60.0" in anchored.text()
    assert RewardFaults.parse(anchored.text()) == anchored
    assert RewardFaults.parse("") == RewardFaults() and RewardFaults().text() == ""
    assert RewardFaults.parse("hang=0.5").hang_s == 300.0


def test_every_bad_part_is_named_in_one_error():
    with pytest.raises(ConfigurationError) as error:
        RewardFaults.parse("raise=1.5,flaky=0.1,hang_s=-2,outage=30,hang=often,raise=0.1,"
                           "outage_at=5:nan")
    problems = error.value.problems
    assert len(problems) == 7, problems
    for words in ("'raise=1.5': a rate is in [0, 1]", "'flaky=0.1' is not one of",
                  "'hang_s=-2': expected a finite number, 0 or more",
                  "'outage=30': expected START:SECONDS", "'hang=often': 'often' is not a number",
                  "raise is given twice", "'outage_at=5:nan': expected a finite number"):
        assert any(words in p for p in problems), (words, problems)
    with pytest.raises(ConfigurationError, match="not both"):
        RewardFaults.parse("outage=1:2,outage_at=3:4")
    with pytest.raises(ConfigurationError) as error:  # built directly, checked the same
        RewardFaults(raise_p=1.5, hang_s=float("inf"))
    assert len(error.value.problems) == 2, error.value.problems


def test_draws_are_fixed_by_kind_and_id_in_every_process():
    assert draw("gen-0000001", RAISE) == draw("gen-0000001", RAISE)
    assert draw("gen-0000001", RAISE) != draw("gen-0000001", HANG)
    assert all(0 <= draw(i, RAISE) < 1 for i in IDS[:1000])
    code = ("from reef_stream.demo.reward_faults import draw; "
            "print(repr(draw('gen-0000007', 'raise')))")
    for seed in ("1", "2"):  # Python's hash() would differ between these
        shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, cwd=_ROOT, env={**os.environ, "PYTHONHASHSEED": seed})
        assert float(shown.stdout) == draw("gen-0000007", RAISE)


def test_the_share_of_failing_ids_is_near_the_rate():
    faults = RewardFaults.parse("raise=0.1,hang=0.02")
    raising = [i for i in IDS if faults.raises(i)]
    hanging = [i for i in IDS if faults.hangs(i)]
    assert abs(len(raising) / len(IDS) - 0.1) < 0.01
    # a hang is drawn apart from the raise, among the ids that do not raise
    assert abs(len(hanging) / len(IDS) - 0.02 * 0.9) < 0.005
    assert not set(raising) & set(hanging)
    assert [i for i in IDS if faults.fault(i, 0.0) == RAISE] == raising
    assert [i for i in IDS if faults.fault(i, 0.0) == HANG] == hanging
    assert not any(RewardFaults().fault(i, 0.0) for i in IDS[:1000])


def test_the_outage_covers_its_window_only_once_anchored():
    relative = RewardFaults.parse("outage=10:5")
    with pytest.raises(ValueError, match="anchor"):
        relative.fault("gen-0000001", 0.0)
    with pytest.raises(ValueError, match="anchor"):
        with_faults(NamedReward("s", _score), relative)
    faults = relative.anchored(1000.0)
    assert [faults.fault("gen-0000001", t) for t in (1009.99, 1010.0, 1014.99, 1015.0)] == \
        [None, OUTAGE, OUTAGE, None]


def test_a_sync_reward_raises_hangs_and_scores_as_its_id_says():
    faults = RewardFaults.parse("raise=0.3,hang=0.3,hang_s=0.2")
    reward = with_faults(NamedReward("judge", _score), faults)
    assert reward.source == "judge" and not is_coroutine_function(reward)
    generations = [generation(i) for i in range(40)]
    raising = next(g for g in generations if faults.raises(g.generation_id))
    hanging = next(g for g in generations if faults.hangs(g.generation_id))
    healthy = next(g for g in generations if faults.fault(g.generation_id, 0.0) is None)
    for _ in range(3):  # every try of the same generation
        with pytest.raises(InjectedFault, match=raising.generation_id) as error:
            reward(raising)
        assert not is_transient(error.value)
    began = time.monotonic()
    assert reward(hanging) == _score(hanging)
    assert time.monotonic() - began >= 0.2
    began = time.monotonic()
    assert reward(healthy) == _score(healthy)
    assert time.monotonic() - began < 0.1


def test_an_outage_is_transient_for_every_generation():
    faults = RewardFaults.parse("outage=0:30").anchored(time.time())
    reward = with_faults(NamedReward("judge", _score), faults)
    for i in range(5):
        with pytest.raises(Exception) as error:
            reward(generation(i))
        assert is_transient(error.value) and "injected outage" in str(error.value)


def test_an_async_reward_stays_async():
    faults = RewardFaults.parse("raise=0.5,hang=0.5,hang_s=0.1")
    reward = with_faults(NamedReward("ajudge", _ascore), faults)
    assert reward.source == "ajudge" and is_coroutine_function(reward)
    generations = [generation(i) for i in range(40)]
    raising = next(g for g in generations if faults.raises(g.generation_id))
    hanging = next(g for g in generations if faults.hangs(g.generation_id))
    with pytest.raises(InjectedFault):
        asyncio.run(reward(raising))
    began = time.monotonic()
    assert asyncio.run(reward(hanging)) == Reward(reward=1.0)
    assert time.monotonic() - began >= 0.1


def test_the_sandbox_workers_build_the_same_faulty_reward_from_plain_fields():
    faults = RewardFaults.parse("raise=0.5,outage=3600:60").anchored(time.time())
    target = sandbox_target("tests.recipes.sandbox_rewards:hostile", (), faults)
    named = worker_target(target)  # what the pool gives its workers: a class and JSON fields
    assert named["target"] == "reef_stream.demo.reward_faults:SandboxedFaults"
    assert named["build"]["target"] == "tests.recipes.sandbox_functions:hostile_judge"
    assert RewardFaults.parse(named["build"]["faults"]) == faults
    built = resolve(named["target"], named["overrides"], named["build"])  # as a worker does
    for g in (generation(i) for i in range(20)):
        if faults.raises(g.generation_id):
            with pytest.raises(InjectedFault):
                built(g)
        else:
            assert built(g).reward == len(g.completion_token_ids) / 100
