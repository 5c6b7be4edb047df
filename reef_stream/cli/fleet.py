"""``reef fleet``: models, their published and serving versions, and every replica, from Redis.

    reef fleet                      the projection as tables
    reef fleet --model sao-small    one model
    reef fleet --rebuild            rebuild the projection from Kafka first
    reef fleet --json               the same data as JSON (for scripts)

The projection is ``reef_stream.publishing.fleet``; ``COMMANDS`` lists the command for
``main.add_command``.
"""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(highlight=False)


@click.command()
@click.option("--model", "-m", default=None, help="Show only this model.")
@click.option("--rebuild", is_flag=True,
              help="First rebuild the projection from Kafka: published versions from "
                   "<namespace>.publications, replicas from their heartbeats in "
                   "<namespace>.metrics within the TTL. Replaces this namespace's keys in Redis.")
@click.option("--ttl", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="How long a heartbeat keeps a replica listed (and, with --rebuild, how far "
                   "back heartbeats are read) [default: 20].")
@click.option("--json", "as_json", is_flag=True, help="Print the projection as JSON.")
@click.pass_context
def fleet(ctx: click.Context, model: str | None, rebuild: bool, ttl: float | None,
          as_json: bool) -> None:
    """Show the serving fleet: published and serving versions, replicas and their age.

    For each model: the published version (the newest promoted one, with its
    evaluator, and UNEVALUATED when the default evaluator promoted it), the
    serving version (the newest one a live replica serves, which routers
    use), and how many live replicas serve the published version; a version
    waiting for a decision (a canary on a share of the replicas, or one
    awaiting `reef approve`). Then every live replica: its model, loaded
    version, state (serving, canary, waiting), host and seconds since its
    last heartbeat. Everything comes from Redis (REEF_REDIS_URL or `reef redis
    up`), which holds projections only; --rebuild restores them from Kafka
    after Redis lost them.
    """
    from reef_stream.core.settings import load_settings
    from reef_stream.publishing.fleet import DEFAULT_TTL_S, Fleet
    from reef_stream.topics.connect import bootstrap_servers

    settings = ctx.obj if ctx.obj is not None else load_settings()
    projection = Fleet.from_settings(settings, ttl_s=ttl or DEFAULT_TTL_S)
    if rebuild:
        report = projection.rebuild(bootstrap_servers(settings))
        message = (f"rebuilt the fleet projection of {settings.namespace} from Kafka: "
                   f"{report.publications} publications, {report.heartbeats} heartbeats -> "
                   f"{report.models} models, {report.replicas} live replicas "
                   f"({report.deleted_keys} old keys replaced, {report.elapsed_s:.1f} s)")
        click.echo(message, err=as_json)
    snapshot = projection.snapshot(model)
    if as_json:
        click.echo(json.dumps(_as_dict(snapshot), indent=2))
        return
    _print(snapshot)


def _as_dict(snapshot) -> dict:
    now = snapshot.taken_at
    return {"namespace": snapshot.namespace, "taken_at": snapshot.taken_at, "models": [{
        "model": m.model,
        "published": None if m.published is None else {
            "version": m.published.version, "checkpoint_id": m.published.checkpoint_id,
            "uri": m.published.uri, "sha256": m.published.sha256,
            "evaluator": m.published.evaluator, "evaluated": m.published.evaluated,
            "decided_at": m.published.decided_at},
        "serving": m.serving,
        "staged": None if m.staged is None else {
            "version": m.staged.version, "share": m.staged.share, "awaiting": m.staged.awaiting,
            "reason": m.staged.reason, "evaluator": m.staged.evaluator,
            "decided_at": m.staged.decided_at},
        "replicas": [{"replica": r.replica_id, "version": r.version, "host": r.host,
                      "state": r.state, "last_seen": r.last_seen,
                      "age_s": round(r.age_s(now), 1)} for r in m.replicas],
    } for m in snapshot.models]}


def _print(snapshot) -> None:
    if not snapshot.models:
        console.print(f"no models in the fleet projection of {snapshot.namespace} (nothing "
                      "published or served yet; after Redis lost its data: `reef fleet --rebuild`)")
        return
    models = Table(title=f"models ({snapshot.namespace})")
    for column in ("model", "published", "evaluator", "serving", "replicas", "on published"):
        models.add_column(column, justify="right" if column in ("replicas", "on published")
                          else "left")
    for m in snapshot.models:
        published = "-" if m.published is None else str(m.published.version)
        evaluator = "-" if m.published is None else escape(m.published.evaluator) + (
            "" if m.published.evaluated else " [bold red]UNEVALUATED[/bold red]")
        on_published = sum(1 for r in m.replicas
                           if m.published is not None and r.version == m.published.version)
        models.add_row(escape(m.model), published, evaluator,
                       "-" if m.serving is None else str(m.serving), str(len(m.replicas)),
                       str(on_published))
    console.print(models)
    for m in snapshot.models:
        if m.staged is not None:
            console.print(f"[bold yellow]waiting for a decision:[/bold yellow] "
                          f"{escape(m.model)} version {m.staged.version} (share "
                          f"{m.staged.share:g}, awaiting {escape(m.staged.awaiting)}): "
                          f"{escape(m.staged.reason)}")
    replicas = [(m, r) for m in snapshot.models for r in m.replicas]
    if not replicas:
        console.print("no live replicas")
        return
    table = Table(title="replicas")
    for column in ("replica", "model", "version", "state", "host", "age"):
        table.add_column(column, justify="right" if column == "age" else "left")
    for m, r in replicas:
        version = "-" if r.version is None else str(r.version)
        if m.published is not None and r.version != m.published.version:
            version += " [yellow](behind)[/yellow]" if r.version is not None \
                and r.version < m.published.version else ""
        table.add_row(escape(r.replica_id), escape(m.model), version, escape(r.state),
                      escape(r.host),
                      f"{r.age_s(snapshot.taken_at):.1f}s")
    console.print(table)


COMMANDS = [fleet]


if __name__ == "__main__":
    from reef_stream.cli.common import run_standalone

    run_standalone(fleet, "reef fleet", "reef_stream.publishing.fleet")
