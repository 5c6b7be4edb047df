"""Shared by the tests: run the real `reef` command line, read a whole topic back, wait for a
condition with a deadline (never a fixed sleep)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import Consumer

from reef_stream.topics.connect import client_config

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, message: str | Callable[[], str], *,
               poll_s: float = 0.1) -> T:
    """Call ``condition`` every ``poll_s`` seconds until it returns something true, and return
    that; fail the test saying ``message`` (what was awaited) if ``timeout`` seconds pass first.
    ``message`` may be a function, called only on the timeout, to show the state the wait gave
    up on (what was seen instead). How a test waits for something to happen: a fixed ``sleep``
    is either too short on a loaded machine or longer than needed everywhere else."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            awaited = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g} s waiting for {awaited}")
        time.sleep(poll_s)


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
    """Every message of ``topic`` from the start: reads until ``expected`` arrived and the topic went quiet.

    A group of its own: a group shared with another reader (another test on the same broker)
    rebalances when that one joins, and without commits each rebalance reads from the start
    again (seen: every generation counted three times)."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"verifier-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False}))
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
    from reef_stream.core.serde import decode

    return [decode(m.value(), m.headers(), reader, topic=m.topic(), partition=m.partition(),
                   offset=m.offset()) for m in consume_all(bootstrap, topic, expected)]


def events_to_end(bootstrap: str, topic: str, reader: type | None = None) -> list:
    """Every committed message of ``topic`` up to its current end, decoded as ``reader``
    events. ``read_to_end``: a consumer assigned to the partitions (no group to join) that
    stops at their end offsets, so a call takes a round trip, not a join and idle rounds
    (``consume_all``'s, which on a topic still being written, such as ``<ns>.metrics``, may
    never go quiet). Records written after the call are left out: to wait for some, call it
    again inside ``wait_until``."""
    from reef_stream.core.serde import decode
    from reef_stream.topics.reading import read_to_end

    return [decode(m.value(), m.headers(), reader, topic=m.topic(), partition=m.partition(),
                   offset=m.offset()) for m in read_to_end(bootstrap, topic)]
