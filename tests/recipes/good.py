"""A sound recipe: groups by group_id, one feedback source, group-baseline advantages."""

from reef_stream.api.losses import POLICY_GRADIENT, VALUE_REGRESSION
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from tests.recipes.parts import GroupBaseline

recipe = Recipe(
    name="good",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=60_000)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2,
                      max_staleness=2),
    backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT, VALUE_REGRESSION)),
)
