"""The example methods bound to the demo task: what ``reef demo --recipe methods.sao`` runs.

A method package (``methods/sao``, ``methods/grpo``) knows no task; it exposes a recipe factory.
Here the demo binds each to its task (``reef_stream.demo.task``): the ``policy_model``, the
``exact_match`` reward and the ``HeldOutAccuracy`` evaluator::

    reef check --recipe reef_stream.demo.recipes:sao
    reef train --recipe reef_stream.demo.recipes:grpo --group g --set schedule.max_staleness=4

``reef demo --recipe methods.sao`` (or ``methods.grpo``, or their ``reef_stream.methods``
names in an installed wheel) gives its stages these (``stage_recipe``). With
``REEF_DEVICE_MODEL`` set (``reef demo --device-model``) the loss also waits the trainer's
modelled device time (``reef_stream.demo.devices.DeviceTimedLoss``): the same computation.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from reef_stream.api.recipe import Recipe
from reef_stream.demo.devices import DEVICE_DIR_ENV, DeviceClock, DeviceModel, DeviceTimedLoss
from reef_stream.demo.task import HeldOutAccuracy, exact_match, policy_model

#: The example methods the demo binds, by their name here.
METHODS = ("sao", "grpo")
#: A candidate is rejected when its held-out accuracy falls more than this below the
#: incumbent's: on 100 prompts one answer is 0.01, and a tighter bound rejects the wobble of a
#: policy still near chance, while the trainer runs ahead.
TOLERANCE = 0.05


def method(name: str) -> ModuleType:
    """The example method package ``name``: the one already imported under either name, else
    ``methods.<name>`` in a checkout, else ``reef_stream.methods.<name>`` (where the wheel
    installs them). Never both: each would register the method's loss family."""
    for imported in (f"methods.{name}", f"reef_stream.methods.{name}"):
        if imported in sys.modules:
            return sys.modules[imported]
    try:
        return importlib.import_module(f"methods.{name}")
    except ModuleNotFoundError as error:
        if error.name not in ("methods", f"methods.{name}"):
            raise
        return importlib.import_module(f"reef_stream.methods.{name}")


def bind(factory: Callable[..., Recipe]) -> Recipe:
    """A method's recipe factory bound to the demo task, its loss timed on the trainer's
    modelled device when ``REEF_DEVICE_MODEL`` says so (``timed``). Reads the environment."""
    return timed(factory(model=policy_model, reward=exact_match,
                         evaluator=HeldOutAccuracy(tolerance=TOLERANCE, model=policy_model)))


def timed(recipe: Recipe, device: DeviceModel | None = None,
          clock: DeviceClock | None = None) -> Recipe:
    """``recipe`` with its loss wrapped in ``DeviceTimedLoss`` on ``device`` (default: what
    ``REEF_DEVICE_MODEL`` spells; None there: ``recipe`` itself). ``clock`` defaults to the
    trainer's, reporting to ``$REEF_DEVICE_DIR/trainer.json`` when that is set. Pure but for
    reading the environment."""
    device = device or DeviceModel.from_environment()
    if device is None:
        return recipe
    if clock is None:
        folder = os.environ.get(DEVICE_DIR_ENV, "").strip()
        clock = DeviceClock("trainer", Path(folder) / "trainer.json" if folder else None)
    family = recipe.objective.loss_family
    loss = dict(recipe.backend.losses).get(family, family.reference)
    losses = {**dict(recipe.backend.losses), family: DeviceTimedLoss(loss, device, clock)}
    return dataclasses.replace(recipe, backend=dataclasses.replace(recipe.backend,
                                                                    losses=losses))


def stage_recipe(path: str, engine: str = "toy") -> str:
    """The recipe path the demo's stages load for ``reef demo --recipe path``: an example
    method's name (``methods.sao``, ``reef_stream.methods.grpo``) becomes its demo binding
    here (``reef_stream.demo.recipes:sao``), or with ``engine="vllm"`` its binding to the
    Hugging Face policy (``reef_stream.demo.vllm_recipes:sao``); any other path is a bound
    recipe, taken as is."""
    module = path.partition(":")[0]
    for name in METHODS:
        if module in (f"methods.{name}", f"reef_stream.methods.{name}") and ":" not in path:
            where = "reef_stream.demo.vllm_recipes" if engine == "vllm" else __name__
            return f"{where}:{name}"
    return path


sao = bind(method("sao").recipe)
grpo = bind(method("grpo").recipe)
#: ``--recipe reef_stream.demo.recipes``: the demo's default method.
recipe = sao
