"""A recipe with a model: groups by group_id, group-baseline advantages, a tiny causal LM.

Small sizes so a step takes milliseconds on a CPU: the trainer's tests and benchmark use it.
"""

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ByGroupId, ComposedProcessor, RequireSources
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from reef_stream.engine.models import TinyCausalLM
from tests.recipes.parts import GroupBaseline

recipe = Recipe(
    name="trainable",
    processor=ComposedProcessor(grouping=ByGroupId(),
                                feedback=RequireSources(("exact_match",), timeout_ms=60_000)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=4, optimizer_batch_size=2, micro_batch_size=1, epochs=2,
                      seed=7, max_staleness=3),
    backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,),
                    model=lambda: TinyCausalLM(vocab_size=64, dim=16)),
)
