"""``reef up``, ``reef kafka``, ``reef redis``, ``reef s3``: the local Kafka cluster, Redis server
and object store."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.table import Table

from reef_stream.cli.common import console, progress, settings_of
from reef_stream.cli.topics import topics_create
from reef_stream.core.errors import ConfigurationError
from reef_stream.servers.kafka_local import DEFAULT_PORT as KAFKA_PORT
from reef_stream.servers.kafka_local import (
    KAFKA_VERSION, ClusterStatus, LocalCluster, check_java, kafka_classpath,
)
from reef_stream.servers.redis_local import DEFAULT_PORT as REDIS_PORT
from reef_stream.servers.redis_local import LocalRedis
from reef_stream.servers.s3_local import DEFAULT_PORT as S3_PORT
from reef_stream.servers.s3_local import LocalS3
from reef_stream.topics.connect import new_admin

# --------------------------------------------------------------------------- reef up


@click.command()
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


@click.group()
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
    settings = settings_of(ctx)
    if nodes == 2:
        raise click.BadParameter("a cluster has 1 or 3 nodes", param_hint="--nodes")
    if settings.bootstrap_servers:
        progress(f"REEF_BOOTSTRAP_SERVERS={settings.bootstrap_servers}: using that cluster, "
                  "starting nothing")
        return
    cluster = LocalCluster.from_settings(settings, data)
    bootstrap = cluster.up(nodes=nodes, port=port, timeout=timeout, progress=progress)
    console.print(f"bootstrap: [bold]{bootstrap}[/bold]")


@kafka.command("fetch")
@click.pass_context
def kafka_fetch(ctx: click.Context) -> None:
    """Fetch the broker's jars from Maven Central (once) and check Java.

    `reef kafka up` does this itself; run it ahead to do the download early.
    """
    settings = settings_of(ctx)
    check_java()
    classpath = kafka_classpath(settings.cache_dir, progress)
    jars = classpath.split(os.pathsep)
    console.print(f"Apache Kafka {KAFKA_VERSION}: {len(jars)} jars, in {os.path.commonpath(jars)}")


@kafka.command("down")
@_data_option
@click.pass_context
def kafka_down(ctx: click.Context, data: Path | None) -> None:
    """Stop the local cluster cleanly; its data stays for the next `up`."""
    LocalCluster.from_settings(settings_of(ctx), data).down(progress=progress)


@kafka.command("status")
@_data_option
@click.pass_context
def kafka_status(ctx: click.Context, data: Path | None = None) -> None:
    """Show brokers, the controller, topics, and whether each node process is alive."""
    settings = settings_of(ctx)
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
    admin = new_admin(bootstrap)
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


@click.group()
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
    settings = settings_of(ctx)
    if settings.redis_url:
        progress(f"REEF_REDIS_URL={settings.redis_url}: using that server, starting nothing")
        return
    url = LocalRedis(data or settings.redis_dir).up(port=port, progress=progress)
    console.print(f"redis: [bold]{url}[/bold]")


@redis.command("down")
@_redis_data_option
@click.pass_context
def redis_down(ctx: click.Context, data: Path | None) -> None:
    """Stop the local Redis server."""
    LocalRedis(data or settings_of(ctx).redis_dir).down(progress=progress)


@redis.command("status")
@_redis_data_option
@click.pass_context
def redis_status(ctx: click.Context, data: Path | None) -> None:
    """Show whether the local Redis server is alive, its version and key count."""
    status = LocalRedis(data or settings_of(ctx).redis_dir).status()
    state = "[green]alive[/green]" if status.alive else "[red]stopped[/red]"
    console.print(f"redis {status.url}: {state} (pid {status.pid or '-'}, "
                  f"version {status.version or '-'}, keys {status.keys if status.keys is not None else '-'})")


# --------------------------------------------------------------------------- reef s3


@click.group()
def s3() -> None:
    """The local object store (S3Proxy over a directory, jars from Maven Central).

    For checkpoints and artifacts at s3:// URLs in development and tests: start it, then
    `eval "$(reef s3 env)"` gives clients (s3fs, boto3, vLLM's loaders) its endpoint and
    credentials. Needs the s3 extra (pip install 'reef-stream[s3]') for the client side.
    """


_s3_data_option = click.option(
    "--data", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Data directory of the store [default: $REEF_HOME/s3].")


def _local_s3(ctx: click.Context, data: Path | None) -> LocalS3:
    settings = settings_of(ctx)
    return LocalS3(data or settings.s3_dir, settings.cache_dir)


@s3.command("up")
@click.option("--port", type=int, default=S3_PORT, show_default=True,
              help="Port, when the store is first created in its data directory.")
@click.option("--bucket", "buckets", multiple=True, help="Create this bucket (again: no-op).")
@_s3_data_option
@click.pass_context
def s3_up(ctx: click.Context, port: int = S3_PORT, buckets: tuple[str, ...] = (),
          data: Path | None = None) -> None:
    """Start the local object store if it is not running; print its endpoint.

    The first run fetches S3Proxy's jars with Maven (once). The objects stay in the data
    directory across restarts; so do the credentials (see `reef s3 env`).
    """
    store = _local_s3(ctx, data)
    endpoint = store.up(port=port, progress=progress)
    for bucket in buckets:
        store.create_bucket(bucket)
        progress(f"Bucket {bucket} is there")
    console.print(f"s3: [bold]{endpoint}[/bold]  (eval \"$(reef s3 env)\" for its credentials)")


@s3.command("env")
@_s3_data_option
@click.pass_context
def s3_env(ctx: click.Context, data: Path | None) -> None:
    """Print the store's endpoint and credentials as shell exports, for clients to use."""
    for name, value in _local_s3(ctx, data).environment().items():
        click.echo(f"export {name}={value}")


@s3.command("down")
@_s3_data_option
@click.pass_context
def s3_down(ctx: click.Context, data: Path | None) -> None:
    """Stop the local object store (its objects stay)."""
    _local_s3(ctx, data).down(progress=progress)


@s3.command("status")
@_s3_data_option
@click.pass_context
def s3_status(ctx: click.Context, data: Path | None) -> None:
    """Show whether the local object store is alive and its buckets."""
    status = _local_s3(ctx, data).status()
    state = "[green]alive[/green]" if status.alive else "[red]stopped[/red]"
    buckets = ", ".join(status.buckets) if status.buckets else "-"
    console.print(f"s3 {status.endpoint}: {state} (pid {status.pid or '-'}, buckets {buckets})")


COMMANDS = [up, kafka, redis, s3]
