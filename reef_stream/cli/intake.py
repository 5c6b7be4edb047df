"""``reef intake serve``: the HTTP intake for fleets not written in Python; ``reef intake
proxy``: a recording proxy in front of OpenAI-compatible servers (docs/proxy.md).

    REEF_INTAKE_TOKEN=s3cret reef intake serve --host 0.0.0.0 --port 8080
    reef intake proxy --upstream http://127.0.0.1:8000 --listen 0.0.0.0:8001 --model my-model

The endpoints, body forms and status codes are documented in
``reef_stream.intake.http``. ``REEF_INTAKE_TOKEN``, when set, is the bearer
token every POST must carry. The server stops on Ctrl-C or SIGTERM, after
flushing its producer; what the broker has not acknowledged by then stays in
the spool and is replayed by the next server on the same spool.
``COMMANDS`` lists the group for ``main.add_command``.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics
from reef_stream.core.settings import Settings
from reef_stream.topics.connect import bootstrap_servers

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

#: Seconds ``send`` waits for room in a full spool before the request gets a 503.
SPOOL_BLOCK_TIMEOUT_S = 5.0


@click.group()
def intake() -> None:
    """The HTTP intake (serve) and the recording proxy for OpenAI-compatible servers (proxy)."""


@intake.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 for every interface.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--max-request-bytes", type=click.IntRange(min=1), default=None,
              help="Larger request bodies are refused with 413 [default: 16 MiB].")
@click.option("--durable-timeout", type=click.FloatRange(min=0), default=30.0,
              show_default=True,
              help="Seconds a request waits for its records to be acknowledged or spooled "
                   "before a 503.")
@click.option("--spool", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Spool directory for records the broker has not acknowledged "
                   "[default: $REEF_HOME/spool/<namespace>-intake]. One per server.")
@metrics_port_option
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, max_request_bytes: int | None,
          durable_timeout: float, spool: Path | None, metrics_port: int | None) -> None:
    """Serve the HTTP intake until Ctrl-C or SIGTERM.

    A POST is answered once its records are acknowledged by the broker or
    spooled on this host, with a result per record (invalid ones are
    rejected with the field at fault). Set REEF_INTAKE_TOKEN to require
    'Authorization: Bearer <token>' on every POST.
    """
    # aiohttp takes ~0.4 s to import: only this command pays for it, not every `reef`.
    from aiohttp import web

    from reef_stream.intake.aio import AsyncRecordProducer
    from reef_stream.intake.http import DEFAULT_MAX_REQUEST_BYTES, make_app

    settings: Settings = ctx.obj
    serve_metrics(metrics_port)
    token = settings.intake_token
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/yellow] REEF_INTAKE_TOKEN is not set: anyone who "
                          f"reaches {escape(host)}:{port} can write records")
    bootstrap = bootstrap_servers(settings)
    spool_dir = spool or settings.home / "spool" / f"{settings.namespace}-intake"

    async def app() -> web.Application:
        producer = AsyncRecordProducer(settings=settings, spool_dir=spool_dir,
                                       block_timeout=SPOOL_BLOCK_TIMEOUT_S, client="http")
        application = make_app(producer, bootstrap=bootstrap, token=token,
                               max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                               durable_timeout=durable_timeout)

        async def close_producer(_: web.Application) -> None:
            report = await producer.close()
            console.print(f"producer closed: {report.acknowledged} acknowledged, "
                          f"{report.spooled} left in the spool {escape(str(spool_dir))}")

        application.on_cleanup.append(close_producer)
        return application

    console.print(f"intake for namespace [bold]{escape(settings.namespace)}[/bold] on "
                  f"http://{escape(host)}:{port} (broker {escape(bootstrap)}, "
                  f"{'bearer token required' if token else 'no token'})")
    web.run_app(app(), host=host, port=port, print=None)


def _listen(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT, e.g. 127.0.0.1:8001")
    return host.strip("[]"), int(port)


@intake.command("proxy")
@click.option("--upstream", required=True, metavar="URL",
              help="The OpenAI-compatible server to forward to, e.g. http://127.0.0.1:8000.")
@click.option("--listen", default="127.0.0.1:8001", show_default=True, callback=_listen,
              metavar="HOST:PORT", help="Where the proxy listens.")
@click.option("--model", default=None, metavar="NAME",
              help="The model name recorded (the one 'reef follow --model' follows) "
                   "[default: the name in each response].")
@click.option("--policy-version-file", "--version-file", "policy_version_file",
              type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="PATH",
              help="A file holding the policy version the upstream serves (decimal, or JSON "
                   "with policy_version), rewritten on each reload: `reef follow "
                   "--version-file PATH` keeps one.")
@click.option("--version-from-model", default=None, metavar="REGEX",
              help="A regular expression whose first group is the policy version in the model "
                   "name a request names (a LoRA adapter per version), e.g. 'lora-v(\\d+)'.")
@click.option("--unknown-version", type=click.Choice(["mark", "skip"]), default="mark",
              show_default=True,
              help="When the served version cannot be told: record it marked "
                   "reef.policy_version=unknown (version 0), or record nothing (counted).")
@click.option("--redact", type=click.Choice(["prompt", "completion", "user"]), multiple=True,
              help="Do not record this (repeatable): the prompt text, the completion text and "
                   "tool calls, the OpenAI user. Token ids are always recorded.")
@click.option("--replica-id", default=None,
              help="The replica id recorded [default: proxy@<upstream host:port>].")
@click.option("--feedback-source", default="user", show_default=True,
              help="The source of POST /v1/feedback records that name none.")
@click.option("--spool", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Spool directory for records the broker has not acknowledged, and the "
                   "journal of held tool-calling trajectories "
                   "[default: $REEF_HOME/spool/<namespace>-proxy]. One per proxy.")
@click.option("--spool-max-bytes", type=click.IntRange(min=1), default=1 << 30,
              show_default=True,
              help="The spool's bound; past it, records are dropped (counted), never waited for.")
@metrics_port_option
@click.pass_context
def proxy(ctx: click.Context, upstream: str, listen: tuple[str, int], model: str | None,
          policy_version_file: Path | None, version_from_model: str | None,
          unknown_version: str, redact: tuple[str, ...], replica_id: str | None,
          feedback_source: str, spool: Path | None, spool_max_bytes: int,
          metrics_port: int | None) -> None:
    """Forward OpenAI requests to --upstream and record each choice as a Generation.

    Serves /v1/chat/completions and /v1/completions (streamed or not) with the header
    x-reef-generation-ids, POST /v1/feedback for scores, and passes anything else through.
    Serving never waits for the broker: records are spooled while it is away, and dropped
    (counted) when the spool is full. A record's policy version is the one the upstream
    served (--policy-version-file, --version-from-model), or marked unknown.
    """
    from aiohttp import web

    from reef_stream.intake.aio import AsyncRecordProducer
    from reef_stream.intake.journal import TrajectoryJournal
    from reef_stream.intake.proxy import (
        ProxyMetrics,
        ProxyOptions,
        RecordingProxy,
        Versions,
    )

    settings: Settings = ctx.obj
    serve_metrics(metrics_port)
    host, port = listen
    bootstrap = bootstrap_servers(settings)
    spool_dir = spool or settings.home / "spool" / f"{settings.namespace}-proxy"
    options = ProxyOptions(upstream=upstream, model=model, replica_id=replica_id,
                           versions=Versions(policy_version_file, version_from_model),
                           redact=frozenset(redact), feedback_source=feedback_source,
                           unknown_version=unknown_version)

    async def app() -> web.Application:
        producer = AsyncRecordProducer(settings=settings, spool_dir=spool_dir,
                                       spool_max_bytes=spool_max_bytes, block_timeout=0,
                                       client="proxy")
        recording = RecordingProxy(producer, options,
                                   metrics=ProxyMetrics(bootstrap, settings.namespace),
                                   journal=TrajectoryJournal(spool_dir))
        application = recording.app()

        async def close_producer(_: web.Application) -> None:
            report = await producer.close()
            counts = recording.counts
            console.print(f"proxy closed: {counts.recorded} recorded, "
                          f"{sum(counts.dropped.values())} dropped (spool full); producer: "
                          f"{report.acknowledged} acknowledged, {report.spooled} left in the "
                          f"spool {escape(str(spool_dir))}")

        application.on_cleanup.append(close_producer)
        return application

    console.print(f"proxy for {escape(upstream)} on http://{escape(host)}:{port}, recording to "
                  f"namespace [bold]{escape(settings.namespace)}[/bold] (broker "
                  f"{escape(bootstrap)})")
    web.run_app(app(), host=host, port=port, print=None)


COMMANDS = [intake]
