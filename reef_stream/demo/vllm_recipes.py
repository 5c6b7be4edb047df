"""The example methods bound to the demo task with a Hugging Face policy: ``reef demo --engine vllm``.

    reef check --recipe reef_stream.demo.vllm_recipes:sao

As ``reef_stream.demo.recipes`` binds them, but the model is ``HuggingFace(path)`` on the demo's
tiny Qwen2-style model (``reef_stream.demo.vllm_model``; ``path`` is under ``$REEF_HOME``, read
from the settings when this module is imported, so every stage of a run given the same
``REEF_HOME`` trains, evaluates and serves the same directory). Full fine-tuning in float32:
the model has 76k parameters. The evaluator is the toy task's ``HeldOutAccuracy`` (greedy
decoding with the model in-process), and because the model is a Hugging Face one, the
evaluator writes each promoted version's serving artifact, which the vLLM replica's follower
loads into the engine.

The schedule differs from the toy demo's where the engine and the model need it:
``SCHEDULE_CHANGES`` (``units_per_step`` 128, the toy's 256: more versions, so that reloads
are exercised often and a version serves for a second or two) and ``LEARNING_RATE`` (why
1e-3: ``docs/history.md``, "The engine demo's learning rate").
"""

from __future__ import annotations

import dataclasses

from reef_stream.api.recipe import Recipe
from reef_stream.core.settings import load_settings
from reef_stream.demo.recipes import TOLERANCE, method
from reef_stream.demo.task import HeldOutAccuracy, exact_match
from reef_stream.demo.vllm_model import demo_model_dir
from reef_stream.engine.hf import HuggingFace

#: The learning rate of the Hugging Face policy (AdamW).
LEARNING_RATE = 1e-3
#: What the engine demo's schedule changes of the method's.
SCHEDULE_CHANGES = {"units_per_step": 128, "optimizer_batch_size": 128, "micro_batch_size": 128}


def policy() -> HuggingFace:
    """The demo's Hugging Face policy: ``HuggingFace`` on ``demo_model_dir($REEF_HOME)``
    (data; calling it loads the model)."""
    return HuggingFace(str(demo_model_dir(load_settings().home)), dtype="float32")


def bind(name: str) -> Recipe:
    """The example method ``name`` bound to the demo task with the Hugging Face policy. Pure
    but for reading the settings."""
    model = policy()
    recipe = method(name).recipe(model=model, reward=exact_match,
                                 evaluator=HeldOutAccuracy(tolerance=TOLERANCE, model=model))
    schedule = dataclasses.replace(recipe.schedule, **SCHEDULE_CHANGES) if name == "sao" \
        else recipe.schedule
    optimizer = dataclasses.replace(recipe.backend.optimizer, lr=LEARNING_RATE)
    return dataclasses.replace(recipe, schedule=schedule,
                               backend=dataclasses.replace(recipe.backend, optimizer=optimizer))


sao = bind("sao")
#: Bound for completeness: the vllm replica samples one completion per prompt, so the demo
#: refuses a grouped method with the engine.
grpo = bind("grpo")
#: ``--recipe reef_stream.demo.vllm_recipes``: the engine demo's default method.
recipe = sao
