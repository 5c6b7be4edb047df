"""``reef sink tensorboard|wandb``: the metrics topic into TensorBoard event files or a Weights &
Biases run (``reef_stream.ops.sinks``; each behind its extra).

``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

from pathlib import Path

import click

from reef_stream.cli.common import settings_of, stop_on_signals

_MAPPING = """Each Metric becomes one scalar: tag <stage>/<name> then /<key>=<value> per label but
instance (e.g. trainer/loss/group=g/recipe=sao, processor/generations/outcome=unit/recipe=sao);
step: for the trainer's metrics the trainer step, for other stages the metric's created_at in
milliseconds; wall time: created_at. The sink is consumer group <ns>.sink.KIND (--group): it
commits offsets only after the scalars are flushed to the sink, so a restarted sink goes on
where it stopped. Runs until Ctrl-C or SIGTERM, or with --until-end until it has read to the
end of the topic."""


def _common(command):
    command = click.option(
        "--until-end", is_flag=True,
        help="Stop after reading to the end of the metrics topic (batch export, tests).")(command)
    command = click.option(
        "--group", default=None, metavar="GROUP",
        help="Consumer group whose committed offsets mark what was written "
             "[default: <ns>.sink.KIND].")(command)
    return command


@click.group()
def sink() -> None:
    """Copy the metrics topic (<ns>.metrics) into TensorBoard or Weights & Biases."""


@sink.command("tensorboard", epilog=_MAPPING)
@click.option("--logdir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory of the event files (`tensorboard --logdir DIR` shows them).")
@click.option("--flush-every", type=click.FloatRange(min=0), default=10.0, show_default=True,
              metavar="SECONDS", help="Seconds between flush-and-commit while metrics arrive.")
@_common
@click.pass_context
def tensorboard(ctx: click.Context, logdir: Path, flush_every: float, group: str | None,
                until_end: bool) -> None:
    """Write the namespace's metrics as TensorBoard event files in --logdir.

    Needs the tensorboard extra: pip install 'reef-stream[tensorboard]'.
    Each run adds an event file beside the earlier ones; TensorBoard shows
    them as one run.
    """
    from reef_stream.ops.sinks import TensorBoardSink

    _run(ctx, TensorBoardSink(logdir), group, until_end, flush_every)
    click.echo(f"event files in {logdir}")


@sink.command("wandb", epilog=_MAPPING)
@click.option("--project", default="reef-stream", show_default=True,
              help="W&B project of the run.")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True,
              help="Where W&B writes its run directories (DIR/wandb/offline-run-*).")
@click.option("--flush-every", type=click.FloatRange(min=0), default=300.0, show_default=True,
              metavar="SECONDS",
              help="Seconds between flush-and-commit while metrics arrive; each flush finishes "
                   "the W&B run and leaves one run directory.")
@_common
@click.pass_context
def wandb(ctx: click.Context, project: str, directory: Path, flush_every: float,
          group: str | None, until_end: bool) -> None:
    """Log the namespace's metrics to a Weights & Biases run, in offline mode: no network, no
    account needed.

    Offline unless WANDB_MODE says otherwise; upload later with `wandb sync
    --id RUN_ID DIR/wandb/offline-run-*` (the run id is the consumer group,
    printed at the end; every run of the sink uses it, and each flush leaves
    one run directory). Needs the wandb extra: pip install 'reef-stream[wandb]'.
    """
    from reef_stream.ops.sinks import WandbSink, default_group

    namespace = settings_of(ctx).namespace
    group = group or default_group(namespace, WandbSink.kind)
    target = WandbSink(project=project, dir=directory, run_id=group, name=namespace)
    _run(ctx, target, group, until_end, flush_every)
    click.echo(f"W&B run {target.run_id} ({target.mode}) in {directory / 'wandb'}")


def _run(ctx: click.Context, target, group: str | None, until_end: bool,
         flush_every: float) -> None:
    """Run ``target`` as consumer group ``group`` until the end, or until SIGTERM/SIGINT."""
    from reef_stream.ops.sinks import MetricsSinkRunner, default_group
    from reef_stream.topics.connect import bootstrap_servers

    settings = settings_of(ctx)
    runner = MetricsSinkRunner(
        bootstrap_servers(settings), settings.namespace, target,
        group=group or default_group(settings.namespace, target.kind),
        until_end=until_end, flush_every=flush_every)
    with stop_on_signals(runner.stop):
        summary = runner.run()
    click.echo(summary.line())


COMMANDS = [sink]
