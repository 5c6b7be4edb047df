"""The arithmetic of a rescore's range, and the command's refusals before it touches a broker."""
from click.testing import CliRunner

from reef_stream.cli.rescore import rescore
from reef_stream.consumers.rescore.rescore import RescoreRange, rescore_group


def test_progress_counts_only_what_lies_inside_each_partitions_range():
    span = RescoreRange(starts={0: 10, 1: 5, 2: 7}, ends={0: 20, 1: 5, 2: 9})
    assert span.total == 12                       # partition 1 has nothing left to score
    assert span.done({0: None, 1: None, 2: None}) == 0
    assert span.done({0: 15, 1: 5, 2: 8}) == 6
    assert span.done({0: 25, 1: 9, 2: 9}) == 12   # commits past the end count once


def test_each_source_has_its_own_group_so_a_rerun_resumes():
    assert rescore_group("reef", "judge_v2") == "reef.rescore.judge_v2"
    assert rescore_group("reef", "judge_v2") != rescore_group("reef", "judge_v3")


def test_the_start_of_the_range_must_be_given_exactly_once():
    runner = CliRunner()
    base = ["--recipe", "tests.recipes.rescoring:fixed", "--source", "v2"]
    for extra in ([], ["--from-earliest", "--from-time", "2026-01-01"]):
        result = runner.invoke(rescore, base + extra)
        assert result.exit_code != 0
        assert "exactly one of --from-time and --from-earliest" in str(result.exception)
    result = runner.invoke(rescore, base + ["--from-time", "2026-01-02", "--to-time", "2026-01-01"])
    assert "is not after --from-time" in str(result.exception)
    result = runner.invoke(rescore, base + ["--from-time", "yesterday"])
    assert "is not an ISO 8601 time" in str(result.exception)
