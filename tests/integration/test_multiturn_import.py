"""Multi-turn trajectories through the real broker: chat logs with tool calls imported with
`reef produce`, joined with their feedback by the processor runtime, land in units whose samples
carry the mask of their environment tokens; a bad chat log is a dead letter naming its field."""

from __future__ import annotations

import json
import threading

import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.api.losses import POLICY_GRADIENT
from reef_stream.api.parts import ComposedProcessor, RequireSources, Ungrouped
from reef_stream.api.recipe import Backend, Recipe
from reef_stream.api.schedule import Schedule
from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.core.events import DeadLetter, Generation, RolloutUnit, SegmentSource
from reef_stream.core.settings import load_settings
from reef_stream.engine.training import collate
from reef_stream.ops.trace import trace_generation
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from tests.helpers import consume_events, wait_until
from tests.integration.test_http_intake import request, serve  # noqa: F401, F811 - a fixture
from tests.integration.test_jsonl_import import reef_produce, summary_counts, write_lines
from tests.recipes.parts import GroupBaseline

RECIPE = Recipe(
    name="mt",
    processor=ComposedProcessor(grouping=Ungrouped(),
                                feedback=RequireSources(("judge",), timeout_ms=30_000)),
    objective=GroupBaseline(),
    schedule=Schedule(units_per_step=2, optimizer_batch_size=2, micro_batch_size=2,
                      max_staleness=2),
    backend=Backend(name="torch-test", loss_families=(POLICY_GRADIENT,)),
)


def chat_log(conversation_id: str, *, tool_tokens=(300, 301, 302), answer=True) -> dict:
    messages = [
        {"role": "system", "content": "You add.", "token_ids": [10, 11]},
        {"role": "user", "content": "17+25?", "token_ids": [12, 13, 14]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "add", "arguments": "{\"a\": 17, \"b\": 25}"}}],
         "token_ids": [200, 201],
         "logprobs": {"content": [{"token": "token_id:200", "logprob": -0.5},
                                  {"token": "token_id:201", "logprob": -0.25}]}},
        {"role": "tool", "name": "add", "tool_call_id": "c1", "content": "42",
         "token_ids": list(tool_tokens)},
    ]
    if answer:
        messages.append({"role": "assistant", "content": "42",
                         "logprobs": {"content": [{"token": "token_id:400", "logprob": -0.125}]}})
    return {"reef": {"policy_version": 2, "replica_id": "agent-a",
                     "sampling": {"max_tokens": 32}},
            "id": conversation_id, "model": "tiny", "messages": messages}


@pytest.fixture
def import_settings(kafka_bootstrap, namespace, tmp_path):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)),
                  declarations.declare_topics(namespace, (RECIPE.name,)))
    return load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap, "REEF_NAMESPACE": namespace,
                          "REEF_HOME": str(tmp_path / "home")})


def test_imported_chat_logs_become_units_that_mask_their_tool_tokens(
        import_settings, kafka_bootstrap, namespace, tmp_path):
    single = chat_log("single")
    single["messages"] = single["messages"][:3]
    bad = chat_log("bad")
    del bad["messages"][3]["token_ids"]
    lines = [json.dumps(chat_log("multi")), json.dumps(single), json.dumps(bad)]
    result = reef_produce(import_settings, "generations", str(write_lines(tmp_path / "agent.jsonl",
                                                                   lines)))
    assert result.exit_code == 0, result.output
    counts = summary_counts(result.output)
    assert (counts["records sent"], counts["acknowledged"]) == (2, 2)
    assert counts["lines rejected (dead letters)"] == 1
    feedback = "".join(json.dumps({"generation_id": gid, "source": "judge", "reward": r}) + "\n"
                       for gid, r in (("multi", 1.0), ("single", 0.0)))
    assert reef_produce(import_settings, "feedback", "-", stdin=feedback.encode()).exit_code == 0

    stored = {g.generation_id: g for g in consume_events(
        kafka_bootstrap, declarations.generations(namespace), 2, Generation)}
    assert [(s.source, s.length, s.role) for s in stored["multi"].segments] == [
        (SegmentSource.POLICY, 2, "assistant"), (SegmentSource.ENVIRONMENT, 3, "tool:add"),
        (SegmentSource.POLICY, 1, "assistant")]
    assert stored["single"].segments == ()

    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    try:

        def both_units() -> list[RolloutUnit] | None:
            units = consume_events(kafka_bootstrap, declarations.units(namespace, RECIPE.name),
                                   2, RolloutUnit)
            return units if len(units) >= 2 else None

        units = wait_until(both_units, 60, "the two generations' units", poll_s=0.5)
    finally:
        runtime.stop()
        thread.join(30)

    samples = {u.members[0].generation_id: u.members[0] for u in units}
    assert set(samples) == {"multi", "single"}
    multi = samples["multi"]
    assert multi.prompt_token_ids.tolist() == [10, 11, 12, 13, 14]
    assert multi.completion_token_ids.tolist() == [200, 201, 300, 301, 302, 400]  # as sampled
    assert multi.completion_logprobs.tolist() == [-0.5, -0.25, 0, 0, 0, -0.125]
    assert multi.policy_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert multi.reward == 1.0
    assert samples["single"].policy_mask.size == 0
    batch = collate([multi, samples["single"]])
    assert batch.completion_mask.tolist() == [[True, True, False, False, False, True],
                                              [True, True, False, False, False, False]]

    # reef trace shows the turns and what the unit masks
    lines = [link.line() for link in trace_generation(kafka_bootstrap, namespace, "multi").links]
    turns = [line for line in lines if line.startswith("turn")]
    assert [t.split(":")[0].split()[1:3] for t in turns] == [
        ["1/3", "assistant"], ["2/3", "tool"], ["3/3", "assistant"]]
    assert "(environment, masked): 3 tokens [300 301 302]" in turns[1]
    assert any(line.startswith("mask") and "trains 3 policy tokens; 3 environment tokens masked"
               in line for line in lines), lines

    letters = consume_events(kafka_bootstrap, declarations.dead_letters(namespace), 1, DeadLetter)
    assert [(d.stage, d.source_offset) for d in letters] == [("import", 3)]
    assert "messages[3].token_ids" in letters[0].reason


def test_the_http_intake_takes_chat_logs_and_names_the_field_of_a_bad_one(serve,  # noqa: F811
                                                                          kafka_bootstrap,
                                                                          namespace):
    server = serve()
    bad = chat_log("bad-http")
    bad["messages"][2]["logprobs"]["content"][0]["logprob"] = 0.5
    reply = request(f"{server.url}/v1/generations",
                    json.dumps([chat_log("multi-http"), bad]).encode())

    assert reply.status == 200, reply.body
    by_index = {r["index"]: r for r in reply.body["results"]}
    assert by_index[0]["status"] == "acknowledged"
    assert by_index[1]["status"] == "rejected"
    assert by_index[1]["field"] == "messages[2].logprobs" and "positive" in by_index[1]["error"]
    (stored,) = consume_events(kafka_bootstrap, declarations.generations(namespace), 1,
                               Generation)
    assert stored.generation_id == "multi-http"
    assert stored.policy_mask().tolist() == [1, 1, 0, 0, 0, 1]
