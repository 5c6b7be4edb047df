"""The ``reef`` command line.

    reef up                         local broker + Redis + topics, then the status
    reef kafka up|down|status       the local Kafka cluster (1 or 3 KRaft nodes)
    reef redis up|down|status       the local Redis server
    reef s3 up|down|status|env      the local object store (S3Proxy), for s3:// checkpoints
    reef engine install|up|down|status  a local vLLM server (own cached environment)
    reef topics create|verify       the declared topics of a namespace
    reef produce generations|feedback   import JSONL logs (native or OpenAI-style)
    reef intake serve               HTTP intake for fleets not written in Python
    reef replay|tail|lag            consumer-group cursors, records as JSON, lag
    reef check --recipe X           a recipe's contract, or every problem with its bindings
    reef reward --recipe X          reward workers: score generations, emit feedback
    reef rescore --recipe X --source S  a fixed reward over logged generations, as a new source
    reef process --recipe X         the processor: generations + feedback -> typed units
    reef train --recipe X --group G the trainer: units -> checkpoints (acknowledged steps)
    reef evaluate --recipe X        candidate evaluation: one Publication per checkpoint
    reef follow --model M           a serving replica: newest promoted version, verified
    reef fleet [--rebuild]          published/serving versions and replicas (Redis, rebuildable)
    reef approve|reject MODEL VERSION   a person's decision on a staged (canary) version
    reef rollback MODEL [--to V]    serve an earlier promoted version again (a decision event)
    reef demo                       the whole loop on a toy task, every stage a process
    reef trace GENERATION_ID        a generation's lineage: feedback, unit, step, publication, replicas
    reef top [--once]               live view: topic rates, group lag, versions, replicas, dead letters
    reef scorecard --recipe NAME    the standard scorecard of a namespace's loop (docs/metrics.md)
    reef sink tensorboard|wandb     the metrics topic into TensorBoard event files or an offline W&B run
    reef dashboard [--port P]       live charts of the metrics topic on a local web page

Where ``REEF_BOOTSTRAP_SERVERS`` / ``REEF_REDIS_URL`` name existing servers,
nothing is started and every command uses those (see ``reef_stream.core.settings``).
Every error is one message saying what to do; the exit status is 2 for a
configuration problem and 1 for anything else.
"""

from __future__ import annotations

import logging
import sys

import click

from reef_stream.cli import (
    check,
    cursors,
    dashboard,
    decide,  # noqa: I001 - reef approve / reject / rollback
    demo,
    evaluate,
    fleet,
    follow,
    inference,
    intake,
    process,
    produce,
    rescore,
    reward,
    scorecard,
    servers,
    sink,
    top,
    topics,
    trace,
    train,
)
from reef_stream.cli.common import ReefGroup, print_error
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.settings import load_settings
from reef_stream.topics.connect import KAFKA_LOGGER


@click.group(cls=ReefGroup)
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
        print_error(exc)
        sys.exit(2)


for module in (servers, topics, produce, intake, cursors, check, reward, rescore, process, train,
               evaluate, follow, fleet, demo, trace, top, scorecard, sink, dashboard, inference,
               decide):
    for command in module.COMMANDS:
        main.add_command(command)


if __name__ == "__main__":
    main()
