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

A held trajectory is in memory only: a proxy killed without ``close`` loses it.
Pure (no I/O), not thread-safe: one event loop calls it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reef_stream.core.events import Generation, Segment, SegmentSource
from reef_stream.intake.validation import validate

__all__ = ["IDLE_S", "MAX_HELD", "TURNS_KEY", "Trajectories"]

#: Seconds a trajectory is held without a next turn before it is recorded as it is.
IDLE_S = 600.0
#: Trajectories held at most; past it the oldest is recorded as it is.
MAX_HELD = 10_000
#: ``metadata[TURNS_KEY]``: how many policy turns a chained Generation holds.
TURNS_KEY = "proxy.turns"


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

    @classmethod
    def start(cls, generation: Generation, now: float) -> _Held:
        held = cls(generation, generation, now)
        held._policy(generation)
        return held

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
    extend them, ``expired`` ones recorded after ``idle_s`` or past ``max_held``."""

    def __init__(self, idle_s: float = IDLE_S, max_held: int = MAX_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.max_held, self.clock = idle_s, max_held, clock
        self.counts: Counter[str] = Counter()
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def turn(self, conversation: str, generation: Generation, *, calls_tools: bool,
             environment_role: str = "") -> list[Generation]:
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
                out.append(held.generation())
                self.counts["split"] += 1
            held = _Held.start(generation, now)
        if not calls_tools:
            out.append(held.generation())
            return out
        self._held[conversation] = held
        while len(self._held) > self.max_held:
            out.append(self._held.popitem(last=False)[1].generation())
            self.counts["expired"] += 1
        return out

    def expired(self, now: float | None = None) -> list[Generation]:
        """The trajectories held longer than ``idle_s`` since their last turn, taken out."""
        now = self.clock() if now is None else now
        out = []
        while self._held:
            conversation, held = next(iter(self._held.items()))
            if now - held.touched < self.idle_s:
                break
            del self._held[conversation]
            out.append(held.generation())
            self.counts["expired"] += 1
        return out

    def close(self) -> list[Generation]:
        """Every held trajectory, as it is, taken out."""
        out = [held.generation() for held in self._held.values()]
        self._held.clear()
        return out

    def __len__(self) -> int:
        return len(self._held)
