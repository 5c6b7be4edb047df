"""What every ``reef`` command shares: the console, the one mapping from an error to a
message and an exit status, the one runner for a command outside the ``reef`` group, and
the one signal handler that turns SIGTERM/SIGINT into a graceful stop
(``reef_stream.core.processes.stop_on_signals``, which the stages' own entry points use too).

Exit statuses: 0 done; 2 a configuration problem (the message says what to set or run);
1 any other ``ReefError``; 130 interrupted.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from reef_stream.core.errors import ConfigurationError, ReefError
from reef_stream.core.processes import stop_on_signals
from reef_stream.core.settings import Settings, load_settings

__all__ = ["ReefGroup", "console", "err_console", "exit_status", "fail", "print_error", "progress",
           "run_stage", "run_standalone", "settings_of", "stop_on_signals"]

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

def progress(message: str) -> None:
    console.print(f"[dim]·[/dim] {escape(message)}")


def print_error(exc: BaseException) -> None:
    err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")


def run_stage(worker: Any, *, stop: Callable[[], None] | None = None) -> None:
    """Run a long-running stage's ``worker`` until it returns or SIGINT / SIGTERM calls
    ``stop`` [default: ``worker.stop``], then print its one-line summary
    (``worker.summary.line()``), also after a failure: what it did before it failed."""
    try:
        with stop_on_signals(stop or worker.stop):
            worker.run()
    finally:
        click.echo(worker.summary.line())


def settings_of(ctx: click.Context) -> Settings:
    """The settings the ``reef`` group loaded, or fresh ones for a command run on its own."""
    return ctx.obj if ctx.obj is not None else load_settings()


def exit_status(error: ReefError) -> int:
    """2 for a configuration problem, 1 for any other ``ReefError``."""
    return 2 if isinstance(error, ConfigurationError) else 1


def fail(error: ReefError) -> NoReturn:
    """Print ``error`` as one line and exit with its status."""
    print_error(error)
    sys.exit(exit_status(error))


class ReefGroup(click.Group):
    """Turns every ReefError raised by a subcommand into one clear message and its status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ReefError as error:
            fail(error)


def run_standalone(command: click.Command, prog_name: str, logger: str) -> None:
    """Run ``command`` outside the ``reef`` group (``python -m reef_stream.cli.X``)
    with the group's error handling. ``logger`` logs at INFO."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("reef_stream.kafka").setLevel(logging.CRITICAL)
    logging.getLogger(logger).setLevel(logging.INFO)
    try:
        command.main(standalone_mode=False, prog_name=prog_name)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except ReefError as error:
        fail(error)
