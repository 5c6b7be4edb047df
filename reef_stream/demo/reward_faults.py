"""Reward faults you can dial in: ``raise=P,hang=P,hang_s=S,outage=START:SECONDS``.

    faults = RewardFaults.parse("raise=0.05,hang=0.01,hang_s=300,outage=120:60")
    faults = faults.anchored(time.time())         # the outage's START counts from now
    reward = with_faults(recipe.reward, faults)   # same source; sync or async as it was

Which generations fail is drawn from their ids (``draw``: BLAKE2b of the fault's kind and the
id, the same in every process and every run), so ``reef demo --reward-faults``, ``reef reward
--faults`` and ``bench/reward_faults.py`` fail the same generations:

- ``raise=P``: a generation with ``draw(id, "raise") < P`` raises ``InjectedFault`` on every
  try: a failure that repeats for the same input, the generation's own;
- ``hang=P``: one with ``draw(id, "hang") < P`` (that does not raise) sleeps ``hang_s``
  seconds (default 300), then gets its real reward;
- ``outage=START:SECONDS``: every call raises ``Transient`` (the grading service is down, not
  the generation's fault) from START to START + SECONDS seconds after an anchor.
  ``anchored(t)`` makes the window absolute, ``outage_at=T:SECONDS`` with T a unix time, which
  is what the stages are given, so every process has the same window: ``reef reward
  --faults`` anchors START at its own start, ``reef demo --reward-faults`` at the demo's.

In the sandbox (``reef reward --sandbox process``) the faults run inside the sandboxed call:
``sandbox_target`` names a ``SandboxedFaults`` that the pool's workers build from its plain
fields (``reef_stream.consumers.reward.sandbox.reference``), so nothing is added to the
sandbox's environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import math
import time
import types
from dataclasses import dataclass
from typing import Any

from reef_stream.api.rewards import NamedReward, Reward, RewardFunction, Transient
from reef_stream.core.errors import ConfigurationError

__all__ = ["InjectedFault", "RewardFaults", "SandboxedFaults", "applied", "draw",
           "sandbox_target", "with_faults"]

#: Seconds a hanging call sleeps when the spec gives no ``hang_s``.
DEFAULT_HANG_S = 300.0
RAISE, HANG, OUTAGE = "raise", "hang", "outage"
_KEYS = ("raise", "hang", "hang_s", "outage", "outage_at")


class InjectedFault(RuntimeError):
    """The failure ``raise=P`` injects: the generation's own, the same on every try."""


def draw(generation_id: str, kind: str) -> float:
    """A number in [0, 1) fixed by ``kind`` and ``generation_id`` alone (BLAKE2b, not Python's
    salted ``hash``): the same in every process. Pure."""
    digest = hashlib.blake2b(f"{kind}:{generation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


@dataclass(frozen=True)
class RewardFaults:
    """A parsed fault spec (see the module docstring). ``outage_start``: seconds after an
    anchor not yet given; ``outage_at``: the unix time the outage begins, once anchored."""

    raise_p: float = 0.0
    hang_p: float = 0.0
    hang_s: float = DEFAULT_HANG_S
    outage_s: float = 0.0
    outage_start: float | None = None
    outage_at: float | None = None

    def __post_init__(self) -> None:
        """Raises one ``ConfigurationError`` naming every field out of its range."""
        problems = [f"reward faults: {name} is a rate in [0, 1], not {value}"
                    for name, value in (("raise", self.raise_p), ("hang", self.hang_p))
                    if not 0 <= value <= 1]
        problems += [f"reward faults: {name} must be finite seconds, 0 or more, not {value}"
                     for name, value in (("hang_s", self.hang_s), ("the outage's seconds",
                                                                   self.outage_s),
                                         ("the outage's start", self.outage_start))
                     if value is not None and not (math.isfinite(value) and value >= 0)]
        if self.outage_start is not None and self.outage_at is not None:
            problems.append("reward faults: an outage is relative (outage_start) or absolute "
                            "(outage_at), not both")
        if problems:
            raise ConfigurationError(problems)

    @classmethod
    def parse(cls, spec: str) -> RewardFaults:
        """The faults of ``spec`` (comma-separated ``KEY=VALUE``, every key optional; ""
        injects none). Raises one ``ConfigurationError`` naming every bad part: an unknown or
        repeated key, a rate outside [0, 1], negative or infinite seconds, START:SECONDS
        malformed, ``outage`` and ``outage_at`` together."""
        problems: list[str] = []
        values: dict[str, Any] = {}
        seen: set[str] = set()
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            key, sep, text = (s.strip() for s in item.partition("="))
            if not sep or key not in _KEYS:
                problems.append(f"reward faults: {item!r} is not one of "
                                f"{', '.join(k + '=' for k in _KEYS)}")
            elif key in seen:
                problems.append(f"reward faults: {key} is given twice")
            else:
                seen.add(key)
                try:
                    values[key] = _value(key, text)
                except ValueError as error:
                    problems.append(f"reward faults: {item!r}: {error}")
        if "outage" in values and "outage_at" in values:
            problems.append("reward faults: give outage=START:SECONDS or outage_at=T:SECONDS, "
                            "not both")
        if problems:
            raise ConfigurationError(problems)
        start, seconds = values.get("outage") or (None, 0.0)
        at, at_seconds = values.get("outage_at") or (None, 0.0)
        return cls(raise_p=values.get("raise", 0.0), hang_p=values.get("hang", 0.0),
                   hang_s=values.get("hang_s", DEFAULT_HANG_S),
                   outage_s=seconds or at_seconds, outage_start=start, outage_at=at)

    def anchored(self, at: float) -> RewardFaults:
        """These faults with a relative outage made absolute: it begins ``outage_start``
        seconds after the unix time ``at``. Pure; unchanged when already absolute or none."""
        if self.outage_start is None:
            return self
        return dataclasses.replace(self, outage_start=None, outage_at=at + self.outage_start)

    def text(self) -> str:
        """The spec that parses back to these faults (floats exact); "" for none."""
        parts = [f"{key}={value!r}" for key, value, default in (
            ("raise", self.raise_p, 0.0), ("hang", self.hang_p, 0.0),
            ("hang_s", self.hang_s, DEFAULT_HANG_S)) if value != default]
        if self.outage_start is not None:
            parts.append(f"outage={self.outage_start!r}:{self.outage_s!r}")
        elif self.outage_at is not None:
            parts.append(f"outage_at={self.outage_at!r}:{self.outage_s!r}")
        return ",".join(parts)

    def fault(self, generation_id: str, now: float) -> str | None:
        """The fault of this call at unix time ``now``: ``OUTAGE`` inside the outage's
        window, else ``RAISE`` or ``HANG`` as ``generation_id`` draws them, else None. Pure.
        Raises ``ValueError`` for an outage not anchored yet."""
        if self.outage_start is not None:
            raise ValueError("the outage is relative: anchor it first (RewardFaults.anchored)")
        if self.outage_at is not None and self.outage_at <= now < self.outage_at + self.outage_s:
            return OUTAGE
        if self.raises(generation_id):
            return RAISE
        return HANG if self.hangs(generation_id) else None

    def raises(self, generation_id: str) -> bool:
        """Whether every try of ``generation_id`` raises (outside an outage)."""
        return bool(self.raise_p) and draw(generation_id, RAISE) < self.raise_p

    def hangs(self, generation_id: str) -> bool:
        """Whether ``generation_id``'s calls hang (outside an outage)."""
        return not self.raises(generation_id) and bool(self.hang_p) \
            and draw(generation_id, HANG) < self.hang_p

    def _before(self, generation: Any) -> float:
        """Raise this call's fault, or the seconds it hangs before its real reward."""
        generation_id = generation.generation_id
        kind = self.fault(generation_id, time.time())
        if kind == OUTAGE:
            raise Transient(f"injected outage: the grading service is down for "
                            f"{self.outage_s:g} s from unix time {self.outage_at:.0f}")
        if kind == RAISE:
            raise InjectedFault(f"injected fault: generation {generation_id} raises on every "
                                f"try (raise={self.raise_p:g})")
        return self.hang_s if kind == HANG else 0.0


def _value(key: str, text: str) -> Any:
    if key in ("outage", "outage_at"):
        first, sep, second = text.partition(":")
        if not sep:
            raise ValueError("expected START:SECONDS" if key == "outage" else "expected T:SECONDS")
        return _seconds(first), _seconds(second)
    number = _seconds(text)
    if key in ("raise", "hang") and number > 1:
        raise ValueError(f"a rate is in [0, 1], not {number:g}")
    return number


def _seconds(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"expected a finite number, 0 or more, not {text}")
    return number


def with_faults(reward: RewardFunction, faults: RewardFaults) -> NamedReward:
    """``reward`` with ``faults`` applied before each call, as a ``NamedReward`` of the same
    ``source``: a coroutine function when ``reward`` is one (an ``async def``, an object whose
    ``__call__`` is one, or a ``NamedReward`` of either: the reward worker's own rule), so
    a hang awaits, else a plain one, whose hang blocks its thread. Raises ``ValueError`` for
    an outage not anchored yet."""
    if faults.outage_start is not None:
        raise ValueError("the outage is relative: anchor it first (RewardFaults.anchored)")
    if _is_async(reward):
        async def faulty_async(generation: Any) -> Reward:
            hang = faults._before(generation)
            if hang:
                await asyncio.sleep(hang)
            return await reward(generation)

        return NamedReward(reward.source, faulty_async)

    def faulty(generation: Any) -> Any:
        hang = faults._before(generation)
        if hang:
            time.sleep(hang)
        return reward(generation)

    return NamedReward(reward.source, faulty)


def _is_async(reward: Any) -> bool:
    """``reef_stream.consumers.reward.calls.is_coroutine_function``'s rule, without importing
    the Kafka client into a sandbox worker."""
    inner = getattr(reward, "function", None)
    if inner is not None:
        return _is_async(inner)
    return inspect.iscoroutinefunction(reward) \
        or inspect.iscoroutinefunction(getattr(type(reward), "__call__", None))


# --------------------------------------------------------------------------- the sandbox

@dataclass(frozen=True)
class SandboxedFaults:
    """The faulty reward a sandbox worker calls: ``faults`` (an anchored spec) applied to what
    ``target`` names (``module:attribute``, with ``overrides`` or ``build``, as in
    ``reef_stream.consumers.reward.sandbox.worker.resolve``). Built from these plain fields
    in the worker, which resolves the reward once, at start."""

    faults: str
    target: str
    overrides: tuple[str, ...] = ()
    build: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        from reef_stream.consumers.reward.sandbox.worker import resolve

        object.__setattr__(self, "overrides", tuple(self.overrides))
        inner = resolve(self.target, list(self.overrides), self.build)
        object.__setattr__(self, "_reward", with_faults(inner, RewardFaults.parse(self.faults)))

    def __call__(self, generation: Any) -> Any:
        return self._reward(generation)


#: The ``SandboxedFaults`` that ``sandbox_target`` names, in this process only (a worker is
#: given the fields instead).
_TARGETS = types.SimpleNamespace()


def sandbox_target(target: str, overrides: tuple[str, ...], faults: RewardFaults) -> str:
    """A ``sandbox_target`` for ``RewardOptions`` that runs ``faults`` (anchored) around the
    reward function of ``target`` (with ``overrides``) in the sandbox's workers. The pool
    finds a ``SandboxedFaults`` under the name and gives its workers the class and its fields
    (``worker_target``); only the worker's own reward is imported there, as without faults.
    Raises ``ConfigurationError`` when ``target`` does not resolve here."""
    from reef_stream.consumers.reward.sandbox.reference import worker_target

    if faults.outage_start is not None:
        raise ValueError("the outage is relative: anchor it first (RewardFaults.anchored)")
    inner = worker_target(target, overrides)
    try:
        wrapped = SandboxedFaults(faults.text(), inner["target"], tuple(inner["overrides"]),
                                  inner.get("build"))
    except (Exception, SystemExit) as error:  # noqa: BLE001 - said as a configuration error
        raise ConfigurationError(f"--faults: the reward of {target} did not load: "
                                 f"{type(error).__name__}: {error}") from None
    name = "faulty_" + hashlib.blake2b(repr(wrapped).encode(), digest_size=6).hexdigest()
    setattr(_TARGETS, name, wrapped)
    return f"{__name__}:_TARGETS.{name}"


def applied(spec: str | None, recipe: Any, options: Any, target: str,
            overrides: tuple[str, ...]) -> tuple[Any, Any]:
    """``reef reward --faults spec``: the recipe (its reward wrapped by ``with_faults``) and
    the ``RewardOptions`` (with ``--sandbox process``, a ``sandbox_target`` that wraps it in
    the workers) to run; both unchanged without a spec. A relative outage counts from now.
    Raises ``ConfigurationError`` for a bad spec."""
    if not spec:
        return recipe, options
    faults = RewardFaults.parse(spec).anchored(time.time())
    recipe = dataclasses.replace(recipe, reward=with_faults(recipe.reward, faults))
    if options.sandbox == "process":
        options = dataclasses.replace(options, sandbox_overrides=(),
                                      sandbox_target=sandbox_target(target, overrides, faults))
    return recipe, options
