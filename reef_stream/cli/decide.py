"""``reef approve`` / ``reef reject`` / ``reef rollback``: a person's decision, recorded as an event.

    reef approve sao-small 12 --reason "looked at 20 samples"
    reef reject sao-small 12 --reason "answers got longer and worse"
    reef rollback sao-small --to 9 --reason "users report regressions"

The decisions are ``reef_stream.publishing.decisions``; each is one Publication on
``<namespace>.publications`` naming who (``--by``, default the login name), when and why.
``COMMANDS`` lists the commands for ``main.add_command``.
"""

from __future__ import annotations

import getpass

import click

from reef_stream.cli.common import settings_of


def _by_option(function):
    return click.option("--by", default=None, metavar="NAME",
                        help="Who decides [default: the login name].")(function)


def _decide(ctx: click.Context, build) -> None:
    from reef_stream.core.errors import ConfigurationError
    from reef_stream.publishing.decisions import record
    from reef_stream.publishing.fleet import Fleet
    from reef_stream.publishing.publications import PublicationLedger
    from reef_stream.topics.connect import bootstrap_servers

    settings = settings_of(ctx)
    bootstrap = bootstrap_servers(settings)
    with PublicationLedger(bootstrap, settings.namespace) as ledger:
        ledger.catch_up()
        publication = build(ledger)
        try:
            fleet = Fleet.from_settings(settings)
        except ConfigurationError:
            fleet = None
        record(bootstrap, settings.namespace, publication, ledger=ledger, fleet=fleet)
    target = "" if publication.rolled_back_to is None else \
        f"; replicas serve version {publication.rolled_back_to} again"
    click.echo(f"{publication.decision.value} {publication.model} version "
               f"{publication.policy_version} by {publication.decided_by}: "
               f"{publication.reason}{target}")


def _who(by: str | None) -> str:
    return by or getpass.getuser()


@click.command()
@click.argument("model")
@click.argument("version", type=click.IntRange(min=0))
@click.option("--reason", default=None, help="Why (recorded with the decision).")
@_by_option
@click.pass_context
def approve(ctx: click.Context, model: str, version: int, reason: str | None,
            by: str | None) -> None:
    """Promote VERSION of MODEL, waiting for a decision (a canary, or a recipe that requires
    approval): every replica serves it. Recorded as a PROMOTED publication naming who."""
    from reef_stream.publishing.decisions import approval

    _decide(ctx, lambda ledger: approval(ledger, model, version, by=_who(by), reason=reason))


@click.command()
@click.argument("model")
@click.argument("version", type=click.IntRange(min=0))
@click.option("--reason", required=True, help="Why (recorded with the decision).")
@_by_option
@click.pass_context
def reject(ctx: click.Context, model: str, version: int, reason: str, by: str | None) -> None:
    """Reject VERSION of MODEL, waiting for a decision: replicas that took it as a canary go
    back to the incumbent. Recorded as a REJECTED publication naming who and why."""
    from reef_stream.publishing.decisions import rejection

    _decide(ctx, lambda ledger: rejection(ledger, model, version, by=_who(by), reason=reason))


@click.command()
@click.argument("model")
@click.option("--to", "to", type=click.IntRange(min=0), default=None, metavar="VERSION",
              help="The earlier promoted version to serve again [default: the one promoted "
                   "before the current one]. Its published copy must still be kept "
                   "(reef evaluate --keep-published).")
@click.option("--reason", default=None, help="Why (recorded with the decision).")
@_by_option
@click.pass_context
def rollback(ctx: click.Context, model: str, to: int | None, reason: str | None,
             by: str | None) -> None:
    """Make the fleet serve an earlier promoted version of MODEL, recorded as a ROLLED_BACK
    publication. With a canary open, rolls the canary back (its replicas go back to the
    incumbent). Versions stay monotonic: a trainer too far past the version served rolls back
    to its weights as its next version."""
    from reef_stream.publishing.decisions import rollback as build

    _decide(ctx, lambda ledger: build(ledger, model, by=_who(by), to=to, reason=reason))


COMMANDS = [approve, reject, rollback]
