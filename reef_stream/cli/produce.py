"""``reef produce generations|feedback [FILE.jsonl | -]``: import the logs of an inference fleet.

    reef produce generations logs/2025-06-01.jsonl
    reef produce generations vllm.jsonl --policy-version 12 --replica-id old-fleet \\
        --sampling '{"temperature": 1.0, "max_tokens": 1024}'
    zcat feedback.jsonl.gz | reef produce feedback -

The accepted JSONL forms (native events, OpenAI-style responses with token
ids) are documented in ``reef_stream.intake.formats``; the loop in
``reef_stream.intake.jsonl``. Invalid lines go to ``<ns>.dead-letters``
with their line number and reason, and the import goes on. At the end a
summary: lines read, records sent, acknowledged, not yet acknowledged
(spooled), failed, and rejected lines by reason. The exit status is 1 when
the broker refused a record for good (FAILED), not for rejected lines
(those are in dead letters). ``COMMANDS`` lists the command for
``main.add_command``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
)
from rich.table import Table

from reef_stream.core.errors import ConfigurationError, InvalidRecord
from reef_stream.core.events import SamplingParams
from reef_stream.core.settings import Settings
from reef_stream.intake.formats import KINDS, OpenAIDefaults, parse_sampling
from reef_stream.intake.jsonl import ImportSummary, import_jsonl
from reef_stream.intake.producer import DeliveryError, RecordProducer

console = Console(highlight=False)


@click.command()
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("source", default="-", metavar="[FILE.jsonl | -]",
                type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=str))
@click.option("--spool", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Spool directory for records the broker has not acknowledged "
                   "[default: $REEF_HOME/spool/<namespace>-import]. Records left there by an "
                   "earlier run are replayed first.")
@click.option("--policy-version", type=click.IntRange(min=0), default=None,
              help="OpenAI lines: the policy version, where the line's envelope has none.")
@click.option("--replica-id", default=None,
              help="OpenAI lines: the replica id, where the line's envelope has none.")
@click.option("--model", default=None,
              help="OpenAI lines: the model, where the envelope has none [default: the "
                   "response's model].")
@click.option("--sampling", "sampling_json", metavar="JSON", default=None,
              help='OpenAI lines: the sampling parameters, where the envelope has none, e.g. '
                   '\'{"temperature": 0.7, "max_tokens": 512}\'.')
@click.option("--flush-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds to wait at the end for the broker to acknowledge everything.")
@click.pass_context
def produce(ctx: click.Context, kind: str, source: str, spool: Path | None,
            policy_version: int | None, replica_id: str | None, model: str | None,
            sampling_json: str | None, flush_timeout: float) -> None:
    """Import KIND records from a JSONL file, or from stdin with - (the default).

    Each line is a native event or, for generations, an OpenAI-style
    completion or chat completion response with token ids (docs/intake.md).
    Invalid lines go to the dead-letter topic with their line number and
    reason; the import goes on. Prints a summary at the end. Exit status 1 if
    the broker refused any record for good.
    """
    settings: Settings = ctx.obj
    defaults = _openai_defaults(kind, policy_version, replica_id, model, sampling_json)
    spool_dir = spool or settings.home / "spool" / f"{settings.namespace}-import"
    name = "stdin" if source == "-" else source
    producer = RecordProducer(settings=settings, spool_dir=spool_dir, client="jsonl")
    try:
        with _input(source) as (stream, size):
            summary = _run_import(stream, size, kind, producer, f"import:{name}", defaults,
                                  flush_timeout)
    finally:
        producer.close(timeout=5)
    _print_summary(summary, kind, spool_dir)
    if summary.failed or summary.dead_letters_failed:
        count = summary.failed + summary.dead_letters_failed
        raise DeliveryError(f"the broker refused {count} record(s) for good, e.g. "
                            f"{summary.errors[0]}; fix that and import the file again "
                            "(ids are deterministic, so readers drop the duplicates)")


def _openai_defaults(kind: str, policy_version: int | None, replica_id: str | None,
                     model: str | None, sampling_json: str | None) -> OpenAIDefaults:
    given = {"--policy-version": policy_version, "--replica-id": replica_id, "--model": model,
             "--sampling": sampling_json}
    if kind == "feedback" and any(value is not None for value in given.values()):
        options = ", ".join(option for option, value in given.items() if value is not None)
        raise ConfigurationError(f"{options}: only for generations (they fill in what "
                                 "OpenAI responses lack); drop them for feedback")
    return OpenAIDefaults(policy_version=policy_version, replica_id=replica_id, model=model,
                          sampling=None if sampling_json is None else _sampling(sampling_json))


def _sampling(text: str) -> SamplingParams:
    try:
        return parse_sampling(json.loads(text), field="--sampling")
    except ValueError as error:
        raise ConfigurationError(f"--sampling is not JSON: {error}") from error
    except InvalidRecord as error:
        raise ConfigurationError(str(error)) from error


@contextmanager
def _input(source: str) -> Iterator[tuple[BinaryIO, int | None]]:
    """The input as a binary stream, and its size in bytes when it is a regular file."""
    if source == "-":
        yield click.get_binary_stream("stdin"), None
        return
    with open(source, "rb") as stream:
        info = os.fstat(stream.fileno())
        yield stream, info.st_size if stat.S_ISREG(info.st_mode) else None


def _run_import(stream: BinaryIO, size: int | None, kind: str, producer: RecordProducer,
                source: str, defaults: OpenAIDefaults, flush_timeout: float) -> ImportSummary:
    """The import, with a progress bar by bytes read when the input is a file."""
    if size is None:
        return import_jsonl(stream, kind=kind, producer=producer, source=source,
                            defaults=defaults, flush_timeout=flush_timeout)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(escape(source), total=size)
        return import_jsonl(stream, kind=kind, producer=producer, source=source,
                            defaults=defaults, flush_timeout=flush_timeout,
                            advance=lambda n: progress.advance(task, n))


def _print_summary(summary: ImportSummary, kind: str, spool_dir: Path) -> None:
    console.print(f"[bold]{escape(summary.source)}[/bold] → {kind}")
    table = Table()
    table.add_column("")
    table.add_column("count", justify="right")
    rows = [
        ("lines read", summary.lines_read),
        ("records sent", summary.records_sent),
        ("acknowledged", summary.acknowledged),
        ("not yet acknowledged (spooled)", summary.outstanding),
        ("failed", summary.failed),
        ("lines rejected (dead letters)", summary.lines_rejected),
    ]
    for label, count in rows:
        table.add_row(label, str(count))
    console.print(table)
    if summary.rejected:
        _print_rejections(summary)
    if summary.outstanding or summary.dead_letters_outstanding:
        console.print(escape(f"{summary.outstanding + summary.dead_letters_outstanding} "
                             f"record(s) are not acknowledged yet; they are kept in {spool_dir} "
                             "and replayed by the next `reef produce` with this spool."))
    for error in summary.errors:
        console.print(f"[red]failed:[/red] {escape(error)}")


def _print_rejections(summary: ImportSummary) -> None:
    table = Table(title="rejected lines, by reason")
    table.add_column("field or problem")
    table.add_column("lines", justify="right")
    table.add_column("first")
    for group, count in summary.rejected.most_common():
        table.add_row(escape(group), str(count), escape(summary.first_rejection[group]))
    console.print(table)
    console.print(escape(f"{summary.dead_letters_acknowledged} of {summary.dead_letters_sent} "
                         f"dead letters acknowledged (source {summary.source})."))


COMMANDS = [produce]
