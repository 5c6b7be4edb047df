"""What a sandbox worker imports: the reward function itself, not the recipe around it.

A pool's ``target`` names a ``Recipe`` (``module:attribute``) as ``reef reward --recipe``
does. A recipe module imports its method, objective and losses, and with them torch: a
worker that imported it would carry about 0.5 GB, and each call's fork would copy page
tables for all of it. ``worker_target`` resolves the reward function in the parent (which has
the recipe loaded already) and names something smaller for the worker to import, in order:

1. the reward function itself, where a module defines it (a module-level name that *is* the
   object: a function, or an instance such as ``exact_match = ExactMatch()``), looked for in
   the modules of the object, of its class and of its callable fields (``NamedReward``'s
   ``function``, a ``CodeExecutionReward``'s ``tests`` and ``text``);
2. for a ``NamedReward`` not found so, its ``function`` (the worker calls it directly: what
   ``NamedReward.__call__`` does);
3. an instance of a dataclass found by its class's ``module:qualname`` whose fields are plain
   JSON (``ExactMatch(source="x")`` after a ``--set``): the worker builds it from them, and the
   parent checks that the rebuilt one equals it;
4. else the target and its overrides, as given (the worker imports the recipe).

The worker imports the module of what is named, and what that module imports: a reward
defined in a module without torch (``reef_stream.api.rewards`` for ``Reward`` and
``NamedReward``) gives a worker without torch. Never pickle: names and JSON only.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from reef_stream.api.rewards import NamedReward

__all__ = ["importable_name", "worker_target"]


def worker_target(target: str, overrides: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The worker's ``target`` (and ``overrides``, or ``build``: the fields to call it with)
    for the reward function ``target`` (after ``overrides``) names; see the module docstring.
    Falls back to ``target`` as given when the parent cannot resolve it (the worker then says
    why at start)."""
    as_given = {"target": target, "overrides": list(overrides)}
    from reef_stream.consumers.reward.sandbox.worker import resolve
    try:
        reward = resolve(target, list(overrides))
    except (Exception, SystemExit):  # noqa: BLE001 - the worker reports it at start
        return as_given
    name = importable_name(reward)
    if name is not None:
        return {"target": name, "overrides": []}
    if isinstance(reward, NamedReward):
        name = importable_name(reward.function)
        if name is not None:
            return {"target": name, "overrides": []}
    built = _buildable(reward)
    if built is not None:
        return built
    return as_given


def importable_name(value: Any) -> str | None:
    """``module:name`` of a module-level name (or a class's attribute, by qualname) that is
    ``value`` in a module already imported, among the modules of ``value``, of its class and
    of its callable fields; None if there is none."""
    for module_name in _modules_of(value):
        module = sys.modules.get(module_name)
        if module is None or module_name == "__main__":
            continue
        qualname = getattr(value, "__qualname__", None)
        if isinstance(qualname, str) and "<" not in qualname:
            found: Any = module
            for part in qualname.split("."):
                found = getattr(found, part, None)
            if found is value:
                return f"{module_name}:{qualname}"
        for attribute, found in vars(module).items():
            if found is value and not attribute.startswith("__"):
                return f"{module_name}:{attribute}"
    return None


def _modules_of(value: Any) -> list[str]:
    candidates = [value, type(value)]
    fields = dataclasses.fields(value) if dataclasses.is_dataclass(value) and \
        not isinstance(value, type) else ()
    candidates += [getattr(value, f.name, None) for f in fields]
    candidates += [getattr(value, "function", None)]
    modules: list[str] = []
    for candidate in candidates:
        if candidate is None or (candidate is not value and not callable(candidate)):
            continue
        name = getattr(candidate, "__module__", None)
        if isinstance(name, str) and name not in modules:
            modules.append(name)
    return modules


def _buildable(reward: Any) -> dict[str, Any] | None:
    if not dataclasses.is_dataclass(reward) or isinstance(reward, type):
        return None
    cls = type(reward)
    name = importable_name(cls)
    if name is None:
        return None
    fields = {f.name: getattr(reward, f.name) for f in dataclasses.fields(reward) if f.init}
    try:
        plain = json.loads(json.dumps(fields, allow_nan=False))
        if cls(**plain) != reward:
            return None
    except (TypeError, ValueError):
        return None
    return {"target": name, "overrides": [], "build": plain}
