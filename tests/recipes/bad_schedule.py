"""A recipe whose schedule is inconsistent in three ways: it fails as it is built."""

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from tests.recipes.parts import GroupBaseline

recipe = Recipe(
    name="bad_schedule",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=60_000)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=10, optimizer_batch_size=4, micro_batch_size=3,
                      epochs=0, max_staleness=2),
    backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT,)),
)
