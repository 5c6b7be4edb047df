"""The in-memory broker is a test double: no module of reef_stream imports it (only the
contract tests do), and it reaches the Kafka client only through ``reef_stream.topics.kafka``."""

from __future__ import annotations

import ast
from pathlib import Path

import reef_stream

PACKAGE = Path(reef_stream.__file__).resolve().parent
MEMORY = "reef_stream.topics.memory"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_module_of_the_package_uses_the_memory_broker():
    memory = PACKAGE / "topics" / "memory.py"
    users = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
             if path != memory and MEMORY in _imports(path)]
    assert users == []


def test_the_memory_broker_takes_the_kafka_client_from_the_kafka_layer_only():
    imported = _imports(PACKAGE / "topics" / "memory.py")
    assert not any(name.split(".")[0] == "confluent_kafka" for name in imported), imported
    assert {name for name in imported if name.startswith("reef_stream")} <= {
        "reef_stream.topics.kafka", *(f"reef_stream.topics.kafka.{n}" for n in (
            "OFFSET_BEGINNING", "KafkaError", "KafkaException", "Message", "TopicPartition"))}
