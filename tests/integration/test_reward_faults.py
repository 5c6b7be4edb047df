"""`reef reward --faults raise=P` against the real broker, as a real worker process, in-thread
and in the sandbox: exactly the generations whose ids the spec draws end as dead letters of
``InjectedFault``; every other one is rewarded."""

from __future__ import annotations

import dataclasses

import pytest

from reef_stream.core.events import DeadLetter, Feedback
from reef_stream.demo.reward_faults import RewardFaults
from reef_stream.topics.declarations import dead_letters, feedback
from tests.faults.records import generation
from tests.helpers import events_to_end
from tests.integration.test_sandbox_reward import _produce, _run, topics  # noqa: F401 - a fixture

SPEC = "raise=0.3"


@pytest.mark.parametrize("sandbox", ["thread", "process"])
def test_the_ids_the_spec_draws_are_dead_lettered_and_the_others_rewarded(
        kafka_bootstrap, namespace, topics, tmp_path, sandbox):  # noqa: F811 - the fixture
    generations = [dataclasses.replace(generation(i), metadata={"do": "score"})
                   for i in range(20)]
    faults = RewardFaults.parse(SPEC)
    raising = {g.generation_id for g in generations if faults.raises(g.generation_id)}
    assert 0 < len(raising) < len(generations)
    _produce(kafka_bootstrap, namespace, tmp_path, generations)

    code, counts, log = _run(kafka_bootstrap, namespace, tmp_path, "hostile", "--faults", SPEC,
                             "--sandbox", sandbox, "--concurrency", "2", "--slow-concurrency",
                             "0", "--sandbox-workers", "2", "--retries", "1", "--backoff",
                             "0.05",
                             "--max-records", str(len(generations)), timeout=60)
    assert code == 0, log
    assert counts["failed"] == len(raising), counts
    letters = events_to_end(kafka_bootstrap, dead_letters(namespace), DeadLetter)
    assert {letter.key.decode() for letter in letters} == raising
    assert {letter.error_type for letter in letters} == {"InjectedFault"}
    rewarded = events_to_end(kafka_bootstrap, feedback(namespace), Feedback)
    assert {f.generation_id for f in rewarded} == \
        {g.generation_id for g in generations} - raising
