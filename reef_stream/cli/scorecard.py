"""``reef scorecard``: the standard scorecard of one namespace's loop (``reef_stream.ops.scorecard``).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--namespace", default=None, metavar="NS",
              help="The namespace whose topics are read [default: REEF_NAMESPACE].")
@click.option("--recipe", "recipe", required=True, metavar="NAME",
              help="The recipe's name, as in the topic <ns>.units.<NAME> (e.g. sao).")
@click.option("--target", type=float, default=None, metavar="VALUE",
              help="The measurement a promoted version must reach for the time to target "
                   "(e.g. 0.9); without it there is no time to target.")
@click.option("--measure", default="accuracy", show_default=True, metavar="KEY",
              help="Which value of a publication's measurement the target is about.")
@click.option("--checkpoints", default=None, metavar="PATH",
              help="The trainer's checkpoint store (a directory or fsspec URL): adds the unit "
                   "ledger (units trained, trained twice, lost).")
@click.option("--group", default=None, metavar="GROUP",
              help="The trainer group whose samples, staleness, age and promoted versions count "
                   "[default: the group of the newest promoted version's checkpoint, else the "
                   "only one]. Another group replaying the units topic trains the same "
                   "generations again: its samples are its own, not the loop's.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every figure.")
@click.pass_context
def scorecard(ctx: click.Context, namespace: str | None, recipe: str, target: float | None,
              measure: str, checkpoints: str | None, group: str | None, as_json: bool) -> None:
    """The standard scorecard of the loop of recipe NAME in a namespace, read from its topics
    (docs/metrics.md defines every figure precisely):

    \b
    time to target        first generation -> first PROMOTED publication whose
                          measurement reaches --target, in seconds
    generated / trained   generations in the topic / samples the trainer trained
    goodput               trained / generated
    shed, dead letters    dead letters by kind (a shed is a kind ending in .shed)
    too stale             the processor's and the trainer's too-stale dead letters
    staleness             of trained samples: trainer version - behaviour version
                          (mean, p50, p99), and their age in seconds (histogram)
    checkpoint -> serving seconds from a checkpoint's creation to a replica
                          serving it, one observation per version loaded
    CPU                   seconds per stage (process_cpu_seconds), per generation,
                          and the share of reward + processor (+ broker)
    unit ledger           with --checkpoints: trained twice, lost (must be 0)

    Reads the generations' watermarks and the publications, metrics and
    dead-letters topics whole: seconds on a long run.
    """
    from reef_stream.cli.common import settings_of
    from reef_stream.core.errors import ConfigurationError
    from reef_stream.ops.scorecard import read_scorecard
    from reef_stream.topics.connect import bootstrap_servers

    settings = settings_of(ctx)
    bootstrap = bootstrap_servers(settings)
    ns = namespace or settings.namespace
    if checkpoints is not None and "://" not in checkpoints and not Path(checkpoints).is_dir():
        raise ConfigurationError(f"--checkpoints {checkpoints}: no such directory (give the "
                                 "trainer's checkpoint store, e.g. <run dir>/checkpoints)")
    card = read_scorecard(bootstrap, ns, recipe, target=target, measure=measure, group=group)
    if checkpoints is not None:
        from reef_stream.demo.run import unit_ledger

        card.ledger = unit_ledger(bootstrap, ns, recipe, checkpoints, group)
    if as_json:
        click.echo(json.dumps(card.as_dict()))
    else:
        click.echo("\n".join(card.lines()))
        click.echo(f"SCORECARD {card.line()}")


COMMANDS = [scorecard]
