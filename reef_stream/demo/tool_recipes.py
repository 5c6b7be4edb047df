"""The example methods bound to the tool task: what ``reef demo --task tool`` runs.

As ``reef_stream.demo.recipes`` binds SAO and GRPO to the arithmetic task, this binds them to
``reef_stream.demo.tool_task``: its policy (two more token ids), its ``tool_answer`` reward and
held-out accuracy measured by greedy rollouts that call the tool::

    reef check --recipe reef_stream.demo.tool_recipes:sao
"""

from __future__ import annotations

from collections.abc import Callable

from reef_stream.api.recipe import Recipe
from reef_stream.demo.recipes import METHODS, TOLERANCE, method, timed
from reef_stream.demo.task import HeldOutAccuracy
from reef_stream.demo.tool_task import tool_accuracy, tool_policy_model, tool_reward


def bind(factory: Callable[..., Recipe]) -> Recipe:
    """A method's recipe factory bound to the tool task, its loss timed on the trainer's
    modelled device when ``REEF_DEVICE_MODEL`` says so (``recipes.timed``)."""
    return timed(factory(model=tool_policy_model, reward=tool_reward,
                         evaluator=HeldOutAccuracy(tolerance=TOLERANCE, model=tool_policy_model,
                                                   measure_with=tool_accuracy)))


def stage_recipe(path: str) -> str:
    """The recipe path the demo's stages load for ``reef demo --task tool --recipe path``: an
    example method's name (``methods.sao``) becomes its binding here; any other path is a
    bound recipe, taken as is."""
    module = path.partition(":")[0]
    for name in METHODS:
        if module in (f"methods.{name}", f"reef_stream.methods.{name}") and ":" not in path:
            return f"{__name__}:{name}"
    return path


sao = bind(method("sao").recipe)
grpo = bind(method("grpo").recipe)
#: ``--recipe reef_stream.demo.tool_recipes``: the default method.
recipe = sao
