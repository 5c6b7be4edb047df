"""`reef rescore` against the real broker: a reward with a bug trains a policy; the bug is fixed;
the logged generations are scored again under a new source — killed half way and restarted,
each generation scored once under it — and a fresh processor and trainer group of a recipe
waiting for that source train on the corrected rewards, the ledger clean; `reef trace` shows
both feedback records of a generation. The recipes are tests/recipes/rescoring.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import defaultdict


from reef_stream.core.events import Generation, RolloutUnit, SamplingParams, now_ms
from reef_stream.core.settings import load_settings
from reef_stream.demo.run import unit_ledger
from reef_stream.demo.verify import GenerationOutcomes
from reef_stream.intake.producer import RecordProducer
from reef_stream.topics.cursors import committed_offsets, resolve_topic
from reef_stream.topics.declarations import feedback, units
from tests import factories
from tests.helpers import events_to_end, reef, wait_until
from tests.recipes import rescoring
from tests.unit_log import create_topics

BUGGY, FIXED = "tests.recipes.rescoring:buggy", "tests.recipes.rescoring:fixed"
GROUPS, GROUP_SIZE = 8, 4
_SUMMARY = re.compile(r"reward worker \S+: records=(\d+) rewarded=(\d+)")


def _generations() -> list[Generation]:
    """8 groups of 4; completions starting with tokens 2..33 (half even: half right)."""
    return [factories.generation(
        f"gen-{i:03d}", request_id=f"req-{i}", prompt_id=f"p-{i // GROUP_SIZE}",
        group_id=f"g-{i // GROUP_SIZE}", group_size=GROUP_SIZE, model="policy",
        completion_token_ids=factories.ids([2 + i, 40]),
        completion_logprobs=factories.logprobs([-1.5, -0.5]), created_at=now_ms(),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=2))
        for i in range(GROUPS * GROUP_SIZE)]


def _start(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reef_stream.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _train(env, recipe: str, group: str, store) -> None:
    """Process and train ``recipe`` until its trainer has trained every unit (2 steps)."""
    processor = _start(env, "process", "--recipe", recipe)
    try:
        result = reef("train", "--recipe", recipe, "--group", group, "--checkpoints", str(store),
                      "--keep", "0", "--max-steps", str(GROUPS // 4), env=env, timeout=240)
        assert f"now at step {GROUPS // 4}" in result.stdout, result.stdout
    finally:
        processor.send_signal(signal.SIGTERM)
        out, err = processor.communicate(timeout=60)
        assert processor.returncode == 0, err[-3000:]


def _v2_feedback(bootstrap, ns):
    """The feedback of source parity_v2, all of it once the rescore runs have returned."""
    return [f for f in events_to_end(bootstrap, feedback(ns)) if f.source == "parity_v2"]


def test_a_fixed_reward_rescored_over_the_log_trains_a_fresh_group(kafka_bootstrap, cli_env,
                                                                   namespace, tmp_path):
    ns, n = namespace, GROUPS * GROUP_SIZE
    create_topics(kafka_bootstrap, ns, "rescore-buggy")
    create_topics(kafka_bootstrap, ns, "rescore-fixed")
    generations = _generations()
    with RecordProducer(kafka_bootstrap, settings=load_settings(), namespace=ns,
                        spool_dir=tmp_path / "spool") as producer:
        for generation in generations:
            producer.send(generation)
        assert producer.flush(30).complete

    # The bug: rewards inverted, and a policy trained on them.
    reef("reward", "--recipe", BUGGY, "--idle-exit", "3", env=cli_env)
    _train(cli_env, BUGGY, "old", tmp_path / "old")

    # The fix, over the log: killed once half way, then run to the end, then once more.
    rescore = ("rescore", "--recipe", FIXED, "--source", "parity_v2", "--from-earliest",
               "--concurrency", "1")
    first = _start(cli_env, *rescore)
    topic = resolve_topic(kafka_bootstrap, ns, "generations")
    wait_until(lambda: sum(o or 0 for o in committed_offsets(
        kafka_bootstrap, f"{ns}.rescore.parity_v2", topic).values()) >= n // 4, 120,
        "a quarter of the generations rescored and committed", poll_s=0.2)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    second = reef(*rescore, env=cli_env, timeout=240)
    records, rewarded = map(int, _SUMMARY.search(second.stdout).groups())
    assert 0 < rewarded == records < n, second.stdout      # resumed, not from the start
    third = reef(*rescore, env=cli_env)
    assert "0 generations to score" in third.stderr, third.stderr

    # Each generation scored once under the new source (a kill's re-sent tail: the same id).
    by_id = defaultdict(set)
    for record in _v2_feedback(kafka_bootstrap, ns):
        by_id[record.feedback_id].add((record.generation_id, record.reward))
    assert {fid: rewards for fid, rewards in by_id.items()} == {
        f"{g.generation_id}:parity_v2": {(g.generation_id, rescoring.right(g))}
        for g in generations}

    # A fresh processor and trainer group learn from the corrected rewards.
    _train(cli_env, FIXED, "fresh", tmp_path / "fresh")
    trained = events_to_end(kafka_bootstrap, units(ns, "rescore-fixed"), RolloutUnit)
    rewards = {m.generation_id: m.reward for u in trained for m in u.members}
    assert rewards == {g.generation_id: rescoring.right(g) for g in generations}
    outcomes = GenerationOutcomes(kafka_bootstrap, ns, rescoring.fixed)
    try:
        counts = outcomes.update()
    finally:
        outcomes.close()
    assert counts == {"generations": n, "in_units": n, "dead_lettered": 0, "no_outcome": 0,
                      "more_than_one": 0, "undecodable": 0}
    assert unit_ledger(kafka_bootstrap, ns, "rescore-fixed", tmp_path / "fresh") == \
        {"trained": GROUPS, "trained_twice": 0, "lost": 0, "dropped": 0, "duplicates": 0}

    # The lineage shows both feedback records: the buggy one and the rescored one.
    lineage = json.loads(reef("trace", "gen-000", "--json", env=cli_env, check=False).stdout)
    texts = [link["text"] for link in lineage["links"] if link["kind"] == "feedback"]
    assert len(texts) == 2 and any("parity_v1" in t for t in texts) \
        and any("parity_v2" in t for t in texts), lineage
