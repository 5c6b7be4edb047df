"""``reef trace GENERATION_ID | --unit ID | --checkpoint ID``: a lineage (``reef_stream.ops.trace``).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click


@click.command()
@click.argument("generation_id", required=False)
@click.option("--unit", "unit_id", default=None, metavar="ID",
              help="Trace a unit instead: its trainer step, publication and replicas.")
@click.option("--checkpoint", "checkpoint_id", default=None, metavar="ID",
              help="Trace a checkpoint instead: its publication and replicas.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every link.")
@click.pass_context
def trace(ctx: click.Context, generation_id: str | None, unit_id: str | None,
          checkpoint_id: str | None, as_json: bool) -> None:
    """The lineage of GENERATION_ID (or of --unit ID, or --checkpoint ID), read back from the
    topics of the namespace.

    For a generation: when and by which replica and version it was produced,
    for a multi-turn trajectory its turns (policy turns trained, environment
    and tool turns masked) and how many tokens its unit masks, its feedback, the unit that holds it (or the dead letter that ended it),
    the trainer step and checkpoint that consumed the unit and whether it
    trained it, the first promoted publication that includes its effect, and
    the replicas that served that version. Each link names the topic,
    partition and offset it was read from (check it with `reef tail`); a
    missing link says what is missing. Scans the topics from the beginning:
    slow on a long log. Exit status 1 when the lineage is incomplete.
    """
    from reef_stream.core.settings import load_settings
    from reef_stream.ops.trace import trace_checkpoint, trace_generation, trace_unit
    from reef_stream.topics.connect import bootstrap_servers

    given = [(name, value) for name, value in (("GENERATION_ID", generation_id),
                                               ("--unit", unit_id),
                                               ("--checkpoint", checkpoint_id)) if value]
    if len(given) != 1:
        raise click.UsageError("give exactly one of GENERATION_ID, --unit ID, --checkpoint ID")
    settings = ctx.obj if ctx.obj is not None else load_settings()
    bootstrap = bootstrap_servers(settings)
    if generation_id:
        lineage = trace_generation(bootstrap, settings.namespace, generation_id)
    elif unit_id:
        lineage = trace_unit(bootstrap, settings.namespace, unit_id)
    else:
        lineage = trace_checkpoint(bootstrap, settings.namespace, checkpoint_id)
    if as_json:
        click.echo(json.dumps({"traced": given[0][1], "complete": lineage.complete,
                               "links": [asdict(link) for link in lineage.links]}))
    else:
        for link in lineage.links:
            click.echo(link.line())
    if not lineage.complete:
        sys.exit(1)


COMMANDS = [trace]
