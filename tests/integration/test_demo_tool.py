"""`reef demo --task tool`, short: the multi-turn toy task through the whole live loop.

The real command runs every stage as a process on the session's broker and Redis until the
evaluator promotes a first trained version (target accuracy 0: the run is cut short there, to
stay within CI's budget). Checked here, on the log: every unit the trainer took holds
multi-turn samples (call, the tool's two tokens, the answer) whose tool tokens are masked
(policy_mask 1 0 0 1, logprobs 0 there), exactly the trajectories the replicas sampled;
units were trained; the ledger shows nothing lost or trained twice. Reaching 0.9 is the
bench's run (docs/benchmarks.md, "Multi-turn trajectories").
"""

from __future__ import annotations

import re
import time

from reef_stream.core.events import Generation, RolloutUnit, SegmentSource
from reef_stream.demo.tool_recipes import sao
from reef_stream.demo.tool_task import ADD
from reef_stream.topics.declarations import generations, units
from tests.helpers import consume_events, reef

#: Stop at the first promoted version: what is checked here is what the units hold and that the
#: trainer trained them, not how far it learned.
TARGET = 0.0


def test_the_tool_task_trains_multi_turn_units_with_the_tool_tokens_masked(cli_env, tmp_path,
                                                                           kafka_bootstrap):
    started = time.monotonic()
    result = reef("demo", "--task", "tool", "--replicas", "1", "--target-accuracy", str(TARGET),
                  "--time-limit", "80", "--run-dir", str(tmp_path / "run"), env=cli_env,
                  timeout=170, check=False)
    print(f"\n{time.monotonic() - started:.0f} s\n{result.stdout[-2500:]}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    ledger = re.search(r"ledger \{'trained': (\d+), 'trained_twice': (\d+), 'duplicates': "
                       r"(\d+), 'dropped': (\d+), 'lost': (\d+)\}", result.stdout)
    trained, twice, _, _, lost = map(int, ledger.groups())
    assert trained > 0 and twice == 0 and lost == 0
    namespace = re.search(r"^demo (\S+):", result.stdout, re.M).group(1)

    some = consume_events(kafka_bootstrap, units(namespace, sao.name), 20, RolloutUnit)
    samples = [m for u in some for m in u.members]
    assert len(samples) >= 20
    for sample in samples:
        assert sample.policy_mask.tolist() == [1, 0, 0, 1], sample.generation_id
        assert sample.completion_logprobs[1:3].tolist() == [0.0, 0.0]
        assert (sample.completion_logprobs[[0, 3]] < 0).all()
    assert any(s.completion_token_ids[0] == ADD for s in samples)   # tool calls were sampled

    sampled = {g.generation_id: g for g in consume_events(
        kafka_bootstrap, generations(namespace), 200, Generation)}
    for sample in samples:
        if sample.generation_id in sampled:   # what was sampled is what is trained
            generation = sampled[sample.generation_id]
            assert generation.completion_token_ids.tolist() == \
                sample.completion_token_ids.tolist()
            assert [s.source for s in generation.segments] == [
                SegmentSource.POLICY, SegmentSource.ENVIRONMENT, SegmentSource.POLICY]
