"""``reef topics create|verify``: the declared topics of a namespace."""

from __future__ import annotations

import click

from reef_stream.cli.common import progress, settings_of
from reef_stream.topics.connect import bootstrap_servers, new_admin
from reef_stream.topics.declarations import declare_topics

# --------------------------------------------------------------------------- reef topics


@click.group()
def topics() -> None:
    """The topics of the namespace (REEF_NAMESPACE, default "reef")."""


@topics.command("create")
@click.option("--recipe", "recipes", multiple=True, help="Also the units topic of this recipe.")
@click.option("--partitions", type=click.IntRange(min=1), default=None,
              help="Partitions of the generations, feedback and units topics: at least as "
                   "many as processors or trainer ranks will share the work (default: the "
                   "namespace's existing count, or 6 for a new namespace). Each partition a "
                   "producer spreads records over costs the broker a request per batch; a "
                   "one-node setup runs cheapest on 1-2.")
@click.pass_context
def topics_create(ctx: click.Context, recipes: tuple[str, ...] = (),
                  partitions: int | None = None) -> None:
    """Create the declared topics; verify the ones that exist (idempotent).

    A topic that exists with settings other than its declaration is an error
    listing every difference; it is never silently used.
    """
    from reef_stream.topics.admin import ensure_topics, namespace_topics

    settings = settings_of(ctx)
    admin = new_admin(bootstrap_servers(settings))
    declared = (namespace_topics(admin, settings.namespace, recipes) if partitions is None
                else declare_topics(settings.namespace, recipes, partitions))
    report = ensure_topics(admin, declared)
    for name in report.created:
        progress(f"created {name}")
    for name in report.verified:
        progress(f"verified {name}")


@topics.command("verify")
@click.option("--recipe", "recipes", multiple=True, help="Also the units topic of this recipe.")
@click.pass_context
def topics_verify(ctx: click.Context, recipes: tuple[str, ...]) -> None:
    """Check that every declared topic exists with its declared settings (the feedback and
    units topics with as many partitions as the generations topic)."""
    from reef_stream.core.errors import TopicMismatchError
    from reef_stream.topics.admin import namespace_topics, verify_topics

    settings = settings_of(ctx)
    admin = new_admin(bootstrap_servers(settings))
    problems = verify_topics(admin, namespace_topics(admin, settings.namespace, recipes))
    if problems:
        raise TopicMismatchError(problems)
    progress("every declared topic exists with its declared settings")


COMMANDS = [topics]
