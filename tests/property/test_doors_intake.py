"""Bad input at the three intake doors, against the real broker: the SDK, `reef produce` (JSONL)
and the HTTP intake.

Each test draws a few batches with hypothesis (hostile records mixed with valid ones), sends each
batch through its door once, and then reads the topics back:

- SDK (``RecordProducer.send``): every hostile event raises ``InvalidRecord`` naming its field
  (or, for an oversized record, the topic's size limit) and is not sent; every accepted one is
  acknowledged and is in its topic byte for byte, duplicates included.
- JSONL (``reef produce``): every line that does not parse (not JSON, invalid UTF-8, a broken
  field, ...) is one dead letter whose reason starts ``line <n>:`` and whose value is the line;
  every valid line's records are in the topic; the summary counts add up.
- HTTP (``POST /v1/generations``, ``/v1/feedback``): a hostile record is ``rejected`` in the
  results with the field and the reason, valid ones in the same batch are acknowledged and in
  the topic; a body that is not a record (garbage bytes, deep nesting, a scalar, too large) is
  a 4xx with the reason, never a 5xx.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from confluent_kafka.admin import AdminClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from reef_stream.core.errors import InvalidRecord
from reef_stream.core.events import DeadLetter, Generation, SamplingParams
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import load_settings
from reef_stream.intake.formats import NO_DEFAULTS, OpenAIDefaults, parse_record
from reef_stream.intake.producer import DeliveryState, RecordProducer
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics, feedback, generations
from tests.helpers import consume_all, consume_events
from tests.integration.test_http_intake import request, serve  # noqa: F401 - serve: a fixture
from tests.integration.test_jsonl_import import reef_produce, summary_counts
from tests.property.hostile import (
    generation_event, hostile_feedback_event, hostile_generation_event, hostile_json,
    mutated_feedback, mutated_generation, native_feedback, native_generation,
)

#: A few batches per door; no shrinking (each try costs broker round trips): a failure
#: reports the batch as drawn.
FEW = settings(max_examples=3, deadline=None, database=None,
               phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
registry = SchemaRegistry.default()


@pytest.fixture
def topics(kafka_bootstrap, namespace):
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))


def read_values(bootstrap: str, topic: str, expected: int) -> list[bytes]:
    return [m.value() for m in consume_all(bootstrap, topic, expected)]


# --------------------------------------------------------------------------- the SDK


def test_the_sdk_refuses_hostile_events_naming_the_field_and_delivers_the_rest(
        kafka_bootstrap, namespace, topics, tmp_path):
    sent: Counter[tuple[str, bytes]] = Counter()
    refused: list[str] = []
    valid_events = st.builds(lambda e: (e, None), st.sampled_from(
        [generation_event("ok-1"), generation_event("ok-2", group_id="grp", group_size=2),
         generation_event("ok-1")]))  # a duplicate id: accepted, the readers drop it
    producer = RecordProducer(kafka_bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool", metrics_every_s=None)

    def send(event, name) -> None:
        topic = generations(namespace) if isinstance(event, Generation) else feedback(namespace)
        try:
            handle = producer.send(event)
        except InvalidRecord as error:
            assert error.field is not None or "max.message.bytes" in error.reason, str(error)
            if name is not None and error.field is not None:
                assert error.field.split(".")[0] in (
                    name, "group_id", "completion_logprobs", "completion_token_ids"), \
                    (name, str(error))
            refused.append(str(error))
            return
        assert handle.wait(30), handle
        assert handle.state is DeliveryState.ACKNOWLEDGED
        sent[(topic, registry.encode(event)[0])] += 1

    @FEW
    @given(batch=st.lists(st.one_of(hostile_generation_event(), hostile_feedback_event(),
                                    valid_events), min_size=25, max_size=40))
    def throw(batch) -> None:
        for event, name in batch:
            send(event, name)

    try:
        throw()
        # Oversized: a 9 MiB id, a 3M-token prompt (the generations topic takes 8 MiB).
        send(generation_event("x" * (9 << 20)), None)
        send(generation_event("huge", prompt_token_ids=np.ones(3_000_000, dtype=np.int32)), None)
        assert producer.flush(30).complete
    finally:
        producer.close()

    assert sum("max.message.bytes" in reason for reason in refused) >= 2
    assert refused and sent
    stored = Counter()
    for topic in (generations(namespace), feedback(namespace)):
        expected = sum(n for (t, _), n in sent.items() if t == topic)
        stored.update((topic, value) for value in read_values(kafka_bootstrap, topic, expected))
    assert stored == sent


# --------------------------------------------------------------------------- JSONL


def _line(value) -> bytes:
    return json.dumps(value).encode()


OPENAI_DEFAULTS = {"generations": ("--policy-version", "1", "--replica-id", "r",
                                   "--sampling", '{"max_tokens": 4}'), "feedback": ()}
DEFAULTS = OpenAIDefaults(policy_version=1, replica_id="r", sampling=SamplingParams(max_tokens=4))


def _parses(kind: str, line: bytes, defaults: OpenAIDefaults = NO_DEFAULTS) -> int:
    """The records a line yields, or 0 when the import must dead-letter it."""
    try:
        return len(parse_record(kind, json.loads(line), defaults))
    except (ValueError, RecursionError, InvalidRecord):
        return 0


def test_reef_produce_dead_letters_every_bad_line_with_its_number_and_sends_the_rest(
        kafka_bootstrap, namespace, topics, tmp_path):
    settings_ = load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap,
                               "REEF_NAMESPACE": namespace, "REEF_HOME": str(tmp_path / "home")})
    files = itertools.count()
    runs: list[tuple[str, str, list[bytes]]] = []  # (kind, source, lines)
    raw_lines = st.binary(max_size=80).map(lambda b: b.replace(b"\n", b""))
    lines_of = {
        "generations": st.one_of(
            native_generation().map(_line), mutated_generation().map(lambda m: _line(m.record)),
            hostile_json().map(_line), raw_lines,
            st.sampled_from([b"{", b"\xff\xfe{}", b"[" * 50_000, b"NaN", b'"\\ud800"', b"{}",
                             b"   ", b"\x00"])),
        "feedback": st.one_of(
            native_feedback().map(_line), mutated_feedback().map(lambda m: _line(m.record)),
            hostile_json().map(_line), raw_lines),
    }

    @FEW
    @given(data=st.data())
    def throw(data) -> None:
        kind = data.draw(st.sampled_from(["generations", "feedback"]))
        lines = data.draw(st.lists(lines_of[kind], min_size=10, max_size=30))
        path = tmp_path / f"import-{next(files)}.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        result = reef_produce(settings_, kind, str(path), *OPENAI_DEFAULTS[kind])
        assert result.exit_code == 0, result.output
        counts = summary_counts(result.output)
        read = [line for line in lines if line.strip()]
        bad = [line for line in read if not _parses(kind, line, DEFAULTS)]
        assert counts["lines read"] == len(read), result.output
        assert counts.get("lines rejected (dead letters)", 0) == len(bad), result.output
        assert counts["records sent"] == counts["acknowledged"], result.output
        runs.append((kind, f"import:{path}", lines))

    throw()
    letters = consume_events(kafka_bootstrap, dead_letters(namespace), 1, DeadLetter)
    by_source: dict[str, dict[int, DeadLetter]] = {}
    for letter in letters:
        assert letter.source_offset not in by_source.get(letter.source_topic, {}), "twice"
        by_source.setdefault(letter.source_topic, {})[letter.source_offset] = letter
    sent_ids = {kind: Counter() for kind in lines_of}
    for kind, source, lines in runs:
        mine = by_source.get(source, {})
        expected_bad = {number for number, line in enumerate(lines, start=1)
                        if line.strip() and not _parses(kind, line, DEFAULTS)}
        assert set(mine) == expected_bad, (source, sorted(mine), sorted(expected_bad))
        for number, letter in mine.items():
            assert letter.reason.startswith(f"line {number}: "), letter.reason
            assert letter.stage == "import" and letter.value == lines[number - 1].rstrip(b"\r\n")
        for number, line in enumerate(lines, start=1):
            if line.strip() and number not in expected_bad:
                for event in parse_record(kind, json.loads(line), DEFAULTS):
                    sent_ids[kind][_event_id(event)] += 1
    for kind, topic in (("generations", generations(namespace)), ("feedback", feedback(namespace))):
        stored = Counter(map(_event_id, consume_events(kafka_bootstrap, topic,
                                                       sum(sent_ids[kind].values()))))
        assert stored == sent_ids[kind]


def _event_id(event) -> str:
    return event.generation_id if isinstance(event, Generation) else event.feedback_id


# --------------------------------------------------------------------------- HTTP


def test_the_http_intake_rejects_hostile_records_with_the_field_and_acknowledges_the_rest(
        serve, kafka_bootstrap, namespace):  # noqa: F811 - serve is the fixture imported above
    server = serve()
    acknowledged = {"generations": Counter(), "feedback": Counter()}
    ids = itertools.count()

    def valid(kind: str):
        strategy = native_generation if kind == "generations" else native_feedback
        return st.builds(lambda r: {**r, "generation_id": f"ok-{next(ids)}"}, strategy())

    @FEW
    @given(data=st.data())
    def throw(data) -> None:
        kind = data.draw(st.sampled_from(["generations", "feedback"]))
        mutated = mutated_generation() if kind == "generations" else mutated_feedback()
        batch = data.draw(st.lists(st.one_of(
            valid(kind), mutated.map(lambda m: m.record), hostile_json()), min_size=5,
            max_size=25))
        reply = request(f"{server.url}/v1/{kind}", json.dumps(batch).encode())
        assert reply.status in (200, 400, 413), reply
        if reply.status == 413:
            return
        results = reply.body["results"]
        assert sorted({r["index"] for r in results}) == list(range(len(batch)))
        for result in results:
            record = batch[result["index"]]
            if result["status"] == "rejected":
                assert result["error"], result
                assert _parses(kind, json.dumps(record).encode()) == 0, (record, result)
            else:
                assert result["status"] == "acknowledged", result
                acknowledged[kind][result["id"]] += 1
        if reply.status == 400:
            assert all(r["status"] == "rejected" for r in results)

    throw()
    for body in (b"\xff\xfe\x00garbage", b"[" * 100_000, b"42", b'"text"', b"[]", b"null",
                 b'{"generation_id": ', b"[1, 2, 3]", b"x" * (70 * 1024)):
        reply = request(f"{server.url}/v1/generations", body)
        assert reply.status in (400, 413) and reply.body["error"], (body[:20], reply)
    for kind, topic in (("generations", generations(namespace)), ("feedback", feedback(namespace))):
        stored = Counter(map(_event_id, consume_events(kafka_bootstrap, topic,
                                                       sum(acknowledged[kind].values()))))
        assert stored == acknowledged[kind]
