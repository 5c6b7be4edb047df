"""``Recipe``: a method's processor, objective, schedule, backend and evaluator, bound and checked.

    # my_project/recipes.py
    recipe = Recipe(name="mymethod", processor=..., objective=..., schedule=Schedule(...),
                    backend=Backend(name="torch", loss_families=(POLICY_GRADIENT,),
                                    model=my_model, optimizer=AdamW(lr=1e-3)),
                    evaluator=..., reward=my_reward, group_size=8)

A method package stays task-agnostic and exposes a factory (``methods.sao.recipe(...)``);
a task's module calls it (``reef_stream.demo.recipes``). ``load_recipe("module[:attr]")``
imports that module, takes its ``recipe`` (or ``RECIPE``), applies ``--set`` overrides
(``apply_overrides``) and checks the bindings before anything runs: the processor's unit
type is the objective's and has a known Avro schema; the loss family is registered and
supported by the backend; the batch sizes fit the backend; every part follows its protocol;
the reward's ``source`` is one the feedback policy wants. ``trains=True`` also requires
``Backend.model``; ``complete=True`` (the whole loop) also requires ``group_size`` when the
processor groups by group id, and a source for every feedback the processor waits for
(the reward function or ``external_sources``). Every problem found is listed in one
``ConfigurationError``, an import failure included. The long form:
``docs/design-notes.md`` ("Recipes").
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from reef_stream.api.evaluator import AcceptEverything, CandidateEvaluator
from reef_stream.api.losses import LossFamily, is_registered
from reef_stream.api.objective import Objective
from reef_stream.api.processor import Processor, processor_problems

# The reward-facing types live in a module without torch (the sandbox workers import it
# alone); re-exported here: ``from reef_stream.api.recipe import Reward`` keeps working.
from reef_stream.api.rewards import NamedReward, Reward, RewardFunction  # noqa: F401
from reef_stream.api.schedule import Schedule
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import EpochMillis, Feedback, Generation
from reef_stream.core.serde import SchemaRegistry

#: Recipe names end up in topic names (``<ns>.units.<recipe>``): Kafka's legal characters.
_RECIPE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}\Z")


@dataclass(frozen=True, slots=True)
class AdamW:
    """An AdamW optimizer, as data: ``Backend(optimizer=AdamW(lr=3e-4))``, so its settings can be
    overridden (``--set backend.optimizer.lr=1e-4``). Called with the model's parameters, it
    returns ``torch.optim.AdamW`` with these settings (torch's defaults, but ``lr``)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        problems = [f"AdamW.{name} must be a finite number >= 0, got {getattr(self, name)!r}"
                    for name in ("lr", "weight_decay", "eps")
                    if not _finite_at_least(getattr(self, name), 0.0)]
        problems += [f"AdamW.{name} must be within [0, 1), got {getattr(self, name)!r}"
                     for name in ("beta1", "beta2")
                     if not _finite_at_least(getattr(self, name), 0.0) or getattr(self, name) >= 1]
        if problems:
            raise ConfigurationError(problems)

    def __call__(self, parameters: Any) -> Any:
        import torch

        return torch.optim.AdamW(parameters, lr=self.lr, betas=(self.beta1, self.beta2),
                                 eps=self.eps, weight_decay=self.weight_decay)


def _finite_at_least(value: Any, least: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= least)


@dataclass(frozen=True, slots=True)
class Backend:
    """What the training backend of a recipe can do, and the model it trains.

    ``loss_families``: the families it has a loss for. ``data_parallel_size``:
    how many ranks share each optimizer batch.

    ``model``: a zero-argument callable building the torch module to train
    (see ``reef_stream.engine.training.CausalLM`` for what it must compute); the
    trainer seeds torch with the schedule's seed before calling it, so the
    initial weights are reproducible. ``optimizer``: called with the
    model's parameters, returns a torch optimizer (default: AdamW, lr 1e-3; give
    ``AdamW(lr=...)`` so ``--set backend.optimizer.lr=...`` can change it).
    A recipe that trains must have a ``model`` (``load_recipe(..., trains=True)``).
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


def feedback_for(generation: Generation, reward: Reward, *, source: str,
                 created_at: EpochMillis) -> Feedback:
    """The ``Feedback`` a reward worker emits: id ``<generation_id>:<source>`` (the same on a
    retry, so readers deduplicate it), keyed like its generation."""
    return Feedback(feedback_id=f"{generation.generation_id}:{source}",
                    generation_id=generation.generation_id, group_id=generation.group_id,
                    source=source, reward=float(reward.reward),
                    components={k: float(v) for k, v in reward.components.items()},
                    created_at=created_at)


def awaited_sources(reward: RewardFunction | None, external_sources: Sequence[str], *,
                    method: str) -> tuple[str, ...]:
    """The feedback sources a method's processor waits for: its reward function's ``source``
    and the ``external_sources`` fed from outside ``reef reward``. ``ConfigurationError``
    naming ``method`` when that leaves none (every generation would expire waiting)."""
    sources = (() if reward is None else (reward.source,)) + tuple(external_sources)
    if not sources:
        raise ConfigurationError(f"{method} needs a reward function or external_sources: the "
                                 "feedback its processor waits for")
    return sources


@dataclass(frozen=True, slots=True)
class Recipe:
    """A method, bound to a task: see the module docstring. Build it freely; ``load_recipe``
    or ``check_recipe`` validates it.

    Group size lives here rather than in the ``Schedule``: the schedule is the trainer's
    geometry (counted in units, whatever their size), while the group size is what the
    serving side must do (sample that many completions per prompt) for the processor's
    grouping to complete: a contract between replicas and processor, which the recipe binds.
    """

    name: str
    processor: Processor[Any]
    objective: Objective[Any, Any]
    schedule: Schedule
    backend: Backend
    evaluator: CandidateEvaluator = field(default_factory=AcceptEverything)
    reward: RewardFunction | None = None
    #: Completions a replica samples per prompt under one ``group_id`` (each generation
    #: declares it as its ``group_size``); 1: ungrouped. Required (at least 2) when the
    #: processor groups by group id (``ByGroupId``).
    group_size: int = 1
    #: Feedback sources produced outside ``reef reward`` (humans, environments, judges) that
    #: the processor may wait for, besides the reward function's ``source``.
    external_sources: tuple[str, ...] = ()
    #: Where ``reef reward`` may run the reward function: "thread" (anywhere) or "process"
    #: (required in a sandbox process, ``reef reward --sandbox process``; a worker started
    #: without it refuses to start): for a reward that runs code a model wrote.
    reward_sandbox: str = "thread"


def recipe_problems(recipe: Any, *, registry: SchemaRegistry | None = None, trains: bool = False,
                    complete: bool = False) -> list[str]:
    """Every problem with ``recipe``'s bindings, as sentences (empty when it is sound).

    ``trains``: it is about to be trained, so its backend needs a model. ``complete``: the
    whole loop is to run from it (implies ``trains``): see the module docstring."""
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
    reward_ok = not (found := _reward_problems(recipe.reward))
    problems += found
    if getattr(recipe, "reward_sandbox", "thread") not in ("thread", "process"):
        problems.append(f"reward_sandbox must be 'thread' or 'process', not "
                        f"{recipe.reward_sandbox!r}")
    problems += _sampling_problems(recipe)
    if processor_ok and reward_ok:
        problems += _source_problems(recipe, complete=complete)
    if (trains or complete) and backend_ok and recipe.backend.model is None:
        problems.append(f"the backend {recipe.backend.name!r} has no model, and a recipe that "
                        "trains needs one: give Backend(model=<zero-argument callable building "
                        "the torch module>)")
    if complete and processor_ok and _groups_by_group_id(recipe.processor) \
            and isinstance(recipe.group_size, int) and recipe.group_size < 2:
        problems.append(f"the processor groups generations by group_id "
                        f"({type(recipe.processor.grouping).__name__}) but the recipe declares no "
                        "group size: set Recipe(group_size=N), the completions replicas sample "
                        "per prompt (at least 2)")
    return problems


def check_recipe(recipe: Any, *, registry: SchemaRegistry | None = None, trains: bool = False,
                 complete: bool = False) -> Recipe:
    """``recipe`` if its bindings are sound (see ``recipe_problems``); otherwise one
    ``ConfigurationError`` listing every problem."""
    problems = recipe_problems(recipe, registry=registry, trains=trains, complete=complete)
    if problems:
        raise ConfigurationError(problems)
    return recipe


def load_recipe(path: str, *, registry: SchemaRegistry | None = None,
                overrides: Sequence[str] = (), trains: bool = False,
                complete: bool = False) -> Recipe:
    """Import the recipe at ``path``, apply ``overrides`` and check it (``check_recipe``).

    ``path`` is a dotted module path whose module exposes ``recipe`` or
    ``RECIPE`` (``reef_stream.demo.recipes:sao``), or ``module:attribute``.
    Only that module is imported, with the current directory first on
    ``sys.path`` (as uvicorn does for its app), so a module of the checkout the
    command runs in wins over an installed one; nothing else is searched.
    ``overrides``: ``FIELD=VALUE`` items (``reef ... --set``), applied in order
    by ``apply_overrides``. ``trains`` / ``complete``: see ``recipe_problems``.
    Blocks for the import. Raises one ``ConfigurationError`` naming the module
    for an import failure, a missing attribute, a method not bound to a task,
    a bad override, or every binding problem (each prefixed with ``path``).
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")) \
            or (attribute and not attribute.isidentifier()):
        raise ConfigurationError(f"recipe path {path!r} is not a dotted module path "
                                 "(my_project.recipes) or module:attribute")
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in (cwd, ""):
        sys.path.insert(0, cwd)
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
    if callable(recipe) and not isinstance(recipe, (Recipe, type)):
        factory = f"{getattr(recipe, '__module__', '?')}.{getattr(recipe, '__qualname__', '?')}"
        raise ConfigurationError(
            f"{path} is a method's recipe factory ({factory}), "
            "not a recipe bound to a task: bind it in a module of yours "
            "(`recipe = factory(model=..., reward=..., evaluator=...)`) and give that module; "
            "reef_stream.demo.recipes binds the example methods to the demo task "
            "(reef_stream.demo.recipes:sao, reef_stream.demo.recipes:grpo)")
    if overrides and isinstance(recipe, Recipe):
        try:
            recipe = apply_overrides(recipe, overrides)
        except ConfigurationError as error:
            raise ConfigurationError([f"{path}: {problem}" for problem in error.problems]
                                     ) from error
    problems = recipe_problems(recipe, registry=registry, trains=trains, complete=complete)
    if problems:
        raise ConfigurationError([f"{path}: {problem}" for problem in problems])
    return recipe


# --------------------------------------------------------------------------- overrides


def apply_overrides(recipe: Recipe, overrides: Sequence[str]) -> Recipe:
    """``recipe`` with each ``FIELD=VALUE`` of ``overrides`` set.

    ``FIELD`` is a dotted path through the recipe's frozen dataclasses
    (``schedule.max_staleness``, ``backend.optimizer.lr``, ``objective.decay``,
    ``group_size``). The items setting fields of one config are applied together
    in one ``dataclasses.replace`` (so batch geometry can change in one go, in any
    order), which runs that config's own validation again; a field given twice
    takes its last value. ``VALUE`` is read as the field's declared type: an
    integer, a float, ``true``/``false``, a string, an enum member's name or
    value, ``none`` where the field may be None, comma-separated items for a
    ``tuple[X, ...]`` (``processor.feedback.sources=exact_match,judge``). Pure. Raises one
    ``ConfigurationError`` listing every bad item: a malformed one, an unknown
    field (with the valid ones), a value of the wrong type, or values the
    config rejects.
    """
    problems: list[str] = []
    tree: dict[str, Any] = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        path = name.strip().split(".")
        if not sep or not all(part.strip() for part in path):
            problems.append(f"--set {item!r}: expected FIELD=VALUE "
                            "(e.g. schedule.max_staleness=4)")
            continue
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part.strip(), {})
            if not isinstance(child, dict):
                problems.append(f"--set {name.strip()}: {'.'.join(path[:-1])} is given a value "
                                "too; set either it or its fields")
                break
            node = child
        else:
            node[path[-1].strip()] = text.strip()
    if tree:
        try:
            recipe = _replaced(recipe, tree, "")
        except ConfigurationError as error:
            problems += error.problems
    if problems:
        raise ConfigurationError(problems)
    return recipe


def _replaced(config: Any, tree: Mapping[str, Any], where: str) -> Any:
    """``config`` with the fields of ``tree`` (name -> text, or name -> subtree) set;
    ``where``: the path of ``config`` in the recipe (empty for the recipe)."""
    label = where or "the recipe"
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigurationError(f"--set {where}.{next(iter(tree))}: {label} is a "
                                 f"{type(config).__name__}, which has no fields to set; edit "
                                 "the recipe instead")
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    problems: list[str] = []
    changes: dict[str, Any] = {}
    for head, value in tree.items():
        here = f"{where}.{head}" if where else head
        if head not in fields:
            problems.append(f"--set {here}: {label} ({type(config).__name__}) has no field "
                            f"{head!r}; its fields: {', '.join(fields)}")
            continue
        try:
            if isinstance(value, dict):
                changes[head] = _replaced(getattr(config, head), value, here)
            else:
                hint = _field_type(type(config), head, getattr(config, head))
                try:
                    changes[head] = _parsed(value, hint, here)
                except ConfigurationError as error:
                    raise ConfigurationError([f"--set {here}: {p}" for p in error.problems]
                                             ) from None
        except ConfigurationError as error:
            problems += error.problems
    if problems:
        raise ConfigurationError(problems)
    given = ", ".join(f"{where}.{name}" if where else name for name in tree)
    try:
        return dataclasses.replace(config, **changes)
    except ConfigurationError as error:
        raise ConfigurationError([f"--set {given}: {p}" for p in error.problems]) from None
    except (TypeError, ValueError) as error:
        raise ConfigurationError(f"--set {given}: refused by {type(config).__name__}: "
                                 f"{error}") from None


def _field_type(cls: type, name: str, current: Any) -> Any:
    try:
        return typing.get_type_hints(cls)[name]
    except Exception:  # noqa: BLE001 - an unresolvable annotation: go by the current value
        return type(current)


def _parsed(text: str, hint: Any, where: str) -> Any:
    """``text`` as a value of type ``hint`` (see ``apply_overrides``)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        options = typing.get_args(hint)
        if type(None) in options and text.lower() in ("none", "null"):
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _parsed(text, option, where)
            except ConfigurationError:
                continue
        raise ConfigurationError(f"{where} takes {_type_name(hint)}, got {text!r}")
    if hint is bool:
        flags = {"true": True, "yes": True, "on": True, "1": True,
                 "false": False, "no": False, "off": False, "0": False}
        if text.lower() in flags:
            return flags[text.lower()]
        raise ConfigurationError(f"{where} takes true or false, got {text!r}")
    if hint is int:
        try:
            return int(text, 10)
        except ValueError:
            raise ConfigurationError(f"{where} takes an integer, got {text!r}") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigurationError(f"{where} takes a number, got {text!r}") from None
    if hint is str:
        return text
    if typing.get_origin(hint) is tuple:
        items = typing.get_args(hint)
        if len(items) == 2 and items[1] is Ellipsis:
            parts = [part.strip() for part in text.split(",")] if text.strip() else []
            return tuple(_parsed(part, items[0], f"{where}[{i}]") for i, part in enumerate(parts))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if text in (member.name, str(member.value)):
                return member
        raise ConfigurationError(f"{where} takes one of {[m.name for m in hint]}, got {text!r}")
    raise ConfigurationError(f"{where} is a {_type_name(hint)}, which --set cannot build; "
                             "edit the recipe (or its factory's arguments) instead")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


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


def _groups_by_group_id(processor: Any) -> bool:
    """Whether ``processor``'s grouping groups the generations of a group_id (and so needs
    replicas to sample groups): a grouping says so with ``by_group_id = True``."""
    return getattr(processor.grouping, "by_group_id", False) is True


def _sampling_problems(recipe: Recipe) -> list[str]:
    problems = []
    size = recipe.group_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        problems.append(f"group_size must be a positive integer (1: ungrouped), got {size!r}")
    external = recipe.external_sources
    if isinstance(external, str) or not isinstance(external, tuple) \
            or not all(isinstance(s, str) and s for s in external):
        problems.append(f"external_sources must be a tuple of source names, got {external!r}")
    return problems


def _source_problems(recipe: Recipe, *, complete: bool) -> list[str]:
    """The reward function's source against the feedback the processor waits for."""
    feedback, reward = recipe.processor.feedback, recipe.reward
    awaited = _awaited_sources(feedback)
    problems = []
    if reward is not None and not feedback.wants(reward.source):
        waits = (f"it waits for {', '.join(repr(s) for s in awaited)}" if awaited
                 else "its wants() refuses it")
        problems.append(f"the reward function's feedback source {reward.source!r} is not one the "
                        f"processor's feedback policy wants ({waits}): its feedback would be "
                        "ignored and every generation would expire waiting")
    if complete and awaited is not None:
        produced = {*(() if reward is None else (reward.source,)),
                    *(recipe.external_sources if isinstance(recipe.external_sources, tuple)
                      else ())}
        never = [s for s in awaited if s not in produced]
        if never:
            source = ("no reward function" if reward is None
                      else f"the reward function's source is {reward.source!r}")
            problems.append(
                f"the processor waits for feedback from {', '.join(repr(s) for s in never)}, "
                f"which nothing in the recipe produces ({source}; external_sources: "
                f"{list(recipe.external_sources)}): fix the name, or declare a source fed from "
                "outside in Recipe(external_sources=(...))")
    return problems


def _awaited_sources(feedback: Any) -> tuple[str, ...] | None:
    """The sources a feedback policy waits for, when it says (``RequireSources.sources``)."""
    sources = getattr(feedback, "sources", None)
    if isinstance(sources, tuple) and all(isinstance(s, str) for s in sources):
        return sources
    return None
