"""``reef top``: a live view of one namespace's pipeline (``reef_stream.ops.top``).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import time

import click


@click.command()
@click.option("--once", is_flag=True, help="Print one view (after reading to the end) and exit.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes.")
@click.pass_context
def top(ctx: click.Context, once: bool, interval: float) -> None:
    """A live view of the pipeline of the namespace (REEF_NAMESPACE), read from its topics.

    Records and records per second of each topic; every consumer group on the
    namespace's topics with its state and lag (reward workers, processors,
    trainers); per model the trained, published and serving versions, the
    rejected candidates and the trainer's rollbacks after rejections; each
    replica's serving version; dead letters by stage; the trainer's latest
    staleness. Refreshes every --interval seconds until Ctrl-C; rates appear
    from the second refresh on.
    """
    from rich.console import Console
    from rich.live import Live

    from reef_stream.core.settings import load_settings
    from reef_stream.ops.top import TopView
    from reef_stream.topics.connect import bootstrap_servers

    settings = ctx.obj if ctx.obj is not None else load_settings()
    view = TopView(bootstrap_servers(settings), settings.namespace)
    console = Console()
    try:
        view.refresh()
        if once:
            console.print(view.render())
            return
        with Live(view.render(), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                view.refresh()
                live.update(view.render())
    except KeyboardInterrupt:
        pass
    finally:
        view.close()


COMMANDS = [top]
