"""``--metrics-port``: the option every long-running stage command shares, and its server.

    @click.command()
    @metrics_port_option
    def process(..., metrics_port: int | None) -> None:
        serve_metrics(metrics_port)      # until the command returns

The server is ``reef_stream.core.prometheus.serve`` on ``127.0.0.1`` only (put a
proxy or a Prometheus agent on the host in front of it to scrape from
elsewhere); it stops when the command's click context closes.
"""

from __future__ import annotations

import click

metrics_port_option = click.option(
    "--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
    help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics: every Metric event this "
         "stage writes to <namespace>.metrics, as a gauge reef_<stage>_<name> with the same "
         "labels (0: any free port, printed at start) [default: not served].")


def serve_metrics(port: int | None) -> None:
    """Serve ``/metrics`` on ``127.0.0.1:port`` until the running command ends, and print its URL
    (stderr); nothing when ``port`` is None. Raises ``ConfigurationError`` if the port is taken.
    Call it inside a click command."""
    if port is None:
        return
    from reef_stream.core.prometheus import serve

    server = serve(port)
    click.get_current_context().call_on_close(server.stop)
    click.echo(f"serving Prometheus metrics at {server.url}", err=True)
