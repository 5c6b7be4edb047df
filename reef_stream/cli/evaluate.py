"""``reef evaluate --recipe X``: decide on every checkpoint of a recipe, once, as a Publication.

    reef evaluate --recipe reef_stream.demo.recipes:sao
    reef evaluate --recipe reef_stream.demo.recipes:sao --model sao-small --publish-to s3://b/pub
    python -m reef_stream.cli evaluate --recipe reef_stream.demo.recipes:sao  # without the reef script

The worker is ``reef_stream.consumers.evaluator.evaluator.EvaluatorWorker``; this
command loads and checks the recipe, prints the evaluator's warning (the
default AcceptEverything promotes every checkpoint unevaluated), connects the
Redis fleet projection when Redis is configured, installs SIGTERM/SIGINT
handlers that stop it cleanly, runs it and prints its one-line summary on
exit. ``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import logging

import click

from reef_stream.cli.common import run_stage
from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics
from reef_stream.cli.recipe_options import set_option
from reef_stream.core.errors import ConfigurationError


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe whose candidate evaluator decides: a dotted module path exposing "
                   "`recipe`, or module:attribute (reef_stream.demo.recipes:sao). Only its "
                   "checkpoints are decided.")
@set_option
@click.option("--group", "-g", default=None,
              help="The consumer group on <namespace>.checkpoints; one member is active, others "
                   "stand by [default: <namespace>.evaluate.<recipe name>].")
@click.option("--model", "-m", default=None,
              help="Decide only on checkpoints of this model [default: every model of the recipe].")
@click.option("--publish-to", default=None, metavar="URL",
              help="Where promoted checkpoints are copied, out of reach of the trainer's "
                   "retention; a path or any fsspec URL "
                   "[default: $REEF_HOME/published/<namespace>].")
@click.option("--keep-published", type=click.IntRange(min=0), default=3, show_default=True,
              help="Published copies kept per model; older ones are deleted (0 keeps all).")
@click.option("--retries", type=click.IntRange(min=0), default=1, show_default=True,
              help="Tries of the evaluator's measure after one that raised. A candidate whose "
                   "every try failed is REJECTED with the error as its reason.")
@click.option("--backoff", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds before the first retry; doubled before each further one (at most 60).")
@click.option("--supersede/--no-supersede", default=True, show_default=True,
              help="When newer checkpoints of the same model are already waiting (read from the "
                   "log, not decided yet), measure only the newest and REJECT the older ones "
                   "unmeasured (reason 'superseded: ...'), so replicas get the newest version "
                   "instead of a queue of old ones. Every checkpoint still gets one decision; "
                   "a rollback checkpoint is never superseded, nor a candidate of a model with "
                   "no promoted version yet, and an evaluator that does not measure "
                   "(AcceptEverything) decides every candidate. --no-supersede measures every "
                   "candidate.")
@click.option("--serving-dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default=None,
              help="For a Hugging Face model: the dtype of the serving artifact written beside "
                   "each promoted copy (what `reef follow --engine` loads) [default: the "
                   "model's own].")
@click.option("--publish-every", "publish_every_s", type=click.FloatRange(min=0, min_open=True),
              default=None, metavar="SECONDS",
              help="Publication cadence: at most one promotion per SECONDS of the trainer's "
                   "clock; a candidate whose checkpoint is younger than that after the "
                   "incumbent's is REJECTED unmeasured ('publication cadence: ...') [default: "
                   "the recipe's release policy, else every promoted candidate].")
@click.option("--canary-share", type=click.FloatRange(min=0, max=1), default=None,
              metavar="SHARE",
              help="Publish what the offline evaluator promotes as a CANARY on this share of "
                   "the replicas, judged by the recipe's canary evaluator on live feedback (a "
                   "recipe without one: MeanDifference's defaults); 0 turns the canary off "
                   "[default: the recipe's].")
@click.option("--require-approval/--no-require-approval", default=None,
              help="Whether a version that passed waits for `reef approve` [default: the "
                   "recipe's].")
@click.option("--max-candidates", type=click.IntRange(min=1), default=None,
              help="Stop after this many decisions, superseded rejections included (each "
                   "is a candidate's one decision; for tests and batch runs).")
@click.option("--idle-exit", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="Stop after this many seconds without a new checkpoint event "
                   "[default: run until stopped].")
@metrics_port_option
@click.pass_context
def evaluate(ctx: click.Context, path: str, group: str | None, model: str | None,
             publish_to: str | None, keep_published: int, retries: int, backoff: float,
             supersede: bool, serving_dtype: str | None, publish_every_s: float | None,
             canary_share: float | None, require_approval: bool | None,
             max_candidates: int | None,
             idle_exit: float | None, metrics_port: int | None,
             overrides: tuple[str, ...] = ()) -> None:
    """Evaluate candidate checkpoints and publish one decision per checkpoint.

    Consumes <namespace>.checkpoints as a consumer group. For each checkpoint
    of the recipe it verifies the files against their sha256, runs the
    recipe's CandidateEvaluator (measure, then select against the incumbent:
    the model's newest promoted version, read back from
    <namespace>.publications at start) and produces one Publication, PROMOTED
    or REJECTED, with the measurement, the reason and the evaluator's name.
    A promoted checkpoint is first copied to the publication store, and the
    Publication names the copy; for a Hugging Face model, also the serving
    artifact written beside it (the weights in --serving-dtype, or the LoRA
    adapter alone). Only promoted versions are served by
    `reef follow` replicas.

    Exactly one decision per checkpoint: a re-emitted Checkpoint event (same
    id) or a version not newer than one already decided gets none. The
    offset is committed only after the Publication is acknowledged.

    When the trainer checkpoints faster than the evaluator measures, the
    checkpoints already waiting are decided together: only the newest of a
    model is measured, and the older ones are REJECTED as superseded, without
    measuring (--no-supersede measures them all, one after the other).

    Release: with a canary (the recipe's Staged(canary=...) or --canary-share)
    a promoted candidate is first a CANARY on a share of the replicas, then
    PROMOTED or ROLLED_BACK from live feedback; with --require-approval it
    waits for `reef approve` / `reef reject`; --publish-every sets a cadence.

    The default evaluator (AcceptEverything) promotes everything without
    measuring; a warning says so at start and its publications are marked
    unevaluated. Stops on SIGTERM or Ctrl-C, --max-candidates or
    --idle-exit, and prints a one-line summary. A decision whose Kafka
    transaction is stuck for 120 s (a client bug after a broker died) ends
    it with status 75: restart it; nothing committed is lost.
    """
    from reef_stream.api.recipe import load_recipe
    from reef_stream.consumers.evaluator.evaluator import EvaluateOptions, EvaluatorWorker
    from reef_stream.core.settings import load_settings
    from reef_stream.publishing.fleet import Fleet
    from reef_stream.topics.fencing import exit_for_restart

    settings = ctx.obj if ctx.obj is not None else load_settings()
    logging.getLogger("reef_stream.consumers.evaluator").setLevel(logging.INFO)
    recipe = load_recipe(path, overrides=overrides)
    options = EvaluateOptions(group=group, model=model, publish_to=publish_to,
                              keep_published=keep_published, retries=retries, backoff=backoff,
                              supersede=supersede, serving_dtype=serving_dtype,
                              publish_every_s=publish_every_s, canary_share=canary_share,
                              require_approval=require_approval,
                              max_candidates=max_candidates, idle_exit=idle_exit)
    try:
        fleet = Fleet.from_settings(settings)
    except ConfigurationError:
        fleet = None
        click.echo("no Redis configured: the fleet projection is not updated "
                   "(`reef fleet --rebuild` restores it later)", err=True)
    worker = EvaluatorWorker(
        recipe, settings=settings, options=options, fleet=fleet,
        announce=lambda text: click.secho(text, fg="red", bold=True, err=True),
        on_stuck=exit_for_restart("evaluator"))
    serve_metrics(metrics_port)
    run_stage(worker)    # a signal stops it after the current candidate



COMMANDS = [evaluate]
