"""Shared by the tests: run the real `reef` command line, read a whole topic back."""

from __future__ import annotations

import subprocess
import sys

from confluent_kafka import Consumer

from reef_stream.topics.connect import client_config


def reef(*args: str, env: dict[str, str], timeout: float = 180,
         check: bool = True) -> subprocess.CompletedProcess:
    """Run `reef ARGS...`; with ``check``, fail the test showing its output on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "reef_stream.cli", *args],
        env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"reef {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def consume_all(bootstrap: str, topic: str, expected: int, idle_rounds: int = 5) -> list:
    """Every message of ``topic`` from the start: reads until ``expected`` arrived and the topic went quiet."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": "verifier", "auto.offset.reset": "earliest", "enable.auto.commit": False}))
    consumer.subscribe([topic])
    messages, idle = [], 0
    while idle < idle_rounds:
        batch = consumer.consume(num_messages=5000, timeout=1.0)
        idle = 0 if batch else idle + 1
        for message in batch:
            assert message.error() is None, message.error()
            messages.append(message)
        if len(messages) >= expected and not batch:
            break
    consumer.close()
    return messages


def consume_events(bootstrap: str, topic: str, expected: int, reader: type | None = None) -> list:
    """Every message of ``topic``, decoded as ``reader`` events (see ``consume_all``)."""
    from reef_stream.topics.serde import decode

    return [decode(m.value(), m.headers(), reader, topic=m.topic(), partition=m.partition(),
                   offset=m.offset()) for m in consume_all(bootstrap, topic, expected)]
