"""The ``reef`` command line.

    reef up                         local broker + Redis + topics, then the status
    reef kafka up|down|status       the local Kafka cluster (1 or 3 KRaft nodes)
    reef redis up|down|status       the local Redis server
    reef topics create|verify       the declared topics of a namespace
    reef produce generations|feedback   import JSONL logs (native or OpenAI-style)
    reef intake serve               HTTP intake for fleets not written in Python
    reef replay|tail|lag            consumer-group cursors, records as JSON, lag
    reef check --recipe X           a recipe's contract, or every problem with its bindings
    reef reward --recipe X          reward workers: score generations, emit feedback
    reef process --recipe X         the processor: generations + feedback -> typed units
    reef train --recipe X --group G the trainer: units -> checkpoints (acknowledged steps)
    reef evaluate --recipe X        candidate evaluation: one Publication per checkpoint
    reef follow --model M           a serving replica: newest promoted version, verified
    reef fleet [--rebuild]          published/serving versions and replicas (Redis, rebuildable)
    reef demo                       the whole loop on a toy task, every stage a process
    reef trace GENERATION_ID        a generation's lineage: feedback, unit, step, publication, replicas
    reef top [--once]               live view: topic rates, group lag, versions, replicas, dead letters
    reef sink tensorboard|wandb     the metrics topic into TensorBoard event files or an offline W&B run
    reef dashboard [--port P]       live charts of the metrics topic on a local web page

Where ``REEF_BOOTSTRAP_SERVERS`` / ``REEF_REDIS_URL`` name existing servers,
nothing is started and every command uses those (see ``reef_stream.config``).
Every error is one message saying what to do; the exit status is 2 for a
configuration problem and 1 for anything else.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reef_stream.commands.check import COMMANDS as CHECK_COMMANDS
from reef_stream.commands.cursors import COMMANDS as CURSOR_COMMANDS
from reef_stream.commands.dashboard import COMMANDS as DASHBOARD_COMMANDS
from reef_stream.commands.demo import COMMANDS as DEMO_COMMANDS
from reef_stream.commands.evaluate import COMMANDS as EVALUATE_COMMANDS
from reef_stream.commands.fleet import COMMANDS as FLEET_COMMANDS
from reef_stream.commands.follow import COMMANDS as FOLLOW_COMMANDS
from reef_stream.commands.intake import COMMANDS as INTAKE_COMMANDS
from reef_stream.commands.process import COMMANDS as PROCESS_COMMANDS
from reef_stream.commands.produce import COMMANDS as PRODUCE_COMMANDS
from reef_stream.commands.reward import COMMANDS as REWARD_COMMANDS
from reef_stream.commands.sink import COMMANDS as SINK_COMMANDS
from reef_stream.commands.top import COMMANDS as TOP_COMMANDS
from reef_stream.commands.trace import COMMANDS as TRACE_COMMANDS
from reef_stream.commands.train import COMMANDS as TRAIN_COMMANDS
from reef_stream.config import Settings, load_settings
from reef_stream.connect import KAFKA_LOGGER, bootstrap_servers, client_config
from reef_stream.errors import ConfigurationError, ReefError
from reef_stream.kafka_local import DEFAULT_PORT as KAFKA_PORT
from reef_stream.kafka_local import KAFKA_VERSION, ClusterStatus, LocalCluster, check_java, kafka_classpath
from reef_stream.redis_local import DEFAULT_PORT as REDIS_PORT
from reef_stream.redis_local import LocalRedis
from reef_stream.topics.declarations import declare_topics

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def _progress(message: str) -> None:
    console.print(f"[dim]·[/dim] {escape(message)}")


def _print_error(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")


def _settings(ctx: click.Context) -> Settings:
    return ctx.obj


class _ReefGroup(click.Group):
    """Turns every ReefError into one clear message and an exit status."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ConfigurationError as exc:
            _print_error(exc)
            sys.exit(2)
        except ReefError as exc:
            _print_error(exc)
            sys.exit(1)


@click.group(cls=_ReefGroup)
@click.option("-v", "--verbose", is_flag=True, help="Show the Kafka client's own log lines.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """reef-stream: event-sourced reinforcement learning on a durable Kafka log.

    Environment: REEF_BOOTSTRAP_SERVERS and REEF_REDIS_URL name existing
    servers (nothing is started then); REEF_NAMESPACE prefixes topic names
    (default "reef"); REEF_HOME holds the local servers' data
    (default ~/.local/share/reef-stream).
    """
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    KAFKA_LOGGER.setLevel(logging.INFO if verbose else logging.CRITICAL)
    try:
        ctx.obj = load_settings()
    except ConfigurationError as exc:
        _print_error(exc)
        sys.exit(2)


# --------------------------------------------------------------------------- reef up


@main.command()
@click.option("--recipe", "recipes", multiple=True, help="Also create the units topic of this recipe.")
@click.pass_context
def up(ctx: click.Context, recipes: tuple[str, ...]) -> None:
    """Bring up the local Kafka broker and Redis, create the topics, show the status.

    Servers named by REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL are used instead
    of starting local ones. Safe to run again: what is running is left alone.
    """
    ctx.invoke(kafka_up)
    ctx.invoke(redis_up)
    ctx.invoke(topics_create, recipes=recipes)
    ctx.invoke(kafka_status)


# --------------------------------------------------------------------------- reef kafka


@main.group()
def kafka() -> None:
    """The local Kafka cluster (Apache Kafka 3.9, KRaft, jars from Maven Central)."""


_data_option = click.option(
    "--data", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Data directory of the cluster [default: $REEF_HOME/kafka].")


@kafka.command("up")
@click.option("--nodes", type=click.IntRange(1, 3), default=None,
              help="1 broker, or 3 (replication 3, min.insync.replicas 2). Fixed when the "
                   "cluster is created [default: 1].")
@click.option("--port", type=int, default=KAFKA_PORT, show_default=True,
              help="Port of node 1 when the cluster is created; node i uses port+2(i-1), "
                   "its controller the next one. 0 picks free ports.")
@_data_option
@click.option("--timeout", type=float, default=90.0, show_default=True,
              help="Seconds to wait for the cluster to answer.")
@click.pass_context
def kafka_up(ctx: click.Context, nodes: int | None = None, port: int = KAFKA_PORT,
             data: Path | None = None, timeout: float = 90.0) -> None:
    """Start the local cluster, creating and formatting it on first use.

    The first run fetches the broker's jars with Maven (once). Restarting on
    the same data directory keeps every record. Prints the bootstrap address.
    """
    settings = _settings(ctx)
    if nodes == 2:
        raise click.BadParameter("a cluster has 1 or 3 nodes", param_hint="--nodes")
    if settings.bootstrap_servers:
        _progress(f"REEF_BOOTSTRAP_SERVERS={settings.bootstrap_servers}: using that cluster, "
                  "starting nothing")
        return
    cluster = LocalCluster.from_settings(settings, data)
    bootstrap = cluster.up(nodes=nodes, port=port, timeout=timeout, progress=_progress)
    console.print(f"bootstrap: [bold]{bootstrap}[/bold]")


@kafka.command("fetch")
@click.pass_context
def kafka_fetch(ctx: click.Context) -> None:
    """Fetch the broker's jars from Maven Central (once) and check Java.

    `reef kafka up` does this itself; run it ahead to do the download early.
    """
    settings = _settings(ctx)
    check_java()
    classpath = kafka_classpath(settings.cache_dir, _progress)
    jars = classpath.split(os.pathsep)
    console.print(f"Apache Kafka {KAFKA_VERSION}: {len(jars)} jars, in {os.path.commonpath(jars)}")


@kafka.command("down")
@_data_option
@click.pass_context
def kafka_down(ctx: click.Context, data: Path | None) -> None:
    """Stop the local cluster cleanly; its data stays for the next `up`."""
    LocalCluster.from_settings(_settings(ctx), data).down(progress=_progress)


@kafka.command("status")
@_data_option
@click.pass_context
def kafka_status(ctx: click.Context, data: Path | None = None) -> None:
    """Show brokers, the controller, topics, and whether each node process is alive."""
    settings = _settings(ctx)
    if settings.bootstrap_servers:
        _print_remote_status(settings.bootstrap_servers)
        return
    cluster = LocalCluster.from_settings(settings, data)
    if not cluster.exists():
        raise ConfigurationError(f"No Kafka cluster in {cluster.data_dir}: run `reef kafka up`")
    _print_cluster_status(cluster.status())


def _print_cluster_status(status: ClusterStatus) -> None:
    table = Table(title=f"Kafka cluster in {status.data_dir}")
    for column in ("node", "process", "pid", "broker port", "controller port", "role"):
        table.add_column(column)
    for node in status.nodes:
        role = []
        if node.node_id in status.brokers:
            role.append("broker")
        if node.node_id == status.controller:
            role.append("[bold]active controller[/bold]")
        table.add_row(str(node.node_id),
                      "[green]alive[/green]" if node.alive else "[red]stopped[/red]",
                      str(node.pid or "-"), str(node.port), str(node.controller_port),
                      ", ".join(role) or "-")
    console.print(table)
    console.print(f"bootstrap: [bold]{status.bootstrap}[/bold]")
    if status.error:
        console.print(f"[red]{status.error}[/red]")
    _print_topics(status.topics)


def _print_remote_status(bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_config(bootstrap))
    cluster = admin.describe_cluster(request_timeout=10).result()
    metadata = admin.list_topics(timeout=10)
    table = Table(title=f"Kafka cluster {cluster.cluster_id} (REEF_BOOTSTRAP_SERVERS)")
    table.add_column("broker")
    table.add_column("address")
    for node in cluster.nodes:
        table.add_row(str(node.id), f"{node.host}:{node.port}")
    console.print(table)
    controller = cluster.controller.id if cluster.controller else "unknown"
    console.print(f"controller (as the brokers report it): {controller}")
    _print_topics({name: len(t.partitions) for name, t in sorted(metadata.topics.items())})


def _print_topics(topics: dict[str, int]) -> None:
    visible = {name: count for name, count in topics.items() if not name.startswith("__")}
    if not visible:
        console.print("topics: none (run `reef topics create`)")
        return
    table = Table(title="topics")
    table.add_column("topic")
    table.add_column("partitions", justify="right")
    for name, count in visible.items():
        table.add_row(name, str(count))
    console.print(table)


# --------------------------------------------------------------------------- reef redis


@main.group()
def redis() -> None:
    """The local Redis server (Debian's redis-server), holder of projections."""


_redis_data_option = click.option(
    "--data", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Data directory of the server [default: $REEF_HOME/redis].")


@redis.command("up")
@click.option("--port", type=int, default=REDIS_PORT, show_default=True,
              help="Port, when the server is first created in its data directory.")
@_redis_data_option
@click.pass_context
def redis_up(ctx: click.Context, port: int = REDIS_PORT, data: Path | None = None) -> None:
    """Start the local Redis server if it is not running; print its URL."""
    settings = _settings(ctx)
    if settings.redis_url:
        _progress(f"REEF_REDIS_URL={settings.redis_url}: using that server, starting nothing")
        return
    url = LocalRedis(data or settings.redis_dir).up(port=port, progress=_progress)
    console.print(f"redis: [bold]{url}[/bold]")


@redis.command("down")
@_redis_data_option
@click.pass_context
def redis_down(ctx: click.Context, data: Path | None) -> None:
    """Stop the local Redis server."""
    LocalRedis(data or _settings(ctx).redis_dir).down(progress=_progress)


@redis.command("status")
@_redis_data_option
@click.pass_context
def redis_status(ctx: click.Context, data: Path | None) -> None:
    """Show whether the local Redis server is alive, its version and key count."""
    status = LocalRedis(data or _settings(ctx).redis_dir).status()
    state = "[green]alive[/green]" if status.alive else "[red]stopped[/red]"
    console.print(f"redis {status.url}: {state} (pid {status.pid or '-'}, "
                  f"version {status.version or '-'}, keys {status.keys if status.keys is not None else '-'})")


# --------------------------------------------------------------------------- reef topics


@main.group()
def topics() -> None:
    """The topics of the namespace (REEF_NAMESPACE, default "reef")."""


@topics.command("create")
@click.option("--recipe", "recipes", multiple=True, help="Also the units topic of this recipe.")
@click.pass_context
def topics_create(ctx: click.Context, recipes: tuple[str, ...] = ()) -> None:
    """Create the declared topics; verify the ones that exist (idempotent).

    A topic that exists with settings other than its declaration is an error
    listing every difference; it is never silently used.
    """
    from confluent_kafka.admin import AdminClient

    from reef_stream.topics.admin import ensure_topics

    settings = _settings(ctx)
    admin = AdminClient(client_config(bootstrap_servers(settings)))
    report = ensure_topics(admin, declare_topics(settings.namespace, recipes))
    for name in report.created:
        _progress(f"created {name}")
    for name in report.verified:
        _progress(f"verified {name}")


@topics.command("verify")
@click.option("--recipe", "recipes", multiple=True, help="Also the units topic of this recipe.")
@click.pass_context
def topics_verify(ctx: click.Context, recipes: tuple[str, ...]) -> None:
    """Check that every declared topic exists with its declared settings."""
    from confluent_kafka.admin import AdminClient

    from reef_stream.errors import TopicMismatchError
    from reef_stream.topics.admin import verify_topics

    settings = _settings(ctx)
    admin = AdminClient(client_config(bootstrap_servers(settings)))
    problems = verify_topics(admin, declare_topics(settings.namespace, recipes))
    if problems:
        raise TopicMismatchError(problems)
    _progress("every declared topic exists with its declared settings")


for command in (*PRODUCE_COMMANDS, *INTAKE_COMMANDS, *CURSOR_COMMANDS, *CHECK_COMMANDS,
                *REWARD_COMMANDS, *PROCESS_COMMANDS, *TRAIN_COMMANDS,
                *EVALUATE_COMMANDS, *FOLLOW_COMMANDS, *FLEET_COMMANDS, *DEMO_COMMANDS,
                *TRACE_COMMANDS, *TOP_COMMANDS, *SINK_COMMANDS, *DASHBOARD_COMMANDS):
    main.add_command(command)


if __name__ == "__main__":
    main()
