"""``reef rescore``: run a (fixed) reward over logged generations under a new feedback source.

    reef rescore --recipe methods.sao.recipe --source exact_match_v2 --from-earliest
    reef rescore --recipe X --source judge_v3 --from-time 2026-12-01T08:00Z --to-time 2026-12-01T12:00Z

The work is ``reef_stream.consumers.rescore.rescore.Rescorer``. SIGTERM/SIGINT stop it
cleanly (a second signal without waiting for running calls); run it again to go
on where it stopped.
"""

from __future__ import annotations

import click

from reef_stream.cli.common import run_stage, settings_of
from reef_stream.cli.recipe_options import set_option


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe whose (fixed) reward function scores the generations.")
@set_option
@click.option("--source", required=True, metavar="NAME",
              help="The new feedback source the scores are emitted under (a recipe whose "
                   "processor waits for it learns from them). Its consumer group is "
                   "<namespace>.rescore.<NAME>: a second run resumes, never scoring a "
                   "generation twice under NAME.")
@click.option("--from-time", "from_time", metavar="ISO-8601",
              help="Start at the first generation logged at or after this time (no timezone "
                   "means UTC).")
@click.option("--from-earliest", is_flag=True,
              help="Start at the first generation still in the log.")
@click.option("--to-time", "to_time", metavar="ISO-8601",
              help="Stop before the first generation logged at or after this time "
                   "[default: the end of the log when the run starts].")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=8, show_default=True,
              help="Reward calls in flight at once.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds one try of the reward function may take.")
@click.option("--retries", type=click.IntRange(min=0), default=2, show_default=True,
              help="Tries after a failed one; a generation whose every try failed goes to "
                   "dead letters, never to feedback.")
@click.pass_context
def rescore(ctx: click.Context, path: str, source: str, from_time: str | None,
            from_earliest: bool, to_time: str | None, concurrency: int, timeout: float,
            retries: int, overrides: tuple[str, ...] = ()) -> None:
    """Score logged generations again with a recipe's reward, as feedback of a new source.

    When a reward bug is found, the generations are still in the log: fix the
    reward, rescore the range under a new source, and train a fresh processor
    and trainer group on a recipe that waits for that source (`reef replay`
    moves a group where needed). The old feedback stays beside the new one
    (`reef trace GENERATION` shows both). Exactly one of --from-time and
    --from-earliest says where the range starts; the first run of a source
    starts there, later runs resume where the last one stopped. Prints
    progress, then the reward worker's one-line summary.
    """
    import logging

    from reef_stream.api.recipe import load_recipe
    from reef_stream.consumers.rescore.rescore import Rescorer
    from reef_stream.consumers.reward.worker import RewardOptions
    from reef_stream.core.errors import ConfigurationError
    from reef_stream.topics.cursors import AtTime, Earliest, parse_time

    if from_earliest == (from_time is not None):
        raise ConfigurationError("give exactly one of --from-time and --from-earliest: where "
                                 "the range of generations to rescore starts")
    start = Earliest() if from_earliest else AtTime(parse_time(from_time, "--from-time"))
    to_ms = None if to_time is None else parse_time(to_time, "--to-time")
    if to_ms is not None and isinstance(start, AtTime) and to_ms <= start.ms:
        raise ConfigurationError(f"--to-time {to_time} is not after --from-time {from_time}")
    logging.getLogger("reef_stream.consumers.rescore").setLevel(logging.INFO)  # progress
    recipe = load_recipe(path, overrides=overrides)
    rescorer = Rescorer(recipe, source=source, start=start, to_ms=to_ms,
                        settings=settings_of(ctx),
                        options=RewardOptions(concurrency=concurrency, timeout=timeout,
                                              retries=retries))
    run_stage(rescorer, stop=lambda: rescorer.stop(now=rescorer.stopping))


COMMANDS = [rescore]
