"""``Recipe``: a method's processor, objective, schedule, backend and evaluator, bound and checked.

A method package exposes one recipe::

    # methods/mymethod/__init__.py
    recipe = Recipe(name="mymethod", processor=..., objective=..., schedule=Schedule(...),
                    backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,)))

``load_recipe("methods.mymethod")`` imports exactly that module (or
``"module:attribute"``), takes its ``recipe`` (or ``RECIPE``) and checks the
bindings before anything runs:

- the unit type the processor emits is the one the objective consumes, and
  its Avro schema is known (a current schema in ``schemas/``, with the same
  fields as the dataclass);
- the objective's loss family is registered and supported by the backend;
- the schedule's batch sizes fit the backend (the optimizer batch splits
  into micro batches on every data-parallel rank);
- the processor, objective, evaluator and reward function follow their
  protocols.

Every problem found is listed in one ``ConfigurationError``; an import
failure is one too, naming the module and the exception.

A recipe may carry a reward function, which ``reef reward`` workers run over
generations to produce feedback (``RewardFunction``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from reef_stream.errors import ConfigurationError
from reef_stream.api.evaluator import AcceptEverything, CandidateEvaluator
from reef_stream.topics.events import EpochMillis, Feedback, Generation
from reef_stream.api.losses import LossFamily, is_registered
from reef_stream.api.objective import Objective
from reef_stream.api.processor import Processor, processor_problems
from reef_stream.api.schedule import Schedule
from reef_stream.topics.serde import SchemaRegistry

#: Recipe names end up in topic names (``<ns>.units.<recipe>``): Kafka's legal characters.
_RECIPE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}\Z")


@dataclass(frozen=True, slots=True)
class Backend:
    """What the training backend of a recipe can do, and the model it trains.

    ``loss_families``: the families it has a loss for. ``data_parallel_size``:
    how many ranks share each optimizer batch.

    ``model``: a zero-argument callable building the torch module to train
    (see ``reef_stream.engine.training.CausalLM`` for what it must compute); the
    trainer seeds torch with the schedule's seed before calling it, so the
    initial weights are reproducible. ``optimizer``: called with the
    model's parameters, returns a torch optimizer (default: AdamW, lr 1e-3).
    ``losses``: the loss to run per family, when not the family's
    ``reference``. ``model_name``: what publications and replicas call the
    model (default: the trainer group). ``max_grad_norm``: clip the
    gradient's global norm to this before each optimizer update (None: no
    clipping); the step's metrics then report ``grad_norm`` (before clipping,
    averaged over the step's updates) either way.
    """

    name: str
    loss_families: tuple[LossFamily[Any], ...]
    data_parallel_size: int = 1
    model: Callable[[], Any] | None = None
    optimizer: Callable[[Any], Any] | None = None
    losses: Mapping[LossFamily[Any], Callable[[Any], Any]] = field(default_factory=dict)
    model_name: str | None = None
    max_grad_norm: float | None = None

    def supports(self, family: LossFamily[Any]) -> bool:
        """Whether it has a loss for this very family."""
        return any(known is family for known in self.loss_families)


@dataclass(frozen=True, slots=True)
class Reward:
    """What a reward function returns for one generation: a finite reward and its named parts."""

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one generation; ``reef reward`` workers turn the result into ``Feedback`` from
    ``source``.

    Calling it may block or be a coroutine (``async def``); the worker applies a
    timeout and bounded retries, so it should be idempotent. Raise to signal a
    failure: the worker dead-letters the generation with the exception and never
    records a reward for it.
    """

    source: str

    def __call__(self, generation: Generation) -> Reward | Awaitable[Reward]: ...


@dataclass(frozen=True, slots=True)
class NamedReward:
    """A plain function (sync or async) as a ``RewardFunction`` of ``source``."""

    source: str
    function: Callable[[Generation], Reward | Awaitable[Reward]]

    def __call__(self, generation: Generation) -> Reward | Awaitable[Reward]:
        return self.function(generation)


def feedback_for(generation: Generation, reward: Reward, *, source: str,
                 created_at: EpochMillis) -> Feedback:
    """The ``Feedback`` a reward worker emits: id ``<generation_id>:<source>`` (the same on a
    retry, so readers deduplicate it), keyed like its generation."""
    return Feedback(feedback_id=f"{generation.generation_id}:{source}",
                    generation_id=generation.generation_id, group_id=generation.group_id,
                    source=source, reward=float(reward.reward),
                    components={k: float(v) for k, v in reward.components.items()},
                    created_at=created_at)


@dataclass(frozen=True, slots=True)
class Recipe:
    """A method, bound: see the module docstring. Build it freely; ``load_recipe`` or
    ``check_recipe`` validates it."""

    name: str
    processor: Processor[Any]
    objective: Objective[Any, Any]
    schedule: Schedule
    backend: Backend
    evaluator: CandidateEvaluator = field(default_factory=AcceptEverything)
    reward: RewardFunction | None = None


def recipe_problems(recipe: Any, *, registry: SchemaRegistry | None = None) -> list[str]:
    """Every problem with ``recipe``'s bindings, as sentences (empty when it is sound)."""
    if not isinstance(recipe, Recipe):
        return [f"expected a reef_stream.api.recipe.Recipe, got {type(recipe).__name__}"]
    problems: list[str] = []
    if not isinstance(recipe.name, str) or not _RECIPE_NAME.match(recipe.name):
        problems.append(f"recipe name {recipe.name!r} must be 1-100 letters, digits, '.', '_' "
                        "or '-' (it names the topic <ns>.units.<recipe>)")
    processor_ok = not (found := processor_problems(recipe.processor))
    problems += found
    problems += _objective_problems(recipe.objective)
    objective_ok = recipe.objective is not None and all(
        hasattr(recipe.objective, name) for name in _OBJECTIVE_MEMBERS)
    if processor_ok:
        problems += _unit_schema_problems(recipe.processor.units.unit_type,
                                          registry or SchemaRegistry.default())
    if processor_ok and objective_ok:
        emitted, consumed = recipe.processor.units.unit_type, recipe.objective.unit_type
        if emitted is not consumed:
            problems.append(f"the processor emits {_name(emitted)} units but the objective "
                            f"{recipe.objective.name!r} consumes {_name(consumed)}")
    backend_ok = not (found := _backend_problems(recipe.backend))
    problems += found
    family = getattr(recipe.objective, "loss_family", None)
    if isinstance(family, LossFamily) and backend_ok:
        if not recipe.backend.supports(family):
            supported = ", ".join(f.name for f in recipe.backend.loss_families) or "none"
            problems.append(f"the objective {recipe.objective.name!r} needs the loss family "
                            f"{family.name!r}, which the backend {recipe.backend.name!r} does not "
                            f"support (it supports: {supported})")
    if not isinstance(recipe.schedule, Schedule):
        problems.append(f"schedule must be a reef_stream.api.schedule.Schedule, got "
                        f"{type(recipe.schedule).__name__}")
    elif backend_ok:
        schedule, ranks = recipe.schedule, recipe.backend.data_parallel_size
        if schedule.optimizer_batch_size % (schedule.micro_batch_size * ranks):
            problems.append(
                f"schedule.optimizer_batch_size ({schedule.optimizer_batch_size}) must be a "
                f"multiple of schedule.micro_batch_size ({schedule.micro_batch_size}) x the "
                f"backend's data_parallel_size ({ranks})")
    problems += _evaluator_problems(recipe.evaluator)
    problems += _reward_problems(recipe.reward)
    return problems


def check_recipe(recipe: Any, *, registry: SchemaRegistry | None = None) -> Recipe:
    """``recipe`` if its bindings are sound; otherwise one ``ConfigurationError`` listing every
    problem."""
    problems = recipe_problems(recipe, registry=registry)
    if problems:
        raise ConfigurationError(problems)
    return recipe


def load_recipe(path: str, *, registry: SchemaRegistry | None = None) -> Recipe:
    """Import the recipe at ``path`` and check it (``check_recipe``).

    ``path`` is a dotted module path whose module exposes ``recipe`` or
    ``RECIPE`` (``methods.sao``), or ``module:attribute``. Only that module is
    imported (with the current directory importable, as under ``python -m``);
    nothing else is searched. Blocks for the import. Raises one
    ``ConfigurationError`` naming the module for an import failure, a missing
    attribute, or every binding problem (each prefixed with ``path``).
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")) \
            or (attribute and not attribute.isidentifier()):
        raise ConfigurationError(f"recipe path {path!r} is not a dotted module path "
                                 "(methods.sao) or module:attribute")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ConfigurationError as error:
        raise ConfigurationError([f"{path} (while importing): {problem}"
                                  for problem in error.problems]) from error
    except Exception as error:  # noqa: BLE001 - any import failure is the recipe's to fix
        if isinstance(error, ModuleNotFoundError) and error.name and (
                module_name == error.name or module_name.startswith(error.name + ".")):
            raise ConfigurationError(
                f"recipe module {module_name!r} not found ({error}): give a module importable "
                "from the current directory or the installed packages") from error
        raise ConfigurationError(f"recipe module {module_name!r} failed to import: "
                                 f"{type(error).__name__}: {error}") from error
    names = (attribute,) if attribute else ("recipe", "RECIPE")
    for name in names:
        if hasattr(module, name):
            recipe = getattr(module, name)
            break
    else:
        raise ConfigurationError(f"module {module_name!r} has no {' or '.join(names)} attribute; "
                                 "a recipe module exposes `recipe = Recipe(...)`")
    problems = recipe_problems(recipe, registry=registry)
    if problems:
        raise ConfigurationError([f"{path}: {problem}" for problem in problems])
    return recipe


# --------------------------------------------------------------------------- the checks


def _name(value: Any) -> str:
    return getattr(value, "__name__", repr(value))


_OBJECTIVE_MEMBERS = ("name", "unit_type", "loss_family", "initial_state", "compute")


def _objective_problems(objective: Any) -> list[str]:
    if objective is None:
        return ["no objective"]
    missing = [name for name in _OBJECTIVE_MEMBERS if not hasattr(objective, name)]
    if missing:
        return [f"objective {type(objective).__name__} lacks {missing} (see "
                "reef_stream.api.objective.Objective)"]
    problems = []
    if not isinstance(objective.loss_family, LossFamily):
        problems.append(f"objective {objective.name!r} declares loss family "
                        f"{objective.loss_family!r}, not a reef_stream.api.losses.LossFamily "
                        "(loss families are types, not strings)")
    elif not is_registered(objective.loss_family):
        problems.append(f"loss family {objective.loss_family.name!r} of objective "
                        f"{objective.name!r} is not registered (register_loss_family)")
    if not isinstance(objective.unit_type, type):
        problems.append(f"objective {objective.name!r} unit_type must be a class, got "
                        f"{objective.unit_type!r}")
    return problems


def _unit_schema_problems(unit_type: type, registry: SchemaRegistry) -> list[str]:
    try:
        known = registry.current(unit_type.SCHEMA)  # type: ignore[attr-defined]
    except ConfigurationError as error:
        return [f"unit type {unit_type.__name__}: {error}"]
    schema_fields = [f["name"] for f in known.parsed["fields"]]
    class_fields = [f.name for f in dataclasses.fields(unit_type)]
    if schema_fields != class_fields:
        return [f"unit type {unit_type.__name__} has fields {class_fields} but its schema "
                f"{known.name} ({known.path.name}) has {schema_fields}"]
    return []


def _backend_problems(backend: Any) -> list[str]:
    if not isinstance(backend, Backend):
        return [f"backend must be a reef_stream.api.recipe.Backend, got {type(backend).__name__}"]
    problems = []
    not_families = [f for f in backend.loss_families if not isinstance(f, LossFamily)]
    if not_families:
        problems.append(f"backend {backend.name!r} lists {not_families} as loss families; "
                        "give LossFamily objects (e.g. reef_stream.api.losses.POLICY_GRADIENT)")
    if backend.model is not None and not callable(backend.model):
        problems.append(f"backend {backend.name!r} model must be a callable building a torch "
                        f"module, got {backend.model!r}")
    if backend.optimizer is not None and not callable(backend.optimizer):
        problems.append(f"backend {backend.name!r} optimizer must be a callable taking the "
                        f"model's parameters, got {backend.optimizer!r}")
    for family, loss in dict(backend.losses).items():
        if not any(family is known for known in backend.loss_families):
            problems.append(f"backend {backend.name!r} has a loss for {family!r}, which is not "
                            "among its loss_families")
        if not callable(loss):
            problems.append(f"backend {backend.name!r} loss for {family!r} is not callable")
    if not isinstance(backend.data_parallel_size, int) or backend.data_parallel_size < 1:
        problems.append(f"backend {backend.name!r} data_parallel_size must be a positive "
                        f"integer, got {backend.data_parallel_size!r}")
    norm = backend.max_grad_norm
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                             or not math.isfinite(norm) or norm <= 0):
        problems.append(f"backend {backend.name!r} max_grad_norm must be a positive finite "
                        f"number or None, got {norm!r}")
    return problems


def _evaluator_problems(evaluator: Any) -> list[str]:
    if evaluator is None:
        return ["no candidate evaluator (use reef_stream.api.evaluator.AcceptEverything to promote "
                "every checkpoint unevaluated, knowingly)"]
    missing = [name for name in ("name", "evaluates", "warning", "measure", "select")
               if not hasattr(evaluator, name)]
    if missing:
        return [f"evaluator {type(evaluator).__name__} lacks {missing} (see "
                "reef_stream.api.evaluator.CandidateEvaluator)"]
    if not isinstance(evaluator.evaluates, bool):
        return [f"evaluator {evaluator.name!r}: evaluates must be True or False"]
    return []


def _reward_problems(reward: Any) -> list[str]:
    if reward is None:
        return []
    if not callable(reward) or not isinstance(getattr(reward, "source", None), str) \
            or not reward.source:
        return [f"reward function {reward!r} must be callable with a non-empty `source` "
                "(wrap a plain function in NamedReward(source, function))"]
    return []
