"""The demo's two diagnoses of a loop that does not learn (``Demo.stalled``,
``Demo.overloaded``), from observations the test makes up. No broker: nothing is started."""

from __future__ import annotations

import pytest

from reef_stream.core.events import Decision, Publication
from reef_stream.core.settings import load_settings
from reef_stream.demo.run import Demo, DemoOptions, Sample, member_of


def publication(version: int, decision: Decision) -> Publication:
    return Publication(model="policy", policy_version=version, checkpoint_id=f"c{version}",
                       uri=f"file:///c{version}", sha256="0" * 64, decision=decision, reason="",
                       evaluator="test", evaluated=True, measurement={"accuracy": 0.5},
                       created_at=1_795_000_000_000)


@pytest.fixture
def demo(tmp_path, monkeypatch):
    monkeypatch.setenv("REEF_HOME", str(tmp_path / "home"))
    return Demo(DemoOptions(run_dir=tmp_path / "run"), settings=load_settings(),
                bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1")


def _observe(demo: Demo, seconds: int, lag_growth_per_s: float, staleness: float) -> None:
    demo.staleness = staleness
    for t in range(seconds + 1):
        demo.samples.append(Sample(float(t), {"generations": 0, "feedback": 0, "units": 0},
                                   t, 500 + int(t * lag_growth_per_s)))


def test_a_growing_trainer_lag_with_stale_samples_is_overloaded(demo):
    assert demo.recipe.schedule.units_per_step == 256 and demo.recipe.schedule.max_staleness == 16
    _observe(demo, 40, lag_growth_per_s=100, staleness=15.8)
    said = demo.overloaded()
    assert said is not None and "grew from 1500 to 4500 records in 30 s" in said
    assert demo.was_overloaded == said


@pytest.mark.parametrize("lag_growth_per_s, staleness", [
    (100, 3.0),     # a growing backlog, but what is trained is fresh: not (yet) the symptom
    (5, 15.0),      # stale, but the trainer keeps up (its lag is flat): stale for another reason
])
def test_not_overloaded(demo, lag_growth_per_s, staleness):
    _observe(demo, 40, lag_growth_per_s, staleness)
    assert demo.overloaded() is None


def test_too_short_a_history_says_nothing(demo):
    _observe(demo, 10, lag_growth_per_s=100, staleness=16)
    assert demo.overloaded() is None


def test_a_trainer_past_max_staleness_of_the_served_version_is_stalled(demo):
    demo.publications = [(1.0, publication(3, Decision.PROMOTED)),
                         (2.0, publication(4, Decision.REJECTED)),
                         (3.0, publication(5, Decision.REJECTED))]
    demo.steps = 3 + 16
    assert demo.stalled() is None
    demo.steps = 3 + 17
    said = demo.stalled()
    assert said is not None and "17 past the newest promoted version 3" in said \
        and "rejected the last 2 candidates" in said


def test_units_committed_add_up_over_a_processor_restart(demo):
    """The processors' running ``units`` metric, as the demo's rate reads it: a restarted
    processor counts from 0 again under the same instance label, which once made the demo print
    a negative units/s."""
    for value in (100, 250, 40, 90):      # instance "0" restarted after 250
        demo.count_units("0", value)
    demo.count_units("1", 30)
    assert demo.units() == 250 + 90 + 30
    demo.count_units("0", 90)             # the same figure again: no new run
    assert demo.units() == 370


def test_members_of_a_group_are_stages_of_their_own(tmp_path, monkeypatch):
    """Two processors, two reward workers and an evaluator with its standby: each a stage of
    its own with its own log, the processors distinct members (``--instance`` 0 and 1); the
    replicas wait for every member, and each member's work is its own."""
    monkeypatch.setenv("REEF_HOME", str(tmp_path / "home"))
    demo = Demo(DemoOptions(run_dir=tmp_path / "run", processors=2, reward_workers=2,
                            evaluators=2, replicas=1), settings=load_settings(),
                bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1")
    assert list(demo.stages) == ["reward", "reward-2", "processor", "processor-2", "trainer",
                                 "evaluator", "evaluator-2", "replica-0"]
    assert len({s.log for s in demo.stages.values()}) == len(demo.stages)
    assert "--instance" not in demo.commands["processor"]
    assert demo.commands["processor-2"][-2:] == ["--instance", "1"]
    assert demo.commands["reward-2"] == demo.commands["reward"]
    assert demo.commands["evaluator-2"] == demo.commands["evaluator"]
    assert [member_of(n) for n in demo.stages] == [
        "reward", "reward", "processor", "processor", "trainer", "evaluator", "evaluator",
        "replica-0"]
    for stage, processes in {"reward": ["h.11"], "processor": ["h.21", "h.22"],
                             "trainer": ["h.31"], "evaluator": ["h.41", "h.42"]}.items():
        demo.reporting[stage] = set(processes)
    assert not demo.pipeline_runs()          # one reward worker has not reported yet
    demo.reporting["reward"].add("h.12")
    assert demo.pipeline_runs()
    # reward-2 was restarted: two processes, each counting from 0
    demo.stages["reward"].pids, demo.stages["reward-2"].pids = [11], [12, 13]
    demo.rewarded.update({"h.11": 40, "h.12": 7, "h.13": 5})
    demo.count_units("1", 30)
    assert demo.work() == {"reward": 40, "reward-2": 12, "processor": 0, "processor-2": 30}
