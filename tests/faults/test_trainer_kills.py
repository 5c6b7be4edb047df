"""The trainer SIGKILLed at 20+ moments -- while fetching, inside a step, while writing the
checkpoint, between the checkpoint and its event, between the event and the commit, and at
random times -- and restarted each time, over a fixed log of units: its final weights are
bitwise those of a trainer that never stopped, and each unit was trained exactly once. Once
with a checkpoint every step, once with a checkpoint every 5 (``schedule.checkpoint_every``):
a restart then trains the steps since the newest checkpoint again, from the log.

What a run left is read from the log, as every reader reads it: the group's committed
``Checkpoint`` events (``lineage``). A kill between a checkpoint's files and its transaction
leaves files no event names; they do not count.

Prints the time from each restart to its first resumed step (recovery) and, with the cadence,
the steps each restart replayed; never asserts them. (The cadence's kills all come at
failpoints: a kill at a random moment could come after the run's last step.)
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch
from confluent_kafka import Consumer, TopicPartition

from reef_stream.consumers.trainer.trainer import committed_checkpoint
from reef_stream.core.events import Checkpoint
from reef_stream.engine.checkpoints import load
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import checkpoints, units
from tests.helpers import events_to_end
from tests.unit_log import create_topics, produce_units, rollout_unit

RECIPE = "tests.recipes.trainable"
STEPS = 10
KILLS = 20
PHASES = ["trainer.fetching", "trainer.in-step", "trainer.before-checkpoint",
          "checkpoint.mid-write", "trainer.after-checkpoint", "trainer.after-event",
          "trainer.after-commit"]


@pytest.fixture
def started():
    """Every process a test starts; those still alive at its end are killed (woken first, in
    case a test paused it)."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()


def _start(cli_env, group: str, store, *, max_steps: int = STEPS, failpoints: str = "",
           started: list, sets: tuple[str, ...] = ()) -> subprocess.Popen:
    """A `reef train` process whose stderr lines are collected in ``process.lines`` by a thread."""
    env = {**cli_env, "REEF_FAILPOINTS": failpoints}
    process = subprocess.Popen(
        [sys.executable, "-m", "reef_stream.cli", "train", "--recipe", RECIPE, "--group", group,
         "--checkpoints", str(store), "--keep", "0", "--max-steps", str(max_steps),
         *(f"--set={s}" for s in sets)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.lines = []
    process.reader = threading.Thread(target=lambda: process.lines.extend(process.stderr),
                                      daemon=True)
    process.reader.start()
    started.append(process)
    return process


def _wait_for_line(process: subprocess.Popen, pattern: str, timeout: float) -> bool:
    """True once a stderr line matches; False if the process exits or the timeout passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(re.search(pattern, line) for line in list(process.lines)):
            return True
        if process.poll() is not None:
            process.reader.join(5)
            return any(re.search(pattern, line) for line in process.lines)
        time.sleep(0.05)
    return False


def lineage(bootstrap: str, namespace: str, group: str) -> list[Checkpoint]:
    """The group's committed Checkpoint events, in log order."""
    return [e for e in events_to_end(bootstrap, checkpoints(namespace), Checkpoint)
            if e.trainer_group == group]


def _at(bootstrap: str, namespace: str, group: str) -> int:
    """The step of the group's newest committed checkpoint (0: none)."""
    newest = committed_checkpoint(bootstrap, namespace, "trainable", group)
    return newest.step if newest else 0


def _kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_a_trainer_killed_20_times_ends_bitwise_where_an_uninterrupted_one_does(
        kafka_bootstrap, cli_env, namespace, tmp_path, started):
    create_topics(kafka_bootstrap, namespace)
    # Behaviour versions keep up with the trainer (one step per 4 units): none is too stale.
    log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4)]
    produce_units(kafka_bootstrap, namespace, [*log[:9], log[2], *log[9:]])  # one re-emitted

    reference = _start(cli_env, "straight", tmp_path / "straight", started=started)
    out, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err[-3000:]
    assert f"now at step {STEPS}" in out, out

    rng = random.Random(20261129)
    kills, recoveries = Counter(), []
    while sum(kills.values()) < KILLS:
        at = _at(kafka_bootstrap, namespace, "crashy")
        assert at < STEPS, f"all {STEPS} steps done after only {dict(kills)} kills"
        # Near the end, only moments that precede the acknowledgement, so the kills go on.
        phases = PHASES if at < STEPS - 2 else PHASES[:4]
        began = time.monotonic()
        target = min(at + rng.randint(1, 2), STEPS)
        if rng.random() < (0.75 if at < STEPS - 2 else 1.0):
            phase = rng.choice(phases)
            process = _start(cli_env, "crashy", tmp_path / "crashy", started=started,
                             max_steps=target,
                             failpoints=f"{phase}@{target}")
            if not _wait_for_line(process, r"failpoint \S+ reached", timeout=120):
                process.wait(timeout=60)   # it reached --max-steps first: progress, no kill
                continue
        else:
            phase = "random moment"
            process = _start(cli_env, "crashy", tmp_path / "crashy", started=started,
                             max_steps=target)
            time.sleep(rng.uniform(0.5, 6.0))
            if process.poll() is not None:
                continue
        _kill(process)
        process.reader.join(5)
        kills[phase] += 1
        match = re.search(r"first step after start: ([\d.]+) s \(resume ([\d.]+) s\)",
                          "".join(process.lines))
        if match:
            recoveries.append((float(match.group(2)), float(match.group(1))))
        assert time.monotonic() - began < 180

    final = _start(cli_env, "crashy", tmp_path / "crashy", started=started)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    print(f"\nSIGKILLs by moment: {dict(kills)}")
    print("restart -> resumed / first step (s): "
          + ", ".join(f"{r:.2f}/{f:.2f}" for r, f in recoveries))
    print(f"final run: {out.strip()}")
    assert sum(kills.values()) >= 20, kills
    assert len([k for k in kills if k != "random moment"]) >= 5, kills

    straight = [load(c.uri, c.sha256) for c in lineage(kafka_bootstrap, namespace, "straight")]
    events = lineage(kafka_bootstrap, namespace, "crashy")
    crashy = [load(c.uri, c.sha256) for c in events]
    # One committed event per step, in order: the aborted acknowledgements left none.
    assert [c.step for c in crashy] == list(range(1, STEPS + 1))
    # Each unit trained exactly once, in the same steps as without the crashes ...
    assert Counter(u for c in crashy for u in c.step_units) == Counter(u.unit_id for u in log)
    assert [c.step_units for c in crashy] == [c.step_units for c in straight]
    # ... to bitwise the same weights and optimizer state.
    for name, tensor in straight[-1].weights.items():
        assert torch.equal(tensor, crashy[-1].weights[name]), name
    assert crashy[-1].algorithm_state == straight[-1].algorithm_state

    # The group's committed offsets are the last checkpoint's (committed in its transaction).
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    consumer = Consumer(client_config(kafka_bootstrap, {"group.id": "crashy"}))
    committed = consumer.committed([TopicPartition(units(namespace, "trainable"), o.partition)
                                    for o in crashy[-1].offsets], timeout=30)
    consumer.close()
    assert {(tp.partition, tp.offset) for tp in committed} == \
        {(o.partition, o.offset) for o in crashy[-1].offsets}


EVERY = 5
CADENCE = ("schedule.checkpoint_every=5", "schedule.max_staleness=8")
#: Moments that come before a checkpoint's acknowledgement completes, and those that come in
#: it (only at a checkpoint's step).
BEFORE, DURING = PHASES[:2], PHASES[2:]


def test_with_a_checkpoint_every_5_steps_a_trainer_killed_20_times_replays_to_the_same_weights(
        kafka_bootstrap, cli_env, namespace, tmp_path, started):
    create_topics(kafka_bootstrap, namespace)
    log = [rollout_unit(i, policy_version=i // 4) for i in range(STEPS * 4)]
    produce_units(kafka_bootstrap, namespace, [*log[:9], log[2], *log[9:]])  # one re-emitted

    reference = _start(cli_env, "straight", tmp_path / "straight", started=started, sets=CADENCE)
    out, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err[-3000:]
    straight = [load(c.uri, c.sha256) for c in lineage(kafka_bootstrap, namespace, "straight")]
    assert [c.step for c in straight] == [5, 10]   # not one per step

    rng = random.Random(20261202)
    kills, replayed = Counter(), []
    while sum(kills.values()) < KILLS:
        at = _at(kafka_bootstrap, namespace, "crashy")
        assert at < STEPS, f"all {STEPS} steps done after only {dict(kills)} kills"
        checkpoint_at = at + EVERY
        # Before the last checkpoint, only moments that precede its acknowledgement.
        phase = rng.choice(PHASES if checkpoint_at < STEPS else BEFORE + DURING[:2])
        target = rng.randint(at + 1, checkpoint_at) if phase in BEFORE else checkpoint_at
        process = _start(cli_env, "crashy", tmp_path / "crashy", started=started,
                         sets=CADENCE, failpoints=f"{phase}@{target}")
        assert _wait_for_line(process, r"failpoint \S+ reached", timeout=120), \
            "".join(process.lines)[-3000:]
        _kill(process)
        process.reader.join(5)
        kills[phase] += 1
        trained = [int(n) for n in re.findall(r"step (\d+): \d+ units", "".join(process.lines))]
        replayed.append(max(trained, default=at) - at)

    final = _start(cli_env, "crashy", tmp_path / "crashy", started=started, sets=CADENCE)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    print(f"\nSIGKILLs by moment: {dict(kills)}")
    print(f"steps trained after the newest checkpoint and lost to each kill (replayed by the "
          f"next run): {replayed}")
    assert sum(kills.values()) >= 20, kills
    assert sum(replayed) > 0   # the kills did land between checkpoints

    crashy = [load(c.uri, c.sha256) for c in lineage(kafka_bootstrap, namespace, "crashy")]
    assert [c.step for c in crashy] == [5, 10]
    # Each unit in exactly one checkpoint, in the same order as without the crashes ...
    assert Counter(u for c in crashy for u in c.step_units) == Counter(u.unit_id for u in log)
    assert [c.step_units for c in crashy] == [c.step_units for c in straight]
    # ... to bitwise the same weights, optimizer state and algorithm state.
    for name, tensor in straight[-1].weights.items():
        assert torch.equal(tensor, crashy[-1].weights[name]), name
    for key, value in straight[-1].optimizer["state"].items():
        for name, tensor in value.items():
            assert torch.equal(torch.as_tensor(tensor),
                               torch.as_tensor(crashy[-1].optimizer["state"][key][name])), name
    assert crashy[-1].algorithm_state == straight[-1].algorithm_state
