"""The device model (``reef_stream.demo.devices``): its spec, its costs, a clock that waits off
the CPU, and the invariant that it changes no computation."""

from __future__ import annotations

import json
import time

import pytest
import torch

from reef_stream.core.errors import ConfigurationError
from reef_stream.demo import recipes
from reef_stream.demo.devices import (
    DEFAULT_SPEC, DEVICE_MODEL_ENV, GENERATION_BOUND_SPEC, DeviceClock, DeviceModel,
    DeviceTimedLoss, read_reports,
)
from reef_stream.demo.sync import SynchronousLoop, run_synchronous


def test_a_spec_parses_into_a_frozen_model_and_back():
    model = DeviceModel.parse(" gen_ms=300, train_ms=1.5 ,batch=16")
    assert model == DeviceModel(gen_ms=300.0, train_ms=1.5, batch=16)
    assert DeviceModel.parse(model.spec()) == model
    assert DeviceModel.parse("gen_ms=2,train_ms=0").batch == 32   # the replica's round
    assert model.label() == "300/1.5/16" and DeviceModel(1, 2).label() == "1/2"
    with pytest.raises(AttributeError):
        model.gen_ms = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("spec, problems", [
    ("", ["gen_ms is missing", "train_ms is missing"]),
    ("gen_ms=x,foo=1,batch=0.5", ["unknown key 'foo'", "train_ms is missing",
                                  "gen_ms='x' is not a number",
                                  "batch='0.5' is not a whole number"]),
    ("gen_ms=1,gen_ms=2,train_ms", ["gen_ms is given twice", "'train_ms' is not KEY=VALUE"]),
    ("gen_ms=-1,train_ms=inf,batch=0", ["gen_ms must be a finite number",
                                        "train_ms must be a finite number",
                                        "batch must be a whole number >= 1"]),
])
def test_a_bad_spec_is_one_error_listing_every_problem(spec, problems):
    with pytest.raises(ConfigurationError) as raised:
        DeviceModel.parse(spec)
    message = str(raised.value)
    for problem in problems:
        assert problem in message
    assert f"{len(problems)} problems" in message


def test_a_batch_of_up_to_b_completions_costs_one_gen_ms():
    model = DeviceModel(gen_ms=300, train_ms=1.5, batch=32)
    assert model.generation_ms(1) == model.generation_ms(32) == 300
    assert model.generation_ms(33) == 600
    assert model.generation_ms(256, devices=2) == 4 * 300     # 2 devices of 32 at once
    assert model.generation_ms(0) == 0
    assert model.training_ms(256) == 384


def test_the_overlap_bound_is_g_plus_t_over_the_larger():
    model = DeviceModel.parse(DEFAULT_SPEC)
    assert model.overlap_bound(256, replicas=2) == pytest.approx((1200 + 384) / 1200)
    assert DeviceModel(gen_ms=10, train_ms=10 / 32, batch=32).overlap_bound(32) == 2.0
    assert DeviceModel(gen_ms=0, train_ms=0).overlap_bound(256) == 1.0


def test_the_defaults_put_generation_at_three_quarters_and_the_second_setting_above():
    """The default's synchronous step at the demo's settings (256 samples, 2 replicas) is ~75 %
    generation; the generation-bound setting's is more (docs/benchmarks.md)."""
    def share(spec: str) -> float:
        model = DeviceModel.parse(spec)
        g, t = model.generation_ms(256, 2), model.training_ms(256)
        return g / (g + t)

    assert 0.7 <= share(DEFAULT_SPEC) <= 0.8
    assert share(GENERATION_BOUND_SPEC) > 0.9


def test_the_model_is_read_from_the_environment():
    assert DeviceModel.from_environment({}) is None
    assert DeviceModel.from_environment({DEVICE_MODEL_ENV: " "}) is None
    assert DeviceModel.from_environment({DEVICE_MODEL_ENV: "gen_ms=1,train_ms=2"}) == \
        DeviceModel(1, 2)


def test_a_device_clock_waits_off_the_cpu_and_reports_its_busy_time(tmp_path):
    clock = DeviceClock("replica-0", tmp_path / "devices" / "replica-0.json")
    wall, cpu = time.perf_counter(), time.thread_time()
    clock.wait_ms(300)
    clock.wait_ms(0)                     # nothing to wait: not counted
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.3
    assert cpu < 0.1 * wall              # a sleep, not CPU work
    assert clock.waits == 1 and clock.busy_s >= 0.3
    clock.write()
    report = read_reports(tmp_path / "devices")["replica-0"]
    assert report["busy_s"] == clock.busy_s and report["waits"] == 1
    assert 0.9 <= report["busy_fraction"] <= 1.0
    assert json.loads((tmp_path / "devices" / "replica-0.json").read_text())["name"] == \
        "replica-0"
    assert DeviceClock("idle").busy_fraction() is None


def test_a_device_clock_counts_the_work_since_toward_its_time_and_waits_the_rest():
    """``pad_ms``: the toy's own work (here 50 ms of CPU) is the device's work, so it counts
    toward the modelled time and only the rest is slept; work longer than the model says is
    busy for as long as it took, with no wait."""
    def work(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    clock = DeviceClock("trainer")
    began = time.time()
    work(0.05)
    clock.pad_ms(200, began)
    assert time.time() - began >= 0.2 and clock.busy_s >= 0.2
    assert clock.waited_s <= clock.busy_s - 0.05       # the work was not waited again
    busy, waited = clock.busy_s, clock.waited_s
    began = time.time()
    work(0.1)
    clock.pad_ms(20, began)                           # took longer than modelled
    assert clock.waited_s == waited and clock.busy_s - busy >= 0.1 and clock.waits == 2


def test_the_timed_loss_counts_the_forward_and_backward_passes_toward_train_ms():
    """The trainer's device time per micro batch is its samples' ``train_ms``, its forward
    and backward passes inside it: at ``train_ms=0`` the clock counts only those passes and
    waits nothing; at 1 s a sample (counted, not slept) it counts exactly the modelled time
    and waits less than it by the passes' time."""
    samples = recipes.sao.schedule.units_per_step
    clocks = {}
    for train_ms in (0.0, 1000.0):
        clock = DeviceClock("trainer", sleep=False)
        recipe = recipes.timed(recipes.sao, DeviceModel(gen_ms=0, train_ms=train_ms), clock)
        with torch.random.fork_rng(devices=[]):
            SynchronousLoop(recipe, seed=3).step()
        clocks[train_ms] = clock
    passes = clocks[0.0]
    assert passes.waits >= 1 and passes.busy_s > 0 and passes.waited_s == 0
    modelled = clocks[1000.0]
    assert modelled.waits == passes.waits
    assert modelled.busy_s == pytest.approx(samples * recipes.sao.schedule.epochs * 1.0)
    assert 0 < modelled.busy_s - modelled.waited_s < 60    # the passes, not waited again


def test_the_timed_loss_keeps_the_loss_s_declared_inputs():
    family = recipes.sao.objective.loss_family
    loss = dict(recipes.sao.backend.losses).get(family, family.reference)
    timed = recipes.timed(recipes.sao, DeviceModel(1, 1), DeviceClock("trainer"))
    wrapped = dict(timed.backend.losses)[timed.objective.loss_family]
    assert isinstance(wrapped, DeviceTimedLoss) and wrapped.loss is loss
    assert wrapped.extra_inputs == getattr(loss, "extra_inputs", ())
    assert recipes.timed(recipes.sao) is recipes.sao     # REEF_DEVICE_MODEL unset: as it was


def _one_step(device: DeviceModel | None) -> tuple[dict[str, torch.Tensor], SynchronousLoop]:
    clock = DeviceClock("trainer")
    recipe = recipes.sao if device is None else recipes.timed(recipes.sao, device, clock)
    loop = SynchronousLoop(recipe, seed=3, device=device, replicas=2)
    loop.step()
    weights, _, _ = loop.backend.state()
    assert (clock.waits > 0) == (device is not None)    # the trainer's loss waited
    return weights, loop


def test_the_device_model_changes_no_computation():
    """One step of the demo's toy model -- sampling, scoring, processing, training -- gives
    bitwise the same weights with the device model as without it (same seeds)."""
    with torch.random.fork_rng(devices=[]):
        plain, _ = _one_step(None)
    with torch.random.fork_rng(devices=[]):
        timed, loop = _one_step(DeviceModel(gen_ms=1, train_ms=0.01, batch=32))
    assert loop.generation_clock.waits > 0 and loop.training_clock.waits == 1
    assert plain.keys() == timed.keys()
    for name in plain:
        assert torch.equal(plain[name], timed[name]), name


def test_the_demo_gives_its_replicas_and_its_trainer_the_model(tmp_path, monkeypatch):
    from reef_stream.core.settings import load_settings
    from reef_stream.demo.devices import DEVICE_DIR_ENV
    from reef_stream.demo.run import Demo, DemoOptions

    monkeypatch.setenv("REEF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(DEVICE_MODEL_ENV, "gen_ms=1,train_ms=1")   # not inherited without one

    def demo(**options) -> Demo:
        return Demo(DemoOptions(run_dir=tmp_path / "run", **options), settings=load_settings(),
                    bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1")

    plain = demo()
    assert all(DEVICE_MODEL_ENV not in s.env and "--device-model" not in s.argv
               for s in plain.stages.values())
    modelled = demo(device_model="train_ms=1.5,gen_ms=300")
    trainer, replica = modelled.stages["trainer"], modelled.stages["replica-1"]
    assert trainer.env[DEVICE_MODEL_ENV] == "gen_ms=300,train_ms=1.5,batch=32"
    assert trainer.env[DEVICE_DIR_ENV] == str(tmp_path / "run" / "devices")
    at = replica.argv.index("--device-model")
    assert replica.argv[at + 1:at + 4] == ["gen_ms=300,train_ms=1.5,batch=32", "--device-report",
                                           str(tmp_path / "run" / "devices" / "replica-1.json")]
    with pytest.raises(ConfigurationError, match="batch"):
        demo(device_model="gen_ms=1,train_ms=1,batch=0")


def test_a_counted_device_gives_the_slept_run_s_weights_and_its_modelled_time():
    """``sleep_device=False`` (``bench/loop.py``'s synchronous seeds): the same computation as
    sleeping the waits, every modelled millisecond on the stopwatch, none of it slept."""
    device = DeviceModel(gen_ms=100, train_ms=2, batch=32)   # longer than the toy's work
    runs = {}
    for sleep in (True, False):
        with torch.random.fork_rng(devices=[]):
            loop = SynchronousLoop(recipes.sao, seed=3, device=device, replicas=2,
                                   sleep_device=sleep)
            for _ in range(2):
                loop.step()
            runs[sleep] = loop.backend.state()[0], loop
    (slept, slept_loop), (counted, counted_loop) = runs[True], runs[False]
    for name in slept:
        assert torch.equal(slept[name], counted[name]), name
    samples = recipes.sao.schedule.units_per_step
    g, t = device.step_ms(samples, 2, recipes.sao.schedule.epochs)
    # Every modelled millisecond; more only where the toy's own work, which counts toward
    # it, took longer than modelled on a loaded machine.
    assert 2 * (g + t) / 1000 <= counted_loop.device_busy_s < 2 * (g + t) / 1000 + 1.0
    assert slept_loop.device_busy_s >= 2 * (g + t) / 1000 * 0.99


def test_a_counted_synchronous_run_puts_its_device_time_on_the_stopwatch(monkeypatch):
    # 22.56 s a step, never slept: a step's own CPU time, however loaded the machine, stays
    # far below the 7.4 s between the first step's end and the limit, and below its modelled
    # time (which it counts toward).
    device = DeviceModel(gen_ms=5000, train_ms=10, batch=32)
    slept = []
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), sleep(s)))
    result = run_synchronous(recipes.sao, target=1.01, time_limit=30.0, seed=1, device=device,
                             replicas=2, sleep_device=False)
    assert result.steps == 2          # 22.6 s, then 45.1 s: past the limit
    assert result.seconds >= result.generation_busy_s + result.training_busy_s == \
        pytest.approx(2 * 22.56)
    assert not [s for s in slept if s >= 0.1]      # counted, not slept
