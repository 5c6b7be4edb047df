"""A recipe whose objective consumes a unit type the processor does not emit, with a loss family
given as a string and an unregistered unit schema: every problem is listed."""

from dataclasses import dataclass
from typing import ClassVar

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources, RolloutUnits
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from tests.recipes.parts import GroupBaseline


@dataclass(frozen=True, kw_only=True)
class PairUnit:
    SCHEMA: ClassVar[str] = "tests.PairUnit"

    unit_id: str


recipe = Recipe(
    name="bad units",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=60_000),
                                units=RolloutUnits(unit_type=PairUnit)),
    objective=GroupBaseline(loss_family="policy_gradient"),
    schedule=Schedule(units_per_step=8, optimizer_batch_size=4, micro_batch_size=2,
                      max_staleness=2),
    backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT,)),
)
