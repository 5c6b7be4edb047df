"""The proxy's tool-calling trajectories (``reef_stream.intake.trajectories``), without a
broker: turns chain only when the prompt carries every token so far, and nothing held is lost
to a split, a version change, idleness or the bound on what is held."""

from __future__ import annotations

from reef_stream.core.events import (
    POLICY_VERSION_KEY,
    UNKNOWN_POLICY_VERSION,
    SegmentSource,
    events_equal,
)
from reef_stream.intake.trajectories import Given, Trajectories
from tests import factories
from tests.factories import ids, logprobs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(gid: str, prompt: list[int], completion: list[int], **overrides):
    return factories.generation(gid, prompt_token_ids=ids(prompt),
                                completion_token_ids=ids(completion),
                                completion_logprobs=logprobs([-0.5] * len(completion)),
                                **overrides)


def generations(given: list[Given]) -> list:
    return [g.generation for g in given]


def test_a_turn_whose_prompt_carries_the_trajectory_extends_it_and_the_answer_ends_it():
    held = Trajectories()
    assert held.turn("c", turn("t0", [1, 2], [10, 11]), calls_tools=True) == []
    assert held.turn("c", turn("t1", [1, 2, 10, 11, 7], [12]), calls_tools=True,
                     environment_role="tool:add") == []
    # nothing came between: the two policy turns are one run
    ((g, trajectory),) = held.turn("c", turn("t2", [1, 2, 10, 11, 7, 12], [13, 14]),
                                   calls_tools=False)
    assert trajectory == "t0", "named by its first turn"
    assert (g.generation_id, g.prompt_token_ids.tolist()) == ("t2", [1, 2])
    assert g.completion_token_ids.tolist() == [10, 11, 7, 12, 13, 14]
    assert g.completion_logprobs.tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, -0.5]
    assert [(s.source, s.length, s.role) for s in g.segments] == [
        (SegmentSource.POLICY, 2, "assistant"), (SegmentSource.ENVIRONMENT, 1, "tool:add"),
        (SegmentSource.POLICY, 3, "assistant")]
    assert g.metadata["proxy.turns"] == "3" and len(held) == 0
    assert held.counts == {"chained": 2}
    plain = turn("p", [5], [6])
    assert held.turn("d", plain, calls_tools=False) == [Given(plain, None)], \
        "a turn alone is unchanged, and was never held"


def test_a_turn_that_does_not_carry_it_or_another_version_ends_the_trajectory_as_it_was():
    held = Trajectories()
    first = turn("t0", [1, 2], [10, 11])
    held.turn("c", first, calls_tools=True)
    retokenised = turn("t1", [1, 2, 10, 99, 7], [12])   # the template did not give back 11
    assert held.turn("c", retokenised, calls_tools=False) == [Given(first, "t0"),
                                                              Given(retokenised, None)]
    held.turn("c", first, calls_tools=True)
    newer = turn("t1", [1, 2, 10, 11, 7], [12], policy_version=1)
    assert generations(held.turn("c", newer, calls_tools=True)) == [first]
    unknown = turn("t2", [1, 2, 10, 11, 7, 12, 8], [13], policy_version=1,
                   metadata={POLICY_VERSION_KEY: UNKNOWN_POLICY_VERSION})
    assert generations(held.turn("c", unknown, calls_tools=True)) == [newer]
    assert held.counts == {"split": 3} and len(held) == 1


def test_an_idle_trajectory_the_oldest_past_the_bound_and_all_at_close_are_given_back():
    clock = Clock()
    held = Trajectories(idle_s=10, max_held=2, clock=clock)
    a, b, c = (turn(f"t-{k}", [1], [2]) for k in "abc")
    held.turn("a", a, calls_tools=True)
    clock.now = 1
    held.turn("b", b, calls_tools=True)
    clock.now = 2
    assert held.turn("c", c, calls_tools=True) == [Given(a, "t-a")], "past max_held: the oldest"
    clock.now = 11.5
    assert generations(held.expired()) == [b]
    assert generations(held.close()) == [c] and len(held) == 0
    assert held.counts == {"expired": 2}


def agent(held: Trajectories, turns: range) -> list[Given]:
    """Turns ``turns`` of one tool-calling conversation ``c`` (of 4: the last answers without
    tools)."""
    every = [turn("t0", [1, 2], [10, 11]), turn("t1", [1, 2, 10, 11, 7], [12]),
             turn("t2", [1, 2, 10, 11, 7, 12], [13]), turn("t3", [1, 2, 10, 11, 7, 12, 13, 8], [14])]
    out: list[Given] = []
    for k in turns:
        out += held.turn("c", every[k], calls_tools=k < 3, environment_role="tool:add")
    return out


def test_a_held_trajectory_restored_from_what_held_gives_goes_on_as_the_original():
    (want,) = agent(Trajectories(), range(4))
    for upto in (1, 2, 3):
        original = Trajectories()
        assert agent(original, range(upto)) == []
        so_far = original.held("c")
        assert so_far is not None and so_far.trajectory == "t0"
        assert original.held("other") is None
        restored = Trajectories()
        assert restored.restore("c", so_far.generation, so_far.trajectory, idle_for=3) == []
        assert restored.counts == {"restored": 1} and len(restored) == 1
        (got,) = agent(restored, range(upto, 4))
        assert got.trajectory == want.trajectory == "t0"
        assert events_equal(got.generation, want.generation), upto


def test_a_restored_trajectory_keeps_its_idle_time_and_splits_an_older_one_off():
    clock = Clock()
    clock.now = 100
    held = Trajectories(idle_s=10, clock=clock)
    a, b = turn("t-a", [1], [2]), turn("t-b", [3], [4])
    assert held.restore("c", a, "t-a", idle_for=4) == []
    assert held.restore("c", b, "t-b", idle_for=2) == [Given(a, "t-a")], \
        "one conversation's older trajectory, given back when it was not done"
    clock.now = 107.5
    assert held.expired() == []
    clock.now = 108
    assert held.expired() == [Given(b, "t-b")], "idle 2 s before it was restored, 8 s after"
