"""The proxy's tool-calling trajectories (``reef_stream.intake.trajectories``), without a
broker: turns chain only when the prompt carries every token so far, and nothing held is lost
to a split, a version change, idleness or the bound on what is held."""

from __future__ import annotations

from reef_stream.core.events import POLICY_VERSION_KEY, UNKNOWN_POLICY_VERSION, SegmentSource
from reef_stream.intake.trajectories import Trajectories
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


def test_a_turn_whose_prompt_carries_the_trajectory_extends_it_and_the_answer_ends_it():
    held = Trajectories()
    assert held.turn("c", turn("t0", [1, 2], [10, 11]), calls_tools=True) == []
    assert held.turn("c", turn("t1", [1, 2, 10, 11, 7], [12]), calls_tools=True,
                     environment_role="tool:add") == []
    # nothing came between: the two policy turns are one run
    (g,) = held.turn("c", turn("t2", [1, 2, 10, 11, 7, 12], [13, 14]), calls_tools=False)
    assert (g.generation_id, g.prompt_token_ids.tolist()) == ("t2", [1, 2])
    assert g.completion_token_ids.tolist() == [10, 11, 7, 12, 13, 14]
    assert g.completion_logprobs.tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, -0.5]
    assert [(s.source, s.length, s.role) for s in g.segments] == [
        (SegmentSource.POLICY, 2, "assistant"), (SegmentSource.ENVIRONMENT, 1, "tool:add"),
        (SegmentSource.POLICY, 3, "assistant")]
    assert g.metadata["proxy.turns"] == "3" and len(held) == 0
    assert held.counts == {"chained": 2}
    plain = turn("p", [5], [6])
    assert held.turn("d", plain, calls_tools=False) == [plain], "a turn alone is unchanged"


def test_a_turn_that_does_not_carry_it_or_another_version_ends_the_trajectory_as_it_was():
    held = Trajectories()
    first = turn("t0", [1, 2], [10, 11])
    held.turn("c", first, calls_tools=True)
    retokenised = turn("t1", [1, 2, 10, 99, 7], [12])   # the template did not give back 11
    assert held.turn("c", retokenised, calls_tools=False) == [first, retokenised]
    held.turn("c", first, calls_tools=True)
    newer = turn("t1", [1, 2, 10, 11, 7], [12], policy_version=1)
    assert held.turn("c", newer, calls_tools=True) == [first]
    unknown = turn("t2", [1, 2, 10, 11, 7, 12, 8], [13], policy_version=1,
                   metadata={POLICY_VERSION_KEY: UNKNOWN_POLICY_VERSION})
    assert held.turn("c", unknown, calls_tools=True) == [newer]
    assert held.counts == {"split": 3} and len(held) == 1


def test_an_idle_trajectory_the_oldest_past_the_bound_and_all_at_close_are_given_back():
    clock = Clock()
    held = Trajectories(idle_s=10, max_held=2, clock=clock)
    a, b, c = (turn(f"t-{k}", [1], [2]) for k in "abc")
    held.turn("a", a, calls_tools=True)
    clock.now = 1
    held.turn("b", b, calls_tools=True)
    clock.now = 2
    assert held.turn("c", c, calls_tools=True) == [a], "past max_held: the oldest"
    clock.now = 11.5
    assert held.expired() == [b]
    assert held.close() == [c] and len(held) == 0
    assert held.counts == {"expired": 2}
