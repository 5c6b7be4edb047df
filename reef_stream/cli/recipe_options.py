"""``--set FIELD=VALUE``: the one option every command that loads a recipe takes.

    reef train --recipe reef_stream.demo.recipes:sao --group g --set schedule.max_staleness=4
    reef demo --recipe methods.grpo --set backend.optimizer.lr=3e-4 --set group_size=8

Repeatable; applied in order to the loaded recipe's frozen configs
(``reef_stream.api.recipe.apply_overrides``), each value read as its field's type. An unknown
field or a bad value is a configuration error (exit status 2) naming the valid fields. The
stages of one run must agree on the recipe, so give each the same ``--set`` items (``reef
demo`` passes its own to every stage it starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def set_option(command: F) -> F:
    """Adds ``--set`` (repeatable) to ``command``, as the parameter ``overrides`` (a tuple)."""
    return click.option(
        "--set", "overrides", multiple=True, metavar="FIELD=VALUE",
        help="Override a field of the recipe, typed as the field (repeatable): "
             "schedule.max_staleness=4, backend.optimizer.lr=3e-4, objective.decay=0.8, "
             "group_size=8. Every stage of a run must be given the same.")(command)
