"""A model of the accelerators the demo's stages would run on: device time as a wall-clock wait.

    model = DeviceModel.parse("gen_ms=300,train_ms=1.5,batch=32")
    clock = DeviceClock("replica-0", report=run_dir / "devices" / "replica-0.json")
    clock.wait_ms(model.generation_ms(32))      # one batch of up to 32 completions: 300 ms
    clock.busy_s, clock.busy_fraction()

A sampled completion costs ``gen_ms`` of its replica's device time, and a replica's device runs
up to ``batch`` completions at once (a batch of up to ``batch`` costs one ``gen_ms``); a trained
sample costs ``train_ms`` of the trainer's device time. The toy model's own sampling and its
forward and backward passes are what that device time stands for, so they count toward it:
the clock pads the work to the modelled time (``DeviceClock.pad_ms``), and only work that took
longer than the model says is busy for as long as it took. The pad is ``time.sleep``: off the
CPU, as a GPU kernel is for the host. The model changes no computation -- it only adds waits --
so nothing lost, bitwise resume and the same weights for the same log all hold with it on.

Off by default. ``reef demo --device-model SPEC`` gives it to the replicas (``--device-model``
of ``reef_stream.demo.replica``) and to the trainer, through ``REEF_DEVICE_MODEL`` and
``REEF_DEVICE_DIR`` (the demo's recipes wrap the loss in ``DeviceTimedLoss``); the synchronous
loop (``reef_stream.demo.sync``) takes it as an argument. Each clock with a ``report`` path
writes its busy time there as JSON (``DeviceClock.write``). docs/benchmarks.md says where the
defaults come from.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook

from reef_stream.core.errors import ConfigurationError

#: The environment variable the demo sets for its trainer: the device model's spec.
DEVICE_MODEL_ENV = "REEF_DEVICE_MODEL"
#: The environment variable naming the folder where each stage's clock writes its busy time.
DEVICE_DIR_ENV = "REEF_DEVICE_DIR"
#: The default model: a synchronous step of the demo (256 samples, 2 replicas' devices of 32)
#: spends 75 % of its device time generating (4 x 300 = 1200 ms) and 25 % training (256 x 1.5 =
#: 384 ms), the share RL systems report for reasoning tasks (docs/benchmarks.md).
DEFAULT_SPEC = "gen_ms=300,train_ms=1.5,batch=32"
#: A setting where generation dominates: the same generation, a third of the training (91 %).
GENERATION_BOUND_SPEC = "gen_ms=300,train_ms=0.5,batch=32"
#: Completions a replica's device runs at once when the spec does not say: the demo replica's
#: sampling round (``reef_stream.demo.replica.ROUND_COMPLETIONS``), so a round is one batch.
DEFAULT_BATCH = 32
#: The least time between two writes of a clock's report.
REPORT_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """The modelled device costs: ``gen_ms`` per batch of up to ``batch`` completions on a
    replica's device, ``train_ms`` per trained sample on the trainer's device."""

    gen_ms: float
    train_ms: float
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        problems = []
        for name in ("gen_ms", "train_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                problems.append(f"device model: {name} must be a finite number of milliseconds "
                                f">= 0, not {value!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            problems.append(f"device model: batch must be a whole number >= 1, not "
                            f"{self.batch!r}")
        if problems:
            raise ConfigurationError(problems)

    @classmethod
    def parse(cls, spec: str) -> DeviceModel:
        """``gen_ms=G,train_ms=T[,batch=B]`` as a model. ``ConfigurationError`` listing every
        problem (an unknown or repeated key, a missing one, a value that is not a number)."""
        problems: list[str] = []
        values: dict[str, str] = {}
        given: set[str] = set()   # known keys given, well formed or not
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key, equals, value = (s.strip() for s in part.partition("="))
            if key in ("gen_ms", "train_ms", "batch") and key not in values:
                given.add(key)
            if not equals or not value:
                problems.append(f"device model: {part!r} is not KEY=VALUE")
            elif key not in ("gen_ms", "train_ms", "batch"):
                problems.append(f"device model: unknown key {key!r} (known: gen_ms, train_ms, "
                                "batch)")
            elif key in values:
                problems.append(f"device model: {key} is given twice")
            else:
                values[key] = value
        for key in ("gen_ms", "train_ms"):
            if key not in given:
                problems.append(f"device model: {key} is missing (spec: gen_ms=G,train_ms=T"
                                "[,batch=B])")
        parsed: dict[str, Any] = {}
        for key, value in values.items():
            try:
                parsed[key] = int(value) if key == "batch" else float(value)
            except ValueError:
                problems.append(f"device model: {key}={value!r} is not a "
                                f"{'whole number' if key == 'batch' else 'number'}")
        if problems:
            raise ConfigurationError(problems)
        return cls(**parsed)

    def spec(self) -> str:
        """The spec ``parse`` reads back as this model."""
        return f"gen_ms={self.gen_ms:g},train_ms={self.train_ms:g},batch={self.batch}"

    def label(self) -> str:
        """``G/T`` (with ``/B`` when the batch is not the default), for a result line."""
        batch = "" if self.batch == DEFAULT_BATCH else f"/{self.batch}"
        return f"{self.gen_ms:g}/{self.train_ms:g}{batch}"

    def generation_ms(self, completions: int, devices: int = 1) -> float:
        """Device time of ``completions`` spread over ``devices`` replicas' devices: every
        device runs batches of up to ``batch`` at once, so ``ceil(n / (devices x batch))``
        batches one after the other, ``gen_ms`` each."""
        return math.ceil(completions / (max(devices, 1) * self.batch)) * self.gen_ms

    def training_ms(self, samples: int) -> float:
        """Device time of training ``samples``: ``train_ms`` each."""
        return samples * self.train_ms

    def step_ms(self, samples_per_step: int, replicas: int = 1, epochs: int = 1
                ) -> tuple[float, float]:
        """A step's device time ``(g, t)``: generating its samples on ``replicas`` devices
        (``generation_ms``) and training them ``epochs`` times (``training_ms``)."""
        return (self.generation_ms(samples_per_step, replicas),
                self.training_ms(samples_per_step) * epochs)

    def overlap_bound(self, samples_per_step: int, replicas: int = 1, epochs: int = 1) -> float:
        """The best speedup overlapping can give over doing a step's work in turn:
        ``(g + t) / max(g, t)`` of ``step_ms``. 1 when the model costs nothing."""
        g, t = self.step_ms(samples_per_step, replicas, epochs)
        return (g + t) / max(g, t) if max(g, t) > 0 else 1.0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> DeviceModel | None:
        """The model ``REEF_DEVICE_MODEL`` spells, None when unset or empty."""
        spec = (os.environ if environ is None else environ).get(DEVICE_MODEL_ENV, "").strip()
        return cls.parse(spec) if spec else None


class DeviceClock:
    """One modelled device: ``wait_ms`` sleeps (off the CPU) and adds the wait to ``busy_s``;
    ``pad_ms`` counts the work done since a time toward the modelled time and sleeps the rest.
    ``waited_s`` is what was slept (or only counted), ``busy_s`` the device's whole busy time.

    With ``sleep=False`` it only counts: a wait is added to ``busy_s`` and ``waited_s`` and
    returns at once. That is for a loop that does nothing else while its device is busy (the
    synchronous loop): its stopwatch adds ``waited_s`` instead of sleeping it, the same figure
    without the wall-clock wait (``reef_stream.demo.sync``); its ``busy_fraction`` then means
    nothing.

    ``busy_fraction`` is ``busy_s`` over the span from the start of the first busy time to the
    end of the last. With ``report``, the figures are written there as JSON (``write``) at most
    every ``REPORT_EVERY_S`` and whenever ``write`` is called. Thread-safe; ``wait_ms`` and
    ``pad_ms`` block for their wait.
    """

    def __init__(self, name: str, report: Path | None = None, *, sleep: bool = True) -> None:
        self.name, self.report, self.sleep = name, report, sleep
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.waited_s = 0.0
        self.waits = 0
        self.first: float | None = None   # time.time() at the start of the first wait
        self.last: float | None = None    # time.time() at the end of the last
        self._written = 0.0

    def wait_ms(self, milliseconds: float) -> None:
        """Be busy for ``milliseconds``: a sleep, counted (only counted with ``sleep=False``).
        Does nothing for 0."""
        if milliseconds <= 0:
            return
        self.pad_ms(milliseconds, time.time())

    def pad_ms(self, milliseconds: float, since: float) -> None:
        """Be busy for ``milliseconds`` from ``since`` (``time.time()`` when the work the device
        stands for began: the toy's sampling, or its forward pass): the time since counts toward
        them and the rest is slept (only counted with ``sleep=False``). Work that took longer
        is busy for as long as it took, with no wait."""
        started = time.time()
        rest = max(milliseconds / 1000.0 - (started - since), 0.0)
        if self.sleep and rest > 0:
            time.sleep(rest)
            ended = time.time()
            rest = ended - started
        else:
            ended = started + rest
        with self._lock:
            self.busy_s += ended - since
            self.waited_s += rest
            self.waits += 1
            self.first = since if self.first is None else min(self.first, since)
            self.last = ended
        if self.report is not None and ended - self._written >= REPORT_EVERY_S:
            self.write()

    def busy_fraction(self) -> float | None:
        """``busy_s`` over the span of the waits; None before the first wait."""
        with self._lock:
            if self.first is None or self.last is None or self.last <= self.first:
                return None
            return min(self.busy_s / (self.last - self.first), 1.0)

    def figures(self) -> dict[str, Any]:
        """What ``write`` writes: the name, ``busy_s``, ``waited_s``, ``waits``, ``first``,
        ``last`` (unix seconds) and ``busy_fraction``."""
        fraction = self.busy_fraction()
        with self._lock:
            return {"name": self.name, "busy_s": self.busy_s, "waited_s": self.waited_s,
                    "waits": self.waits, "first": self.first, "last": self.last,
                    "busy_fraction": fraction}

    def write(self) -> None:
        """Write ``figures()`` to ``report`` (atomically: a reader never sees half of it)."""
        if self.report is None:
            return
        self._written = time.time()
        self.report.parent.mkdir(parents=True, exist_ok=True)
        partial = self.report.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_text(json.dumps(self.figures()))
        os.replace(partial, self.report)


def _parameters_of(tensor: Any) -> list[Any]:
    """The leaf tensors (parameters) ``tensor``'s autograd graph accumulates gradients into."""
    leaves, seen, nodes = [], set(), [tensor.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)   # an AccumulateGrad node's parameter
        if variable is not None:
            leaves.append(variable)
        nodes.extend(following for following, _ in node.next_functions)
    return leaves


def read_reports(folder: Path) -> dict[str, dict[str, Any]]:
    """Every clock's report in ``folder`` (``*.json``), by the clock's name."""
    reports = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        figures = json.loads(path.read_text())
        reports[figures["name"]] = figures
    return reports


class DeviceTimedLoss:
    """A loss that also keeps the trainer's modelled device busy: each call computes ``loss``
    unchanged; the micro batch's forward pass, loss and backward pass are its device's work,
    padded at the end of the backward pass to ``model.training_ms`` for its samples on
    ``clock`` (``DeviceClock.pad_ms``). The backend reads a loss's optional ``extra_inputs``
    and ``kl``: both are ``loss``'s.

    The work is timed by two torch hooks, put in place at the first call (so only a process
    that trains has them): every module's forward pre-hook notes when the first forward since
    the last pad began (the model's, or a no-grad one the step needs, such as the proximal
    policy's), and a hook on the gradients of the parameters the loss depends on (found in its
    autograd graph) pads once they are all computed. The first micro batch's forward, before
    the hooks, is not counted. A micro batch whose backward never runs (its loss not finite:
    the step fails) is not padded."""

    def __init__(self, loss: Any, model: DeviceModel, clock: DeviceClock) -> None:
        self.loss, self.model, self.clock = loss, model, clock
        self.extra_inputs = getattr(loss, "extra_inputs", ())
        self.kl = getattr(loss, "kl", None)
        self._began: float | None = None    # time.time() at the first forward since a pad
        self._samples = 0                   # of the micro batch awaiting its backward's end
        self._handles: list[Any] = []

    def __call__(self, inputs: Any) -> Any:
        output = self.loss(inputs)
        if not self._handles:
            self._began = time.time()
            self._handles = [register_module_forward_pre_hook(self._forward_began),
                             register_multi_grad_hook(_parameters_of(output.loss),
                                                      self._backward_ended)]
        self._samples = int(inputs.mask.shape[0])
        return output

    def _forward_began(self, _module: Any, _inputs: Any) -> None:
        if self._began is None:
            self._began = time.time()

    def _backward_ended(self, _gradients: Any) -> None:
        if self._samples and self._began is not None:
            self.clock.pad_ms(self.model.training_ms(self._samples), self._began)
        self._samples, self._began = 0, None

    def __repr__(self) -> str:
        return f"DeviceTimedLoss({self.loss!r}, {self.model.spec()})"
