"""``reef replay``, ``reef tail`` and ``reef lag``: replay cursors from the command line.

    reef replay --group G --topic T --to-offset N | --to-time ISO | --to-earliest | --to-latest
    reef tail TOPIC [--from earliest|latest|OFFSET|ISO8601] [-n N] [--partition P] [--follow]
    reef lag [--group G]

The logic lives in ``reef_stream.topics.cursors``; these commands parse options,
call it, and print: rich tables for people, JSON lines (``tail``) for
programs. They raise ``reef_stream.core.errors`` exceptions, which the ``reef``
group turns into one-line errors. ``COMMANDS`` lists them for
``main.add_command``.
"""

from __future__ import annotations

from contextlib import closing

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.settings import Settings
from reef_stream.topics import cursors
from reef_stream.topics.connect import bootstrap_servers
from reef_stream.topics.cursors import GroupLag, Position, ReplayResult, describe_position

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

_partition_option = click.option(
    "--partition", "-p", "partitions", type=click.IntRange(min=0), multiple=True,
    help="Only this partition; repeat for several [default: every partition].")


def _settings(ctx: click.Context) -> Settings:
    return ctx.obj


# --------------------------------------------------------------------------- reef replay


@click.command()
@click.option("--group", "-g", required=True, help="The consumer group whose offsets move.")
@click.option("--topic", "-t", required=True,
              help="The topic, in full (reef.generations) or short for <namespace>.<name> "
                   "(generations, units.sao).")
@click.option("--to-offset", type=click.IntRange(min=0), default=None,
              help="This offset on every chosen partition. It must lie between each "
                   "partition's low and high watermark; otherwise nothing moves.")
@click.option("--to-time", metavar="ISO8601", default=None,
              help="The first record at or after this time, e.g. 2025-06-01T12:00:00Z. "
                   "No timezone means UTC. A partition with no record that late goes to its "
                   "high watermark.")
@click.option("--to-earliest", is_flag=True,
              help="The first record still in the log (low watermark): re-read everything.")
@click.option("--to-latest", is_flag=True,
              help="The end of the log (high watermark): skip every record not yet read.")
@_partition_option
@click.option("--dry-run", is_flag=True, help="Print the offsets it would set; change nothing.")
@click.pass_context
def replay(ctx: click.Context, group: str, topic: str, to_offset: int | None,
           to_time: str | None, to_earliest: bool, to_latest: bool,
           partitions: tuple[int, ...], dry_run: bool) -> None:
    """Move a consumer group's committed offsets so that its next run re-reads from there.

    Give exactly one --to-* option. Prints, per partition, the offset the
    group had committed before and after, the low and high watermarks, and the
    lag after the move (high - after). A group that never committed is fine.

    Refused while the group has active members, which would overwrite the
    move with their own commits: stop its consumers first.
    """
    target = _replay_target(to_offset, to_time, to_earliest, to_latest)
    bootstrap = bootstrap_servers(_settings(ctx))
    resolved = cursors.resolve_topic(bootstrap, _settings(ctx).namespace, topic)
    result = cursors.replay(bootstrap, group, resolved, target, partitions, dry_run=dry_run)
    _print_replay(result)


def _replay_target(to_offset: int | None, to_time: str | None, to_earliest: bool,
                   to_latest: bool) -> Position:
    given = {
        "--to-offset": None if to_offset is None else cursors.AtOffset(to_offset),
        "--to-time": None if to_time is None else cursors.AtTime(
            cursors.parse_time(to_time, "--to-time")),
        "--to-earliest": cursors.Earliest() if to_earliest else None,
        "--to-latest": cursors.Latest() if to_latest else None,
    }
    chosen = {option: target for option, target in given.items() if target is not None}
    if len(chosen) != 1:
        got = " and ".join(chosen) if chosen else "none"
        raise ConfigurationError(
            f"give exactly one of --to-offset, --to-time, --to-earliest, --to-latest (got {got})")
    return next(iter(chosen.values()))


def _print_replay(result: ReplayResult) -> None:
    verb = "moved" if result.applied else "would move (dry run)"
    table = Table(title=escape(f"consumer group {result.group} on {result.topic}: {verb} to "
                               f"{describe_position(result.target)}"))
    for column in ("partition", "committed before", "committed after", "low", "high",
                   "lag after"):
        table.add_column(column, justify="right")
    notes = any(move.note for move in result.moves)
    if notes:
        table.add_column("note")
    for move in result.moves:
        row = [str(move.partition), "-" if move.before is None else str(move.before),
               str(move.after), str(move.low), str(move.high), str(move.lag_after)]
        table.add_row(*row, *([escape(move.note)] if notes else []))
    console.print(table)
    if result.applied:
        moved = len(result.moves)
        console.print(f"Moved {moved} partition{'' if moved == 1 else 's'}: the group's next "
                      "run reads from these offsets.")
    else:
        console.print("Dry run: nothing was changed.")
    if result.refusal:
        console.print(f"[yellow]A real run would be refused now:[/yellow] {escape(result.refusal)}")


# --------------------------------------------------------------------------- reef tail


@click.command()
@click.argument("topic")
@click.option("--from", "start", metavar="earliest|latest|OFFSET|ISO8601", default=None,
              help="Start here on each partition: the first or last offset, an offset (one "
                   "outside a partition's log starts at its nearest end), or the first record "
                   "at or after an ISO 8601 time (no timezone means UTC). "
                   "[default: the last N records]")
@click.option("-n", "--count", type=click.IntRange(min=1), default=10, show_default=True,
              help="Records to print, in all partitions together.")
@_partition_option
@click.option("--follow", "-f", is_flag=True,
              help="Then keep printing every new record as it arrives, until Ctrl-C.")
@click.pass_context
def tail(ctx: click.Context, topic: str, start: str | None, count: int,
         partitions: tuple[int, ...], follow: bool) -> None:
    """Print records of TOPIC as JSON lines, decoded, for inspection.

    TOPIC is given in full (reef.generations) or short for
    <namespace>.<name> (generations, units.sao). Prints the last N records,
    or the first N from --from, in time order. Each line holds topic,
    partition, offset, timestamp (ms), key, schema and value; arrays are
    lists, enums names, bytes {"base64": ...}. A record that does not decode
    is printed with "error" and its raw value in base64.

    Reads without a consumer group: commits nothing, moves no cursor.
    """
    position = None if start is None else cursors.parse_position(start, "--from")
    bootstrap = bootstrap_servers(_settings(ctx))
    resolved = cursors.resolve_topic(bootstrap, _settings(ctx).namespace, topic)
    records = cursors.tail(bootstrap, resolved, start=position, count=count,
                           partitions=partitions, follow=follow)
    printed = 0
    try:
        with closing(records):
            for record in records:
                click.echo(record.to_json())
                printed += 1
    except KeyboardInterrupt:
        if not follow:
            raise
        return  # Ctrl-C is how --follow ends
    if not printed:
        where = "" if position is None else f" from {describe_position(position)}"
        err_console.print(f"no records in {escape(resolved.name)}{where}")


# --------------------------------------------------------------------------- reef lag


@click.command()
@click.option("--group", "-g", default=None,
              help="Only this consumer group [default: every group of the cluster].")
@click.pass_context
def lag(ctx: click.Context, group: str | None) -> None:
    """Print how far consumer groups are behind: per group, topic and partition.

    Lag is the high watermark minus the group's committed offset: the records
    its next run still has to read. Each group ends with its total; a group
    with no committed offsets is shown as such.
    """
    groups = cursors.lag(bootstrap_servers(_settings(ctx)), group)
    if not groups:
        console.print("No consumer groups.")
        return
    table = Table(title="consumer group lag")
    for column, justify in (("group", "left"), ("state", "left"), ("topic", "left"),
                            ("partition", "right"), ("committed", "right"),
                            ("high", "right"), ("lag", "right")):
        table.add_column(column, justify=justify)
    for entry in groups:
        _add_group_rows(table, entry)
    console.print(table)


def _add_group_rows(table: Table, entry: GroupLag) -> None:
    name = escape(entry.group)
    if not entry.partitions:
        table.add_row(name, entry.state, "[dim]no committed offsets[/dim]", "", "", "", "",
                      end_section=True)
        return
    for p in entry.partitions:
        table.add_row(name, entry.state, escape(p.topic), str(p.partition), str(p.committed),
                      "gone" if p.high is None else str(p.high),
                      "-" if p.lag is None else str(p.lag))
    table.add_row(name, "", "[bold]total[/bold]", "", "", "", f"[bold]{entry.total}[/bold]",
                  end_section=True)


COMMANDS = [replay, tail, lag]
