"""``reef process --recipe X``: run a recipe's processor (``reef_stream.consumers.processor.runtime``).

    reef process --recipe reef_stream.demo.recipes:sao
    reef process --recipe tests.recipes.good --group trial-3 --instance 1

Joins ``<ns>.generations`` and ``<ns>.feedback``, emits units to
``<ns>.units.<recipe>`` and every non-unit outcome to ``<ns>.dead-letters``,
its running counts to ``<ns>.metrics``, until SIGINT or SIGTERM (it finishes the current transaction and leaves). A
SIGKILL loses nothing: a restarted instance resumes from its last
transaction. Concurrent processors of one group need distinct ``--instance``
values; a restart must reuse its predecessor's. ``COMMANDS`` lists the
command for ``main.add_command``; also runnable as
``python -m reef_stream.cli.process``.
"""

from __future__ import annotations

import logging

import click

from reef_stream.cli.common import run_standalone
from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics
from reef_stream.cli.recipe_options import set_option


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe whose processor runs (as for `reef check`).")
@set_option
@click.option("--group", default=None,
              help="Consumer group [default: <namespace>.process.<recipe name>].")
@click.option("--instance", default="0", show_default=True,
              help="This processor's name in its group (static membership and transactional "
                   "id); distinct per concurrent processor, the same across restarts.")
@click.option("--batch", type=click.IntRange(1, 100_000), default=None,
              help="Most records per transaction [default: 2000].")
@metrics_port_option
def process(path: str, group: str | None, instance: str, batch: int | None,
            metrics_port: int | None, overrides: tuple[str, ...] = ()) -> None:
    """Run a recipe's processor: generations + feedback -> units and dead letters.

    Every generation ends in exactly one unit or one dead letter (expired, too
    stale, invalid), even across crashes: units, dead letters, the pending
    state's changelog and the consumed offsets are committed in one Kafka
    transaction per batch. Counts go to the log and, as Metric events labelled
    with the recipe, group and instance, to <namespace>.metrics (at most once a
    second).
    """
    from reef_stream.api.recipe import load_recipe
    from reef_stream.consumers.processor.runtime import BATCH, run_processor_runtime
    from reef_stream.core.settings import load_settings
    from reef_stream.topics.connect import bootstrap_servers

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for logger in ("reef_stream.consumers.processor", "reef_stream.topics.fencing",
                   "reef_stream.engine.join"):
        logging.getLogger(logger).setLevel(logging.INFO)
    settings = load_settings()
    recipe = load_recipe(path, overrides=overrides)
    serve_metrics(metrics_port)
    run_processor_runtime(recipe, bootstrap=bootstrap_servers(settings),
                          namespace=settings.namespace, group=group, instance=instance,
                          batch=batch or BATCH, stuck_commit_s=settings.stuck_commit_s)


COMMANDS = [process]


if __name__ == "__main__":
    run_standalone(process, "reef process", "reef_stream.consumers.processor.runtime")
