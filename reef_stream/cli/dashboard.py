"""``reef dashboard``: live charts of one namespace's metrics in a local web page
(``reef_stream.ops.dashboard``).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import click


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True,
              help="Port to serve the page on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 for every interface (the page has no "
                   "authentication).")
@click.option("--from-beginning/--from-now", default=True, show_default=True,
              help="Chart the metrics topic from its first record, or only what arrives from "
                   "now on.")
@click.pass_context
def dashboard(ctx: click.Context, port: int, host: str, from_beginning: bool) -> None:
    """Serve live charts of the namespace's metrics (REEF_NAMESPACE) on a local web page.

    Reads <ns>.metrics, <ns>.publications and <ns>.dead-letters with a consumer
    of its own that commits nothing, and counts <ns>.generations.

    The page opens on the scorecard row: each published version's held-out
    measurement, the trainer's reward, staleness, goodput (samples trained
    per generation), records per second of each stage, consumer lag per
    group and topic, checkpoint -> serving seconds and dead letters by kind.
    Then every stage's charts: the trainer's loss, staleness, logprob gap,
    KL to the behaviour policy, gradient norm and update ratio; the
    processor's generation outcomes and units; the reward workers' counts
    and mean reward; the evaluator's decisions and measurements; each
    replica's policy version; each consumer's lag. A metric without a chart
    of its own gets one.

    Counters are drawn as rates per second, every instance's added up (a
    restarted process starts a new run, never a negative rate); tick "per
    instance" on the page, or open it with ?per_instance=1, to see each
    process apart. The page refreshes itself every 2 s and needs no network.
    Runs until Ctrl-C.
    """
    from rich.console import Console
    from rich.markup import escape

    from reef_stream.core.settings import load_settings
    from reef_stream.ops.dashboard.server import serve
    from reef_stream.topics.connect import bootstrap_servers

    settings = ctx.obj if ctx.obj is not None else load_settings()
    bootstrap = bootstrap_servers(settings)
    console = Console(highlight=False)

    def announce(url: str) -> None:
        console.print(f"dashboard of namespace [bold]{escape(settings.namespace)}[/bold] on "
                      f"[bold]{escape(url)}[/bold] (broker {escape(bootstrap)}, metrics "
                      f"{'from the beginning' if from_beginning else 'from now on'}); "
                      f"Ctrl-C stops it")

    serve(bootstrap, settings.namespace, host=host, port=port, from_beginning=from_beginning,
          announce=announce)


COMMANDS = [dashboard]
