"""A recipe whose backend cannot run its objective's loss family, whose micro batches do not
fit the backend's ranks, and that has no evaluator: three problems, reported together."""

from reef_stream.api.losses import VALUE_REGRESSION
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from tests.recipes.parts import GroupBaseline

recipe = Recipe(
    name="bad_loss",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=60_000)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2,
                      max_staleness=2),
    backend=Backend(name="values-only", loss_families=(VALUE_REGRESSION,), data_parallel_size=4),
    evaluator=None,
)
