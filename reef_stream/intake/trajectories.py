"""The tool-calling turns of one conversation, chained into one multi-turn Generation: what the
recording proxy records for an agent (docs/proxy.md, "Multi-turn tool calls").

An agent calls the model, runs the tool calls it answered with, and calls it again with the
conversation so far: each call is a request of its own. ``Trajectories.turn`` takes the
Generation of each chat response of a conversation (one choice) and:

- holds a turn whose choice called tools: the conversation goes on;
- extends the held trajectory with the next turn when that turn's prompt token ids begin with
  every token of the trajectory so far (its first prompt, then each turn's tokens as sampled
  and what came between): the prompt tokens past them (the tool results, the chat template's
  role markers) become an ENVIRONMENT segment (masked, logprob 0), named after the messages
  they hold (``tool:<function>``, ``user``), and the turn's completion a POLICY segment;
- ends the trajectory at a turn without tool calls, and returns it as one Generation: the first
  turn's prompt, every turn's tokens as sampled (never re-tokenised), ``segments`` saying which
  are the policy's, under the id of its last turn (the id in the last response's header);
- ends the held trajectory as it was and starts anew when a turn does not extend it: the
  template rendered the sampled tokens differently, the version or model changed (or became
  known or unknown: unknown turns chain, and the trajectory stays marked unknown), or the
  history was edited. What was sampled is what is trained, so a turn is never spliced in;
- gives back a trajectory held ``idle_s`` without a next turn (``expired``), the oldest one
  when more than ``max_held`` are held, and all of them at ``close``, as they are.

What is given back is a ``Given``: the Generation to record and the trajectory it ends (the id
of its first turn; None for a turn never held). ``held`` is a held trajectory as one Generation
so far and ``restore`` holds it again from that Generation: what the proxy's journal
(``reef_stream.intake.journal``) writes and replays, so a proxy killed outright loses nothing.
Pure (no I/O), not thread-safe: one event loop calls it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from reef_stream.core.events import Generation, Segment, SegmentSource
from reef_stream.intake.validation import validate

__all__ = ["IDLE_S", "MAX_HELD", "TURNS_KEY", "Given", "Trajectories"]

#: Seconds a trajectory is held without a next turn before it is recorded as it is.
IDLE_S = 600.0
#: Trajectories held at most; past it the oldest is recorded as it is.
MAX_HELD = 10_000
#: ``metadata[TURNS_KEY]``: how many policy turns a chained Generation holds.
TURNS_KEY = "proxy.turns"


class Given(NamedTuple):
    """A Generation to record now, and the trajectory it ends: the generation id of its first
    turn (what names the trajectory while it is held), None for a turn that was never held."""

    generation: Generation
    trajectory: str | None


@dataclass
class _Held:
    """A trajectory so far: its first turn's Generation, the completion's pieces and segments,
    and every token of it (what the next turn's prompt must begin with)."""

    first: Generation
    last: Generation
    touched: float
    tokens: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    turns: int = 0
    #: A restored trajectory's first turn id (``first`` is then the trajectory so far).
    first_turn: str | None = None

    @classmethod
    def start(cls, generation: Generation, now: float) -> _Held:
        held = cls(generation, generation, now)
        held._policy(generation)
        return held

    @classmethod
    def restored(cls, so_far: Generation, trajectory: str, now: float) -> _Held:
        """The trajectory whose ``generation()`` was ``so_far`` (first turn ``trajectory``)."""
        completion = so_far.completion_token_ids
        segments = list(so_far.segments) or [
            Segment(source=SegmentSource.POLICY, length=int(completion.size), role="assistant")]
        return cls(so_far, so_far, now, [completion], [so_far.completion_logprobs], segments,
                   np.concatenate([so_far.prompt_token_ids, completion]),
                   int(so_far.metadata.get(TURNS_KEY, "1")), trajectory)

    @property
    def trajectory(self) -> str:
        """The id of its first turn: what names it while it is held."""
        return self.first_turn or self.first.generation_id

    def extended_by(self, generation: Generation) -> bool:
        prompt = generation.prompt_token_ids
        return (generation.policy_version_known == self.first.policy_version_known
                and generation.policy_version == self.first.policy_version
                and generation.model == self.first.model
                and prompt.size >= self.seen.size
                and np.array_equal(prompt[:self.seen.size], self.seen))

    def extend(self, generation: Generation, environment_role: str, now: float) -> None:
        between = generation.prompt_token_ids[self.seen.size:]
        if between.size:
            self.tokens.append(between)
            self.logprobs.append(np.zeros(between.size, np.float32))
            self.segments.append(Segment(source=SegmentSource.ENVIRONMENT,
                                         length=int(between.size), role=environment_role))
        self.last, self.touched = generation, now
        self._policy(generation)

    def _policy(self, generation: Generation) -> None:
        completion = generation.completion_token_ids
        self.tokens.append(completion)
        self.logprobs.append(generation.completion_logprobs)
        if self.segments and self.segments[-1].source is SegmentSource.POLICY:
            previous = self.segments.pop()   # nothing came between: one policy run
            self.segments.append(dataclasses.replace(previous,
                                                     length=previous.length + completion.size))
        else:
            self.segments.append(Segment(source=SegmentSource.POLICY,
                                         length=int(completion.size), role="assistant"))
        self.seen = np.concatenate([generation.prompt_token_ids, completion])
        self.turns += 1

    def given(self) -> Given:
        return Given(self.generation(), self.trajectory)

    def generation(self) -> Generation:
        """The trajectory as one Generation (a single turn: that turn's, unchanged)."""
        if self.turns == 1:
            return self.first
        metadata = dict(self.first.metadata)
        for key in ("completion", "tool_calls"):   # what was served last
            metadata.pop(key, None)
            if key in self.last.metadata:
                metadata[key] = self.last.metadata[key]
        metadata[TURNS_KEY] = str(self.turns)
        segments = tuple(self.segments)
        generation = dataclasses.replace(
            self.first, generation_id=self.last.generation_id, request_id=self.last.request_id,
            completion_token_ids=np.concatenate(self.tokens).astype(np.int32, copy=False),
            completion_logprobs=np.concatenate(self.logprobs).astype(np.float32, copy=False),
            finish_reason=self.last.finish_reason, metadata=metadata,
            segments=segments if len(segments) > 1 else ())
        validate(generation)
        return generation


class Trajectories:
    """The proxy's held trajectories, by conversation (module docstring). ``counts``:
    ``chained`` turns added to a trajectory, ``split`` trajectories ended by a turn that did not
    extend them, ``expired`` ones recorded after ``idle_s`` or past ``max_held``, ``restored``
    ones held again by ``restore``."""

    def __init__(self, idle_s: float = IDLE_S, max_held: int = MAX_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.max_held, self.clock = idle_s, max_held, clock
        self.counts: Counter[str] = Counter()
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def turn(self, conversation: str, generation: Generation, *, calls_tools: bool,
             environment_role: str = "") -> list[Given]:
        """Take the Generation of one turn of ``conversation``; returns what is to be recorded
        now (none while the trajectory is held). ``calls_tools``: its choice called tools.
        ``environment_role``: what the prompt's messages since the last assistant turn are.
        Raises ``InvalidRecord`` when a chained Generation fails validation (not expected:
        its parts passed it)."""
        now = self.clock()
        held = self._held.pop(conversation, None)
        out = self.expired(now)
        if held is not None and held.extended_by(generation):
            held.extend(generation, environment_role, now)
            self.counts["chained"] += 1
        else:
            if held is not None:
                out.append(held.given())
                self.counts["split"] += 1
            held = _Held.start(generation, now)
        if not calls_tools:
            out.append(held.given() if held.turns > 1 else Given(generation, None))
            return out
        self._held[conversation] = held
        return out + self._over_bound()

    def held(self, conversation: str) -> Given | None:
        """The trajectory held for ``conversation`` as one Generation so far, and its first
        turn's id; None when none is held. ``restore`` takes them back."""
        held = self._held.get(conversation)
        return None if held is None else held.given()

    def restore(self, conversation: str, so_far: Generation, trajectory: str,
                idle_for: float = 0.0) -> list[Given]:
        """Hold again for ``conversation`` the trajectory ``held`` gave as ``so_far`` (first
        turn ``trajectory``), as if its last turn came ``idle_for`` seconds ago: its next turn
        extends it as it would have extended the original. Call it in the order the
        trajectories were last touched. Returns what is to be recorded now: a trajectory held
        for ``conversation`` before (split), and the oldest past ``max_held``."""
        out = []
        previous = self._held.pop(conversation, None)
        if previous is not None:   # not ``split``: no turn failed to extend it
            out.append(previous.given())
        self._held[conversation] = _Held.restored(so_far, trajectory, self.clock() - idle_for)
        self.counts["restored"] += 1
        return out + self._over_bound()

    def _over_bound(self) -> list[Given]:
        out = []
        while len(self._held) > self.max_held:
            out.append(self._held.popitem(last=False)[1].given())
            self.counts["expired"] += 1
        return out

    def expired(self, now: float | None = None) -> list[Given]:
        """The trajectories held longer than ``idle_s`` since their last turn, taken out."""
        now = self.clock() if now is None else now
        out = []
        while self._held:
            conversation, held = next(iter(self._held.items()))
            if now - held.touched < self.idle_s:
                break
            del self._held[conversation]
            out.append(held.given())
            self.counts["expired"] += 1
        return out

    def close(self) -> list[Given]:
        """Every held trajectory, as it is, taken out."""
        out = [held.given() for held in self._held.values()]
        self._held.clear()
        return out

    def __len__(self) -> int:
        return len(self._held)
