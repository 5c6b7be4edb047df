"""The synchronous loop: the lower bound the live loop is measured against.

    result = run_synchronous("reef_stream.demo.recipes:sao", target=0.9, time_limit=300, seed=0)
    result.seconds, result.steps, result.samples, result.curve      # see SyncResult

The naive loop a researcher would write over THE SAME bound recipe ``reef demo`` runs, in one
process, one thing after the other. Each step:

1. samples what one trainer step consumes from the current weights (``schedule.units_per_step``
   prompts, ``recipe.group_size`` completions each, as the replicas sample:
   ``reef_stream.demo.task.sample`` and ``make_generation``, at temperature 1);
2. scores each generation with ``recipe.reward`` (its ``Feedback`` as a reward worker builds
   it, ``feedback_for``);
3. turns them into units with the recipe's own processor (``engine.join.ProcessorState``, the
   state machine the processor runtime runs; the feedback arrives at once);
4. computes the recipe's objective and trains one step with ``engine.training.TorchBackend``,
   as the trainer does (units carried over to the next step when the processor emitted more).

With a device model (``device``, ``reef_stream.demo.devices``) the loop uses the same modelled
devices in turn, as a synchronous RL loop does: each sampling call takes its generation's device
time spread over ``replicas`` replicas' devices (``DeviceModel.generation_ms``), each step its
training's (``DeviceModel.training_ms`` of the samples trained, per epoch), both on the
stopwatch; the toy's sampling, and its training step, count toward them and the clock waits
the rest (``DeviceClock.pad_ms``), as the live loop's replicas and trainer do. The waits change
no computation. With ``sleep_device=False`` they are counted on the stopwatch instead of
slept: the loop does nothing else while a device of its is busy, so the figure is the same
without the wall-clock wait, and several seeds' runs take minutes, not an hour
(``bench/loop.py --sync-seeds``).

With ``lag`` k, each step samples from the weights of k steps before (stamped with that
version), as a live loop's replicas serve a version behind its trainer: what staleness alone
costs in samples, without the live loop's plumbing or timing (``bench/staleness.py``).

Every ``measure_every`` steps the new version is measured with the recipe's evaluator's
``measure`` (for the demo: held-out greedy accuracy, what the live evaluator publishes) on a
checkpoint written to an in-memory store. The stopwatch is PAUSED while measuring and at
version 0, and nothing is published, served or written to Kafka, so no sample is ever stale:
this is the lower bound, not a fair race. Seeded: the weights of version 0 by the recipe's
``schedule.seed`` (as the trainer builds them), prompts and samples by ``seed``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import inspect
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reef_stream.api.recipe import Recipe, Reward, feedback_for, load_recipe
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.events import Checkpoint, Feedback, Generation, now_ms
from reef_stream.demo.devices import DeviceClock, DeviceModel
from reef_stream.demo.task import ProblemStream, make_generation, prompt_tensor, sample
from reef_stream.engine.checkpoints import CheckpointContents, CheckpointStore
from reef_stream.engine.join import ProcessorState
from reef_stream.engine.training import TorchBackend, unit_members

#: The model name on the synchronous loop's generations and candidates.
MODEL = "policy"
#: The sampling temperature of the demo's replicas.
TEMPERATURE = 1.0


@dataclass(frozen=True)
class SyncResult:
    """How a synchronous run went.

    ``seconds``: the stopwatch (measurements excluded) when the target was first measured, or
    when the run stopped without reaching it. ``steps``: training steps taken; ``samples``:
    generations sampled (``steps`` x the samples a step consumes, for the demo's recipes);
    ``units``: units trained. ``curve``: ``(step, seconds, measured value)`` per measurement,
    the first of version 0 (the untrained model). ``threads``: torch's intra-op threads.
    ``generation_busy_s`` / ``training_busy_s``: the modelled devices' busy time on the
    stopwatch, the toy's own sampling and training inside it (0 without a device model).
    """

    recipe: str
    target: float
    reached: bool
    seconds: float
    steps: int
    samples: int
    units: int
    curve: tuple[tuple[int, float, float], ...]
    threads: int
    measure: str = "accuracy"
    generation_busy_s: float = 0.0
    training_busy_s: float = 0.0

    def line(self) -> str:
        how = "reached" if self.reached else "did NOT reach"
        return (f"synchronous {self.recipe}: {how} {self.measure} {self.target:g} in "
                f"{self.seconds:.1f} s ({self.steps} steps, {self.samples} samples, "
                f"{self.threads} torch threads); last measured {self.curve[-1][2]:.3f} at step "
                f"{self.curve[-1][0]}")


class SynchronousLoop:
    """The parts of one synchronous run over ``recipe`` (see the module docstring); the state
    is the current weights, the objective's state, the processor's state and the samplers'.
    Not thread-safe. Every method blocks for its computation."""

    def __init__(self, recipe: Recipe, *, seed: int = 0, measure: str = "accuracy",
                 device: DeviceModel | None = None, replicas: int = 1,
                 sleep_device: bool = True, lag: int = 0) -> None:
        if recipe.reward is None:
            raise ConfigurationError(f"recipe {recipe.name!r} has no reward function: the "
                                     "synchronous loop scores its own samples")
        self.recipe, self.measure_name = recipe, measure
        self.group_size = max(recipe.group_size, 1)
        self.backend = TorchBackend(recipe)
        self.model = self.backend.accelerator.unwrap_model(self.backend.model)
        self.state = recipe.objective.initial_state()
        self.processor = ProcessorState.for_recipe(recipe)
        self.problems = ProblemStream(seed)
        self.generator = torch.Generator().manual_seed(seed)
        #: The version the current weights are (the steps trained).
        self.version = 0
        self.samples = self.units_trained = 0
        self.waiting: list[Any] = []   # units emitted and not trained yet
        self.store = CheckpointStore(f"memory://reef-sync-{uuid.uuid4().hex}")
        #: The modelled devices (None: none): ``replicas`` replicas' devices, one clock for
        #: them all (they run in parallel), and the trainer's.
        self.device, self.replicas = device, max(replicas, 1)
        self.generation_clock = DeviceClock("replicas", sleep=sleep_device)
        self.training_clock = DeviceClock("trainer", sleep=sleep_device)
        #: Samples come from the weights ``lag`` steps behind (``lag_versions``, oldest first,
        #: copies; the newest is the current weights'), stamped with that version: the
        #: staleness a live loop's samples have, without its plumbing (``bench/staleness.py``).
        if lag < 0:
            raise ConfigurationError(f"lag must be at least 0, not {lag}")
        self.lag = lag
        self.lagged = copy.deepcopy(self.model) if lag else self.model
        self.lag_versions: collections.deque[dict[str, torch.Tensor]] = collections.deque(
            [self._weights()], maxlen=lag + 1)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @property
    def device_busy_s(self) -> float:
        """Seconds the modelled devices were busy so far, generating and training."""
        return self.generation_clock.busy_s + self.training_clock.busy_s

    @property
    def device_waited_s(self) -> float:
        """Seconds the modelled devices waited so far (slept, or only counted), beyond the toy's
        own work that counted toward their time."""
        return self.generation_clock.waited_s + self.training_clock.waited_s

    # ----------------------------------------------------------------- one step

    def rollouts(self, prompts: int) -> tuple[list[Generation], list[Feedback]]:
        """``prompts`` prompts, ``group_size`` completions each from the current weights, or
        those ``lag`` steps behind (one forward pass), and each one's reward as Feedback."""
        batch = self.problems.take(prompts)
        policy, version = self.model, self.version
        if self.lag:
            policy, version = self.lagged, max(self.version - self.lag, 0)
            policy.load_state_dict(self.lag_versions[0])
        policy.eval()
        began = time.time()
        completions = sample(policy, prompt_tensor(
            [p for p in batch for _ in range(self.group_size)]), temperature=TEMPERATURE,
            generator=self.generator)
        if self.device is not None:   # the sampling counts toward its device time
            self.generation_clock.pad_ms(self.device.generation_ms(
                prompts * self.group_size, self.replicas), began)
        generations = []
        for i, problem in enumerate(batch):
            group_id = uuid.uuid4().hex if self.group_size > 1 else None
            for row in range(i * self.group_size, (i + 1) * self.group_size):
                generations.append(make_generation(
                    model=MODEL, policy_version=version, replica_id="sync",
                    problem=problem, token_ids=completions.token_ids[row],
                    logprobs=completions.logprobs[row], temperature=TEMPERATURE,
                    group_id=group_id, group_size=self.group_size))
        self.samples += len(generations)
        reward = self.recipe.reward
        feedback = [feedback_for(g, _called(reward, g), source=reward.source,
                                 created_at=now_ms()) for g in generations]
        return generations, feedback

    def units_of(self, generations: Sequence[Generation], feedback: Sequence[Feedback]
                 ) -> list[Any]:
        """The units the recipe's processor emits for ``generations``, each followed at once by
        its feedback."""
        units = []
        by_generation = {f.generation_id: f for f in feedback}
        for generation in generations:
            at = now_ms()
            units += [e.unit for e in self.processor.offer(generation, at=at).units]
            if generation.generation_id in by_generation:
                units += [e.unit for e in self.processor.offer(
                    by_generation[generation.generation_id], at=at).units]
        units += [e.unit for e in self.processor.tick(now_ms()).units]
        return units

    def step(self) -> dict[str, float]:
        """Sample, score and process until a step's units are there, then train on them."""
        need = self.recipe.schedule.units_per_step
        # The units waiting for the trainer are the ones left from the last step: a backlog
        # bound (schedule.max_backlog_steps, at least a step) then never sheds here.
        self.processor.observe_backlog(len(self.waiting))
        while len(self.waiting) < need:
            self.waiting += self.units_of(*self.rollouts(need - len(self.waiting)))
        units, self.waiting = self.waiting[:need], self.waiting[need:]
        result = self.recipe.objective.compute(units, self.state)
        began = time.time()
        metrics = self.backend.train_step(units, result, self.version + 1)
        if self.device is not None:   # the forward and backward passes count toward it
            trained = sum(len(unit_members(u)) for u in units) * self.recipe.schedule.epochs
            self.training_clock.pad_ms(self.device.training_ms(trained), began)
        self.state = result.proposed_state
        self.version += 1
        self.units_trained += len(units)
        self.processor.observe_checkpoint(self.version)
        if self.lag:
            self.lag_versions.append(self._weights())
        return metrics

    # ----------------------------------------------------------------- measuring

    def measure(self) -> float:
        """The recipe's evaluator's measurement of the current weights (``measure``, else its
        first value), as the live evaluator measures a candidate: from a checkpoint, verified."""
        weights, _, _ = self.backend.state()
        stored = self.store.write(CheckpointContents(
            step=self.version, policy_version=self.version, model=MODEL, recipe=self.recipe.name,
            trainer_group="sync", weights=weights, optimizer={}, rng={}, algorithm_state={},
            offsets=(), trained_units=np.zeros(0, dtype=np.uint64)))
        try:
            candidate = Checkpoint(
                checkpoint_id=stored.checkpoint_id, recipe=self.recipe.name, trainer_group="sync",
                step=self.version, model=MODEL, policy_version=self.version, uri=stored.uri,
                sha256=stored.sha256, offsets=(), trained_unit_count=self.units_trained,
                created_at=now_ms())
            values = dict(self.recipe.evaluator.measure(candidate).values)
        finally:
            self.store.fs.rm(self.store.root, recursive=True)
        if self.measure_name in values:
            return float(values[self.measure_name])
        if not values:
            raise ConfigurationError(f"recipe {self.recipe.name!r}: its evaluator measured "
                                     "nothing, so there is no target to reach")
        return float(next(iter(values.values())))


def run_synchronous(recipe: Recipe | str = "reef_stream.demo.recipes:sao", *, target: float,
                    time_limit: float, seed: int = 0, measure_every: int = 1,
                    measure: str = "accuracy", threads: int | None = None,
                    device: DeviceModel | None = None, replicas: int = 1,
                    sleep_device: bool = True, lag: int = 0,
                    max_steps: int | None = None) -> SyncResult:
    """Train ``recipe`` (a bound recipe or its path) synchronously until its evaluator measures
    ``target`` (``measure``) or the stopwatch passes ``time_limit`` seconds; see the module
    docstring. ``threads``: torch intra-op threads for the run (None: torch's setting, by
    default one per core), restored at the end. ``device``: the modelled devices, ``replicas``
    of them generating (None: none); ``sleep_device=False``: their waits are counted on the
    stopwatch, not slept (see the module docstring). ``lag``: sample from the weights that many
    steps behind (``SynchronousLoop``). ``max_steps``: stop after that many steps too. Blocks; seeds torch's global RNG, as the
    trainer does."""
    if isinstance(recipe, str):
        recipe = load_recipe(recipe, complete=True)
    if measure_every < 1:
        raise ConfigurationError(f"measure_every must be at least 1, not {measure_every}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        loop = SynchronousLoop(recipe, seed=seed, measure=measure, device=device,
                               replicas=replicas, sleep_device=sleep_device, lag=lag)
        curve = [(0, 0.0, loop.measure())]
        elapsed = 0.0
        while curve[-1][2] < target and elapsed < time_limit \
                and (max_steps is None or loop.version < max_steps):
            started, waited = time.perf_counter(), loop.device_waited_s
            loop.step()
            elapsed += time.perf_counter() - started
            if not sleep_device:
                elapsed += loop.device_waited_s - waited
            if loop.version % measure_every == 0:
                curve.append((loop.version, elapsed, loop.measure()))   # not on the stopwatch
        if curve[-1][0] != loop.version:
            curve.append((loop.version, elapsed, loop.measure()))
        return SyncResult(recipe=recipe.name, target=target, reached=curve[-1][2] >= target,
                          seconds=elapsed, steps=loop.version, samples=loop.samples,
                          units=loop.units_trained, curve=tuple(curve),
                          threads=torch.get_num_threads(), measure=measure,
                          generation_busy_s=loop.generation_clock.busy_s,
                          training_busy_s=loop.training_clock.busy_s)
    finally:
        torch.set_num_threads(before)


def _called(reward: Any, generation: Generation) -> Reward:
    """``reward(generation)``, awaited when it is a coroutine function's."""
    result = reward(generation)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(result: Any) -> Reward:
    return await result
