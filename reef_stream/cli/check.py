"""``reef check --recipe X``: load a recipe, check its bindings, print its contract.

    reef check --recipe reef_stream.demo.recipes:sao
    reef check --recipe my_package.recipes:small

The contract is what the recipe promises the pipeline: the unit schema and
its fields, how generations are grouped and when a group is complete, how
feedback combines and how long it is awaited, the loss family and the
backend's families, the schedule, and the candidate evaluator (and whether it
evaluates at all). A recipe with problems raises one ``ConfigurationError``
listing them all; the ``reef`` group prints it and exits with status 2.
``COMMANDS`` lists the command for ``main.add_command``. The recipe
machinery (and torch with it) is imported only when the command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from reef_stream.cli.recipe_options import set_option

if TYPE_CHECKING:  # imported when the command runs: they bring torch, which every reef command
    from reef_stream.api.recipe import Recipe  # would otherwise pay for at start
    from reef_stream.core.serde import SchemaRegistry


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe: a dotted module path exposing `recipe`, or module:attribute "
                   "(reef_stream.demo.recipes:sao). Only that module is imported.")
@set_option
def check(path: str, overrides: tuple[str, ...]) -> None:
    """Check a recipe's bindings and print its contract.

    Verifies that the processor's unit type is the objective's input and has
    a known Avro schema, that the backend supports the objective's loss
    family, that the schedule's batch sizes fit, and that processor,
    objective and evaluator follow their protocols, and that the whole loop
    can run from it: the reward function's source is one the processor waits
    for and every source it waits for is produced (by the reward function or
    declared external), the backend has a model to train, and a processor
    grouping by group id has the recipe's group size (what replicas sample
    per prompt). Prints the contract, or every problem at once (exit status 2).
    """
    from reef_stream.api.recipe import load_recipe
    from reef_stream.core.serde import SchemaRegistry

    registry = SchemaRegistry.default()
    recipe = load_recipe(path, registry=registry, overrides=overrides, complete=True)
    for line in contract_lines(recipe, path, registry):
        click.echo(line)


def contract_lines(recipe: Recipe, path: str, registry: SchemaRegistry) -> list[str]:
    """The contract of a checked ``recipe``, as lines of text."""
    processor, objective = recipe.processor, recipe.objective
    unit_type = processor.units.unit_type
    schema = registry.current(unit_type.SCHEMA)
    evaluator = recipe.evaluator
    families = ", ".join(f.name for f in recipe.backend.loss_families)
    lines = [
        f"recipe {recipe.name} ({path}): the bindings check out",
        "",
        f"unit:      {schema.name} ({unit_type.__name__}, {schema.path.name}, "
        f"fingerprint {schema.fingerprint.hex()}), to topic <ns>.units.{recipe.name}",
        *_fields(schema.parsed, "             "),
        f"grouping:  {processor.grouping.description}",
        f"feedback:  {processor.feedback.description}",
        "            duplicates (same generation id, same feedback source) are dropped and "
        "counted; late feedback is counted and dead-lettered",
        f"objective: {objective.name}: consumes {unit_type.__name__}, loss family "
        f"{objective.loss_family.name} ({objective.loss_family.description})",
        *_variant_lines(recipe),
        f"backend:   {recipe.backend.name}: supports {families}; data-parallel size "
        f"{recipe.backend.data_parallel_size}"
        + ("; sharded with FSDP" if getattr(recipe.backend.model, "sharding", "none") == "fsdp"
           else ""),
        f"schedule:  {recipe.schedule.describe()}",
        f"evaluator: {evaluator.name}: "
        + ("evaluates candidates before promoting them" if evaluator.evaluates else
           "evaluates nothing; its publications are marked unevaluated"),
    ]
    if evaluator.warning:
        lines.append(f"            {evaluator.warning}")
    reward = recipe.reward
    lines.append("reward:    " + (f"feedback source {reward.source!r} (reef reward)" if reward
                                  else "none (feedback comes from outside)"))
    if recipe.external_sources:
        lines.append(f"            external feedback sources: "
                     f"{', '.join(recipe.external_sources)}")
    lines.append("sampling:  " + (f"groups of {recipe.group_size} completions per prompt "
                                  "under one group_id" if recipe.group_size > 1 else
                                  "ungrouped: one completion per prompt"))
    model = recipe.backend.model
    name = (f"{getattr(model, '__module__', '?')}.{model.__qualname__}"
            if hasattr(model, "__qualname__") else repr(model))
    lines.append(f"model:     {name}"
                 + (f"; optimizer {recipe.backend.optimizer}" if recipe.backend.optimizer
                    else "; optimizer AdamW (lr 1e-3, the default)"))
    return lines


def _variant_lines(recipe: Recipe) -> list[str]:
    """The chosen variant of each part of the objective and of the loss the backend binds to
    its family, one ``part: choice`` a line (``describe()`` of the built-in ones,
    ``reef_stream.api.variants``). A loss without ``describe`` is shown as it prints."""
    objective = recipe.objective
    family = objective.loss_family
    losses = dict(recipe.backend.losses)
    loss = losses.get(family, family.reference)
    lines = [f"            {part}" for part in getattr(objective, "describe", tuple)()]
    reference = "" if family in losses else " (the family's reference)"
    if not hasattr(loss, "describe"):
        return [*lines, f"loss:      {loss!r}{reference}"]
    lines.append(f"loss:      {type(loss).__name__}{reference}")
    lines += [f"            {part}" for part in loss.describe()]
    return lines


def _fields(record: dict[str, Any], indent: str) -> list[str]:
    """One line per field of an Avro record schema, nested records indented below theirs."""
    lines = []
    for item in record["fields"]:
        lines.append(f"{indent}{item['name']}: {_type(item['type'])}"
                     + (f" (packed {item['reef.dtype']})" if "reef.dtype" in item else ""))
        nested = _nested_record(item["type"])
        if nested is not None:
            lines += _fields(nested, indent + "  ")
    return lines


def _type(avro: Any) -> str:
    if isinstance(avro, str):
        return avro
    if isinstance(avro, list):
        return " | ".join(_type(branch) for branch in avro)
    kind = avro["type"]
    if kind == "array":
        return f"array<{_type(avro['items'])}>"
    if kind == "map":
        return f"map<string, {_type(avro['values'])}>"
    if kind in ("record", "enum", "fixed"):
        return avro["name"]
    if "logicalType" in avro:
        return f"{kind} ({avro['logicalType']})"
    return _type(kind)


def _nested_record(avro: Any) -> dict[str, Any] | None:
    if isinstance(avro, list):
        return next((r for r in map(_nested_record, avro) if r is not None), None)
    if isinstance(avro, dict):
        if avro["type"] == "record":
            return avro
        if avro["type"] == "array":
            return _nested_record(avro["items"])
        if avro["type"] == "map":
            return _nested_record(avro["values"])
    return None


COMMANDS = [check]
