"""``reef trace GENERATION_ID``: the lineage of one generation (``reef_stream.trace``).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click


@click.command()
@click.argument("generation_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every link.")
@click.pass_context
def trace(ctx: click.Context, generation_id: str, as_json: bool) -> None:
    """The lineage of GENERATION_ID, read back from the topics of the namespace.

    When and by which replica and version it was produced, its feedback, the
    unit that holds it (or the dead letter that ended it), the trainer step
    and checkpoint that consumed the unit and whether it trained it, the first
    promoted publication that includes its effect, and the replicas that
    served that version. Each link names the topic, partition and offset it
    was read from (check it with `reef tail`); a missing link says what is
    missing. Scans the topics from the beginning: slow on a long log. Exit
    status 1 when the lineage is incomplete.
    """
    from reef_stream.config import load_settings
    from reef_stream.connect import bootstrap_servers
    from reef_stream.trace import trace_generation

    settings = ctx.obj if ctx.obj is not None else load_settings()
    lineage = trace_generation(bootstrap_servers(settings), settings.namespace, generation_id)
    if as_json:
        click.echo(json.dumps({"generation_id": generation_id, "complete": lineage.complete,
                               "links": [asdict(link) for link in lineage.links]}))
    else:
        for link in lineage.links:
            click.echo(link.line())
    if not lineage.complete:
        sys.exit(1)


COMMANDS = [trace]
