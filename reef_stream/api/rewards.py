"""What a reward function is and returns: ``Reward``, ``RewardFunction``, ``NamedReward``.

A module of their own that imports nothing beyond the standard library (no torch, no numpy),
so reward code, and the sandbox worker that runs it (``reef_stream.consumers.reward.sandbox.worker``), can
import it without the recipe machinery: ``reef_stream.api.recipe`` imports the objectives and
losses, and with them torch (about 0.5 GB in every sandbox worker, and a slower fork per
call). ``reef_stream.api.recipe`` and ``reef_stream`` re-export the three names.

    from reef_stream.api.rewards import NamedReward, Reward

    def _judge(generation) -> Reward:
        return Reward(reward=1.0, components={"format": 1.0})

    judge = NamedReward("judge", _judge)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from reef_stream.core.events import Generation

__all__ = ["NamedReward", "Reward", "RewardFunction", "Transient", "is_transient"]


@dataclass(frozen=True, slots=True)
class Reward:
    """What a reward function returns for one generation: a finite reward and its named parts."""

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)


class Transient(Exception):
    """Raise it (or a subclass, or ``raise Transient(...) from error``) to say a failure is
    not the generation's fault and may pass: a rate limit, a grading service that is down.

    The worker retries a transient failure up to ``--retries`` times, each after a backoff
    that holds no call slot; when most calls fail transiently at once, its circuit opens
    (``docs/stages.md``). Any other exception is the generation's: it is tried once more, and
    not again if it fails the same way. ``ConnectionError`` and ``TimeoutError`` count as
    transient too.
    """


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` says the failure may pass (``Transient``, ``ConnectionError``,
    ``TimeoutError``, or raised from one of them)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (Transient, ConnectionError, TimeoutError)):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False


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
