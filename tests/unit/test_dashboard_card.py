"""The dashboard's scorecard row (``reef_stream.ops.dashboard.card``) as a newcomer reads it: a
tile appears once the namespace wrote something it shows (a run without replicas that report
has no serving tile), and a headline of several trainer groups' values says whose each is."""

from __future__ import annotations

from reef_stream.core import metric_names as m
from reef_stream.ops.dashboard.card import REWARD, first_row
from reef_stream.ops.dashboard.rates import Series, running_totals


def _series(stage, name, labels, raw):
    totals = running_totals(v for _, v in raw)
    return Series(stage, name, labels, [(t, v, total) for (t, v), total in zip(raw, totals)])


def _tiles(series, **options):
    return {tile["id"]: tile for tile in first_row(series, **options)}


def test_a_namespace_with_nothing_written_shows_only_its_dead_letters():
    tiles = _tiles([])
    assert list(tiles) == ["dead_letters"]
    assert tiles["dead_letters"]["value"] == "none"


def test_a_tile_appears_with_the_first_series_of_its_feature():
    reward = _series(m.STAGE_TRAINER, REWARD, {"recipe": "r", "group": "g"}, [(0, 0.5)])
    assert "serving" not in _tiles([reward])
    served = _series(m.STAGE_FOLLOWER, m.FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS,
                     {"replica": "a", "model": "m"}, [(1, 0.25)])
    tiles = _tiles([reward, served])
    assert tiles["serving"]["value"] == "mean 0.25 s · p50 0.25 s · p99 0.25 s (n=1)"
    # the row keeps its order whatever appears
    assert list(tiles) == ["reward", "serving", "dead_letters"]
    # the generations topic counted empty: nothing generated yet, no goodput
    assert list(_tiles([reward], generated=[(5, 0)])) == ["reward", "dead_letters"]
    assert list(_tiles([reward], generated=[(5, 0), (10, 8)])) == [
        "reward", "goodput", "dead_letters"]


def test_one_groups_reward_is_a_number_and_several_groups_each_say_whose():
    def reward(group, recipe, value):
        return _series(m.STAGE_TRAINER, REWARD, {"recipe": recipe, "group": group},
                       [(0, 0.0), (10, value)])

    assert _tiles([reward("g", "grpo", 0.512)])["reward"]["value"] == "0.512"
    several = _tiles([reward("a", "grpo", 0.512), reward("b", "grpo", 0.113),
                      reward("c", "grpo", 0.0859)])["reward"]
    assert several["value"] == "group=a 0.512 · group=b 0.113 · group=c 0.0859"
    assert [line["label"] for line in several["series"]] == ["group=a", "group=b", "group=c"]
    # two recipes of the same group name: the recipe tells them apart
    mixed = _tiles([reward("g", "grpo", 0.5), reward("g", "sao", 0.25)])["reward"]
    assert mixed["value"] == "recipe=grpo 0.5 · recipe=sao 0.25"


def test_staleness_without_samples_counted_headlines_the_newest_steps_mean():
    mean = [_series(m.STAGE_TRAINER, m.TRAINER_STALENESS_MEAN, {"recipe": "r", "group": g},
                    [(0, 0.0), (10, v)]) for g, v in (("a", 1.5), ("b", 0.5))]
    assert _tiles(mean[:1])["staleness"]["value"] == "mean per step 1.5"
    assert _tiles(mean)["staleness"]["value"] == "mean per step group=a 1.5 · group=b 0.5"
    samples = _series(m.STAGE_TRAINER, m.TRAINER_STALENESS_SAMPLES,
                      {"recipe": "r", "group": "a", "staleness": "1"}, [(10, 4.0)])
    assert _tiles([*mean, samples])["staleness"]["value"] == "mean 1 · p50 1 · p99 1 (n=4)"


def test_goodput_and_staleness_are_each_trainer_groups_apart():
    # The loop's group trained 8 of 40 generations; a replay group trained 60 samples of the
    # same units again. Added up, goodput would read 1.7.
    def trained(group, samples, staleness):
        return _series(m.STAGE_TRAINER, m.TRAINER_STALENESS_SAMPLES,
                       {"recipe": "r", "group": group, "staleness": str(staleness)},
                       [(10, float(samples))])

    one = _tiles([trained("loop", 8, 1)], generated=[(10, 40)])
    assert one["goodput"]["value"] == "0.2 (8 trained / 40 generated)"
    both = _tiles([trained("loop", 8, 1), trained("replay", 60, 30)], generated=[(10, 40)])
    assert both["goodput"]["value"] == ("group=loop 0.2 (8 trained / 40 generated) · "
                                        "group=replay 1.5 (60 trained / 40 generated)")
    assert [line["label"] for line in both["goodput"]["series"]] == ["group=loop",
                                                                     "group=replay"]
    assert both["staleness"]["value"] == ("group=loop mean 1 · p50 1 · p99 1 (n=8) · "
                                          "group=replay mean 30 · p50 30 · p99 30 (n=60)")
