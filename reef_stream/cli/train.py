"""``reef train --recipe X --group G``: run a trainer (``reef_stream.consumers.trainer.trainer``).

    reef train --recipe reef_stream.demo.recipes:sao --group run-1
    reef train --recipe tests.recipes.trainable --group g --checkpoints /data/ckpt --max-steps 100

Consumes ``<ns>.units.<recipe>`` as consumer group G, trains a step per
``units_per_step`` units, and acknowledges every ``schedule.checkpoint_every``
steps (``--set schedule.checkpoint_every=5``; or sooner, ``--checkpoint-every-s``)
by writing a checkpoint, producing a Checkpoint event and committing the
offsets, in that order. A trainer killed at any moment (SIGKILL included) and
restarted resumes from its newest checkpoint, trains the steps since again from
the log, and reaches the same weights. SIGINT / SIGTERM stop it after the step
in progress, checkpointing what it trained. An acknowledgement whose Kafka
transaction is stuck for 120 s (a client bug after a broker died) ends it with
status 75, for its supervisor to restart it. ``COMMANDS`` lists the command for
``main.add_command``; also runnable as ``python -m reef_stream.cli.train``.
"""

from __future__ import annotations

import logging
import os

import click

from reef_stream.cli.common import run_stage, run_standalone
from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics
from reef_stream.cli.recipe_options import set_option


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe to train (as for `reef check`); its backend must have a model.")
@set_option
@click.option("--group", required=True,
              help="The trainer's consumer group: its identity. Offsets, checkpoints and the "
                   "model name (by default) belong to it; groups train independently.")
@click.option("--checkpoints", "url", default=None, metavar="URL",
              help="Checkpoint store: a directory or any fsspec URL "
                   "[default: $REEF_HOME/checkpoints/<namespace>/<recipe>/<group>].")
@click.option("--keep", type=click.IntRange(min=0), default=5, show_default=True,
              help="Checkpoints to retain, newest first (0 keeps every one).")
@click.option("--model", "model_name", default=None,
              help="Model name in Checkpoint events and publications "
                   "[default: the backend's model_name, else the group].")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop once the trainer is at this step (counting from the first checkpoint).")
@click.option("--idle-exit", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Stop after this long without a new unit (an unfinished step stays "
                   "unacknowledged and is trained on the next run).")
@click.option("--checkpoint-every-s", type=click.FloatRange(min=0, min_open=True),
              default=None, metavar="SECONDS",
              help="Also checkpoint once this long has passed since the last checkpoint, "
                   "whatever the recipe's schedule.checkpoint_every (steps) says: bounds the "
                   "work a crash makes the trainer redo.")
@click.option("--ranks-timeout-s", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="Data-parallel ranks: how long one waits for the others in an exchange "
                   "before the job fails (a rank's host cut off) [default: torch's, 30 min]. "
                   "Give every rank the same; longer than a checkpoint takes.")
@metrics_port_option
def train(path: str, group: str, url: str | None, keep: int, model_name: str | None,
          max_steps: int | None, idle_exit: float | None, checkpoint_every_s: float | None,
          ranks_timeout_s: float | None, metrics_port: int | None, overrides: tuple[str, ...] = ()) -> None:
    """Train a recipe as a consumer group; checkpoints are the acknowledgements.

    Each step's units come from the units topic in an order fixed by the log
    (not by fetch timing); units already trained are skipped, units too stale
    for the schedule are dropped to the dead letters, and every count goes to
    <namespace>.metrics. Prints a summary when it stops. Under torchrun, the
    rank with LOCAL_RANK=r serves its metrics on --metrics-port + r.
    """
    from reef_stream.api.recipe import load_recipe
    from reef_stream.consumers.trainer.trainer import Trainer
    from reef_stream.core.settings import load_settings
    from reef_stream.topics.connect import bootstrap_servers
    from reef_stream.topics.fencing import exit_for_restart

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for logger in ("reef_stream.consumers.trainer", "reef_stream.engine.sharding"):
        logging.getLogger(logger).setLevel(logging.INFO)
    settings = load_settings()
    recipe = load_recipe(path, overrides=overrides, trains=True)
    trainer = Trainer(recipe, bootstrap=bootstrap_servers(settings), namespace=settings.namespace,
                      group=group, checkpoints=url, keep=keep, model_name=model_name,
                      max_steps=max_steps, idle_exit=idle_exit,
                      checkpoint_every_s=checkpoint_every_s, settings=settings,
                      ranks_timeout_s=ranks_timeout_s, on_stuck=exit_for_restart("trainer"))
    if metrics_port:  # one port per rank on a host (torchrun sets LOCAL_RANK)
        metrics_port += int(os.environ.get("LOCAL_RANK", "0"))
    serve_metrics(metrics_port)
    run_stage(trainer)


COMMANDS = [train]


if __name__ == "__main__":
    run_standalone(train, "reef train", "reef_stream.consumers.trainer.trainer")
