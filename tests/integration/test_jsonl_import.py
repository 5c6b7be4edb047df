"""`reef produce` against the real broker: valid lines land in their topic, invalid ones in dead letters.

The command runs in-process through click's CliRunner, on a group of the
same class as `reef` (errors become the same one-line messages and exit
statuses), with settings pointing at the session's broker, the test's
namespace and a REEF_HOME (so the spool) under tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from confluent_kafka.admin import AdminClient

from reef_stream.cli.main import main
from reef_stream.cli.produce import COMMANDS
from reef_stream.core.events import DeadLetter, Feedback, Generation
from reef_stream.core.serde import decode
from reef_stream.core.settings import Settings, load_settings
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import dead_letters, declare_topics, feedback, generations
from tests.helpers import consume_all


def native_generation(generation_id: str, **overrides) -> dict:
    record = {
        "generation_id": generation_id, "request_id": f"r-{generation_id}", "prompt_id": "p-1",
        "model": "tiny", "policy_version": 3, "replica_id": "replica-a",
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.5, -1.25], "finish_reason": "stop",
        "sampling": {"temperature": 1.0, "max_tokens": 16},
    }
    record.update(overrides)
    return record


def completion_response(response_id: str, n: int) -> dict:
    return {
        "id": response_id, "object": "text_completion", "created": 1_795_000_000, "model": "Qwen",
        "choices": [{"index": i, "text": "x", "finish_reason": "stop",
                     "prompt_token_ids": [7, 8], "token_ids": [9, 10 + i],
                     "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}}
                    for i in range(n)],
    }


def chat_response_with_token_strings() -> dict:
    return {"id": "chat-1", "object": "chat.completion", "created": 1_795_000_000,
            "model": "gpt", "choices": [{"index": 0, "finish_reason": "stop", "logprobs": {
                "content": [{"token": "Hi", "logprob": -0.1}]}}]}


#: (line text, rejected?) for the generations file; line numbers count from 1, blank included.
GENERATION_LINES = [
    json.dumps(native_generation("g-1")),
    '{"generation_id": "g-2", ',                                                  # not JSON
    "",                                                                           # blank: skipped
    json.dumps({k: v for k, v in native_generation("g-4").items() if k != "policy_version"}),
    json.dumps(completion_response("cmpl-5", n=2)),                               # 2 generations
    json.dumps(native_generation("g-6", completion_logprobs=[-0.5])),              # too few
    json.dumps(native_generation("g-7", completion_logprobs=[-0.5, -1, -2])),      # too many
    json.dumps(native_generation("g-8", group_id="grp", group_size=2)),
    json.dumps(chat_response_with_token_strings()),                               # strings only
]
REJECTED_GENERATION_LINES = {2: "not JSON", 4: "policy_version", 6: "completion_logprobs",
                             7: "completion_logprobs", 9: "choices[].logprobs.content[].token"}
SENT_GENERATION_IDS = {"g-1", "cmpl-5:0", "cmpl-5:1", "g-8"}
OPENAI_DEFAULTS = ["--policy-version", "4", "--replica-id", "old-fleet",
                   "--sampling", '{"temperature": 0.7, "max_tokens": 16}']


@pytest.fixture
def import_settings(kafka_bootstrap, namespace, tmp_path) -> Settings:
    ensure_topics(AdminClient(client_config(kafka_bootstrap)), declare_topics(namespace))
    return load_settings({"REEF_BOOTSTRAP_SERVERS": kafka_bootstrap, "REEF_NAMESPACE": namespace,
                          "REEF_HOME": str(tmp_path / "home")})


def reef_produce(settings: Settings, *args: str, stdin: bytes | None = None) -> Result:
    """`reef produce ARGS...`, in-process, as the `reef` group runs it."""

    @click.group(cls=type(main), commands=COMMANDS)
    def group() -> None:
        pass

    result = CliRunner().invoke(group, ["produce", *args], obj=settings, input=stdin,
                                env={"COLUMNS": "200"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def summary_counts(output: str) -> dict[str, int]:
    """The rows of the summary table whose second cell is a number."""
    counts = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) >= 2 and cells[1].isdigit():
            counts.setdefault(cells[0], int(cells[1]))
    return counts


def decoded(messages: list, reader: type) -> list:
    return [decode(m.value(), m.headers(), reader, topic=m.topic(), partition=m.partition(),
                   offset=m.offset()) for m in messages]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_generations_file_lands_in_generations_and_its_bad_lines_in_dead_letters(
        import_settings, kafka_bootstrap, tmp_path):
    path = write_lines(tmp_path / "fleet.jsonl", GENERATION_LINES)

    result = reef_produce(import_settings, "generations", str(path), *OPENAI_DEFAULTS)

    assert result.exit_code == 0, result.output + result.stderr
    counts = summary_counts(result.output)
    assert counts["lines read"] == 8
    assert counts["records sent"] == 4
    assert counts["acknowledged"] == 4
    assert counts["not yet acknowledged (spooled)"] == 0
    assert counts["failed"] == 0
    assert counts["lines rejected (dead letters)"] == 5
    assert counts["completion_logprobs"] == 2
    assert counts["not JSON"] == counts["policy_version"] == 1
    # The longest reason may be cut short with an ellipsis where the table is narrow.
    assert [n for reason, n in counts.items()
            if reason.startswith("choices[].logprobs.content[]")] == [1]

    stored = {g.generation_id: g for g in decoded(
        consume_all(kafka_bootstrap, generations(import_settings.namespace), 4), Generation)}
    assert set(stored) == SENT_GENERATION_IDS
    assert stored["cmpl-5:1"].completion_token_ids.tolist() == [9, 11]
    assert (stored["cmpl-5:1"].policy_version, stored["cmpl-5:1"].replica_id) == (4, "old-fleet")
    assert (stored["cmpl-5:0"].group_id, stored["cmpl-5:0"].group_size) == ("cmpl-5", 2)
    assert stored["cmpl-5:0"].sampling.temperature == 0.7

    letters = {letter.source_offset: letter for letter in decoded(
        consume_all(kafka_bootstrap, dead_letters(import_settings.namespace), 5), DeadLetter)}
    assert set(letters) == set(REJECTED_GENERATION_LINES)
    for number, letter in letters.items():
        assert letter.source_topic == f"import:{path}" and letter.stage == "import"
        assert letter.reason.startswith(f"line {number}: ")
        assert letter.value == GENERATION_LINES[number - 1].encode()
        assert letter.source_partition is None
    assert letters[2].error_type == "JSONDecodeError"
    assert "field 'policy_version': is missing" in letters[4].reason
    assert "1 values for 2 completion tokens" in letters[6].reason
    assert "token ids are required" in letters[9].reason
    assert letters[4].error_type == "InvalidRecord"


def test_feedback_from_stdin_lands_in_feedback_and_its_bad_lines_in_dead_letters(
        import_settings, kafka_bootstrap):
    lines = [
        json.dumps({"generation_id": "g-1", "source": "exact_match", "reward": 1.0}),
        '{"generation_id": "g-2", "source": "exact_match", "reward": NaN}',
        json.dumps({"generation_id": "g-3", "group_id": "grp", "source": "judge", "reward": -0.5,
                    "components": {"format": 0.5, "correct": -1.0}}),
        json.dumps({"generation_id": "g-4", "reward": 1.0}),
        "[1, 2, 3]",
    ]
    stdin = "".join(line + "\r\n" for line in lines).encode()

    result = reef_produce(import_settings, "feedback", "-", stdin=stdin)

    assert result.exit_code == 0, result.output + result.stderr
    counts = summary_counts(result.output)
    assert (counts["lines read"], counts["records sent"], counts["acknowledged"]) == (5, 2, 2)
    assert counts["lines rejected (dead letters)"] == 3
    assert counts["reward"] == counts["source"] == counts["the record as a whole"] == 1

    stored = {f.feedback_id: f for f in decoded(
        consume_all(kafka_bootstrap, feedback(import_settings.namespace), 2), Feedback)}
    assert set(stored) == {"g-1:exact_match", "g-3:judge"}
    assert stored["g-3:judge"].components == {"format": 0.5, "correct": -1.0}

    letters = {letter.source_offset: letter for letter in decoded(
        consume_all(kafka_bootstrap, dead_letters(import_settings.namespace), 3), DeadLetter)}
    assert set(letters) == {2, 4, 5}
    assert all(letter.source_topic == "import:stdin" for letter in letters.values())
    assert "rewards must be finite" in letters[2].reason
    assert letters[2].value == lines[1].encode()  # the line ending is not kept


def test_openai_options_are_refused_for_feedback(import_settings, tmp_path):
    path = write_lines(tmp_path / "feedback.jsonl", [])
    result = reef_produce(import_settings, "feedback", str(path), "--policy-version", "3")
    assert result.exit_code == 2
    assert "--policy-version: only for generations" in " ".join(result.stderr.split())


def test_a_bad_sampling_option_is_a_configuration_error(import_settings, tmp_path):
    path = write_lines(tmp_path / "fleet.jsonl", [])
    result = reef_produce(import_settings, "generations", str(path), "--sampling", '{"top_p": 1}')
    assert result.exit_code == 2
    assert "field '--sampling.max_tokens': is missing" in " ".join(result.stderr.split())
