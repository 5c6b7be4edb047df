"""`reef reward --sandbox process` against the real broker, run as a real worker process.

Hostile reward code among healthy generations: each hostile one ends in a dead letter with
its category (``sandbox.<category>``), or as the reward function's own exception where the
sandbox refused something inside it (a fork bomb's fork, a write outside its directory, a
socket); never in feedback. Every healthy generation, before and after each hostile one,
gets its feedback; the sandbox metrics reach ``<ns>.metrics``. The built-in code-execution
reward scores a model's ``add`` function in the sandbox (pass fraction, a component per test),
and its recipe refuses to run without the sandbox.

The reward functions are in tests/recipes/sandbox_rewards.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from rich.console import Console

from reef_stream.core.events import DeadLetter, Feedback
from reef_stream.core.metric_names import SANDBOX_FAILURES, SANDBOX_NETWORK_ISOLATED, STAGE_REWARD
from reef_stream.core.settings import load_settings
from reef_stream.intake.producer import RecordProducer
from reef_stream.ops.top import TopView
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics, feedback
from tests.faults.records import generation
from tests.helpers import events_to_end
from tests.integration.undecodable import metric_values

_ROOT = Path(__file__).resolve().parents[2]
_SUMMARY = re.compile(r"reward worker (\S+): (.*) elapsed_s=")


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def _produce(kafka_bootstrap, namespace, tmp_path, generations) -> None:
    with RecordProducer(kafka_bootstrap, settings=load_settings(), namespace=namespace,
                        spool_dir=tmp_path / "producer-spool") as producer:
        for g in generations:
            producer.send(g)
        assert producer.flush(30).complete


def _run(kafka_bootstrap, namespace, tmp_path, recipe: str, *args: str,
         timeout: float = 150) -> tuple[int, dict[str, int], str]:
    env = {"PATH": "/usr/bin:/bin", "REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")}
    process = subprocess.run(
        [sys.executable, "-m", "reef_stream.cli", "reward",
         "--recipe", f"tests.recipes.sandbox_rewards:{recipe}", *args],
        env=env, cwd=_ROOT, capture_output=True, text=True, timeout=timeout)
    counts = {}
    for match in map(_SUMMARY.search, process.stdout.splitlines()):
        if match:
            counts = {name: int(value) for name, value in
                      (pair.split("=") for pair in match.group(2).split())}
    return process.returncode, counts, process.stderr


def _gen(i: int, do: str, **metadata: object):
    return dataclasses.replace(generation(i), metadata={"do": do, **{k: str(v) for k, v in
                                                                     metadata.items()}})


def test_hostile_rewards_end_in_their_category_and_the_healthy_ones_flow(
        kafka_bootstrap, namespace, topics, tmp_path):
    host, port = kafka_bootstrap.split(",")[0].rsplit(":", 1)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    hostile = {"loop": ("sandbox.timeout", "CPU limit"),
               "memory": ("sandbox.memory", "MemoryError"),
               "segfault": ("sandbox.crashed", "SIGSEGV"),
               "exit": ("sandbox.exit", "status 3"),
               "sleep": ("sandbox.timeout", "wall clock"),
               "bad_output": ("sandbox.output_invalid", "got str"),
               "nan": ("sandbox.output_invalid", "not a finite reward"),
               "fork_bomb": ("BlockingIOError", "Resource temporarily unavailable"),
               # the host's /tmp is not even visible to a call: its /tmp is its own
               "write_outside": ("FileNotFoundError", "No such file"),
               "socket": ("OSError", "Network is unreachable"),
               "raise": ("ValueError", "the judge refused")}
    metadata = {"write_outside": {"path": outside}, "socket": {"host": host, "port": port}}
    generations, healthy, kinds = [], set(), {}
    for i, do in enumerate(hostile):
        generations.append(_gen(2 * i, "score"))
        generations.append(_gen(2 * i + 1, do, **metadata.get(do, {})))
        healthy.add(generations[-2].generation_id)
        kinds[generations[-1].generation_id] = do
    generations.append(_gen(100, "garbage"))
    generations += [_gen(101 + i, "score") for i in range(4)]
    healthy |= {g.generation_id for g in generations[-5:]}
    _produce(kafka_bootstrap, namespace, tmp_path, generations)

    code, counts, log = _run(
        kafka_bootstrap, namespace, tmp_path, "hostile", "--sandbox", "process",
        "--concurrency", "2", "--slow-concurrency", "1", "--sandbox-workers", "4",
        "--timeout", "8", "--retries", "1", "--backoff", "0.05", "--sandbox-cpu", "1",
        "--sandbox-memory", "256", "--sandbox-processes", "16",
        "--max-records", str(len(generations)))
    assert code == 0, log
    assert "NOT isolated" not in log
    assert counts["rewarded"] == len(healthy) and counts["failed"] == len(hostile)
    assert counts["invalid"] == 0

    # The worker has exited: read both topics to their end offsets (consume_all's quiet round
    # once ended one dead letter short in CI).
    rewarded = events_to_end(kafka_bootstrap, feedback(namespace), Feedback)
    assert {f.generation_id for f in rewarded} == healthy
    assert {f.reward for f in rewarded} == {1.0}
    letters = events_to_end(kafka_bootstrap, dead_letters(namespace), DeadLetter)
    assert len(letters) == len(hostile)
    for letter in letters:
        do = kinds[re.search(r"generation (gen-\d+)", letter.reason).group(1)]
        error_type, words = hostile[do]
        assert letter.error_type == error_type and words in letter.reason, (do, letter.reason)
        assert letter.stage == "reward" and letter.value is not None
    assert not (outside / "escaped.txt").exists()
    # Categories that the same generation would meet again are not tried again; a wall-clock
    # timeout is tried once more, in the slow lane.
    sleep_letter = next(x for x in letters if "wall clock" in x.reason)
    assert "after 2 tries" in sleep_letter.reason
    segfault_letter = next(x for x in letters if "SIGSEGV" in x.reason)
    assert "after 1 try" in segfault_letter.reason

    for category, expected in (("timeout", 3), ("memory", 1), ("crashed", 1), ("exit", 1),
                               ("output_invalid", 2)):
        values = metric_values(kafka_bootstrap, namespace, STAGE_REWARD, SANDBOX_FAILURES,
                               category=category)
        assert values and values[-1] == expected, (category, values)
    assert metric_values(kafka_bootstrap, namespace, STAGE_REWARD,
                         SANDBOX_NETWORK_ISOLATED)[-1] == 1.0
    # reef top shows the worker's sandbox: its failures by category and its network.
    view = TopView(kafka_bootstrap, namespace)
    try:
        view.refresh()
        console = Console(width=250, record=True)
        console.print(view.render())
        shown = console.export_text()
    finally:
        view.close()
    assert "reward workers" in shown and "crashed=1" in shown and "timeout=3" in shown
    assert "isolated" in shown and "NOT isolated" not in shown
    # Its circuit stayed closed: the hostile minority is the generations', not an outage's.
    assert "closed" in shown and "OPEN" not in shown


def test_the_code_reward_scores_model_code_in_the_sandbox(kafka_bootstrap, namespace, topics,
                                                          tmp_path):
    programs = {
        "right": "def add(a, b):\n    return a + b\n",
        "half": "def add(a, b):\n    return a + b if a < 5 else 0\n",
        "hangs": "def add(a, b):\n    while a == 2: pass\n    return a + b\n",
        "broken": "def add(a, b) return a + b\n",
        "segfault": "import ctypes\ndef add(a, b):\n    return ctypes.string_at(0)\n",
    }
    expected = {"right": 1.0, "half": 0.75, "hangs": 0.75, "broken": 0.0}
    generations = [dataclasses.replace(generation(i), metadata={"program": program})
                   for i, program in enumerate(programs.values())]
    names = {g.generation_id: name for g, name in zip(generations, programs)}
    _produce(kafka_bootstrap, namespace, tmp_path, generations)

    code, _, log = _run(kafka_bootstrap, namespace, tmp_path, "code", "--max-records", "5",
                        timeout=60)
    assert code != 0 and "requires its reward function to run in a sandbox" in " ".join(log.split())

    code, counts, log = _run(kafka_bootstrap, namespace, tmp_path, "code", "--sandbox",
                             "process", "--concurrency", "2", "--timeout", "10",
                             "--sandbox-workers", "3", "--max-records", "5")
    assert code == 0, log
    assert counts["rewarded"] == 4 and counts["failed"] == 1
    rewarded = events_to_end(kafka_bootstrap, feedback(namespace), Feedback)
    assert {names[f.generation_id]: f.reward for f in rewarded} == expected
    half = next(f for f in rewarded if names[f.generation_id] == "half")
    assert half.components == {"test_0": 1.0, "test_1": 1.0, "test_2": 0.0, "test_3": 1.0,
                               "passed": 3.0}
    (letter,) = events_to_end(kafka_bootstrap, dead_letters(namespace), DeadLetter)
    assert letter.error_type == "sandbox.crashed" and "SIGSEGV" in letter.reason
