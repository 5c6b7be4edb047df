"""``reef approve`` / ``reef reject`` / ``reef rollback``: a person's decision, asked of the
recipe's fenced evaluator and recorded as an event.

    reef approve sao-small 12 --reason "looked at 20 samples"
    reef reject sao-small 12 --reason "answers got longer and worse"
    reef rollback sao-small --to 9 --reason "users report regressions"

Each command checks the decision against its own read of ``<namespace>.publications`` (a
mistake is refused at once, exit status 2), then sends it as a request that the active
evaluator of the model's recipe applies in its own transaction, against its own ledger, and
waits (``--wait``) for the outcome (``reef_stream.publishing.decisions``): the decision's line,
or why it no longer applies (exit status 2), or, when no evaluator applied it in time, that it
stays queued (exit status 1). The decision is one Publication naming who (``--by``, default the
login name), when and why. ``COMMANDS`` lists the commands for ``main.add_command``.
"""

from __future__ import annotations

import getpass

import click

from reef_stream.cli.common import settings_of

#: How long a command waits for the evaluator's outcome unless ``--wait`` says.
DEFAULT_WAIT_S = 60.0

_APPLIED_BY = """

The decision is applied by the model's active evaluator (`reef evaluate`), the one writer of
decisions, fenced by Kafka: the command checks it against the log first, sends it as a request,
and waits up to --wait seconds for the evaluator's outcome. A decision the log has moved past
meanwhile (the canary decided, another person decided) is refused with the reason (exit status
2). When no evaluator applies it in time, the command says so and exits 1: the request stays
queued and is applied (or refused) when an evaluator of the model runs."""


def _options(function):
    function = click.option(
        "--wait", "wait", type=click.FloatRange(min=0), default=DEFAULT_WAIT_S,
        show_default=True, metavar="SECONDS",
        help="How long to wait for the evaluator to apply the decision.")(function)
    return click.option("--by", default=None, metavar="NAME",
                        help="Who decides [default: the login name].")(function)


def _decide(ctx: click.Context, kind: str, build, reason: str | None, wait: float) -> None:
    from reef_stream.core.errors import ConfigurationError, RetryableError
    from reef_stream.core.events import DecisionKind
    from reef_stream.core.failpoints import failpoint
    from reef_stream.publishing.decisions import ask, request_for
    from reef_stream.publishing.publications import PublicationLedger
    from reef_stream.topics import declarations
    from reef_stream.topics.connect import bootstrap_servers

    settings = settings_of(ctx)
    bootstrap = bootstrap_servers(settings)
    with PublicationLedger(bootstrap, settings.namespace) as ledger:
        ledger.catch_up()
        publication = build(ledger)  # refused here when it does not apply to what was read
    request = request_for(DecisionKind[kind], publication, reason=reason)
    failpoint("decide.before-request")   # the fault tests' moment between the read and the ask
    outcome = ask(bootstrap, settings.namespace, request, wait)
    if outcome is None:
        raise RetryableError(
            f"no evaluator applied the decision on {publication.model} version "
            f"{publication.policy_version} within {wait:g} s (request {request.request_id}): "
            f"it stays queued on {declarations.decision_requests(settings.namespace)} and is "
            f"applied, or refused, when an evaluator of {publication.model!r} runs (reef "
            "evaluate); `reef fleet` shows the outcome")
    if not outcome.applied:
        raise ConfigurationError(f"the evaluator refused the decision: {outcome.text}")
    click.echo(outcome.text)


def _who(by: str | None) -> str:
    return by or getpass.getuser()


@click.command(help="""Promote VERSION of MODEL, waiting for a decision (a canary, or a recipe
that requires approval): every replica serves it. Recorded as a PROMOTED publication naming
who.""" + _APPLIED_BY)
@click.argument("model")
@click.argument("version", type=click.IntRange(min=0))
@click.option("--reason", default=None, help="Why (recorded with the decision).")
@_options
@click.pass_context
def approve(ctx: click.Context, model: str, version: int, reason: str | None,
            by: str | None, wait: float) -> None:
    from reef_stream.publishing import decisions

    _decide(ctx, "APPROVE", lambda ledger: decisions.approval(
        ledger, model, version, by=_who(by), reason=reason), reason, wait)


@click.command(help="""Reject VERSION of MODEL, waiting for a decision: replicas that took it as
a canary go back to the incumbent. Recorded as a REJECTED publication naming who and
why.""" + _APPLIED_BY)
@click.argument("model")
@click.argument("version", type=click.IntRange(min=0))
@click.option("--reason", required=True, help="Why (recorded with the decision).")
@_options
@click.pass_context
def reject(ctx: click.Context, model: str, version: int, reason: str, by: str | None,
           wait: float) -> None:
    from reef_stream.publishing import decisions

    _decide(ctx, "REJECT", lambda ledger: decisions.rejection(
        ledger, model, version, by=_who(by), reason=reason), reason, wait)


@click.command(help="""Make the fleet serve an earlier promoted version of MODEL, recorded as a
ROLLED_BACK publication. With a canary open, rolls the canary back (its replicas go back to the
incumbent). Versions stay monotonic: a trainer too far past the version served rolls back to
its weights as its next version.""" + _APPLIED_BY)
@click.argument("model")
@click.option("--to", "to", type=click.IntRange(min=0), default=None, metavar="VERSION",
              help="The earlier promoted version to serve again [default: the one promoted "
                   "before the current one]. Its published copy must still be kept "
                   "(reef evaluate --keep-published).")
@click.option("--reason", default=None, help="Why (recorded with the decision).")
@_options
@click.pass_context
def rollback(ctx: click.Context, model: str, to: int | None, reason: str | None,
             by: str | None, wait: float) -> None:
    from reef_stream.publishing import decisions

    _decide(ctx, "ROLLBACK", lambda ledger: decisions.rollback(
        ledger, model, by=_who(by), to=to, reason=reason), reason, wait)


COMMANDS = [approve, reject, rollback]
